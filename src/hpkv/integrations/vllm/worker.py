"""The worker side of HpkvConnectorV1: copies between pool slots and the engine's paged KV.

One instance per TP rank, in the worker process. It maps the pool files the
scheduler created (one per rank), checks each record header before copying
(right rank, right chunk, right layout), and reports what it did through the
connector's worker metadata. No tier I/O happens here.

Ordering: loads are issued in ``start_load_kv`` before the forward pass;
stores in ``wait_for_save`` after it, in the same step, so the engine cannot
free or reuse a block before its store has copied it out. The copies go
through the :class:`Mover`: synchronous on CPU; on CUDA ordered by stream
events (see mover.py), with loads reported done only once they landed and
stores sealed and reported by the mover's thread once the device->host copy
is complete.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.keys import Namespace, record_key
from hpkv.integrations.vllm.kvgroups import GroupedPagedKV, KVGroup, KVGroups
from hpkv.integrations.vllm.meta import HpkvMeta, HpkvWorkerMeta, LoadRequest
from hpkv.integrations.vllm.mover import LoadItem, Mover, StoreItem
from hpkv.integrations.vllm.paged import PagedKV
from hpkv.tiers.memory.hostslots import host_group, pool_paths, uses_host_pool
from hpkv.tiers.memory.pool import PAGE, ShmPool

log = logging.getLogger("hpkv")


@dataclass
class _AsyncLoad:
    """One async load on this rank, from its first part to the report of the last part's copies."""

    req: LoadRequest  # the latest part (its ``last`` says whether more are coming)
    loaded: int = 0  # tokens queued
    failed: bool = False  # a chunk failed its header check here
    copies: list[Any] = field(default_factory=list)  # CUDA: (began, landed) events per part
    t0: float = 0.0  # CPU: perf_counter of the first copy
    parts: int = 0  # parts received
    last_sent: float = 0.0  # monotonic time the last part's copies were enqueued


