"""The mover: copies chunk payloads between the shared-memory pool and the engine's paged KV,
on whichever device the engine's KV lives.

* **CPU** (vLLM's CPU build): copies run synchronously on the calling thread
  (:class:`PagedKV` scatter/gather); nothing else to order.
* **CUDA**: the pool is registered with CUDA once (page-locked in place, so
  host<->device copies run at pinned speed; a failed registration is logged
  loudly and copies fall back to pageable speed). Loads are staged host->device
  on a copy stream and scattered into the paged blocks on a scatter stream, in
  groups of chunks with two staging buffers, so the PCIe copy of one group
  overlaps the scatter of the previous one. The engine's compute stream waits
  on an *event* (all layers, or per layer with ``layerwise``), never on the
  host. Stores record an event on the compute stream after the forward pass;
  the store stream waits for it, gathers the blocks into a staging buffer and
  copies them to the pool; the compute stream waits only for the gather (a
  device-local copy), so a block the engine reuses in the next step has
  already been read. The device->host copy finishes in the background; a
  completion thread then seals the record and reports the store.

Thread-safety: one instance per worker; ``load``/``store``/``wait_*`` are called
from the engine's thread. Completion callbacks run on the mover's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpkv.core.procs import name_os_thread
from hpkv.integrations.vllm.paged import PagedKV

if TYPE_CHECKING:
    from hpkv.integrations.vllm.kvgroups import GroupedPagedKV

log = logging.getLogger("hpkv")

GROUP_CHUNKS = 8  # chunks staged per host->device copy group (two groups' buffers live at once)
STORE_GROUP_CHUNKS = 8  # chunks gathered per device->host group (two staging buffers in turn)


@dataclass
class LoadItem:
    payload: torch.Tensor  # uint8 view of the chunk's payload in the pool (host memory)
    block_ids: Sequence[int]  # the chunk's blocks, chunk token j*bs.. in block_ids[j]
    first: int  # first chunk token to load (a multiple of the block size)
    count: int  # tokens to load


@dataclass
class StoreItem:
    payload: torch.Tensor  # uint8 view of the destination slot's payload in the pool
    block_ids: Sequence[int]


def _group_sizes(n: int, group: int) -> list[int]:
    """Chunks per staged group for a load of ``n``: full groups, then the last ``group`` chunks in
    halves (8 -> 4, 2, 1, 1). A group's scatter overlaps the next group's copy; the last scatter
    has nothing to hide behind, so the last group is one chunk."""
    sizes = []
    while n > group:
        sizes.append(group)
        n -= group
    while n > 1:
        sizes.append((n + 1) // 2)
        n -= sizes[-1]
    return [*sizes, n] if n else sizes


def _event(timing: bool = False) -> Any:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def cuda_host_register(t: torch.Tensor) -> str | None:
    """Page-lock ``t``'s host memory in place for CUDA DMA. None on success, else the reason."""
    try:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    except Exception as e:  # no CUDA runtime binding
        return f"{type(e).__name__}: {e}"
    code = int(getattr(err, "value", err))
    return None if code == 0 else f"cudaHostRegister returned error {code} ({err})"


def cuda_host_unregister(t: torch.Tensor) -> None:
    try:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        cudart.cudaHostUnregister(t.data_ptr())
    except Exception:
        log.debug("hpkv: cudaHostUnregister failed", exc_info=True)


