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

Copies are batched per (layer, K/V) and per chunk: one ``index_select`` /
``index_copy_`` over the chunk's blocks, so small blocks do not turn into
many tiny copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpkv.core.layout import KVLayout

CPU_BACKENDS = {"CPU_ATTN"}


@dataclass(frozen=True)
class LayerViews:
    """K and V (or the single MLA latent) of one layer as ``[block, token, head, dim]`` views."""

    parts: tuple[torch.Tensor, ...]


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
        else:
            k, v = t[..., :d], t[..., d:]
        return LayerViews((k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)))

    def gather(self, payload: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy the chunk held by ``block_ids`` (consecutive tokens, whole blocks) into ``payload``."""
        chunk = len(block_ids) * self.block_size
        dst = payload.view(self.layout.dtype).view(self.layout.chunk_shape(chunk))
        nb = len(block_ids)
        L = self.layout
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.device)
        for li, views in enumerate(self.layers):
            for ki, part in enumerate(views.parts):
                out = dst[li, ki].view(nb, self.block_size, L.num_kv_heads, L.head_dim)
                if self.device.type == "cpu":
                    torch.index_select(part, 0, idx, out=out)
                else:
                    out.copy_(part.index_select(0, idx), non_blocking=True)

    def scatter(self, payload: torch.Tensor, block_ids: Sequence[int], first: int, count: int) -> None:
        """Copy tokens ``[first, first+count)`` of the chunk in ``payload`` into the blocks holding them.

        ``block_ids[j]`` holds chunk tokens ``[j*bs, (j+1)*bs)``; ``first`` is a
        multiple of the block size (the engine's own prefix ends on a block);
        ``first + count`` may end inside a block (the engine computes the rest).
        """
        bs = self.block_size
        L = self.layout
        chunk_tokens = len(block_ids) * bs
        src = payload.view(L.dtype).view(L.chunk_shape(chunk_tokens))
        b0 = first // bs
        full = count // bs
        tail = count - full * bs
        idx = torch.as_tensor(block_ids[b0 : b0 + full], dtype=torch.long, device=self.device)
        for li, views in enumerate(self.layers):
            for ki, part in enumerate(views.parts):
                s = src[li, ki]
                if full:
                    blocks = s[first : first + full * bs].view(full, bs, L.num_kv_heads, L.head_dim)
                    part.index_copy_(0, idx, blocks.to(part.device, non_blocking=True))
                if tail:
                    start = first + full * bs
                    part[block_ids[b0 + full], :tail].copy_(s[start : start + tail], non_blocking=True)


def _as_rows(t: torch.Tensor, bs: int, d: int) -> torch.Tensor:
    """``[blocks, heads, bs, 2d]`` -> ``[blocks, heads, 2bs, d]`` for a tensor whose head blocks are
    each contiguous but which is not contiguous overall (a strided per-layer view)."""
    s = t.stride()
    if s[3] != 1 or s[2] != 2 * d:
        raise ValueError(f"cannot read a CPU KV block as K rows then V rows with strides {s}")
    return t.as_strided((t.shape[0], t.shape[1], 2 * bs, d), (s[0], s[1], d, 1))
