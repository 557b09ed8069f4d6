"""The mover against each attention backend's documented KV semantics, written independently here.

CPU_ATTN: a [blocks, heads, bs, 2d] tensor read as [blocks, heads, 2bs, d], K rows then V rows.
GPU backends (FlashAttention & co.): logical [blocks, heads, bs, 2d], K = C[:d], V = C[d:], with
token-major or head-major physical strides, possibly as strided views of one allocation.
"""

from __future__ import annotations

import pytest
import torch

from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.paged import PagedKV

L, H, D = 3, 2, 16
NUM_BLOCKS = 40


def make_caches(kind: str, bs: int, dtype: torch.dtype) -> list[torch.Tensor]:
    if kind == "cpu":
        return [torch.zeros(NUM_BLOCKS, H, bs, 2 * D, dtype=dtype) for _ in range(L)]
    if kind == "gpu-token-major":  # physical [B, N, H, C] per layer
        return [torch.zeros(NUM_BLOCKS, bs, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3) for _ in range(L)]
    if kind == "gpu-one-allocation":  # physical [B, L, N, H, C]: per-layer strided views
        raw = torch.zeros(NUM_BLOCKS, L, bs, H, 2 * D, dtype=dtype)
        return [raw[:, i].permute(0, 2, 1, 3) for i in range(L)]
    if kind == "gpu-head-major":  # physical [B, H, N, C]
        return [torch.zeros(NUM_BLOCKS, H, bs, 2 * D, dtype=dtype) for _ in range(L)]
    raise AssertionError(kind)


def write_kv(kind: str, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bs: int) -> None:
    """Fill one layer from K and V of shape [blocks, bs, H, D], the way the backend's kernel lays them."""
    if kind == "cpu":
        rows = cache.view(NUM_BLOCKS, H, 2 * bs, D)
        rows[:, :, :bs] = k.permute(0, 2, 1, 3)
        rows[:, :, bs:] = v.permute(0, 2, 1, 3)
    else:
        cache[..., :D] = k.permute(0, 2, 1, 3)
        cache[..., D:] = v.permute(0, 2, 1, 3)