class HpkvWorker:
    def __init__(
        self,
        namespace: Namespace,
        chunk_size: int,
        block_size: int,
        backend: str,
        layerwise: bool = False,
        *,
        start_pool: str | None = None,
        config: HpkvConfig | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        """``start_pool``: where to make this rank's pool file at start, for the scheduler to map
        (``config`` gives its size and settings); None: map the scheduler's at the first step.
        ``groups``: vLLM's KV cache groups when there are several (kvgroups.py): their loads are all
        asynchronous, and one that fails is reported as its request's (:meth:`take_failed_loads`)."""
        self.ns = namespace
        self.rank = namespace.rank
        self.rank_digest = namespace.digest
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.backend = backend
        self.payload_bytes = namespace.layout.chunk_bytes(chunk_size)
        self._shard = f" [rank 0's shard of {namespace.world_size}]" if namespace.world_size > 1 else ""
        self.record_bytes = record.record_bytes(self.payload_bytes)
        self.slot_bytes = -(-self.record_bytes // PAGE) * PAGE
        self.paged: PagedKV | GroupedPagedKV | None = None
        self._all_groups = groups or KVGroups((KVGroup("full", namespace.layout.num_layers),))
        self.groups = self._all_groups if self._all_groups.count > 1 else None
        self._failed_reqs: set[str] = set()  # several groups: async loads that failed here
        self.mover: Mover | None = None
        self.layerwise = layerwise
        self._lock = threading.Lock()  # results are also written by the mover's completion thread
        self.pool: ShmPool | None = None
        self._pool_path = ""
        self._results: dict[int, tuple[int, int]] = {}
        self._load_errors: set[int] = set()
        self._unlogged: list[tuple[LoadRequest, int]] = []  # CUDA loads whose copies are in flight
        self._copying = 0  # bytes of the synchronous loads in flight (CUDA), timed when they land
        self._copies: list[tuple[int, float]] = []  # (bytes, seconds) of synchronous loads to report
        self._async: dict[int, _AsyncLoad] = {}  # op id -> async load not yet reported received
        self._announce = False  # mapped the pool since the last report
        self._start_pool = start_pool if config is not None and config.mem_pool_size > 0 else None
        self._config = config
        self._first_meta = True
        self._computes = False

    def register_kv_caches(self, caches: list[torch.Tensor]) -> None:
        if self.groups is not None:
            self.paged = GroupedPagedKV(caches, self.block_size, self.ns.layout, self.backend, self.groups)
        else:
            self.paged = PagedKV(caches, self.block_size, self.ns.layout, self.backend)
        # Layer by layer follows the record's order, group after group, not the model's.
        self.mover = Mover(self.paged, layerwise=self.layerwise and self.groups is None)
        took = self.mover.warm_up(self.chunk_size)
        if took and self.rank == 0:
            log.info("hpkv: GPU copy kernels compiled and staging allocated in %.0f ms", took * 1e3)
        if self._start_pool is not None:
            self._make_pool(self._start_pool)
        elif self._config is not None and uses_host_pool(self._config):
            self._map_host_pool(self._config)

    def _map_host_pool(self, cfg: HpkvConfig) -> None:
        """Map (and on CUDA page-lock) this rank's file of the host pool now, while the engine
        starts, as the scheduler will name it; if that fails, it is mapped at the first request."""
        assert self.mover is not None
        try:
            paths, size, _ = pool_paths(
                cfg,
                host_group(self.ns.logical_digest),
                self.ns.world_size,
                self.slot_bytes,
                cfg.mem_pool_size,
            )
            self.pool = ShmPool.map_shared(paths[self.rank], size, prefault=not self.mover.cuda)
        except (HpkvConfigError, OSError) as e:
            log.warning("hpkv: the host pool is mapped at the first request instead of at start: %s", e)
            return
        self._pool_path = paths[self.rank]
        self.mover.attach_pool(self.pool.tensor)

    def _make_pool(self, path: str) -> None:
        """Make this rank's pool file now, while the engine starts, and page-lock it for CUDA:
        the scheduler maps it once vLLM builds it (see connector.py). If it cannot be made here,
        the scheduler makes one as before and says why if it cannot either."""
        cfg = self._config
        assert cfg is not None and self.mover is not None
        try:
            self.pool = ShmPool(
                path,
                cfg.mem_pool_size,
                where=cfg.where("mem_pool_size"),
                path_where=cfg.where("share_mem_file_path"),
                shared_group=cfg.shared_group,
                prefault=not self.mover.cuda,  # page-locking maps every page
            )
        except (HpkvConfigError, OSError) as e:
            log.warning("hpkv: the memory pool is mapped at the first request instead of at start: %s", e)
            return
        self._pool_path = path
        self.mover.attach_pool(self.pool.tensor)

    def _attach(self, meta: HpkvMeta) -> ShmPool | None:
        if not meta.pool_paths:
            return None
        path = meta.pool_paths[self.rank]
        if self._first_meta:
            self._first_meta = False
            if self.pool is not None and path == self._pool_path:
                # The scheduler mapped the file this rank made at start (none other can be at
                # that name): its name is no longer needed.
                self.pool.unlink()
                self._announce = True
                return self.pool
        if self.pool is None or path != self._pool_path:
            if self.pool is not None:
                self.pool.close()  # one this rank made that the scheduler did not map: removed
            # On CUDA page-locking maps every page; on a CPU engine the worker's own first touch of
            # each page would land in the steps that store into it, so it is read ahead at idle priority.
            cpu = self.mover is not None and not self.mover.cuda
            self.pool = ShmPool.attach(path, meta.pool_size, prefault=cpu)
            self._pool_path = path
            self._announce = True
            if self.mover is not None:
                self.mover.attach_pool(self.pool.tensor)
        return self.pool

    def _slot(self, pool: ShmPool, slot: int) -> tuple[memoryview, torch.Tensor]:
        off = slot * self.slot_bytes
        rec = pool.view[off : off + self.record_bytes]
        payload = pool.tensor[off + record.HEADER_BYTES : off + record.HEADER_BYTES + self.payload_bytes]
        return rec, payload

    # -- loads -------------------------------------------------------------------------

    def start_load(self, meta: HpkvMeta) -> None:
        self._computes = meta.computes  # said back in this step's report (take_results)
        # Mapped at the first step, loads or not: once every rank has, the scheduler unlinks the files.
        pool = self._attach(meta)
        if not meta.loads:
            return
        assert self.mover is not None and pool is not None
        items: list[LoadItem] = []
        logs = []
        t0 = time.perf_counter()
        for req in meta.loads:
            if req.asynchronous:
                self._start_async(pool, req)
                continue
            loaded = self._plan_load(pool, req, items)
            logs.append((req, loaded))
        if not logs:
            return
        self.mover.load(items)
        nbytes = len(items) * self.payload_bytes
        if self.mover.cuda:  # enqueued only: timed and logged when the copies are done (take_results)
            self._copying += nbytes
            if self.rank == 0:
                self._unlogged.extend(logs)
            return
        dt = time.perf_counter() - t0  # CPU: the copies are done on return
        if items:
            self._copies.append((nbytes, dt))
        if self.rank != 0:
            return
        for req, loaded in logs:
            self._log_load(req, loaded, dt if len(logs) == 1 else dt / len(logs))

    def _start_async(self, pool: ShmPool, req: LoadRequest) -> None:
        """A part of an async load: its chunks' copies start now, behind the engine's back (the
        request is not scheduled until :meth:`finished_loads` says so); blocks the scheduler could
        not fill are reported as load errors at once (vLLM wants them no later than the request)."""
        assert self.mover is not None
        st = self._async.get(req.op_id)
        if st is None:
            st = self._async[req.op_id] = _AsyncLoad(req, t0=time.perf_counter())
        st.req = req
        if req.failed_blocks and self.groups is not None:
            st.failed = True  # reported as the request's when the load ends
        self._load_errors.update(req.failed_blocks if self.groups is None else ())
        if st.failed:  # an earlier part failed a check: vLLM recomputes from there anyway
            return
        items: list[LoadItem] = []
        st.loaded += self._plan_load(pool, req, items, report=False)
        st.failed = len(items) < len(req.chunks)  # a header check failed (its blocks are noted)
        copies = self.mover.load_async(items)
        if copies is not None:
            st.copies.append(copies)
        st.parts += 1
        if req.last:
            st.last_sent = time.monotonic()

    def finished_loads(self) -> set[str]:
        """Requests whose async load is complete on this rank: the last part arrived and every copy
        landed (CUDA: events). Each is reported once, with its op.

        Events are only queried, except in a step that computes nothing: there a load whose last
        part is in waits for its copies (that part's few chunks, a fraction of a millisecond each)
        instead of being reported an empty step later. The copy stream runs the parts in order, so
        the last part's event stands for them all."""
        done: set[str] = set()
        for op_id, st in list(self._async.items()):
            if not st.req.last:
                continue
            if not self._computes and st.copies:
                st.copies[-1][1].synchronize()
            if not all(landed.query() for _, landed in st.copies):
                continue
            del self._async[op_id]
            with self._lock:
                self._results[op_id] = (0, 1) if st.failed else (1, 0)
            done.add(st.req.req_id)
            if st.failed and self.groups is not None:
                self._failed_reqs.add(st.req.req_id)
            if self.rank == 0 and st.loaded:
                last = ""
                if st.copies:  # the device's span from the first copy to the last, waits between included
                    took = float(st.copies[0][0].elapsed_time(st.copies[-1][1])) / 1e3
                    last = f", its copies {st.copies[-1][0].elapsed_time(st.copies[-1][1]):.1f} ms"
                else:
                    took = time.perf_counter() - st.t0
                detail = ""
                if st.req.since and st.last_sent:  # where the tail after the reads goes
                    detail = (
                        f"{st.parts} parts, the last enqueued "
                        f"{(st.last_sent - st.req.since) * 1e3:.1f} ms after the lookup{last}; "
                    )
                self._log_load(st.req, st.loaded, took, since=st.req.since, detail=detail)
        return done

    def _plan_load(
        self, pool: ShmPool, req: LoadRequest, items: list[LoadItem], *, report: bool = True
    ) -> int:
        """Check each chunk's header and queue its copy; returns the tokens queued. ``report``:
        the op's result is known now (a synchronous load)."""
        loaded = 0
        failed_from: int | None = None
        for n, ch in enumerate(req.chunks):
            rec, payload = self._slot(pool, ch.slot)
            rk = record_key(self.rank_digest, ch.lk)
            verdict = record.verify(
                rec, self.record_bytes, self.rank_digest, rk, self.payload_bytes, check_payload=False
            )
            if verdict is not record.Verdict.OK:
                failed_from = n
                log.warning(
                    "hpkv: chunk slot %d of request %s failed its header check (%s); "
                    "the engine recomputes from there",
                    ch.slot,
                    req.req_id,
                    verdict.value,
                )
                break
            items.append(LoadItem(payload, ch.block_ids, ch.first, ch.count))
            loaded += ch.count
        if failed_from is not None and self.groups is None:
            for ch in req.chunks[failed_from:]:
                self._load_errors.update(
                    self._all_groups.token_blocks(
                        ch.block_ids, ch.first, ch.first + ch.count, self.block_size
                    )
                )
        if report:
            with self._lock:
                self._results[req.op_id] = (0, 1) if failed_from is not None else (1, 0)
        return loaded

    def _log_load(
        self, req: LoadRequest, loaded: int, dt: float, since: float = 0.0, detail: str = ""
    ) -> None:
        # This rank's bytes over this rank's time: with tensor parallelism every rank copies its
        # own shard on its own link, and only rank 0 logs.
        gb = loaded * self.ns.layout.token_bytes / 1e9
        tiers = ", ".join(f"{k}: {v} chunks" for k, v in sorted(req.tiers.items()) if v)
        extra = ""
        if since:  # an async load: its copies overlapped the tier reads; say the whole wait too
            extra = f"; async, {detail}{(time.monotonic() - since) * 1e3:.1f} ms from the lookup to now"
        log.info(
            "hpkv: Retrieved %d out of %d required tokens (from %d total tokens). size: %.4f gb, "
            "cost %.4f ms, throughput: %.4f GB/s (%s%s)" + self._shard + "; request %s",
            loaded,
            req.requested_tokens,
            req.prompt_tokens,
            gb,
            dt * 1e3,
            gb / dt if dt > 0 else 0.0,
            tiers or "memory",
            extra,
            req.req_id,
        )

    def wait_layer(self, index: int) -> None:
        if self.mover is not None:
            self.mover.wait_layer(index)

    # -- stores ------------------------------------------------------------------------

    def save(self, meta: HpkvMeta) -> None:
        if not meta.stores:
            return
        pool = self._attach(meta)
        assert self.mover is not None and pool is not None
        stores = list(meta.stores)
        slots = [self._slot(pool, st.slot) for st in stores]

        def sealed() -> None:  # the payloads are in the pool now (CPU: at once; CUDA: mover thread)
            for st, (rec, _) in zip(stores, slots, strict=True):
                try:
                    record.seal(
                        rec, self.rank_digest, record_key(self.rank_digest, st.lk), self.payload_bytes
                    )
                    ok = (1, 0)
                except Exception:
                    log.exception("hpkv: sealing a stored chunk failed")
                    ok = (0, 1)
                with self._lock:
                    self._results[st.op_id] = ok

        n = len(stores)

        def timed(took: float) -> None:  # the copies' own time (CUDA: events), said once they landed
            gb = n * self.payload_bytes / 1e9
            log.info(
                "hpkv: Stored %d tokens (%d chunks) into the memory pool. size: %.4f gb, cost %.4f ms, "
                "throughput: %.4f GB/s" + self._shard,
                n * self.chunk_size,
                n,
                gb,
                took * 1e3,
                gb / took if took > 0 else 0.0,
            )

        try:
            self.mover.store(
                [StoreItem(p, st.block_ids) for st, (_, p) in zip(stores, slots, strict=True)],
                sealed,
                timed if self.rank == 0 else None,
            )
        except Exception:
            log.exception("hpkv: storing chunks failed")
            with self._lock:
                for st in stores:
                    self._results[st.op_id] = (0, 1)

    # -- reporting -----------------------------------------------------------------------

    def take_results(self) -> HpkvWorkerMeta:
        if self.mover is not None:
            took = self.mover.finish_loads()  # a load is done only once its copies landed
            logs, self._unlogged = self._unlogged, []
            if took is not None and self._copying:
                self._copies.append((self._copying, took))
            self._copying = 0
            if took is not None:
                for req, loaded in logs:
                    self._log_load(req, loaded, took if len(logs) == 1 else took / len(logs))
        with self._lock:  # a report every step, empty or not (see HpkvWorkerMeta)
            out = HpkvWorkerMeta(self._results, int(self._announce), self._computes, self._copies)
            self._results, self._copies = {}, []
            self._announce = False
        return out

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_failed_loads(self) -> set[str]:
        """Several groups: requests whose async load failed here since the last call (each also
        among :meth:`finished_loads`); vLLM recomputes them."""
        failed, self._failed_reqs = self._failed_reqs, set()
        return failed

    def shutdown(self) -> None:
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
