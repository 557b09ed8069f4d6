"""The scheduler side of HpkvConnectorV1: decides what to load and store, owns the catalog.

Runs on vLLM's scheduler thread. Nothing here waits for long: chunks below memory
are promoted on background threads while the request is asked about again, or
(vLLM's async load, ``HPKV_ASYNC_LOAD``) sent to the workers as each arrives;
only a request that is all the engine has may wait for its own I/O, as an empty
step would (at most IDLE_WAIT_S); stores are filled by the workers during the
step and made visible when every rank confirms.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from hpkv.core.config import HpkvConfig
from hpkv.core.keys import Namespace
from hpkv.engine.catalog import MEMORY, Catalog
from hpkv.engine.costs import RateMemo
from hpkv.engine.reads import staged_line
from hpkv.integrations.vllm.arrival import ArrivalCheck
from hpkv.integrations.vllm.async_parts import next_part
from hpkv.integrations.vllm.identity import IdentityReader, prompt_length
from hpkv.integrations.vllm.meta import HpkvMeta, HpkvWorkerMeta, LoadRequest, StoreChunk
from hpkv.integrations.vllm.poolfull import PoolFullLog
from hpkv.integrations.vllm.reqstate import Op, ReqState
from hpkv.integrations.vllm.statsfile import Refresher, StatsFile
from hpkv.integrations.vllm.stepclock import StepClock
from hpkv.integrations.vllm.steptrace import StepTrace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("hpkv")

# How long a request keeps being asked about before it settles for what is in memory then.
STAGE_GIVE_UP_S = 30.0
# How long a hit waits for pool slots that others hold before it is promoted as far as room goes
# (two waiting requests could each hold, protected, resident chunks the other needs room for).
ROOM_WAIT_S = 2.0
# A step that scheduled nothing while lookups wait for tier I/O: the engine would spin through empty
# steps (scheduler and workers polling), taking the CPU from the promotion threads (on 2 cores that
# made storage and valkey hits 10-50 ms slower). Such a step waits for those lookups' I/O to finish, at
# most this long, unless a computing step is still out (async scheduling): its output waits on this thread.
IDLE_WAIT_S = 0.02
# An async load sends its chunks as they arrive, but not one step per chunk: each step is the engine
# thread's Python on the GIL that every promotion needs back after each system call (with a thread
# spinning in Python, 4 I/O threads staged at 3.0 GB/s instead of 15.0 on the H200's host:
# scripts/gpu/probe_stage.py). After the first arrival the step gathers the others for this long.
ASYNC_GATHER_S = 0.005
PENDING_OPS_MAX_S = 60.0
POOL_FULL_LOG_S = 30.0  # at most one "pool full, chunks not stored" warning per this many seconds
# At shutdown (SIGTERM), how long the write-behind may take to write what is queued: vLLM's process
# manager kills the engine 5 s after its SIGTERM, and the workers stop first.
SHUTDOWN_WRITE_S = 4.0


class HpkvScheduler:
    def __init__(
        self,
        config: HpkvConfig,
        namespace: Namespace,
        block_size: int,
        *,
        load: bool,
        store: bool,
        defer_cascade: bool = False,
        adopt_pools: list[str | None] | None = None,
        gpu: bool = False,
        device: str = "",
    ) -> None:
        """``defer_cascade`` (``HPKV_WRITE_BEHIND``, see connector.defer_writes): the
        write-behind waits for idle time (see :meth:`Catalog.step_scheduled`). ``adopt_pools``: per
        rank, the pool file its worker made at start, if it did (see connector.py). ``gpu``: the
        engine's KV is on a GPU, where a load's copies can run beside a step (``HPKV_ASYNC_LOAD=auto``).
        ``device``: the engine's device name, under which its measured rates are kept (engine/costs.py)."""
        if config.chunk_size % block_size:
            why = f"is not a multiple of the engine's --block-size {block_size}"
            raise config.refuse("chunk_size", why, f"{block_size * max(1, config.chunk_size // block_size)}")
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.load_enabled = load
        self.gpu = gpu
        self.store_enabled = store
        self.catalog = Catalog(config, namespace, defer_cascade=defer_cascade, adopt_pools=adopt_pools)
        self.identity = IdentityReader(self.catalog.logical_digest, self.chunk_size, config.salt)
        self.world_size = namespace.world_size
        self._reqs: dict[str, ReqState] = {}
        self._async: dict[str, ReqState] = {}  # async loads whose last part is still to be sent
        self._ops: dict[int, Op] = {}
        self._next_op = 1
        self._pending_store: set[bytes] = set()
        self._attached = 0  # worker ranks that have mapped their pool file
        self._counters = {
            "lookups": 0,
            "lookup_hit_tokens": 0,
            "loaded_tokens": 0,
            "stored_tokens": 0,
            "load_failures": 0,
            "store_failures": 0,
            "skipped_requests": 0,
            "stores_skipped_pool_full": 0,
            "lookups_waited_for_room": 0,
            "remote_checks_at_arrival": 0,  # lookups that used the existence check made at arrival
            "lookups_waited_alone": 0,  # waits of a lookup for its tier I/O with nothing else to run
            "async_loads": 0,  # hits answered as vLLM's async load (HPKV_ASYNC_LOAD)
            "lookups_cut_by_cost": 0,  # hits loaded only in part: the rest was faster to recompute
            "chunks_left_to_recompute": 0,  # the chunks those hits left out
        }
        self.costs = self.catalog.costs
        self._memo = RateMemo(
            [config.resolved_storage_path, config.share_mem_file_path if self.catalog.pools else None],
            f"{namespace.logical_digest.hex()}|{device or ('gpu' if gpu else 'cpu')}",
        )
        self.costs.seed(self._memo.load())
        self._clock = StepClock()  # each computing step's time: the prefill rate's samples
        self._pool_full = PoolFullLog(config, self.catalog, POOL_FULL_LOG_S)
        self.trace = StepTrace(config.step_trace)
        self.stats_file = StatsFile.for_pool_dir(config.share_mem_file_path, namespace.model_id)
        self.stats_file.write(self.stats, force=True)
        self._refresher = Refresher(self.stats_file, self.stats, lambda: self.catalog.engine_busy_now)
        log.info(
            "hpkv: scheduler ready: tiers %s, chunk %d tokens, %s per chunk per rank, %d rank(s)",
            ",".join(t for t in self.catalog.stats() if "." not in t) or "none",
            self.chunk_size,
            f"{self.catalog.payload_bytes / 2**20:.2f} MiB",
            self.world_size,
        )

    # -- lookup ----------------------------------------------------------------------

    def _state(self, request: Request) -> ReqState:
        """The request's state, created on first sight (keys are hashed once per request), keyed by
        everything the engine keys its own cache by (tokens, LoRA, multimodal inputs, cache_salt,
        prompt embeddings)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            # Prompt embeddings without token ids: the chunks are keyed by the embeddings alone.
            prompt = request.prompt_token_ids or [0] * prompt_length(request)
            ident = self.identity.of(request)
            if ident.skip is not None:
                self._counters["skipped_requests"] += 1
                self._counters[f"skipped_{ident.skip}"] = self._counters.get(f"skipped_{ident.skip}", 0) + 1
                lks: list[bytes] = []
            else:
                lks = self.catalog.keys(prompt, seed=ident.seed, extras=ident.extras)
            st = ReqState(lks=lks, prompt_len=len(prompt), tenant=ident.tenant)
            self._reqs[request.request_id] = st
        return st

    def _seen(self, req_id: str, prompt: list[int] | None) -> ReqState:
        """State of a request scheduled without a lookup first: what vLLM passes to the step
        (NewRequestData) lacks cache_salt, so such a request cannot be keyed and is not touched."""
        st = self._reqs.get(req_id)
        if st is None:
            st = ReqState(lks=[], prompt_len=len(prompt or []))
            self._reqs[req_id] = st
        return st

    def on_new_request(self, request: Request) -> None:
        """vLLM queued the request: ask the remote tiers now about the chunks the local ones lack,
        so the first lookup can use the answer (see arrival.py)."""
        if not self.load_enabled or not self.catalog.has_remote:
            return
        st = self._state(request)
        if st.lks and st.where is None and st.arrival is None:
            st.arrival = ArrivalCheck.start(self.catalog, st.lks, st.tenant)

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """See :meth:`_lookup`; traced (``HPKV_STEP_TRACE``)."""
        hit, asynchronous = self._lookup(request, num_computed)
        if self.trace.on:  # nothing to gather on every lookup otherwise
            st = self._reqs[request.request_id]
            self.trace.lookup(request.request_id, st.prompt_len, num_computed, hit, asynchronous)
        return hit, asynchronous

    def _lookup(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """How many tokens past ``num_computed`` hpkv can load; ``None`` = ask again next step.

        Never waits while the engine has anything else to do (vLLM calls this inside the step that
        serves every running request); a request that is all the engine has waits for its own I/O
        at most IDLE_WAIT_S, as the empty step it would cost waits (see :meth:`_wait_alone`). The
        first call looks in memory and storage (local indexes) and, for the chunks they lack,
        asks valkey once on a thread (one pipelined EXISTS per rank); the hit is cut at the
        first chunk no tier holds, and the chunks below memory are promoted on threads. Until
        the answer and the promotions are in, the request is asked about again: vLLM schedules
        the others meanwhile. The chunks of the hit are protected from eviction from the first
        call until they are pinned, so promotions never evict the request's own chunks."""
        st = self._state(request)
        self._release_lease(st)
        if not self.load_enabled or not st.lks:
            return 0, False
        if st.async_hit and not st.async_op:  # asked again before vLLM could allocate: same answer
            if st.async_hit > num_computed:
                st.load_start, st.load_tokens = num_computed, st.async_hit - num_computed
                return st.load_tokens, True
            self._end_async(st)
            return 0, False
        C = self.chunk_size
        first = num_computed // C
        lks = st.lks
        if not st.staged:
            deadline = time.monotonic() + IDLE_WAIT_S  # see _wait_alone
            if st.where is None:
                st.where = self.catalog.locate_local(lks[first:], st.tenant)
                st.looked_from = first
                self.catalog.count_miss(sum(w != MEMORY for w in st.where))
                gaps = [i for i, w in enumerate(st.where) if w is None]
                arrival, st.arrival = st.arrival, None  # used once
                if gaps and self.catalog.has_remote:
                    st.probe_at = gaps
                    st.probe = arrival.answer_for([first + i for i in gaps]) if arrival else None
                    if st.probe is not None:
                        self._counters["remote_checks_at_arrival"] += 1
                    else:
                        st.probe = self.catalog.probe_remote([lks[first + i] for i in gaps], st.tenant)
                    st.staging_since = time.monotonic()
            if st.probe is not None:
                self._wait_alone([st.probe], deadline)
                if not st.probe.done() and not self._gave_up(st):
                    return None, False
                names = st.probe.result() if st.probe.done() else [None] * len(st.probe_at)
                for i, name in zip(st.probe_at, names, strict=True):
                    st.where[i] = name
                st.probe = None
            if not st.stage_started:
                first_ask = st.cut < 0
                if first_ask:  # the hit ends at the first gap; its chunks are kept from eviction
                    st.cut = st.where.index(None) if None in st.where else len(st.where)
                    st.cut = self._cost_cut(request.request_id, st)
                where = st.where[: st.cut]
                if first_ask:
                    st.tiers = {t: where.count(t) for t in [MEMORY, *self.catalog.tiers] if t in where}
                    st.protected = lks[st.looked_from : st.looked_from + st.cut]
                    self.catalog.protect(st.protected)
                    if not st.staging_since:
                        st.staging_since = time.monotonic()
                need = [lk for lk, w in zip(st.protected, where, strict=True) if w != MEMORY]
                if self.catalog.short_of_room(len(need)) and not self._waited(st, ROOM_WAIT_S):
                    # Promotions that found no slot would cut the hit short, and under load the
                    # engine would recompute the rest behind the backlog holding the slots.
                    self._counters["lookups_waited_for_room"] += not st.waited_for_room
                    st.waited_for_room = True
                    return None, False
                st.stage_started = True
                if self._load_async(bool(need), st.hit_end(C) - num_computed):
                    return self._answer_async(st, num_computed)
                # Under load the reads start when this scheduling pass ends (see _answer_async).
                st.staging = self.catalog.stage(need, st.tenant, defer=self._busy())
            self._wait_alone(st.staging, deadline)
            if st.staging and not all(f.done() for f in st.staging) and not self._gave_up(st):
                return None, False
            st.staged = True
            if st.staging:
                log.info("hpkv: %s", staged_line(st.staging, request.request_id, st.staging_since))
                self._measure_reads(st, st.staging)
                for name in self.catalog.tiers:  # what arrived (a failed promotion shortens the hit)
                    if name in st.tiers:
                        st.tiers[name] = sum(
                            self.catalog.in_memory(lk)
                            for lk, w in zip(st.protected, st.where, strict=False)
                            if w == name
                        )
            st.staging = []
        self._counters["lookups"] += 1
        slots = self.catalog.pin(lks[first:])
        self._unprotect(st)  # pinned now (what is in memory of it)
        hit = (first + len(slots)) * C
        if hit <= num_computed:
            self.catalog.unpin(slots)
            return 0, False
        hit = min(hit, st.prompt_len - 1)  # the engine must compute at least one token
        needed = -(-hit // C) - first
        self.catalog.unpin(slots[needed:])
        st.lease, st.lease_first = slots[:needed], first
        st.load_start, st.load_tokens = num_computed, hit - num_computed
        self._counters["lookup_hit_tokens"] += st.load_tokens
        return st.load_tokens, False

    def _answer_async(self, st: ReqState, num_computed: int) -> tuple[int, bool]:
        """Answer the hit now, as vLLM's async load (see :meth:`_load_async`); chunks below memory
        are promoted meanwhile, and each is sent to the workers as soon as it is in memory (see
        :meth:`_async_part`), so the reads of later chunks overlap the copies of earlier ones."""
        C = self.chunk_size
        first, hit = st.looked_from, st.hit_end(C)
        if hit <= num_computed:
            self._unprotect(st)
            st.staged = True
            return 0, False
        needed = -(-hit // C) - first
        # The chunks below memory are promoted, their reads started when this scheduling pass ends
        # (build_connector_meta): started now, they would slow the pass's other lookups (the GIL),
        # and so the step it sends. On the H200 three such lookups in one pass took 12.5 ms, where a
        # step goes 1.6 ms after the last report at the median.
        wait_on: list[tuple[int, Future[bool] | None]] = []
        for i, lk in enumerate(st.protected[:needed]):
            futs = [] if self.catalog.in_memory(lk) else self.catalog.stage([lk], st.tenant, defer=True)
            wait_on.append((i, futs[0] if futs else None))
        st.async_wait = wait_on
        st.staging = [f for _, f in wait_on if f is not None]
        st.promotions = list(st.staging)
        st.async_hit, st.staged = hit, True
        st.load_start, st.load_tokens = num_computed, hit - num_computed
        self._counters["lookups"] += 1
        self._counters["async_loads"] += 1
        self._counters["lookup_hit_tokens"] += st.load_tokens
        return st.load_tokens, True

    def _cost_cut(self, req_id: str, st: ReqState) -> int:
        """How many chunks of the hit just cut at its first gap to load: the prefix whose loading
        beats recomputing it by the measured rates (engine/costs.py); the rest is left to the
        engine, counted and logged."""
        found = st.cut
        where = (st.where or [])[:found]
        if not found or all(w == MEMORY for w in where):
            return found
        lks = st.lks[st.looked_from : st.looked_from + found]
        sources = [
            MEMORY if w == MEMORY else self.catalog.read_source(lk, w or "", st.tenant)
            for lk, w in zip(lks, where, strict=True)
        ]
        st.sources = {lk: src for lk, src in zip(lks, sources, strict=True) if src != MEMORY}
        plan = self.costs.plan(sources)
        if plan.left:
            st.left_out = set(lks[plan.load :])
            self._counters["lookups_cut_by_cost"] += 1
            self._counters["chunks_left_to_recompute"] += plan.left
            log.info(
                "hpkv: request %s: loading %d of %d chunks found, %d left to recompute (%s)",
                req_id,
                plan.load,
                found,
                plan.left,
                plan.why,
            )
        return plan.load

    def _measure_reads(self, st: ReqState, futures: list[Future[bool]]) -> None:
        """The read rate each source of this load showed (see LoadCosts.promoted), kept."""
        self.costs.promoted(futures, st.sources)
        self._memo.save(self.costs.export())

    def _end_async(self, st: ReqState) -> None:
        st.async_hit, st.async_wait, st.staging = 0, [], []
        self._unprotect(st)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if st.async_hit and not st.async_op:
            if num_external <= 0:  # vLLM kept its own (longer) hit
                self._end_async(st)
                return
            # The request waits for its KV unscheduled: its blocks come from here, not from a step.
            st.block_ids = list(blocks.get_block_ids()[0])
            st.load_tokens = min(st.load_tokens, num_external)
            st.async_op = self._new_op(
                Op("load", [], remaining=self.world_size, tokens=st.load_tokens, req_id=request.request_id)
            )
            self._async[request.request_id] = st
            st.next_store = max(st.next_store, (st.load_start + st.load_tokens) // self.chunk_size)
            return
        if num_external <= 0:
            self._release_lease(st)
            st.pending_load = False
            return
        st.load_tokens = min(st.load_tokens, num_external)
        st.pending_load = True

    # -- per step ---------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> HpkvMeta:
        self.catalog.start_deferred()  # the reads of this pass's lookups (see Catalog.stage)
        computes = so.total_num_scheduled_tokens > 0
        meta = HpkvMeta(self.catalog.pool_paths, self.config.mem_pool_size, computes=computes)
        self.catalog.step_scheduled(computes)
        self._clock.sent(so.total_num_scheduled_tokens, computes)
        if not computes and not self.catalog.engine_busy_now:
            self._idle_wait()  # not with a computing step in flight: its output waits on this thread
        for new in so.scheduled_new_reqs:
            st = self._seen(new.req_id, new.prompt_token_ids)
            st.block_ids = list(new.block_ids[0])
            self._plan(meta, new.req_id, st, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._reqs.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                known.block_ids.extend(new_ids[0])
            self._plan(meta, req_id, known, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        for req_id, st in list(self._async.items()):
            part = self._async_part(req_id, st)
            if part is not None:
                meta.loads.append(part)
        self.stats_file.write(self.stats)
        self.trace.step(so, meta)
        return meta

    def _async_part(self, req_id: str, st: ReqState) -> LoadRequest | None:
        """This step's part of an async load (see async_parts.py); the last part goes out once no
        chunk is awaited; None when there is nothing new."""
        op = self._ops[st.async_op]
        part = next_part(
            self.catalog,
            st.async_wait,
            st.lks,
            st.looked_from,
            st.block_ids,
            (st.load_start, st.load_start + st.load_tokens),
            (self.chunk_size, self.block_size),
            give_up=st.finished or self._gave_up(st),
            finished=st.finished,
        )
        op.slots.extend(c.slot for c in part.chunks)
        op.tokens -= part.lost_tokens
        st.async_wait = part.waiting
        st.staging = [f for _, f in part.waiting if f is not None]
        last = not part.waiting
        if not part.chunks and not part.failed_blocks and not last:
            return None
        if last:
            del self._async[req_id]
            self._unprotect(st)
            self._measure_reads(st, st.promotions)
            log.info(
                "hpkv: async load of request %s: %d chunks sent to the engine as they reached memory, "
                "the last %.1f ms after the lookup%s",
                req_id,
                len(op.slots),
                (time.monotonic() - st.staging_since) * 1e3,
                f"; {len(part.failed_blocks)} blocks could not be read and are recomputed"
                if part.failed_blocks
                else "",
            )
        return LoadRequest(
            st.async_op,
            req_id,
            part.chunks,
            st.prompt_len,
            st.load_tokens,
            st.tiers,
            asynchronous=True,
            last=last,
            failed_blocks=[] if st.finished else part.failed_blocks,
            since=st.staging_since,
        )

    def _plan(self, meta: HpkvMeta, req_id: str, st: ReqState, computed_after: int) -> None:
        C, bs = self.chunk_size, self.block_size
        per_chunk = C // bs
        if st.pending_load:
            st.pending_load = False
            chunks = st.leased_chunks(C, bs)
            op = self._new_op(Op("load", st.lease, remaining=self.world_size, tokens=st.load_tokens))
            meta.loads.append(LoadRequest(op, req_id, chunks, st.prompt_len, st.load_tokens, st.tiers))
            st.lease = []  # now owned by the op, released when every rank has copied
            st.next_store = max(st.next_store, (st.load_start + st.load_tokens) // C)
        if not self.store_enabled or not st.lks:
            return
        limit = min(computed_after, st.prompt_len, len(st.lks) * C) // C
        while st.next_store < limit:
            j = st.next_store
            st.next_store += 1
            lk = st.lks[j]
            if lk in self._pending_store or self.catalog.in_memory(lk):
                continue
            # A chunk storage holds is not written again, unless the hit left it to the engine as
            # slower to read than to compute: the engine's KV of it then goes into memory, so the
            # next hit loads it from there (the write-behind finds storage holding it).
            if lk not in st.left_out and self.catalog.in_storage(lk):
                continue
            reserved = self.catalog.reserve()
            if reserved is None:
                self._counters["stores_skipped_pool_full"] += 1
                self._pool_full.skipped(req_id)
                continue
            blocks = st.block_ids[j * per_chunk : (j + 1) * per_chunk]
            op = self._new_op(
                Op("store", [reserved], lk=lk, remaining=self.world_size, tokens=C, tenant=st.tenant)
            )
            self._pending_store.add(lk)
            meta.stores.append(StoreChunk(op, reserved, lk, blocks))

    def _new_op(self, op: Op) -> int:
        op_id = self._next_op
        self._next_op += 1
        self._ops[op_id] = op
        return op_id

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        wm = output.kv_connector_worker_meta
        self.trace.event("done", computed=getattr(wm, "computed", None))
        if not isinstance(wm, HpkvWorkerMeta):
            self.catalog.step_done(None)  # not our report: the oldest step in flight
            self._step_reported(None)
            return
        self.catalog.step_done(wm.computed)
        self._step_reported(wm.computed)
        if wm.attached:
            self._attached += wm.attached
            if self._attached >= self.world_size:
                # Every rank has mapped its pool: the names are no longer needed, and without
                # them no way of ending (SIGKILL included) can leave a pool file holding RAM.
                self.catalog.unlink_pool_files()
        for op_id, (ok, bad) in wm.results.items():
            op = self._ops.get(op_id)
            if op is None:
                continue
            op.remaining -= ok + bad
            op.failed |= bad > 0
            if op.remaining > 0:
                continue
            del self._ops[op_id]
            if op.kind == "store":
                self._pending_store.discard(op.lk)
                if op.failed:
                    self.catalog.abort(op.slots[0])
                    self._counters["store_failures"] += 1
                elif self.catalog.commit(op.lk, op.slots[0], op.tenant):
                    self._counters["stored_tokens"] += op.tokens
            else:
                self.catalog.unpin(op.slots)
                st = self._reqs.get(op.req_id)
                if st is not None and st.async_op == op_id:
                    st.async_op, st.async_hit = 0, 0  # a later lookup (preemption) pins from memory
                if op.failed:
                    self._counters["load_failures"] += 1
                else:
                    # Bytes every rank copied (each its own shard of every chunk).
                    nbytes = len(op.slots) * self.catalog.payload_bytes * self.world_size
                    self.catalog.count_load(len(op.slots), nbytes)
                    self._counters["loaded_tokens"] += op.tokens
        self.stats_file.write(self.stats)

    def _step_reported(self, computed: bool | None) -> None:
        """A step's output is back: a computing one is a sample of the engine's prefill rate."""
        took = self._clock.reported(computed)
        if took is not None:
            self.costs.computed(*took)
            self._memo.save(self.costs.export())

    def has_pending_ops(self) -> bool:
        """Loads or stores the workers have not reported yet (the engine keeps stepping for them).
        An op unreported for PENDING_OPS_MAX_S no longer keeps an idle engine spinning."""
        now = time.monotonic()
        return any(now - op.since < PENDING_OPS_MAX_S for op in self._ops.values())

    def request_finished(self, request: Request) -> bool:
        """vLLM is done with the request (finished or aborted). True: an async load still writes
        into its blocks, so vLLM must keep them until the workers report it received (they do
        once the copies landed; its remaining part goes out at the next step)."""
        st = self._reqs.pop(request.request_id, None)
        self.trace.event("finished", id=request.request_id)
        delay = False
        if st is not None:
            self._release_lease(st)
            if st.async_op and st.async_op in self._ops:
                delay, st.finished = True, True
                if request.request_id not in self._async:
                    self._unprotect(st)
            else:
                self._end_async(st)
        self.stats_file.write(self.stats)
        return delay

    def reset_cache(self) -> bool:
        """``POST /reset_prefix_cache?reset_external=true``: drop the memory pool's chunks."""
        self.catalog.clear((MEMORY,))
        self.stats_file.write(self.stats, force=True)
        log.info("hpkv: memory pool cleared (reset_external)")
        return True

    def _gave_up(self, st: ReqState) -> bool:
        """The request's tier I/O has taken too long: settle for what has arrived."""
        return self._waited(st, STAGE_GIVE_UP_S)

    def _waited(self, st: ReqState, limit: float) -> bool:
        return bool(st.staging_since) and time.monotonic() - st.staging_since > limit

    def _idle_wait(self) -> None:
        pending: list[Future[Any]] = []
        for st in list(self._reqs.values()):
            if st.probe is not None and not st.probe.done():
                pending.append(st.probe)
            pending.extend(f for f in st.staging if not f.done())
        if pending and not self._async:
            wait(pending, timeout=IDLE_WAIT_S, return_when=ALL_COMPLETED)
        elif pending:  # an async load: wake for the first arrival, and take what follows it shortly
            done, rest = wait(pending, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
            if done and rest:
                wait(rest, timeout=ASYNC_GATHER_S, return_when=ALL_COMPLETED)

    def _load_async(self, slow: bool, tokens: int) -> bool:
        """Whether a hit of ``tokens`` to load (``slow``: it needs storage or valkey) loads
        asynchronously (``HPKV_ASYNC_LOAD``). "auto": on a GPU, a load of a chunk or more that needs
        storage or valkey, or that is found while the engine has any other request.

        A synchronous load is copied inside the step that admits the request, and that step's
        compute waits for it: on the H200 ~9 ms per 448 MiB hit, several hits admitted together
        stacking up, for every request in the step. A slow hit async sends each chunk to the
        engine as it arrives, so its copies overlap the reads: with CUDA graphs a storage hit of a
        request alone took 79.3 ms against 90.3 ms "ask again" (H200, 24 prompts each). A memory
        hit alone keeps the synchronous load (no reads to overlap, and one engine step less), as
        does a load shorter than a chunk (the tail after vLLM's own prefix-cache hit, the
        commonest: async, it cost such a request 30 ms on the H200, and its copy is a fraction of
        a millisecond)."""
        mode = self.config.async_load
        if mode == "auto":
            return self.gpu and tokens >= self.chunk_size and (slow or self._busy())
        return slow and mode == "true"

    def _busy(self) -> bool:
        """Another request is known (queued, running or loading), or a computing step is out."""
        return len(self._reqs) != 1 or self.catalog.engine_busy_now

    def _wait_alone(self, futs: list[Future[Any]], deadline: float) -> None:
        """Wait for a lookup's pending I/O until ``deadline`` if the request looked up is all the engine
        has: no other request known (queued, running or loading) and no computing step out. Else
        return at once. "Ask again" would cost such a request an empty step that waits the same way
        (see :meth:`_idle_wait`), and there is no other request whose step either wait could delay."""
        if self._busy():  # under load: no list, no clock
            return
        pending = [f for f in futs if not f.done()]
        left = deadline - time.monotonic()
        if pending and left > 0:
            self._counters["lookups_waited_alone"] += 1
            wait(pending, timeout=left, return_when=ALL_COMPLETED)

    def _unprotect(self, st: ReqState) -> None:
        if st.protected:
            self.catalog.unprotect(st.protected)
            st.protected = []

    def _release_lease(self, st: ReqState) -> None:
        if st.lease:
            self.catalog.unpin(st.lease)
            st.lease = []

    # -- observability ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, plus ``pending``: work whose counters are still to come (loads and stores the
        workers have not reported, lookups staging). A reader that waits for ``pending == 0`` in a
        file written after its request sees every count of that request (bench.server.settled_stats)."""
        staging = sum(1 for st in list(self._reqs.values()) if st.staging or st.probe is not None)
        return {
            "tiers": self.catalog.stats(),
            "connector": dict(self._counters),
            "write_behind": self.catalog.write_behind(),
            "costs": self.costs.snapshot(),
            "pending": len(self._ops) + staging,
            "ranks": self.world_size,
        }

    def stopping(self) -> None:
        """The engine was told to stop (SIGTERM, SIGINT; on a thread the signal handler starts):
        keep the measured rates and write what is queued at once. With vLLM's default
        ``--shutdown-timeout 0`` the engine is killed right after, and :meth:`shutdown` never runs."""
        self._memo.save(self.costs.export(), force=True)
        self.catalog.stopping()

    def shutdown(self) -> None:
        """Write what the write-behind holds, for at most SHUTDOWN_WRITE_S (a kill loses the rest),
        then close everything."""
        self._refresher.stop()
        self._memo.save(self.costs.export(), force=True)
        self.stats_file.write(self.stats, force=True)
        wb = self.catalog.write_behind()
        log.info(
            "hpkv: stopping: %d chunks written to the slower tiers since start (longest wait %d ms), "
            "%d still queued",
            wb["written"],
            wb["delay_max_ms"],
            wb["pending"],
        )
        self.catalog.close(SHUTDOWN_WRITE_S)
        self.stats_file.remove()
        self.trace.close()
