"""The mover between pool slots and paged KV, on the CPU (always) and on CUDA (where a GPU exists).

The CUDA cases run on the device machine (`make test-gpu` there); elsewhere they are skipped with a
reason naming the missing GPU. They check bit-exact round trips pool -> paged GPU KV -> pool for the
GPU layouts vLLM uses, random block tables, layer-wise loading, that a store reads the blocks before
the engine may reuse them (stream events honoured), and that the pool really is page-locked.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.mover import LoadItem, Mover, StoreItem, _group_sizes
from hpkv.integrations.vllm.paged import PagedKV
from hpkv.tiers.memory.pool import PAGE, ShmPool

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: none found")),
]
CUDA_ONLY = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: none found")

L, H, D = 3, 2, 32
NUM_BLOCKS = 96
CHUNK = 128


def make_caches(kind: str, bs: int, dtype: torch.dtype, device: str, mla: bool = False) -> list[torch.Tensor]:
    """Per-layer KV in vLLM's logical [blocks, heads, bs, C] shape over the given physical layout."""
    c = D if mla else 2 * D
    heads = 1 if mla else H
    if kind == "token-major":  # FlashAttention: physical [B, bs, H, C] per layer
        return [
            torch.zeros(NUM_BLOCKS, bs, heads, c, dtype=dtype, device=device).permute(0, 2, 1, 3)
            for _ in range(L)
        ]
    if kind == "one-allocation":  # physical [B, L, bs, H, C]: per-layer strided views of one tensor
        raw = torch.zeros(NUM_BLOCKS, L, bs, heads, c, dtype=dtype, device=device)
        return [raw[:, i].permute(0, 2, 1, 3) for i in range(L)]
    if kind == "cpu":
        return [torch.zeros(NUM_BLOCKS, heads, bs, c, dtype=dtype, device=device) for _ in range(L)]
    raise AssertionError(kind)


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    path = f"/dev/shm/hpkv-mover-{uuid.uuid4().hex[:10]}.shm"
    p = ShmPool(path, 64 << 20)
    yield p
    p.close()
    if os.path.exists(path):
        os.unlink(path)


def slot(pool: ShmPool, i: int, nbytes: int) -> torch.Tensor:
    off = i * (-(-nbytes // PAGE) * PAGE)
    return pool.tensor[off : off + nbytes]


def fill_random(caches: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))


def expected_payload(paged_cpu: PagedKV, blocks: list[int], layout: KVLayout) -> torch.Tensor:
    out = torch.empty(layout.chunk_bytes(CHUNK), dtype=torch.uint8)
    paged_cpu.gather(out, blocks)
    return out


def _setup(kind: str, bs: int, dtype: torch.dtype, device: str, mla: bool, layerwise: bool = False):  # type: ignore[no-untyped-def]
    layout = KVLayout(
        num_layers=L, num_kv_heads=1 if mla else H, head_dim=D, dtype=dtype, num_kv=1 if mla else 2
    )
    caches = make_caches(kind, bs, dtype, device, mla)
    backend = "CPU_ATTN" if kind == "cpu" else ("FLASHMLA" if mla else "FLASH_ATTN")
    paged = PagedKV(caches, bs, layout, backend)
    return layout, caches, paged, Mover(paged, layerwise=layerwise)


CASES = [
    ("token-major", 16, torch.bfloat16, False),
    ("token-major", 64, torch.float16, False),
    ("one-allocation", 16, torch.float16, False),
    ("one-allocation", 64, torch.bfloat16, False),
    ("token-major", 64, torch.bfloat16, True),  # MLA: one latent per token
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "bs", "dtype", "mla"), CASES)
@pytest.mark.parametrize("layerwise", [False, True])
def test_round_trip_pool_paged_pool(
    pool: ShmPool, device: str, kind: str, bs: int, dtype: torch.dtype, mla: bool, layerwise: bool
) -> None:
    layout, caches, paged, mover = _setup(kind, bs, dtype, device, mla, layerwise)
    try:
        mover.attach_pool(pool.tensor)
        if device == "cuda":
            assert mover.pinned and pool.tensor.is_pinned()  # page-locked in place, not pageable
        fill_random(caches, seed=bs)
        cpu_paged = PagedKV([c.cpu() for c in caches], bs, layout, paged.backend)
        g = torch.Generator().manual_seed(7 + bs)
        perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        per = CHUNK // bs
        n = 5
        src = [perm[i * per : (i + 1) * per] for i in range(n)]
        dst = [perm[(n + i) * per : (n + i + 1) * per] for i in range(n)]
        nbytes = layout.chunk_bytes(CHUNK)

        done: list[int] = []
        took: list[float] = []
        mover.store(
            [StoreItem(slot(pool, i, nbytes), src[i]) for i in range(n)], lambda: done.append(1), took.append
        )
        mover.flush()
        assert done == [1]
        # The copies' own time, reported once they landed (CUDA: events), never zero or the enqueue.
        assert len(took) == 1 and 0 < took[0] < 10
        for i in range(n):
            assert torch.equal(slot(pool, i, nbytes), expected_payload(cpu_paged, src[i], layout)), i

        # Load back into other blocks: whole chunks, and a last chunk that ends inside a block.
        tail = CHUNK - bs - 5
        items = [LoadItem(slot(pool, i, nbytes), dst[i], 0, CHUNK) for i in range(n - 1)]
        items.append(LoadItem(slot(pool, n - 1, nbytes), dst[n - 1], bs, tail))
        before = [c.clone() for c in caches]
        mover.load(items)
        for li in range(L):
            mover.wait_layer(li)
        mover.finish_loads()
        got = PagedKV([c.cpu() for c in caches], bs, layout, paged.backend)
        for i in range(n - 1):
            assert torch.equal(
                expected_payload(got, dst[i], layout), expected_payload(cpu_paged, src[i], layout)
            )
        # the partial chunk: blocks before `first` untouched, tokens after the tail untouched
        last_got = expected_payload(got, dst[n - 1], layout).view(dtype).view(layout.chunk_shape(CHUNK))
        last_src = expected_payload(cpu_paged, src[n - 1], layout).view(dtype).view(layout.chunk_shape(CHUNK))
        old = PagedKV([c.cpu() for c in before], bs, layout, paged.backend)
        last_old = expected_payload(old, dst[n - 1], layout).view(dtype).view(layout.chunk_shape(CHUNK))
        assert torch.equal(last_got[:, :, bs : bs + tail], last_src[:, :, bs : bs + tail])
        assert torch.equal(last_got[:, :, :bs], last_old[:, :, :bs])
        assert torch.equal(last_got[:, :, bs + tail :], last_old[:, :, bs + tail :])
    finally:
        mover.close()


