"""vLLM's KV cache groups, as hpkv serves them (its hybrid KV cache manager, ``SupportsHMA``).

vLLM keeps one block table per group of layers that keep the same tokens: the full-attention
layers, each run of sliding-window (or chunked local) layers of one window. A chunk record holds
every layer's KV for the chunk's tokens, the layers group after group, so each group's share of a
payload is one contiguous run of layers, copied with that group's block ids.

A chunk's blocks travel as one flat list, group after group (``blocks_per_chunk`` ids each), so
the single-group path, the dense models', is unchanged.

Two things differ from one group:

* **Null blocks.** A group with a window gives the tokens before its window vLLM's null block
  (id 0), which holds nothing: a load leaves those blocks alone (the engine never reads them), and a
  chunk is stored only while every group still holds it (:meth:`KVGroups.kept_from`).
* **Load errors.** vLLM takes a failed block only from a single-group model (block ids repeat across
  groups); a multi-group model's loads go asynchronous, so a failure is the request's, which vLLM
  recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpkv.core.errors import HpkvConfigError
from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.paged import PagedKV, Spec

NULL_BLOCK = 0  # vLLM's null block: a placeholder for tokens a group does not keep


@dataclass(frozen=True)
class KVGroup:
    kind: str  # "full", "sliding" or "chunked"
    layers: int
    window: int = 0  # sliding: the window in tokens; chunked: the attention chunk
    extra: int = 0  # sliding: tokens vLLM retains behind the window (speculative decoding)

    def skipped(self, computed: int) -> int:
        """Tokens at the front whose blocks vLLM frees once ``computed`` tokens are computed (its
        managers' ``get_num_skipped_tokens``)."""
        if self.kind == "sliding":
            return max(0, computed - self.window + 1 - self.extra)
        if self.kind == "chunked":
            return computed // self.window * self.window
        return 0

    def describe(self) -> str:
        name = {"full": "full", "sliding": f"sw{self.window}", "chunked": f"local{self.window}"}[self.kind]
        return f"{name}x{self.layers}"


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]

    @property
    def count(self) -> int:
        return len(self.groups)

    def describe(self) -> str:
        """Canonical text for the namespace: records of another grouping are another model's."""
        return "+".join(g.describe() for g in self.groups)

    def kept_from(self, computed: int) -> int:
        """The first token every group still holds once ``computed`` tokens are computed: a chunk
        starting before it may have lost a group's blocks (freed, possibly reused) and is not
        stored from the engine."""
        return max(g.skipped(computed) for g in self.groups)

    def token_blocks(self, blocks: Sequence[int], first: int, end: int, block_size: int) -> list[int]:
        """The real blocks (null ones left out) of every group holding chunk tokens [first, end)."""
        per = len(blocks) // self.count
        lo, hi = first // block_size, -(-end // block_size)
        return [b for g in range(self.count) for b in blocks[g * per + lo : g * per + hi] if b != NULL_BLOCK]


