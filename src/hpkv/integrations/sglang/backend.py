"""HpkvHiCacheStorage: hpkv's tiers as SGLang HiCache's L3 storage backend.

SGLang's hierarchical cache keeps KV pages in GPU memory, then in its host pool (L2); an L3 backend
stores and fetches whole pages by key. SGLang builds this class through its ``dynamic`` loader
(``cls(storage_config, extra_config)``), then hands it the host pool (``register_mem_pool_host``).
Everything below that goes through one :class:`hpkv.engine.catalog.Catalog` (the engine vLLM's
connector and the library use): lookups across tiers that stop at the first gap, verified reads,
write-behind to storage and Valkey. Nothing here repeats that logic.

* **Pages are chunks.** hpkv's chunk size is SGLang's ``--page-size``; a page's bytes are stored as
  the host pool holds them (the order of ``get_data_page``), so a page moves with one copy each way
  (``batch_get_v1``/``batch_set_v1`` read and write the host pool in place).
* **Keys.** SGLang's page hash (already chained over the prefix and seeded by ``extra_key`` /
  ``cache_salt``) is mapped to hpkv's 16-byte logical key; the record key adds the namespace: the
  model, the host layout, PP and CP rank and size, the KV dtype and shape, the page size and TP rank
  and size (MLA: one shard shared by the TP ranks, written by SGLang's storage-writer rank only).
  A page written under another dtype, layout or page size is a different record: a miss, never bytes
  of the wrong shape (SGLang's ``file`` backend names pages by model and rank only).
* **Every read is verified** (checksum or keyed MAC, header, namespace); a page that fails ends the
  prefetch there: SGLang recomputes from it.

Settings: the ``HPKV_*`` variables as for vLLM, overridden by the mapping under ``"hpkv"`` in
``--hicache-storage-backend-extra-config``. The memory tier is off unless set
(``HPKV_KV_MEM_POOL_SIZE``): SGLang's host pool already holds recent pages in RAM.

Counters: each SGLang scheduler process writes them to a small JSON file in the pool directory
(``HPKV_SHARE_MEM_FILE_PATH``), which ``hpkv stats`` reads, as for vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import digest, text_bytes
from hpkv.core.layout import KVLayout
from hpkv.integrations.library.store import KVStore
from hpkv.integrations.statsfile import Refresher, StatsFile

log = logging.getLogger("hpkv")

EXTRA_KEY = "hpkv"  # hpkv's settings inside --hicache-storage-backend-extra-config
SOURCE = "the 'hpkv' mapping of --hicache-storage-backend-extra-config"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def page_key(key: str) -> bytes:
    """hpkv's logical key of an SGLang page hash."""
    return digest(text_bytes(key), person=b"hpkv-sglang")


def _page_keys(keys: list[str]) -> list[bytes]:
    return [page_key(k) for k in keys]


def byte_runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """``t``'s bytes in row-major order as (byte offset in its storage, length) runs, each run as
    long as its memory is contiguous (a ``page_first`` host page: its K run and its V run)."""
    lead, run = t.dim(), 1
    while lead and (t.size(lead - 1) == 1 or t.stride(lead - 1) == run):
        run *= t.size(lead - 1)
        lead -= 1
    starts = [t.storage_offset()]
    for d in range(lead):
        starts = [o + i * t.stride(d) for o in starts for i in range(t.size(d))]
    el = t.element_size()
    return [(int(o) * el, run * el) for o in starts]