def read_kv(kind: str, cache: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "cpu":
        rows = cache.view(NUM_BLOCKS, H, 2 * bs, D)
        return rows[:, :, :bs].permute(0, 2, 1, 3), rows[:, :, bs:].permute(0, 2, 1, 3)
    return cache[..., :D].permute(0, 2, 1, 3), cache[..., D:].permute(0, 2, 1, 3)


KINDS = ["cpu", "gpu-token-major", "gpu-one-allocation", "gpu-head-major"]


def round_trip(
    kind: str, bs: int, dtype: torch.dtype, src_blocks: list[int], dst_blocks: list[int], seed: int
) -> None:
    """Gather a chunk from ``src_blocks``, check it is canonical, scatter it into ``dst_blocks``, check
    those hold it and no other block changed."""
    chunk = len(src_blocks) * bs
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype)
    caches = make_caches(kind, bs, dtype)
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(NUM_BLOCKS, bs, H, D, generator=g).to(dtype) for _ in range(L)]
    vs = [torch.randn(NUM_BLOCKS, bs, H, D, generator=g).to(dtype) for _ in range(L)]
    for c, k, v in zip(caches, ks, vs, strict=True):
        write_kv(kind, c, k, v, bs)
    paged = PagedKV(caches, bs, layout, "CPU_ATTN" if kind == "cpu" else "FLASH_ATTN")

    payload = torch.empty(layout.chunk_bytes(chunk), dtype=torch.uint8)
    paged.gather(payload, src_blocks)
    canon = payload.view(dtype).view(layout.chunk_shape(chunk))
    for li in range(L):
        assert torch.equal(canon[li, 0], ks[li][src_blocks].reshape(chunk, H, D))
        assert torch.equal(canon[li, 1], vs[li][src_blocks].reshape(chunk, H, D))

    untouched = [i for i in range(NUM_BLOCKS) if i not in dst_blocks]
    before = [(k[untouched].clone(), v[untouched].clone()) for k, v in (read_kv(kind, c, bs) for c in caches)]
    paged.scatter(payload, dst_blocks, 0, chunk)
    for li in range(L):
        k, v = read_kv(kind, caches[li], bs)
        assert torch.equal(k[dst_blocks], ks[li][src_blocks])
        assert torch.equal(v[dst_blocks], vs[li][src_blocks])
        assert torch.equal(k[untouched], before[li][0]) and torch.equal(v[untouched], before[li][1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_then_scatter_round_trip(kind: str, bs: int, dtype: torch.dtype) -> None:
    chunk = 128
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(bs)).tolist()
    round_trip(kind, bs, dtype, perm[: chunk // bs], perm[chunk // bs : 2 * chunk // bs], seed=bs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "src_blocks,dst_blocks",
    [([7, 8, 9, 2], [20, 21, 22, 23]), ([30, 31, 32, 33], [11, 5, 6, 12]), ([1, 2, 3, 4], [4, 3, 2, 1])],
)
def test_runs_of_consecutive_blocks_round_trip(
    kind: str, src_blocks: list[int], dst_blocks: list[int]
) -> None:
    """Host copies go run by run of consecutive block ids: runs of every length, and ids reversed."""
    round_trip(kind, 16, torch.bfloat16, src_blocks, dst_blocks, seed=7)


@pytest.mark.parametrize("kind", ["cpu", "gpu-token-major"])
def test_partial_scatter_touches_only_the_named_tokens(kind: str) -> None:
    bs, chunk = 32, 128
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    caches = make_caches(kind, bs, torch.bfloat16)
    paged = PagedKV(caches, bs, layout, "CPU_ATTN" if kind == "cpu" else "FLASH_ATTN")
    payload = torch.randn(layout.chunk_bytes(chunk) // 2).to(torch.bfloat16).view(torch.uint8)
    blocks = [5, 9, 2, 7]
    paged.scatter(payload, blocks, first=32, count=50)  # tokens 32..81: block 9 whole, block 2 up to 18
    canon = payload.view(torch.bfloat16).view(layout.chunk_shape(chunk))
    for li in range(L):
        k, _ = read_kv(kind, caches[li], bs)
        assert torch.equal(k[9], canon[li, 0, 32:64])
        assert torch.equal(k[2, :18], canon[li, 0, 64:82])
        assert not k[2, 18:].any() and not k[5].any() and not k[7].any()


def test_shape_mismatch_is_refused() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        PagedKV([torch.zeros(4, H, 16, 3 * D, dtype=torch.bfloat16)], 16, layout, "CPU_ATTN")
    with pytest.raises(ValueError, match="dtype"):
        PagedKV([torch.zeros(4, H, 16, 2 * D, dtype=torch.float32)], 16, layout, "CPU_ATTN")


def test_mla_single_latent() -> None:
    bs, chunk, c = 16, 64, 24
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=c, dtype=torch.bfloat16, num_kv=1)
    caches = [torch.randn(10, 1, bs, c).to(torch.bfloat16) for _ in range(2)]
    paged = PagedKV(caches, bs, layout, "FLASHMLA")
    payload = torch.empty(layout.chunk_bytes(chunk), dtype=torch.uint8)
    paged.gather(payload, [1, 3, 5, 7])
    canon = payload.view(torch.bfloat16).view(layout.chunk_shape(chunk))
    assert torch.equal(canon[1, 0, :, 0], caches[1][[1, 3, 5, 7], 0].reshape(chunk, c))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs", [16, 64])
def test_batched_forms_match_the_per_chunk_copies(kind: str, bs: int) -> None:
    """scatter_many / scatter_layer / gather_many (the CUDA mover's batched copies) equal the
    per-chunk scatter / gather, here on CPU tensors with the same layouts."""
    chunk, dtype = 128, torch.bfloat16
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=dtype)
    backend = "CPU_ATTN" if kind == "cpu" else "FLASH_ATTN"
    g = torch.Generator().manual_seed(11)
    a_caches, b_caches = make_caches(kind, bs, dtype), make_caches(kind, bs, dtype)
    for a, b in zip(a_caches, b_caches, strict=True):
        a.copy_(torch.randn(a.shape, generator=g).to(dtype))
        b.copy_(a)
    a, b = PagedKV(a_caches, bs, layout, backend), PagedKV(b_caches, bs, layout, backend)
    per = chunk // bs
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    src = [perm[i * per : (i + 1) * per] for i in range(2)]
    dst = [perm[(2 + i) * per : (3 + i) * per] for i in range(2)]
    nbytes = layout.chunk_bytes(chunk)
    buf = torch.empty(2, nbytes, dtype=torch.uint8)
    a.gather_many(buf, src)
    for i in range(2):
        one = torch.empty(nbytes, dtype=torch.uint8)
        a.gather(one, src[i])
        assert torch.equal(buf[i], one)
    specs = [(dst[0], 0, chunk), (dst[1], bs, chunk - bs - 3)]
    a.scatter_many(buf, specs)
    for i, (blocks, first, count) in enumerate(specs):
        b.scatter(buf[i], blocks, first, count)
    assert all(torch.equal(x, y) for x, y in zip(a_caches, b_caches, strict=True))
    per_layer = nbytes // L
    for li in range(L):  # layer by layer gives the same result
        a.scatter_layer(li, buf[:, li * per_layer : (li + 1) * per_layer].contiguous(), specs)
    assert all(torch.equal(x, y) for x, y in zip(a_caches, b_caches, strict=True))