class Mover:
    def __init__(self, paged: PagedKV | GroupedPagedKV, layerwise: bool = False) -> None:
        self.paged = paged
        self.device = paged.device
        self.cuda = self.device.type == "cuda"
        self.layerwise = layerwise and self.cuda
        self.pinned = False
        self._registered: torch.Tensor | None = None
        self._layer_events: list[Any] = []
        self._pending_load: Any = None
        self._load_timing: tuple[Any, Any] | None = None  # (started, done) of the loads in flight
        # Staging buffers live as long as the mover and are reused in turn, guarded by events:
        # allocating per call lets the caching allocator fall back to cudaMalloc, which stalls.
        self._staging: dict[str, torch.Tensor] = {}
        self._free: dict[str, Any] = {}
        if self.cuda:
            self.copy_stream: Any = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.scatter_stream: Any = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.store_stream: Any = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self.d2h_stream: Any = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._done: queue.Queue[
                tuple[Any, Callable[[], None], Callable[[float], None] | None, Any] | None
            ] = queue.Queue()
            self._thread = threading.Thread(target=self._complete, name="hpkv-mover", daemon=True)
            self._thread.start()

    def warm_up(self, chunk_tokens: int) -> float:
        """Compile the copy kernels and allocate the staging buffers now, at start, so that the first
        request does not pay for them (seconds on a GPU). Gathers block 0 into a staging buffer and
        scatters the same bytes back (block 0 is vLLM's reserved null block; the round trip leaves it
        unchanged), whole and per layer. Returns the seconds it took; CPU: nothing to do."""
        if not self.cuda:
            return 0.0
        t0 = time.perf_counter()
        bs = self.paged.block_size
        nb = max(1, chunk_tokens // bs)
        zeros = self.paged.null_chunk(nb)
        spec = [(zeros, 0, nb * bs)]
        nbytes = self.paged.layout.chunk_bytes(nb * bs)
        for name in ("load1", "store0", "store1"):
            rows = STORE_GROUP_CHUNKS if name.startswith("store") else GROUP_CHUNKS
            self._buffer(name, rows, nbytes, self.scatter_stream)
        with torch.cuda.stream(self.scatter_stream):
            buf = self._buffer("load0", GROUP_CHUNKS, nbytes, self.scatter_stream)[:1]
            self.paged.gather_many(buf, [zeros])
            self.paged.scatter_many(buf, spec)
            if self.layerwise:
                per_layer = nbytes // self.paged.layout.num_layers
                lbuf = self._buffer("layer0", 1, per_layer, self.scatter_stream)
                lbuf.copy_(buf[0, :per_layer].view(1, per_layer))
                self.paged.scatter_layer(0, lbuf, spec)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # -- the pool ----------------------------------------------------------------------

    def attach_pool(self, pool_tensor: torch.Tensor) -> None:
        """Register the pool's memory with CUDA (once per pool); no-op on CPU. Page-locking a pool
        of several GiB takes seconds, so the worker does it at start, on the pool it makes then
        (see worker.py), not on a thread: the engine's own CUDA calls would wait for it. Timed in
        the log."""
        if not self.cuda or self._registered is pool_tensor:
            return
        self.detach_pool()
        t0 = time.perf_counter()
        why = cuda_host_register(pool_tensor)
        if why is None:
            self._registered, self.pinned = pool_tensor, True
            log.info(
                "hpkv: memory pool (%.1f GiB) registered with CUDA in %.0f ms",
                pool_tensor.numel() / 2**30,
                (time.perf_counter() - t0) * 1e3,
            )
        else:
            self.pinned = False
            log.warning(
                "hpkv: could not page-lock the memory pool for CUDA (%s); copies fall back to pageable "
                "memory, several times slower. Check the locked-memory limit (ulimit -l).",
                why,
            )

    def detach_pool(self) -> None:
        if self._registered is not None:
            torch.cuda.synchronize(self.device)
            cuda_host_unregister(self._registered)
            self._registered, self.pinned = None, False

    # -- loads -------------------------------------------------------------------------

    def load(self, items: list[LoadItem]) -> None:
        """Copy the items into the paged KV. CPU: done on return. CUDA: enqueued; the compute stream
        waits for it (whole, or per layer with ``layerwise``) before the attention that reads it."""
        if not items:
            return
        if not self.cuda:
            for it in items:
                self.paged.scatter(it.payload, it.block_ids, it.first, it.count)
            return
        compute = torch.cuda.current_stream(self.device)
        # Staging must not overtake earlier work on the compute stream touching these blocks.
        start = _event()
        start.record(compute)
        self.copy_stream.wait_event(start)
        self.scatter_stream.wait_event(start)
        # Timing events bracket the copies themselves (from when the copy stream may start to when
        # the last scatter is done): what the per-request line reports, not the enqueue.
        began = _event(timing=True)
        began.record(self.copy_stream)
        if self.layerwise:
            self._load_layerwise(items)
        else:
            self._load_grouped(items)
            done = _event()
            done.record(self.scatter_stream)
            compute.wait_event(done)
            self._pending_load = done
        ended = _event(timing=True)
        ended.record(self.scatter_stream)
        self._load_timing = (began, ended)

    def load_async(self, items: list[LoadItem]) -> tuple[Any, Any] | None:
        """Copy the items into the paged KV for a request the engine does not run yet (vLLM's async
        load): the compute stream does not wait for them. CPU: done on return (None). CUDA:
        enqueued; returns (began, landed) timing events; the caller reports the request received
        once ``landed`` has completed (``landed.query()``), never before."""
        if not items:
            return None
        if not self.cuda:
            for it in items:
                self.paged.scatter(it.payload, it.block_ids, it.first, it.count)
            return None
        # After whatever the compute stream has enqueued so far: the blocks were just given to
        # this request, and an earlier step may still be reading them for the one that had them.
        start = _event()
        start.record(torch.cuda.current_stream(self.device))
        self.copy_stream.wait_event(start)
        self.scatter_stream.wait_event(start)
        began = _event(timing=True)
        began.record(self.copy_stream)
        self._load_grouped(items)
        landed = _event(timing=True)
        landed.record(self.scatter_stream)
        return began, landed

    def _buffer(self, name: str, rows: int, nbytes: int, stream: Any) -> torch.Tensor:
        """Staging buffer ``name`` (``[rows, nbytes]`` view), after ``stream`` waited until its
        last reader is done."""
        t = self._staging.get(name)
        if t is None or t.numel() < rows * nbytes:
            torch.cuda.synchronize(self.device)  # rare: first use or a larger group
            t = torch.empty(rows * nbytes, dtype=torch.uint8, device=self.device)
            self._staging[name] = t
            self._free.pop(name, None)
        ev = self._free.get(name)
        if ev is not None:
            stream.wait_event(ev)
        return t[: rows * nbytes].view(rows, nbytes)

    def _release(self, name: str, stream: Any) -> None:
        ev = _event()
        ev.record(stream)
        self._free[name] = ev

    def _load_grouped(self, items: list[LoadItem]) -> None:
        nbytes = items[0].payload.numel()
        at = 0
        for g, size in enumerate(_group_sizes(len(items), GROUP_CHUNKS)):
            group = items[at : at + size]
            at += size
            name = f"load{g % 2}"
            buf = self._buffer(name, len(group), nbytes, self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                for j, it in enumerate(group):
                    buf[j].copy_(it.payload, non_blocking=True)
                copied = _event()
                copied.record(self.copy_stream)
            # The group's index tensors are built while its bytes cross PCIe: built for every group
            # before the first copy, they kept the link idle for the host's time of all of them.
            spec = [(it.block_ids, it.first, it.count) for it in group]
            with torch.cuda.stream(self.scatter_stream):
                plan = self.paged.plan(spec)
            self.scatter_stream.wait_event(copied)
            with torch.cuda.stream(self.scatter_stream):
                self.paged.scatter_many(buf, spec, plan)
            self._release(name, self.scatter_stream)

    def _load_layerwise(self, items: list[LoadItem]) -> None:
        """Layer by layer: layer l's bytes of every chunk cross PCIe, are scattered, and an event
        lets the compute stream start layer l while later layers are still on the way."""
        n_layers = self.paged.layout.num_layers
        per_layer = items[0].payload.numel() // n_layers
        specs = [(it.block_ids, it.first, it.count) for it in items]
        with torch.cuda.stream(self.scatter_stream):
            plan = self.paged.plan(specs)
        self._layer_events = []
        for li in range(n_layers):
            name = f"layer{li % 2}"
            buf = self._buffer(name, len(items), per_layer, self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                torch._foreach_copy_(
                    list(buf.unbind(0)),
                    [it.payload[li * per_layer : (li + 1) * per_layer] for it in items],
                    non_blocking=True,
                )
                copied = _event()
                copied.record(self.copy_stream)
            self.scatter_stream.wait_event(copied)
            with torch.cuda.stream(self.scatter_stream):
                self.paged.scatter_layer(li, buf, specs, plan)
                ev = _event()
                ev.record(self.scatter_stream)
            self._free[name] = ev
            self._layer_events.append(ev)
        self._pending_load = self._layer_events[-1]

    def wait_layer(self, li: int) -> None:
        """The compute stream waits until layer ``li`` of the current loads is in place (layerwise)."""
        if self.layerwise and li < len(self._layer_events):
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[li])

    def finish_loads(self) -> float | None:
        """Block the host until the loads enqueued so far are in the paged KV (before reporting them
        done, so the scheduler never frees a pool slot a copy still reads). Returns the seconds the
        copies took on the device (CUDA events), or None when nothing was in flight."""
        took = None
        if self._pending_load is not None:
            self._pending_load.synchronize()
            self._pending_load = None
            self._layer_events = []
        if self._load_timing is not None:
            began, ended = self._load_timing
            ended.synchronize()
            took = float(began.elapsed_time(ended)) / 1e3
            self._load_timing = None
        return took

    # -- stores ------------------------------------------------------------------------

    def store(
        self,
        items: list[StoreItem],
        on_done: Callable[[], None],
        on_timing: Callable[[float], None] | None = None,
    ) -> None:
        """Copy the items' blocks into their pool payloads, then call ``on_done`` (CPU: before
        returning; CUDA: on the mover's thread once the device->host copy has landed) and
        ``on_timing`` with the seconds the copies took (CUDA: events from when the store stream may
        start, after the forward pass, to the last byte landed in the pool; never the enqueue)."""
        if not items:
            return
        if not self.cuda:
            t0 = time.perf_counter()
            for it in items:
                self.paged.gather(it.payload, it.block_ids)
            took = time.perf_counter() - t0
            on_done()
            if on_timing is not None:
                on_timing(took)
            return
        compute = torch.cuda.current_stream(self.device)
        written = _event()
        written.record(compute)  # after the forward pass that wrote these blocks
        self.store_stream.wait_event(written)
        began = None  # the timing events only when someone reads them
        if on_timing is not None:
            began = _event(timing=True)
            began.record(self.store_stream)
        nbytes = items[0].payload.numel()
        gathered: Any = None
        # In groups: the gather of group g+1 (store stream) overlaps the device->host copy of
        # group g (d2h stream).
        for g in range(0, len(items), STORE_GROUP_CHUNKS):
            group = items[g : g + STORE_GROUP_CHUNKS]
            name = f"store{(g // STORE_GROUP_CHUNKS) % 2}"
            buf = self._buffer(name, len(group), nbytes, self.store_stream)
            with torch.cuda.stream(self.store_stream):
                self.paged.gather_many(buf, [it.block_ids for it in group])
                gathered = _event()
                gathered.record(self.store_stream)
            self.d2h_stream.wait_event(gathered)
            with torch.cuda.stream(self.d2h_stream):
                for j, it in enumerate(group):
                    it.payload.copy_(buf[j], non_blocking=True)
            self._release(name, self.d2h_stream)
        landed = _event(timing=on_timing is not None)
        landed.record(self.d2h_stream)
        # The engine may overwrite these blocks in its next step: only after the gathers read them.
        compute.wait_event(gathered)
        self._done.put((landed, on_done, on_timing, began))

    def _complete(self) -> None:
        name_os_thread()
        while True:
            item = self._done.get()
            if item is None:
                return
            ev, fn, on_timing, began = item
            try:
                ev.synchronize()
                fn()
                if on_timing is not None:
                    on_timing(float(began.elapsed_time(ev)) / 1e3)
            except Exception:
                log.exception("hpkv: completing a store failed")
            finally:
                self._done.task_done()

    def flush(self) -> None:
        """Wait until every store has landed and been completed."""
        if self.cuda:
            self._done.join()

    def close(self) -> None:
        if self.cuda:
            self.finish_loads()
            self.flush()
            self._done.put(None)
            self._thread.join(timeout=30)
            self.detach_pool()
