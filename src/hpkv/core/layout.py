"""The shape of one rank's KV and the bytes of one chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpkv.core.errors import HpkvConfigError

# Stable names: they go into key namespaces, so renaming one orphans every stored chunk.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.uint8: "uint8",
    torch.int8: "int8",
}


@dataclass(frozen=True)
class KVLayout:
    """One rank's attention KV: ``num_layers`` layers of K and V, ``num_kv_heads`` × ``head_dim`` per token.

    The canonical payload of a chunk is ``[layer][K,V][token][head][dim]`` for
    this rank's heads, independent of how an engine pages its KV.
    ``num_kv`` is 2 for K and V, or 1 for a single latent (MLA).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_kv: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise HpkvConfigError(f"KVLayout.{name}={v!r} must be a positive integer; use e.g. 8")
        if self.num_kv not in (1, 2):
            raise HpkvConfigError(f"KVLayout.num_kv={self.num_kv!r} must be 2 (K and V) or 1 (MLA latent)")
        if self.dtype not in _DTYPE_NAMES:
            raise HpkvConfigError(
                f"KVLayout.dtype={self.dtype!r} is not supported; use e.g. torch.bfloat16 "
                f"(supported: {', '.join(sorted(_DTYPE_NAMES.values()))})"
            )

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def dtype_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's KV across all layers of this rank."""
        return self.num_layers * self.num_kv * self.num_kv_heads * self.head_dim * self.dtype_size

    def chunk_bytes(self, chunk_size: int) -> int:
        """Payload bytes of one chunk: 2 × layers × chunk_size × kv_heads × head_dim × dtype bytes."""
        return self.token_bytes * chunk_size

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_kv, chunk_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        """Canonical text, used in namespaces: equal layouts give equal text on every machine."""
        return (
            f"layers={self.num_layers},kv={self.num_kv},heads={self.num_kv_heads},"
            f"head_dim={self.head_dim},dtype={self.dtype_name}"
        )
