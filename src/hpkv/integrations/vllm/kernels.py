# mypy: disable-error-code="no-untyped-def"
"""One-launch scatter/gather between staged chunk payloads and paged KV on CUDA (Triton).

Per-(layer, K/V) torch indexing costs two kernel launches and ~20 us of host time
each; for a 28-layer model that is ~100 launches per group of chunks, and the host,
not PCIe, becomes the limit. These kernels move every layer of a group of blocks in
one launch: program (block m, layer-part p) copies ``bs x heads x dim`` elements
between the staging buffer (canonical ``[item][layer][K,V][token][head][dim]``) and
``parts[p]``'s block ``dest[m]``, addressed through a table of the parts' base
pointers (one layer-part per entry) and their common element strides.

Used only when every part shares one set of strides and dtype (vLLM allocates all
layers alike); otherwise the mover falls back to the torch path.
"""

from __future__ import annotations

from typing import Any

import torch

_BLOCK = 2048  # elements per loop step of one program

try:  # Triton comes with CUDA builds of torch; the CPU build runs without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the torch build
    HAVE_TRITON = False


def available() -> bool:
    return HAVE_TRITON


if HAVE_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def paged_offset(e, st, sh, sd: tl.constexpr, hd: tl.constexpr, d: tl.constexpr):
        """Element offset, inside one paged block, of the ``e``-th element of a [token][head][dim] run.
        ``sd`` and ``d`` are compile-time constants so the compiler sees runs of ``d`` contiguous
        elements (``sd == 1`` in vLLM's layouts) and vectorizes them."""
        return (e // hd) * st + ((e % hd) // d) * sh + (e % d) * sd

    @triton.jit  # type: ignore[untyped-decorator]
    def scatter_kernel(
        src_ptr, ptrs_ptr, items_ptr, in_chunk_ptr, dest_ptr, tokens_ptr, parts, chunk_tokens, sb, st, sh,
        sd: tl.constexpr, bs: tl.constexpr, hd: tl.constexpr, d: tl.constexpr,
        ELEM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        m = tl.program_id(0)  # one block of one chunk: its first ``tokens[m]`` tokens
        p = tl.program_id(1)  # one (layer, K/V) part
        item = tl.load(items_ptr + m).to(tl.int64)
        n = tl.load(tokens_ptr + m) * hd
        blk = tl.load(in_chunk_ptr + m).to(tl.int64)
        dst = tl.load(ptrs_ptr + p).to(tl.pointer_type(ELEM)) + tl.load(dest_ptr + m).to(tl.int64) * sb
        src = src_ptr + ((item * parts + p) * chunk_tokens + blk * bs) * hd
        for start in range(0, bs * hd, BLOCK):
            e = start + tl.arange(0, BLOCK)
            mask = e < n
            tl.store(dst + paged_offset(e, st, sh, sd, hd, d), tl.load(src + e, mask=mask), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def gather_kernel(
        dst_ptr, ptrs_ptr, blocks_ptr, parts, nb, sb, st, sh,
        sd: tl.constexpr, bs: tl.constexpr, hd: tl.constexpr, d: tl.constexpr,
        ELEM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        m = tl.program_id(0)  # item * nb + block in chunk
        p = tl.program_id(1)
        item = (m // nb).to(tl.int64)
        blk = (m % nb).to(tl.int64)
        src = tl.load(ptrs_ptr + p).to(tl.pointer_type(ELEM)) + tl.load(blocks_ptr + m).to(tl.int64) * sb
        dst = dst_ptr + ((item * parts + p) * nb * bs + blk * bs) * hd
        for start in range(0, bs * hd, BLOCK):
            e = start + tl.arange(0, BLOCK)
            mask = e < bs * hd
            tl.store(dst + e, tl.load(src + paged_offset(e, st, sh, sd, hd, d), mask=mask), mask=mask)


def _build() -> dict[str, Any]:
    return {"scatter": scatter_kernel, "gather": gather_kernel}


def _elem(dtype: torch.dtype) -> Any:
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}.get(
        dtype, tl.uint8
    )


class PartTable:
    """Base pointers and the shared strides of every (layer, K/V) part view ``[blocks, bs, heads, dim]``."""

    def __init__(self, parts: list[torch.Tensor]) -> None:
        first = parts[0]
        self.ok = all(p.stride() == first.stride() and p.dtype == first.dtype for p in parts)
        self.strides = first.stride()
        self.dtype = first.dtype
        self.n = len(parts)
        self.ptrs = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64, device=first.device)


def scatter(
    table: PartTable, src: torch.Tensor, plan: Any, chunk_tokens: int, bs: int, heads: int, d: int
) -> None:
    """``src``: staged payloads ``[items, bytes]``; ``plan``: every block to fill (items, in_chunk, dest,
    tokens), partial ones included: one launch, where a copy per partial block and part cost ~2 x 28
    launches for the last block of a prompt."""
    if plan.n == 0:
        return
    sb, st, sh, sd = table.strides
    _build()["scatter"][(plan.n, table.n)](
        src.view(table.dtype), table.ptrs, plan.items, plan.in_chunk, plan.dest, plan.tokens,
        table.n, chunk_tokens,
        sb, st, sh, sd=sd, bs=bs, hd=heads * d, d=d, ELEM=_elem(table.dtype), BLOCK=_BLOCK,
    )  # fmt: skip


def gather(
    table: PartTable, dst: torch.Tensor, blocks: torch.Tensor, nb: int, bs: int, heads: int, d: int
) -> None:
    """``dst``: ``[items, bytes]`` to fill with whole chunks; ``blocks``: ``[items, nb]`` source block ids."""
    sb, st, sh, sd = table.strides
    _build()["gather"][(blocks.numel(), table.n)](
        dst.view(table.dtype), table.ptrs, blocks, table.n, nb,
        sb, st, sh, sd=sd, bs=bs, hd=heads * d, d=d, ELEM=_elem(table.dtype), BLOCK=_BLOCK,
    )  # fmt: skip