def _filled_cuda_mover(pool: ShmPool, bs: int, seed: int):  # type: ignore[no-untyped-def]
    """A CUDA mover on token-major bf16 KV filled with random values, the pool attached, and a CPU
    copy of the KV to compute expected payloads from."""
    layout, caches, paged, mover = _setup("token-major", bs, torch.bfloat16, "cuda", False)
    mover.attach_pool(pool.tensor)
    fill_random(caches, seed=seed)
    return layout, caches, mover, PagedKV([c.cpu() for c in caches], bs, layout, paged.backend)


@CUDA_ONLY
def test_store_reads_blocks_before_the_engine_reuses_them(pool: ShmPool) -> None:
    layout, caches, mover, cpu_paged = _filled_cuda_mover(pool, 16, seed=3)
    try:
        blocks = list(range(CHUNK // 16))
        want = expected_payload(cpu_paged, blocks, layout)
        nbytes = layout.chunk_bytes(CHUNK)
        # Hold the store stream back, so an unordered engine would overwrite the blocks first.
        with torch.cuda.stream(mover.store_stream):
            torch.cuda._sleep(200_000_000)
        mover.store([StoreItem(slot(pool, 0, nbytes), blocks)], lambda: None)
        for c in caches:  # the engine's next step reuses the blocks, on its compute stream
            c.fill_(7.0)
        mover.flush()
        assert torch.equal(slot(pool, 0, nbytes), want)
    finally:
        mover.close()


@CUDA_ONLY
def test_load_is_ordered_before_the_compute_stream_reads(pool: ShmPool) -> None:
    layout, caches, mover, cpu_paged = _filled_cuda_mover(pool, 64, seed=5)
    try:
        nbytes = layout.chunk_bytes(CHUNK)
        blocks = [10, 11]
        slot(pool, 0, nbytes).copy_(expected_payload(cpu_paged, [0, 1], layout))
        with torch.cuda.stream(mover.copy_stream):
            torch.cuda._sleep(200_000_000)  # a slow PCIe copy
        mover.load([LoadItem(slot(pool, 0, nbytes), blocks, 0, CHUNK)])
        snapshot = [c.clone() for c in caches]  # on the compute stream: must see the loaded data
        mover.finish_loads()
        got = PagedKV([c.cpu() for c in snapshot], 64, layout, cpu_paged.backend)
        assert torch.equal(expected_payload(got, blocks, layout), expected_payload(cpu_paged, [0, 1], layout))
    finally:
        mover.close()


@pytest.mark.parametrize("device", DEVICES)
def test_async_loads_land_in_parts_without_holding_the_compute_stream(pool: ShmPool, device: str) -> None:
    """vLLM's async load: parts of one request's chunks arrive step by step; each part's copies
    land bit-exact, the engine's compute stream never waits for them, and ``landed`` says when
    they are in place (the worker reports the request received only then)."""
    bs = 16
    kind = "cpu" if device == "cpu" else "token-major"
    layout, caches, paged, mover = _setup(kind, bs, torch.bfloat16, device, False)
    try:
        mover.attach_pool(pool.tensor)
        fill_random(caches, seed=11)
        cpu_paged = PagedKV([c.cpu() for c in caches], bs, layout, paged.backend)
        nbytes = layout.chunk_bytes(CHUNK)
        per = CHUNK // bs
        src = [list(range(i * per, (i + 1) * per)) for i in range(4)]
        dst = [list(range((4 + i) * per, (5 + i) * per)) for i in range(4)]
        for i in range(4):
            slot(pool, i, nbytes).copy_(expected_payload(cpu_paged, src[i], layout))
        first = mover.load_async([LoadItem(slot(pool, i, nbytes), dst[i], 0, CHUNK) for i in range(2)])
        if device == "cuda":
            with torch.cuda.stream(mover.copy_stream):
                torch.cuda._sleep(400_000_000)  # a slow link for the second part
        second = mover.load_async([LoadItem(slot(pool, i, nbytes), dst[i], 0, CHUNK) for i in (2, 3)])
        if device == "cpu":
            assert first is None and second is None  # done on return
        else:
            assert first is not None and second is not None
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream())  # the engine's next kernel
            ev.synchronize()
            assert not second[1].query(), "the compute stream waited for an async load"
            second[1].synchronize()
            assert first[1].query() and second[1].query()
            assert first[0].elapsed_time(second[1]) > 0
        got = PagedKV([c.cpu() for c in caches], bs, layout, paged.backend)
        for i in range(4):
            want = expected_payload(cpu_paged, src[i], layout)
            assert torch.equal(expected_payload(got, dst[i], layout), want)
        assert mover.finish_loads() is None  # nothing of it is a synchronous load
    finally:
        mover.close()


@CUDA_ONLY
@pytest.mark.parametrize("layerwise", [False, True])
def test_load_time_is_the_copy_not_the_enqueue(pool: ShmPool, layerwise: bool) -> None:
    """finish_loads reports the device time of the copies (CUDA events), so the per-request line's
    GB/s is never above the host link (the device's PCIe Gen5 x16 peaks near 64 GB/s); None when
    nothing is in flight."""
    bs = 16
    layout, _, _, mover = _setup("token-major", bs, torch.bfloat16, "cuda", False, layerwise)
    try:
        mover.attach_pool(pool.tensor)
        nbytes = layout.chunk_bytes(CHUNK)
        n = (60 << 20) // (-(-nbytes // PAGE) * PAGE)  # most of the 64 MiB pool
        per = CHUNK // bs
        n = min(n, NUM_BLOCKS // per)
        items = [
            LoadItem(slot(pool, i, nbytes), list(range(i * per, (i + 1) * per)), 0, CHUNK) for i in range(n)
        ]
        assert mover.finish_loads() is None
        mover.load(items)
        took = mover.finish_loads()
        assert took is not None and took > 0
        assert n * nbytes / took < 100e9, f"{n * nbytes / took / 1e9:.0f} GB/s: not a finished copy"
        assert mover.finish_loads() is None
    finally:
        mover.close()


@CUDA_ONLY
@pytest.mark.parametrize("layerwise", [False, True])
def test_warm_up_leaves_the_kv_unchanged_and_the_buffers_ready(layerwise: bool) -> None:
    """The start-time warm-up (kernels compiled, staging allocated, so the first request does not pay)
    round-trips block 0 through staging: every byte of the KV is as before."""
    _, caches, _, mover = _setup("token-major", 16, torch.bfloat16, "cuda", False, layerwise)
    try:
        fill_random(caches, seed=11)
        before = [c.clone() for c in caches]
        assert mover.warm_up(CHUNK) > 0
        assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
        assert {"load0", "load1", "store0", "store1"} <= set(mover._staging)
        assert mover.warm_up(CHUNK) >= 0  # again: nothing reallocated, still unchanged
        assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    finally:
        mover.close()


def test_warm_up_is_nothing_on_cpu() -> None:
    _, _, _, mover = _setup("cpu", 16, torch.bfloat16, "cpu", False)
    assert mover.warm_up(CHUNK) == 0.0


def test_a_load_ends_on_one_chunk_groups() -> None:
    """Staged groups: full ones, then halves, so the last scatter (hidden behind no copy) is one chunk."""
    assert _group_sizes(32, 8) == [8, 8, 8, 4, 2, 1, 1]
    assert _group_sizes(9, 8) == [8, 1]
    assert _group_sizes(5, 8) == [3, 1, 1]
    assert _group_sizes(1, 8) == [1] and _group_sizes(0, 8) == []
    for n in range(1, 70):
        sizes = _group_sizes(n, 8)
        assert sum(sizes) == n and max(sizes) <= 8 and sizes[-1] == 1