class HostPages:
    """Where each host page's bytes lie in SGLang's host pool, as writable views, for reads that
    land there straight from a file. Found once from the pool's page views: each page's runs sit
    a fixed step further than the previous page's (checked on three pages). Building views per
    page through torch would cost the read threads a GIL round trip per tensor call, in a process
    whose scheduler thread holds the GIL whenever it can; slicing one view of the pool costs none.
    ``ok`` is False (and :meth:`pieces` gives None) for a pool this does not describe."""

    def __init__(self, host: Any, most_runs: int = 1024) -> None:
        self.ok = False
        self.page = int(host.page_size)
        try:
            views = [host.get_data_page(k * self.page, flat=False) for k in range(3)]
        except Exception:  # fewer than three pages, or a pool without such views
            return
        if any(v.device.type != "cpu" for v in views):
            return
        storage = views[0].untyped_storage()
        if any(v.untyped_storage().data_ptr() != storage.data_ptr() for v in views):
            return
        runs = [byte_runs(v) for v in views]
        if not runs[0] or len(runs[0]) > most_runs or any(len(r) != len(runs[0]) for r in runs):
            return
        self.runs = runs[0]
        self.step = [b[0] - a[0] for a, b in zip(runs[0], runs[1], strict=True)]
        for a, b, c in zip(runs[0], runs[1], runs[2], strict=True):
            if a[1] != b[1] or a[1] != c[1] or c[0] - a[0] != 2 * (b[0] - a[0]):
                return
        flat = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._view = memoryview(flat.numpy())  # type: ignore[arg-type]
        self.ok = True

    def pieces(self, index: int) -> list[memoryview] | None:
        """The writable runs of the page whose first token sits at host index ``index``."""
        if not self.ok:
            return None
        k = index // self.page
        return [self._view[o + k * s : o + k * s + n] for (o, n), s in zip(self.runs, self.step, strict=True)]


def _shorten_switch_interval(us: int) -> None:
    """Lower this process's GIL switch interval to ``us`` microseconds (never raise it). SGLang's
    scheduler thread polls without sleeping, so another thread that wants the GIL back (after each
    system call of a page read or write) gets it only when Python asks the scheduler to let go:
    after the switch interval. At Python's 5 ms a page's few system calls cost it tens of
    milliseconds; at 0.2 ms the scheduler hands the GIL over within a fraction of a millisecond,
    and only while hpkv's threads have work."""
    before = sys.getswitchinterval()
    if us and us * 1e-6 < before:
        sys.setswitchinterval(us * 1e-6)
        log.info(
            "hpkv: Python's GIL switch interval lowered from %.2f to %.2f ms in this SGLang process "
            "(HPKV_SGLANG_SWITCH_INTERVAL_US=%d; 0 leaves it)",
            before * 1e3,
            us * 1e-3,
            us,
        )


def _leading(n: int, total: int) -> list[bool]:
    """SGLang's per-page result for a run of ``n`` leading pages out of ``total``."""
    return [True] * n + [False] * (total - n)


class HpkvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """hpkv's memory, storage and Valkey tiers under SGLang's HiCache (an L3 backend)."""

    def __init__(self, storage_config: HiCacheStorageConfig, extra: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        extra_config = storage_config.extra_config or {}
        overrides = extra_config.get(EXTRA_KEY) or {}
        if not isinstance(overrides, Mapping):
            raise HpkvConfigError(
                f'"{EXTRA_KEY}" in --hicache-storage-backend-extra-config is {overrides!r}; it must be a '
                'mapping of hpkv settings, e.g. {"hpkv": {"kv_storage_path": "/data/hpkv"}}'
            )
        # Checked now, so a bad setting stops SGLang at start with the variable's name.
        self.config = HpkvConfig.load(dict(overrides), source=SOURCE)
        _shorten_switch_interval(self.config.sglang_switch_interval_us)
        if storage_config.should_split_heads:
            raise HpkvConfigError(
                "hpkv's SGLang backend does not split heads across a heterogeneous TP size "
                "(tp_lcm_size in --hicache-storage-backend-extra-config); remove tp_lcm_size"
            )
        # SGLang before 0.5.23 has no storage-writer flag or decode context parallelism: every rank
        # writes its own shard.
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.store: KVStore | None = None
        self._stats_file: StatsFile | None = None
        self._refresher: Refresher | None = None
        # SGLang's prefetch and backup threads call in at once.
        # read_us: time spent in the reads that brought pages (their rate: read pages x page bytes / it).
        self.pages = {"looked_up": 0, "found": 0, "read": 0, "read_us": 0, "written": 0}
        self._pages_lock = threading.Lock()
        self.host: Any = None
        self._host_pages: HostPages | None = None
        self._page_bytes = 0

    # -- attaching to SGLang's host pool --------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            self.store.close()
        self.host = mem_pool_host
        self.store = self._open(mem_pool_host)
        self._host_pages = HostPages(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if host_pool is self.host or name in ("kv", "__default__"):
            return
        raise NotImplementedError(
            f"hpkv's SGLang backend stores the attention KV pool only; this model also has a '{name}' "
            "pool (a hybrid model: Mamba, SWA or DSA state), which it does not store. Run this model "
            "with another --hicache-storage-backend, or without L3 storage"
        )

    def _open(self, host: Any) -> KVStore:
        sc = self.storage_config
        page = int(host.page_size)
        layout_name = str(getattr(host, "layout", ""))
        if layout_name not in LAYOUTS:
            raise HpkvConfigError(
                f"--hicache-mem-layout {layout_name!r} is not supported by hpkv's SGLang backend; "
                f"use one of {', '.join(LAYOUTS)} (e.g. page_first)"
            )
        config = self.config
        if "chunk_size" in config.origins and config.chunk_size != page:
            raise HpkvConfigError(
                f"{config.where('chunk_size')}={config.chunk_size} differs from SGLang's --page-size {page}; "
                f"under SGLang hpkv stores one chunk per page: unset it or set it to {page}"
            )
        changes: dict[str, Any] = {"chunk_size": page}
        if "mem_pool_size" not in config.origins:
            changes["mem_pool_size"] = 0
        config = dataclasses.replace(config, **changes)
        view = host.get_data_page(0, flat=False)
        kv = _kv_layout(host, view, page)
        self._page_bytes = view.numel() * view.element_size()
        if kv.chunk_bytes(page) != self._page_bytes:
            raise HpkvConfigError(
                f"the host pool's pages are {self._page_bytes} bytes, not the {kv.chunk_bytes(page)} its "
                f"shape says ({type(host).__name__}); hpkv's SGLang backend supports MHA and MLA pools"
            )
        if sc.is_mla_model:  # one shard, the same on every TP rank (DCP: one per DCP rank)
            rank, world = int(getattr(sc, "dcp_rank", 0)), int(getattr(sc, "dcp_size", 1))
        else:
            rank, world = sc.tp_rank, sc.tp_size
        model_id = (
            f"sglang|{sc.model_name or ''}|host={layout_name}|pp={sc.pp_rank}/{sc.pp_size}"
            f"|cp={sc.attn_cp_rank}/{sc.attn_cp_size}"
        )
        store = KVStore(config, kv, model_id=model_id, rank=rank, world_size=world)
        self._publish(config.share_mem_file_path, model_id)
        if sc.tp_rank == 0:
            log.info(
                "hpkv: SGLang L3 backend ready: tiers %s, page %d tokens (%.2f MiB), %s layout, %s%s",
                ",".join(store.tier_names()) or "none",
                page,
                self._page_bytes / 2**20,
                layout_name,
                kv.describe(),
                "" if self.writer else " (reads only: not this MLA group's storage writer)",
            )
        return store

    def _publish(self, directory: str, model_id: str) -> None:
        """Counters for ``hpkv stats`` and tests outside SGLang's scheduler process: the same
        per-process JSON file vLLM's connector writes, refreshed in the background."""
        self._stop_publishing()
        try:
            self._stats_file = StatsFile.for_pool_dir(directory, model_id)
        except OSError as e:  # counters are not worth refusing to serve
            log.warning("hpkv: no stats file under %s (%s): `hpkv stats` will not list it", directory, e)
            return
        self._stats_file.write(self._stats_doc, force=True)
        self._refresher = Refresher(self._stats_file, self._stats_doc, lambda: False)

    def _count(self, **pages: int) -> None:
        with self._pages_lock:
            for k, n in pages.items():
                self.pages[k] += n

    def _stats_doc(self) -> dict[str, Any]:
        store = self.store
        return {
            "engine": "sglang",
            "ranks": int(self.storage_config.tp_size),
            "tiers": store.stats() if store is not None else {},
            "connector": self._pages_now(),
        }

    def _pages_now(self) -> dict[str, int]:
        with self._pages_lock:
            return dict(self.pages)

    def _stop_publishing(self) -> None:
        if self._refresher is not None:
            self._refresher.stop()
            self._refresher = None
        if self._stats_file is not None:
            self._stats_file.remove()
            self._stats_file = None

    def _need_store(self) -> KVStore:
        if self.store is None:
            raise RuntimeError(
                "hpkv: register_mem_pool_host was not called (SGLang attaches the host pool first)"
            )
        return self.store

    # -- the zero-copy interface (interface_v1) --------------------------------------------

    def _page(self, host_indices: torch.Tensor, i: int) -> torch.Tensor:
        page: torch.Tensor = self.host.get_data_page(int(host_indices[i * self.host.page_size]), flat=False)
        return page

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        dtype = self.host.dtype

        def consume(i: int, payload: torch.Tensor) -> None:
            page = self._page(host_indices, i)
            page.copy_(payload.view(dtype).view(page.shape))

        t0 = time.perf_counter_ns()
        starts: list[int] = host_indices[:: self.host.page_size].tolist()
        pages = self._host_pages
        into = (lambda i: pages.pieces(starts[i])) if pages is not None and pages.ok else None
        # SGLang asked batch_exists for these pages just before: read them without asking again.
        n = self._need_store().load_chunks(_page_keys(keys), consume, probe=False, into=into)
        self._count(read=n, read_us=(time.perf_counter_ns() - t0) // 1000 if n else 0)
        return _leading(n, len(keys))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self.writer:  # MLA: another rank writes the shared page
            return [True] * len(keys)
        dtype = self.host.dtype

        def produce(i: int, payload: torch.Tensor) -> None:
            page = self._page(host_indices, i)
            payload.view(dtype).view(page.shape).copy_(page)

        n = self._need_store().store_chunks(_page_keys(keys), produce)
        self._count(written=n)
        return _leading(n, len(keys))

    # -- lookups ----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages held, as a leading run: memory and storage asked per page, Valkey once."""
        if not keys:
            return 0
        located = self._need_store().locate_keys(_page_keys(keys))
        n = located.index(None) if None in located else len(located)
        self._count(looked_up=len(keys), found=n)
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- the older interface (flat page tensors) ------------------------------------------

    def _one_page(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if t.numel() * t.element_size() != self._page_bytes:
            raise ValueError(f"{what} has {t.numel() * t.element_size()} bytes; a page is {self._page_bytes}")
        return t

    def _flat_target(self, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            fresh: torch.Tensor = self.host.get_dummy_flat_data_page()
            return fresh
        return self._one_page(target, "a target")

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        targets = [self._flat_target(t) for t in (target_locations or [None] * len(keys))]

        def consume(i: int, payload: torch.Tensor) -> None:
            targets[i].view(torch.uint8).view(-1).copy_(payload)

        n = self._need_store().load_chunks(_page_keys(keys), consume, probe=False)
        self._count(read=n)
        return [targets[i] if i < n else None for i in range(len(keys))]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if not self.writer:
            return True
        vals = list(values or [])
        if len(vals) != len(keys):
            return False
        for v in vals:
            self._one_page(v, "a value")

        def produce(i: int, payload: torch.Tensor) -> None:
            payload.copy_(vals[i].contiguous().view(torch.uint8).view(-1))

        n = self._need_store().store_chunks(_page_keys(keys), produce)
        self._count(written=n)
        return n == len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    # -- housekeeping -----------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every page of this engine's memory and storage tiers (Valkey is shared: kept)."""
        if self.store is not None:
            self.store.clear()

    def get_stats(self) -> None:
        return None  # SGLang's own storage metrics; hpkv's counters: hpkv_stats() and `hpkv stats`

    def hpkv_stats(self) -> dict[str, dict[str, int]]:
        """Per tier: hits, misses, corrupt, bytes read and written, … (see :meth:`KVStore.stats`)."""
        return self._need_store().stats()

    def flush(self) -> None:
        """Wait for the write-behind to storage and Valkey."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        self._stop_publishing()
        if self.store is not None:
            self.store.close()
            self.store = None


def _kv_layout(host: Any, view: torch.Tensor, page: int) -> KVLayout:
    """hpkv's description of one page: layers, K and V (or one MLA latent), heads, dim, dtype."""
    layers = int(host.layer_num)
    heads = getattr(host, "head_num", None)
    head_dim = getattr(host, "head_dim", None)
    if heads is not None and head_dim is not None and view.numel() == 2 * layers * page * heads * head_dim:
        return KVLayout(layers, int(heads), int(head_dim), host.dtype, num_kv=2)
    per_token = view.numel() // (layers * page)  # MLA: one latent per token and layer
    if per_token * layers * page != view.numel() or per_token <= 0:
        raise HpkvConfigError(f"hpkv's SGLang backend cannot describe {type(host).__name__}'s pages")
    return KVLayout(layers, 1, per_token, host.dtype, num_kv=1)
