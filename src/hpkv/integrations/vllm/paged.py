"""The mover: copies between chunk payloads and an engine's paged KV cache.

A chunk payload is canonical: ``[layer][K,V][token][head][dim]``. The engine's
cache is one tensor per layer, in whatever layout its attention backend uses.
:class:`PagedKV` turns each registered tensor into K and V views of logical
shape ``[block, token-in-block, head, dim]`` (any strides), from the tensor's
own shape and the backend's documented interpretation, so nothing here
hard-codes strides:

* vLLM 0.32 registers per-layer tensors with the logical shape
  ``[blocks, heads, block_size, C]`` (RFC 42082). GPU backends (FlashAttention,
  Triton, FlashInfer) put K and V side by side in ``C`` (``C = 2 × head_dim``);
* the CPU backend (``CPU_ATTN``) reads each ``[block_size, 2 × head_dim]``
  head block as ``[2 × block_size, head_dim]``: all K rows, then all V rows;
* MLA backends keep one latent per token (``heads == 1``, ``num_kv == 1``).

On the host (the CPU build) a chunk's blocks are copied in runs of consecutive
block ids: one strided ``copy_`` per run and layer, K and V together where the
backend keeps them in one head block (``CPU_ATTN``), so the copy is one pass
over contiguous destination memory rather than an indexed copy per K/V. On
CUDA the batched forms below serve the mover (one Triton launch for all layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpkv.core.layout import KVLayout

CPU_BACKENDS = {"CPU_ATTN"}


@dataclass(frozen=True)
class LayerViews:
    """K and V (or the single MLA latent) of one layer as ``[block, token, head, dim]`` views."""

    parts: tuple[torch.Tensor, ...]
    fused: torch.Tensor | None = None  # CPU_ATTN: [block, head, K/V, token, dim] over the same memory


class PagedKV:
    def __init__(
        self, caches: Sequence[torch.Tensor], block_size: int, layout: KVLayout, backend: str
    ) -> None:
        """``caches``: the per-layer tensors in model order; ``backend``: the attention backend name."""
        self.block_size = block_size
        self.layout = layout
        self.backend = backend
        self.layers = [self._views(t) for t in caches]
        if len(self.layers) != layout.num_layers:
            raise ValueError(f"{len(self.layers)} KV tensors for a layout of {layout.num_layers} layers")
        self.device = caches[0].device
        # CUDA: one-launch Triton copies where the layers share strides (see kernels.py).
        self.use_kernels = False
        self._tables: Any = None
        if self.device.type == "cuda":
            from hpkv.integrations.vllm import kernels

            if kernels.available():
                whole = kernels.PartTable([p for v in self.layers for p in v.parts])
                if whole.ok:
                    self.use_kernels = True
                    self._tables = (whole, [kernels.PartTable(list(v.parts)) for v in self.layers])

    def null_chunk(self, blocks: int) -> list[int]:
        """A chunk's block list naming only vLLM's null block (block 0), for warming up copies."""
        return [0] * blocks

    def _views(self, t: torch.Tensor) -> LayerViews:
        L = self.layout
        if t.dtype != L.dtype:
            raise ValueError(f"KV cache dtype {t.dtype} differs from the layout's {L.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"expected a [blocks, heads, block_size, C] KV tensor, got shape {tuple(t.shape)}"
            )
        blocks, heads, bs, c = t.shape
        if bs != self.block_size or heads != L.num_kv_heads:
            raise ValueError(
                f"KV tensor shape {tuple(t.shape)} does not match block_size={self.block_size}, "
                f"kv_heads={L.num_kv_heads}"
            )
        d = L.head_dim
        if L.num_kv == 1:  # MLA: one latent per token
            if c != d:
                raise ValueError(f"MLA KV tensor has C={c}, expected head_dim={d}")
            return LayerViews((t.permute(0, 2, 1, 3),))
        if c != 2 * d:
            raise ValueError(f"KV tensor has C={c}, expected 2 × head_dim = {2 * d}")
        if self.backend in CPU_BACKENDS:
            # Each head block's [bs, 2d] memory holds bs K rows of d, then bs V rows of d.
            rows = t.view(blocks, heads, 2 * bs, d) if t.is_contiguous() else _as_rows(t, bs, d)
            k, v = rows[:, :, :bs], rows[:, :, bs:]
            # K and V of a block as one [block, head, K/V, token, dim] view: a run of blocks is then
            # one copy whose destination is contiguous per block.
            fused = rows.view(rows.shape[0], heads, 2, bs, d) if t.is_contiguous() else _fused(rows, bs)
            return LayerViews((k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)), fused)
        k, v = t[..., :d], t[..., d:]
        return LayerViews((k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)))

    def gather(self, payload: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy the chunk held by ``block_ids`` (consecutive tokens, whole blocks) into ``payload``."""
        L, bs = self.layout, self.block_size
        nb = len(block_ids)
        dst = payload.view(L.dtype).view(L.num_layers, L.num_kv, nb, bs, L.num_kv_heads, L.head_dim)
        if self.device.type != "cpu":
            idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
            for li, views in enumerate(self.layers):
                for ki, part in enumerate(views.parts):
                    dst[li, ki].copy_(part.index_select(0, idx), non_blocking=True)
            return
        for j, b, n in _runs(block_ids, 0, nb):
            for li, views in enumerate(self.layers):
                if views.fused is not None:
                    # Written through a view in the source's order ([n, head, K/V, bs, dim]), so the
                    # copy walks the engine's blocks sequentially.
                    dst[li, :, j : j + n].permute(1, 3, 0, 2, 4).copy_(views.fused[b : b + n])
                else:
                    for ki, part in enumerate(views.parts):
                        dst[li, ki, j : j + n].copy_(part[b : b + n])

    def scatter(self, payload: torch.Tensor, block_ids: Sequence[int], first: int, count: int) -> None:
        """Copy tokens ``[first, first+count)`` of the chunk in ``payload`` into the blocks holding them.

        ``block_ids[j]`` holds chunk tokens ``[j*bs, (j+1)*bs)``; ``first`` is a
        multiple of the block size (the engine's own prefix ends on a block);
        ``first + count`` may end inside a block (the engine computes the rest).
        """
        bs = self.block_size
        L = self.layout
        nb = len(block_ids)
        src = payload.view(L.dtype).view(L.num_layers, L.num_kv, nb, bs, L.num_kv_heads, L.head_dim)
        b0 = first // bs
        full = count // bs
        tail = count - full * bs
        if full and self.device.type != "cpu":
            dev_idx = torch.as_tensor(block_ids[b0 : b0 + full], dtype=torch.long, device=self.device)
            for li, views in enumerate(self.layers):
                for ki, part in enumerate(views.parts):
                    part.index_copy_(
                        0, dev_idx, src[li, ki, b0 : b0 + full].to(part.device, non_blocking=True)
                    )
        elif full:
            runs = _runs(block_ids, b0, b0 + full)
            # Scattered blocks: one indexed copy per layer beats a copy per block (call overhead).
            idx: torch.Tensor | None = None
            if len(runs) > 2:
                idx = torch.as_tensor(block_ids[b0 : b0 + full], dtype=torch.long)
            for li, views in enumerate(self.layers):
                if views.fused is not None:  # [n, head, K/V, bs, dim] <- [K/V, n, bs, head, dim]
                    s = src[li, :, b0 : b0 + full].permute(1, 3, 0, 2, 4)
                    if idx is not None:
                        views.fused.index_copy_(0, idx, s)
                    else:
                        for j, b, n in runs:
                            views.fused[b : b + n].copy_(s[j - b0 : j - b0 + n])
                    continue
                for ki, part in enumerate(views.parts):
                    if idx is not None:
                        part.index_copy_(0, idx, src[li, ki, b0 : b0 + full])
                    else:
                        for j, b, n in runs:
                            part[b : b + n].copy_(src[li, ki, j : j + n])
        if tail:
            j = b0 + full
            for li, views in enumerate(self.layers):
                for ki, part in enumerate(views.parts):
                    part[block_ids[j], :tail].copy_(src[li, ki, j, :tail], non_blocking=True)

    # -- batched forms (the CUDA mover): one indexed copy per layer and K/V for many chunks ------

    def plan(self, specs: Sequence[Spec]) -> _Plan:
        """Index tensors for :meth:`scatter_many` / :meth:`scatter_layer` (build once, reuse per layer)."""
        return _Plan(specs, self.block_size, self.device, fold_tails=self.use_kernels)

    def scatter_many(self, buf: torch.Tensor, specs: Sequence[Spec], plan: _Plan | None = None) -> None:
        """Scatter the chunk payloads in ``buf`` (``[items, payload bytes]``, uint8, canonical, on the
        KV's device) into the paged KV; ``specs[i] = (block_ids, first, count)`` as in :meth:`scatter`."""
        L, bs = self.layout, self.block_size
        nb = len(specs[0][0])
        plan = plan or self.plan(specs)
        whole = self._kernel_scatter(self._tables[0] if self.use_kernels else None, buf, plan, nb)
        src = buf.view(L.dtype).view(buf.shape[0], L.num_layers, L.num_kv, nb, bs, L.num_kv_heads, L.head_dim)
        self._scatter_parts(plan, lambda li, ki: src[:, li, ki], range(L.num_layers), whole)

    def scatter_layer(
        self, li: int, buf: torch.Tensor, specs: Sequence[Spec], plan: _Plan | None = None
    ) -> None:
        """Scatter layer ``li`` only: ``buf[i]`` holds that layer's ``[K,V][token][head][dim]`` of chunk i."""
        L, bs = self.layout, self.block_size
        nb = len(specs[0][0])
        plan = plan or self.plan(specs)
        whole = self._kernel_scatter(self._tables[1][li] if self.use_kernels else None, buf, plan, nb)
        src = buf.view(L.dtype).view(buf.shape[0], L.num_kv, nb, bs, L.num_kv_heads, L.head_dim)
        self._scatter_parts(plan, lambda _li, ki: src[:, ki], [li], whole)

    def _kernel_scatter(self, table: Any, buf: torch.Tensor, plan: _Plan, nb: int) -> bool:
        """Move every block, partial ones included, with the Triton kernel when ``table`` is given;
        True if the torch path must move them instead."""
        if table is None:
            return True
        from hpkv.integrations.vllm import kernels

        L = self.layout
        kernels.scatter(table, buf, plan, nb * self.block_size, self.block_size, L.num_kv_heads, L.head_dim)
        return False

    def _scatter_parts(
        self, plan: _Plan, source: Callable[[int, int], torch.Tensor], layers: Iterable[int], whole: bool
    ) -> None:
        if not (whole and plan.n) and not plan.tails:
            return
        for li in layers:
            for ki, part in enumerate(self.layers[li].parts):
                s = source(li, ki)  # [items, blocks in chunk, bs, heads, dim]
                if whole and plan.n:
                    part.index_put_((plan.dest,), s[plan.items, plan.in_chunk])
                for item, block, tok, n in plan.tails:
                    flat = s[item].flatten(0, 1)
                    part[block, :n].copy_(flat[tok : tok + n])

    def gather_many(self, buf: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> None:
        """Gather whole chunks from the paged KV into ``buf`` (``[items, payload bytes]``, canonical)."""
        L, bs = self.layout, self.block_size
        nb = len(block_ids[0])
        idx = _to_device([list(b) for b in block_ids], self.device)
        if self.use_kernels:
            from hpkv.integrations.vllm import kernels

            kernels.gather(self._tables[0], buf, idx, nb, bs, L.num_kv_heads, L.head_dim)
            return
        dst = buf.view(L.dtype).view(buf.shape[0], L.num_layers, L.num_kv, nb, bs, L.num_kv_heads, L.head_dim)
        for li, views in enumerate(self.layers):
            for ki, part in enumerate(views.parts):
                dst[:, li, ki].copy_(part[idx])


Spec = tuple[Sequence[int], int, int]  # (block_ids, first, count)


class _Plan:
    """Where the blocks of several chunks go: per block (item, block in chunk, destination, tokens).
    The partial blocks at the ends are among them when ``fold_tails`` (the kernel copies a count of
    tokens); otherwise they are kept apart as (item, destination block, chunk token, tokens) for
    the torch path, which moves whole blocks only."""

    def __init__(
        self, specs: Sequence[Spec], bs: int, device: torch.device, fold_tails: bool = False
    ) -> None:
        items: list[int] = []
        in_chunk: list[int] = []
        dest: list[int] = []
        tokens: list[int] = []
        self.tails: list[tuple[int, int, int, int]] = []
        for i, (block_ids, first, count) in enumerate(specs):
            b0, full = first // bs, count // bs
            for b in range(b0, b0 + full):
                items.append(i)
                in_chunk.append(b)
                dest.append(block_ids[b])
                tokens.append(bs)
            rest = count - full * bs
            if rest and fold_tails:
                items.append(i)
                in_chunk.append(b0 + full)
                dest.append(block_ids[b0 + full])
                tokens.append(rest)
            elif rest:
                self.tails.append((i, block_ids[b0 + full], first + full * bs, rest))
        self.n = len(dest)
        self.device = device
        self.items = _to_device(items, device)
        self.in_chunk = _to_device(in_chunk, device)
        self.dest = _to_device(dest, device)
        self.tokens = _to_device(tokens, device)


def _runs(block_ids: Sequence[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``block_ids[lo:hi]`` as runs of consecutive ids: (index in the chunk, first block id, length)."""
    out: list[tuple[int, int, int]] = []
    j = lo
    while j < hi:
        n = 1
        while j + n < hi and block_ids[j + n] == block_ids[j] + n:
            n += 1
        out.append((j, block_ids[j], n))
        j += n
    return out


def _to_device(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """An index tensor on ``device``. On CUDA it goes through page-locked memory: a copy from
    pageable memory would block the host until the stream reached it, stalling the pipeline."""
    t = torch.as_tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _fused(rows: torch.Tensor, bs: int) -> torch.Tensor:
    """``[blocks, heads, 2bs, d]`` (rows of each head block contiguous) -> ``[blocks, heads, 2, bs, d]``."""
    s = rows.stride()
    shape = (rows.shape[0], rows.shape[1], 2, bs, rows.shape[3])
    return rows.as_strided(shape, (s[0], s[1], bs * s[2], s[2], s[3]))


def _as_rows(t: torch.Tensor, bs: int, d: int) -> torch.Tensor:
    """``[blocks, heads, bs, 2d]`` -> ``[blocks, heads, 2bs, d]`` for a tensor whose head blocks are
    each contiguous but which is not contiguous overall (a strided per-layer view)."""
    s = t.stride()
    if s[3] != 1 or s[2] != 2 * d:
        raise ValueError(f"cannot read a CPU KV block as K rows then V rows with strides {s}")
    return t.as_strided((t.shape[0], t.shape[1], 2 * bs, d), (s[0], s[1], d, 1))
