"""SGLang's HiCache pieces on CPU, for hpkv's tests and ``python -m bench.sglang``: a device KV pool, its
allocator, a host pool and SGLang's real HiCacheController with a storage backend built by SGLang's
factory, plus the scheduler-side steps a caller plays (handing a storage hit its host buffers;
collecting the acks). No SGLang server runs on these CPUs; its controller and pools do."""

from __future__ import annotations

import gc
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.sglang.cpu import install_torchvision_placeholder

install_torchvision_placeholder()

# SGLang after the placeholder is in place (its imports reach torchvision).
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache import utils as _sgl_utils  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

# The page hash chain the controller's storage query computes (0.5.23: seeded by extra_key/cache_salt;
# 0.5.17: get_hash_str).
page_hashes = getattr(_sgl_utils, "get_storage_hash_str", None) or _sgl_utils.get_hash_str

PAGE = 16
LAYERS, HEADS, DIM = 4, 2, 64
DEVICE_TOKENS = 1024


def parallel_state(tp_rank: int = 0, tp_size: int = 1) -> None:
    """The parallel state SGLang's launcher publishes for this rank (one rank of ``tp_size``)."""
    get_parallel().override_permanently(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
    )


def hpkv_extra(settings: dict[str, Any], v1: bool = True) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` for hpkv, as a user writes it."""
    extra: dict[str, Any] = {
        "backend_name": "hpkv",
        "module_path": "hpkv.integrations.sglang",
        "class_name": "HpkvHiCacheStorage",
        "hpkv": dict(settings),
    }
    if v1:
        extra["interface_v1"] = 1
    return extra


@dataclass
class Rig:
    controller: Any  # SGLang's HiCacheController (None once closed)
    host: Any
    page: int
    backend_type: str
    acks: list[Any] = field(default_factory=list)

    @property
    def backend(self) -> Any:
        return self.controller.storage_backend

    def close(self) -> None:
        """Detach the backend (SGLang stops its storage threads; hpkv finishes its write-behind) and
        let go of the pools (the controller's threads and queues hold cycles: collected now)."""
        self.controller.detach_storage_backend()
        self.controller = self.host = None
        gc.collect()


def rig(
    backend: str,
    extra: dict[str, Any] | None,
    *,
    layout: str = "page_first",
    dtype: torch.dtype = torch.bfloat16,
    page: int = PAGE,
    model: str = "demo/model",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    shape: tuple[int, int, int] = (LAYERS, HEADS, DIM),
    device_tokens: int = DEVICE_TOKENS,
    host_ratio: float = 4,
) -> Rig:
    """A real controller over real pools (MHA, or MLA's one latent per token), with SGLang's
    factory building ``backend``; this process plays TP rank ``tp_rank`` of ``tp_size``."""
    parallel_state(tp_rank, tp_size)
    layers, heads, dim = shape
    layer_range = {"start_layer": 0, "end_layer": layers}
    kv: Any
    if mla:  # one latent of 64 + 16 per token and layer
        kv = MLATokenToKVPool(device_tokens, page, dtype, 64, 16, layers, "cpu", False, **layer_range)
        host_cls, own = MLATokenToKVPoolHost, {"target_layer_num": layers}
    else:
        kv = MHATokenToKVPool(device_tokens, page, dtype, heads, dim, layers, "cpu", False, **layer_range)
        host_cls, own = MHATokenToKVPoolHost, {"write_back_staging": kv.hicache_write_back_staging}
    host = host_cls(
        kv.get_device_pool_infos()[0].buffer_info,
        host_ratio,
        0,
        page,
        layout,
        pin_memory=False,
        device_capacity_tokens=kv.size,
        **layer_range,
        **own,
    )
    alloc = PagedTokenToKVPoolAllocator(device_tokens, page, dtype, "cpu", kv, False)
    c = HiCacheController(
        alloc,
        host,
        page,
        None,
        threading.Event(),
        storage_backend=backend,
        model_name=model,
        storage_backend_extra_config=extra,
    )
    return Rig(c, host, page, backend)


def tokens(n_pages: int, seed: int, page: int = PAGE) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n_pages * page,), generator=g).tolist()


def fill_host(r: Rig, n_pages: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Host slots for ``n_pages`` pages filled with random bits; returns the indices and each page's
    flat bytes (what SGLang's get_data_page gives)."""
    idx = r.host.alloc(n_pages * r.page)
    assert idx is not None
    g = torch.Generator().manual_seed(seed)
    pages = []
    for i in range(n_pages):
        view = r.host.get_data_page(int(idx[i * r.page]), flat=False)
        raw = torch.randint(0, 256, (view.numel() * view.element_size(),), dtype=torch.uint8, generator=g)
        view.copy_(raw.view(view.dtype).view(view.shape))
        pages.append(r.host.get_data_page(int(idx[i * r.page])).view(torch.uint8).clone())
    return idx, pages


def page_bytes(r: Rig, idx: torch.Tensor, i: int) -> torch.Tensor:
    page: torch.Tensor = r.host.get_data_page(int(idx[i * r.page]))
    return page.view(torch.uint8).clone()


def backup(r: Rig, toks: list[int], idx: torch.Tensor, timeout: float = 60) -> int:
    """SGLang's write-through to L3: write_storage, then the backup ack; returns the tokens written."""
    hashes = page_hashes(toks, None, page_size=r.page)
    op_id = r.controller.write_storage(idx, toks, hash_value=hashes)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            op = r.controller.ack_backup_queue.get(timeout=0.5)
        except queue.Empty:
            continue
        if op.id == op_id:
            return int(op.completed_tokens)
    raise TimeoutError("no backup ack")


@dataclass
class Prefetched:
    hit_tokens: int  # what batch_exists reported (after SGLang's rank reduction)
    loaded_tokens: int  # what the transfer completed
    host_indices: torch.Tensor | None


def prefetch(r: Rig, toks: list[int], timeout: float = 60) -> Prefetched:
    """SGLang's prefetch: the query thread asks batch_exists; the scheduler (here) gives the hit host
    buffers and queues the transfer; the I/O thread reads; the acks say how many tokens landed."""
    c = r.controller
    op = c.prefetch("req", toks, None, None)
    deadline = time.monotonic() + timeout
    got = None
    while got is None and time.monotonic() < deadline:
        try:
            cand = c.prefetch_hit_queue.get(timeout=0.5)
        except queue.Empty:
            continue
        if cand is op:
            got = cand
    if got is None:
        raise TimeoutError("no storage hit query answer")
    hit = int(op.storage_hit_count)
    if hit == 0:
        return Prefetched(0, 0, None)
    idx = c.alloc_prefetch_host_buffers(op, hit)
    assert idx is not None
    op.host_indices = idx
    c.prefetch_buffer.put(op)
    loaded = 0
    while time.monotonic() < deadline:
        try:
            ack = c.ack_prefetch_queue.get(timeout=0.5)
        except queue.Empty:
            continue
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            loaded = max(loaded, int(ack.completed_tokens))
        if ack.completed_req:
            return Prefetched(hit, loaded, idx)
    raise TimeoutError("prefetch did not complete")