def describe_groups(groups: Sequence[Any]) -> tuple[KVGroups, list[str], Any]:
    """hpkv's view of vLLM's ``kv_cache_groups``: the groups, every layer in record order (group
    after group), and one group's spec (the layout every group shares). Raises, naming what is
    not served, for a group kept per request (Mamba, linear attention) or groups whose per-token
    KV differ."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    out: list[KVGroup] = []
    names: list[str] = []
    first: Any = None
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.first_spec
        if not isinstance(spec, AttentionSpec):
            raise HpkvConfigError(
                f"hpkv cannot serve this model: its KV cache group {i} ({type(spec).__name__}, layers "
                f"{', '.join(g.layer_names[:3])}{', …' if len(g.layer_names) > 3 else ''}) keeps a state per "
                "request (linear attention or Mamba), which hpkv does not store yet. Serve it without hpkv "
                "(no --kv-transfer-config)."
            )
        if isinstance(spec, SlidingWindowSpec):
            n, extra = len(g.layer_names), int(spec.extra_retained_tokens)
            kind = KVGroup("sliding", n, int(spec.sliding_window), extra)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            kind = KVGroup("chunked", len(g.layer_names), int(spec.attention_chunk_size))
        elif isinstance(spec, FullAttentionSpec):
            kind = KVGroup("full", len(g.layer_names))
        else:
            raise HpkvConfigError(
                f"hpkv cannot serve this model: its KV cache group {i} is {type(spec).__name__}, which hpkv "
                "does not know how to store. Serve it without hpkv (no --kv-transfer-config)."
            )
        if first is None:
            first = spec
        elif _shape(spec) != _shape(first):
            raise HpkvConfigError(
                "hpkv cannot serve this model: its KV cache groups keep different KV per token "
                f"(group 0: {_shape(first)}, group {i}: {_shape(spec)}). Serve it without hpkv, or with "
                "--disable-hybrid-kv-cache-manager."
            )
        out.append(kind)
        names.extend(g.layer_names)
    return KVGroups(tuple(out)), names, first


def _shape(spec: Any) -> tuple[Any, ...]:
    mla = type(spec).__name__.startswith("MLA")
    return (int(spec.block_size), int(spec.num_kv_heads), int(spec.head_size), spec.dtype, mla)


class GroupedPagedKV:
    """The paged KV of several groups behind :class:`PagedKV`'s interface: each group's share of a
    payload (its layers, contiguous) goes to or from its own blocks, its null blocks left alone.
    Copies use the torch path (the one-launch kernels take one block list for every layer)."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        block_size: int,
        layout: KVLayout,
        backend: str,
        groups: KVGroups,
    ) -> None:
        self.block_size = block_size
        self.layout = layout
        self.groups = groups
        self.parts: list[PagedKV] = []
        at = 0
        for g in groups.groups:
            sub = KVLayout(g.layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.num_kv)
            p = PagedKV(caches[at : at + g.layers], block_size, sub, backend)
            p.use_kernels = False
            self.parts.append(p)
            at += g.layers
        if at != layout.num_layers:
            raise ValueError(f"{at} layers in the groups for a layout of {layout.num_layers}")
        self.device = self.parts[0].device
        self.use_kernels = False

    def null_chunk(self, blocks: int) -> list[int]:
        return [NULL_BLOCK] * (blocks * self.groups.count)

    def _sections(self, blocks: int) -> list[tuple[int, int]]:
        """Byte ranges of each group's layers in a payload of ``blocks`` blocks."""
        per_layer = self.layout.chunk_bytes(blocks * self.block_size) // self.layout.num_layers
        out, at = [], 0
        for g in self.groups.groups:
            out.append((at, at + g.layers * per_layer))
            at += g.layers * per_layer
        return out

    def _split(self, block_ids: Sequence[int]) -> list[Sequence[int]]:
        per = len(block_ids) // self.groups.count
        return [block_ids[g * per : (g + 1) * per] for g in range(self.groups.count)]

    def _segments(self, ids: Sequence[int], first: int, count: int) -> list[tuple[int, int]]:
        """Tokens ``[first, first+count)`` as (first, count) runs over real blocks: a window's null
        blocks (vLLM's placeholder, which it reads as empty) are never written."""
        bs, end = self.block_size, first + count
        out: list[tuple[int, int]] = []
        b = first // bs
        while b * bs < end and b < len(ids):
            if ids[b] == NULL_BLOCK:
                b += 1
                continue
            lo = max(first, b * bs)
            while b * bs < end and b < len(ids) and ids[b] != NULL_BLOCK:
                b += 1
            out.append((lo, min(end, b * bs) - lo))
        return out

    def gather(self, payload: torch.Tensor, block_ids: Sequence[int]) -> None:
        split = self._split(block_ids)
        for p, ids, (lo, hi) in zip(self.parts, split, self._sections(len(split[0])), strict=True):
            p.gather(payload[lo:hi], ids)

    def scatter(self, payload: torch.Tensor, block_ids: Sequence[int], first: int, count: int) -> None:
        split = self._split(block_ids)
        for p, ids, (lo, hi) in zip(self.parts, split, self._sections(len(split[0])), strict=True):
            for f, n in self._segments(ids, first, count):
                p.scatter(payload[lo:hi], ids, f, n)

    # The batched forms serve the CUDA mover; several groups take the per-chunk path there too.

    def plan(self, specs: Sequence[Spec]) -> Any:
        return None

    def scatter_many(self, buf: torch.Tensor, specs: Sequence[Spec], plan: Any = None) -> None:
        for row, (ids, first, count) in zip(buf, specs, strict=True):
            self.scatter(row, ids, first, count)

    def scatter_layer(self, li: int, buf: torch.Tensor, specs: Sequence[Spec], plan: Any = None) -> None:
        raise NotImplementedError("layer-by-layer loads take one KV cache group")

    def gather_many(self, buf: torch.Tensor, block_ids: Sequence[Sequence[int]]) -> None:
        splits = [self._split(ids) for ids in block_ids]
        for g, (p, (lo, hi)) in enumerate(zip(self.parts, self._sections(len(splits[0][0])), strict=True)):
            p.gather_many(buf[:, lo:hi], [s[g] for s in splits])
