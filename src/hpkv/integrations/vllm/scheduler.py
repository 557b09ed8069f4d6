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
from hpkv.engine.catalog import Catalog
from hpkv.engine.costs import RateMemo
from hpkv.engine.interface import MEMORY, NO_ROOM, Asked, Hit, Miss, SteppedEngine
from hpkv.engine.lookup import Lookup
from hpkv.integrations.statsfile import Refresher, StatsFile
from hpkv.integrations.vllm.identity import IdentityReader, prompt_length
from hpkv.integrations.vllm.kvgroups import NULL_BLOCK, KVGroup, KVGroups
from hpkv.integrations.vllm.logs import PoolFullLog, staged_line
from hpkv.integrations.vllm.meta import ChunkLoad, HpkvMeta, HpkvWorkerMeta, LoadRequest, StoreChunk
from hpkv.integrations.vllm.reqstate import LoadPhase, Op, ReqState
from hpkv.integrations.vllm.stepclock import StepClock
from hpkv.integrations.vllm.steptrace import StepTrace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("hpkv")

# A step that scheduled nothing while lookups wait for tier I/O: the engine would spin through empty
# steps (scheduler and workers polling), taking the CPU from the promotion threads. Such a step waits
# for those lookups' I/O to finish, at most this long, unless a computing step is still out (async
# scheduling): its output waits on this thread.
IDLE_WAIT_S = 0.02
# An async load sends its chunks as they arrive, but not one step per chunk: each step is the engine
# thread's Python on the GIL that every promotion needs back after each system call, so stepping per
# chunk would slow the very reads it waits for. After the first arrival the step gathers the others
# for this long.
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
        groups: KVGroups | None = None,
    ) -> None:
        """``defer_cascade`` (``HPKV_WRITE_BEHIND``, see connector.defer_writes): the
        write-behind waits for idle time (see :meth:`Catalog.step_scheduled`). ``adopt_pools``: per
        rank, the pool file its worker made at start, if it did (see connector.py). ``gpu``: the
        engine's KV is on a GPU, where a load's copies can run beside a step (``HPKV_ASYNC_LOAD=auto``).
        ``device``: the engine's device name, under which its measured rates are kept (engine/costs.py).
        ``groups``: vLLM's KV cache groups (kvgroups.py); one full-attention group if not given."""
        if config.chunk_size % block_size:
            why = f"is not a multiple of the engine's --block-size {block_size}"
            raise config.refuse("chunk_size", why, f"{block_size * max(1, config.chunk_size // block_size)}")
        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.load_enabled = load
        self.gpu = gpu
        self.store_enabled = store
        self.groups = groups or KVGroups((KVGroup("full", namespace.layout.num_layers),))
        self.catalog: SteppedEngine = Catalog(
            config, namespace, defer_cascade=defer_cascade, adopt_pools=adopt_pools
        )
        self.identity = IdentityReader(namespace.logical_digest, self.chunk_size, config.salt)
        self.world_size = namespace.world_size
        self._reqs: dict[str, ReqState] = {}
        self._async: dict[str, ReqState] = {}  # async loads whose last part is still to be sent
        self._ops: dict[int, Op] = {}
        self._next_op = 1
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
            "loads_skipped_by_cost": 0,  # hits recomputed whole: loading would cost more than it saves
            "lookups_not_worth_a_load": 0,  # not even a whole hit would save what its load costs
        }
        self.costs = self.catalog.costs
        self._memo = RateMemo(
            [config.resolved_storage_path, config.share_mem_file_path if self.catalog.pool_paths else None],
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
            st = ReqState(Lookup(lks, ident.tenant), prompt_len=len(prompt))
            self._reqs[request.request_id] = st
        return st

    def _seen(self, req_id: str, prompt: list[int] | None) -> ReqState:
        """State of a request scheduled without a lookup first: what vLLM passes to the step
        (NewRequestData) lacks cache_salt, so such a request cannot be keyed and is not touched."""
        st = self._reqs.get(req_id)
        if st is None:
            st = ReqState(Lookup([]), prompt_len=len(prompt or []))
            self._reqs[req_id] = st
        return st

    def on_new_request(self, request: Request) -> None:
        """vLLM queued the request: ask now, on an I/O thread, what its first lookup would ask there,
        so the lookup can use the answer (see Catalog.look_ahead)."""
        if not self.load_enabled:
            return
        self.catalog.look_ahead(self._state(request).lookup)

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """See :meth:`_lookup`; traced (``HPKV_STEP_TRACE``)."""
        hit, asynchronous = self._lookup(request, num_computed)
        if self.trace.on:  # nothing to gather on every lookup otherwise
            st = self._reqs[request.request_id]
            self.trace.lookup(request.request_id, st.prompt_len, num_computed, hit, asynchronous)
        return hit, asynchronous

    def _lookup(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """How many tokens past ``num_computed`` hpkv can load; ``None`` = ask again next step.

        The engine's lookup (:meth:`Catalog.lookup`) finds the hit, promotes its chunks below
        memory on threads and answers "pending" meanwhile: vLLM schedules the others. It never
        waits while the engine has anything else to do (vLLM calls this inside the step that
        serves every running request); a request that is all the engine has waits for its own
        I/O at most IDLE_WAIT_S, as the empty step it would cost waits (see :meth:`_idle_wait`).
        A hit is answered synchronously (its slots leased until vLLM allocates) or, see
        :meth:`_load_async`, as vLLM's async load."""
        st = self._state(request)
        self._release_lease(st)
        lk = st.lookup
        if not self.load_enabled or not lk.lks:
            return 0, False
        if st.load is LoadPhase.ASYNC:  # asked again before vLLM could allocate: same answer
            if st.async_hit > num_computed:
                st.load_start, st.load_tokens = num_computed, st.async_hit - num_computed
                return st.load_tokens, True
            self._end_async(st)
            return 0, False
        C = self.chunk_size
        first = num_computed // C
        # What the engine's own prefix cache holds was computed, and offered to hpkv, before.
        st.next_store = max(st.next_store, first)
        if self.groups.count > 1 and min(len(lk.lks) * C, st.prompt_len - 1) - num_computed < C:
            # Several groups load asynchronously (see _load_async): the step that costs the engine
            # is more than computing what is left after its own hit, less than a chunk.
            self._counters["lookups_not_worth_a_load"] += 1
            return 0, False
        if not st.asked:
            # Even a hit of every chunk from here would not pay for its load (the prompt's last
            # partial block after vLLM's own hit, the commonest): no lookup, no tier asked.
            end = min(len(lk.lks) * C, st.prompt_len - 1)
            if end <= num_computed or not self.costs.worth_loading(
                end - num_computed, st.prompt_len - end, (-(-end // C) - first) * self.catalog.payload_bytes
            ):
                self._counters["lookups_not_worth_a_load"] += 1
                return 0, False
        busy = self._busy()
        if not st.asked:  # the lookup looks from here on (a streamed hit's chunks count from it)
            st.asked, st.hit_first = True, first
        answer = self.catalog.lookup(
            lk,
            first,
            wait_until=None if busy else time.monotonic() + IDLE_WAIT_S,
            defer=busy,
            stream=lambda below, chunks: self._load_async(
                below > 0, self._hit_end(st, chunks) - num_computed
            ),
        )
        self._count_lookup(request.request_id, st, answer.asked)
        if not isinstance(answer, (Hit, Miss)):
            return None, False
        if isinstance(answer, Hit):
            st.hit_first, st.hit_tiers, st.since = answer.first, answer.tiers, answer.since
        if isinstance(answer, Hit) and answer.streaming:
            return self._answer_async(st, answer, num_computed)
        self._counters["lookups"] += 1
        slots = answer.slots if isinstance(answer, Hit) else []
        hit = (first + len(slots)) * C
        if hit <= num_computed:
            self.catalog.finish_load(slots)
            return 0, False
        hit = min(hit, st.prompt_len - 1)  # the engine must compute at least one token
        needed = -(-hit // C) - first
        if not self._worth_loading(st, num_computed, hit, needed):
            self.catalog.finish_load(slots)
            return 0, False
        self.catalog.finish_load(slots[needed:])
        st.lease, st.lease_first = slots[:needed], first
        st.to(LoadPhase.LEASED)
        st.load_start, st.load_tokens = num_computed, hit - num_computed
        self._counters["lookup_hit_tokens"] += st.load_tokens
        return st.load_tokens, False

    def _worth_loading(self, st: ReqState, num_computed: int, end: int, chunks: int) -> bool:
        """Whether loading tokens ``num_computed`` to ``end`` (``chunks`` whole chunks to copy)
        beats computing them, counting the load's own cost (:meth:`LoadCosts.worth_loading`): the
        prompt's last partial block, which vLLM's own cache leaves, is recomputed where a step costs
        the same with or without it. A load not worth it is counted (its chunks stay in memory)."""
        tokens = end - num_computed
        nbytes = chunks * self.catalog.payload_bytes
        if self.costs.worth_loading(tokens, st.prompt_len - end, nbytes):
            return True
        self._counters["loads_skipped_by_cost"] += 1
        return False

    def _hit_end(self, st: ReqState, chunks: int) -> int:
        """Where a hit of ``chunks`` chunks from the lookup's first ends, in tokens (the engine
        computes at least the last one)."""
        return min((st.hit_first + chunks) * self.chunk_size, st.prompt_len - 1)

    def _count_lookup(self, req_id: str, st: ReqState, asked: Asked) -> None:
        """Count and log what this ask of the engine's lookup did."""
        self._counters["lookups_waited_alone"] += asked.waited
        self._counters["lookups_waited_for_room"] += asked.waited_for_room
        if asked.found:
            self._counters["remote_checks_at_arrival"] += asked.used_ahead
        if asked.cut is not None:
            st.left_out = asked.cut.left_out
            self._counters["lookups_cut_by_cost"] += 1
            self._counters["chunks_left_to_recompute"] += len(asked.cut.left_out)
            log.info(
                "hpkv: request %s: loading %d of %d chunks found, %d left to recompute (%s)",
                req_id,
                asked.cut.loaded,
                asked.cut.found,
                len(asked.cut.left_out),
                asked.cut.why,
            )
        if asked.promotions:
            log.info("hpkv: %s", staged_line(list(asked.promotions), req_id, asked.since))
            self._memo.save(self.costs.export())

    def _answer_async(self, st: ReqState, hit: Hit, num_computed: int) -> tuple[int, bool]:
        """Answer the hit now, as vLLM's async load (see :meth:`_load_async`); chunks below memory
        are promoted meanwhile (their reads started when this scheduling pass ends), and each is
        sent to the workers as soon as it is in memory (see :meth:`_async_part`), so the reads of
        later chunks overlap the copies of earlier ones."""
        end = self._hit_end(st, hit.chunks)
        if end <= num_computed:
            self._end_async(st)
            return 0, False
        st.async_hit = end
        st.to(LoadPhase.ASYNC)
        st.load_start, st.load_tokens = num_computed, end - num_computed
        self._counters["lookups"] += 1
        self._counters["async_loads"] += 1
        self._counters["lookup_hit_tokens"] += st.load_tokens
        return st.load_tokens, True

    def _end_async(self, st: ReqState) -> None:
        st.async_hit = 0
        if st.load is LoadPhase.ASYNC:
            st.to(LoadPhase.NONE)
        self.catalog.release(st.lookup)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if st.load is LoadPhase.ASYNC:
            if num_external <= 0:  # vLLM kept its own (longer) hit
                self._end_async(st)
                return
            # The request waits for its KV unscheduled: its blocks come from here, not from a step.
            st.block_ids = [list(ids) for ids in blocks.get_block_ids()]
            st.load_tokens = min(st.load_tokens, num_external)
            st.async_op = self._new_op(
                Op("load", [], remaining=self.world_size, tokens=st.load_tokens, req_id=request.request_id)
            )
            st.to(LoadPhase.ASYNC_LOADING)
            self._async[request.request_id] = st
            st.next_store = max(st.next_store, (st.load_start + st.load_tokens) // self.chunk_size)
            return
        if num_external <= 0:
            self._release_lease(st)
            return
        if st.load is LoadPhase.LEASED:
            st.load_tokens = min(st.load_tokens, num_external)
            st.to(LoadPhase.SCHEDULED)

    # -- per step ---------------------------------------------------------------------

    def build_connector_meta(self, so: SchedulerOutput) -> HpkvMeta:
        self.catalog.start_deferred()  # the reads of this pass's lookups (see Catalog.lookup's defer)
        computes = so.total_num_scheduled_tokens > 0
        meta = HpkvMeta(self.catalog.pool_paths, self.config.mem_pool_size, computes=computes)
        self.catalog.step_scheduled(computes)
        self._clock.sent(so.total_num_scheduled_tokens, computes)
        if not computes and not self.catalog.engine_busy_now:
            self._idle_wait()  # not with a computing step in flight: its output waits on this thread
        for new in so.scheduled_new_reqs:
            st = self._seen(new.req_id, new.prompt_token_ids)
            st.block_ids = [list(ids) for ids in new.block_ids]
            before = new.num_computed_tokens
            self._plan(meta, new.req_id, st, before, before + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            known = self._reqs.get(req_id)
            if known is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                known.block_ids = [list(ids) for ids in new_ids] if new_ids else []
            elif new_ids:
                if not known.block_ids:
                    known.block_ids = [[] for _ in new_ids]
                for mine, ids in zip(known.block_ids, new_ids, strict=True):
                    mine.extend(ids)
            before = cached.num_computed_tokens[i]
            self._plan(meta, req_id, known, before, before + so.num_scheduled_tokens[req_id])
        for req_id, st in list(self._async.items()):
            part = self._async_part(req_id, st)
            if part is not None:
                meta.loads.append(part)
        self.trace.step(so, meta)
        return meta

    def _async_part(self, req_id: str, st: ReqState) -> LoadRequest | None:
        """This step's part of an async load: the chunks that reached memory since the last part
        (pinned by the engine, released when every rank has copied), and the blocks of those that
        never will; the last part goes out once no chunk is awaited. None when there is nothing new."""
        op = self._ops[st.async_op]
        lk = st.lookup
        gone = st.load is LoadPhase.ABANDONED
        got = self.catalog.arrivals(lk, give_up=gone, gone=gone)
        C, bs = self.chunk_size, self.block_size
        per_chunk = C // bs
        start, end = st.load_start, st.load_start + st.load_tokens
        chunks: list[ChunkLoad] = []
        failed_blocks: list[int] = []
        for i, slot in got.ready:
            j = st.hit_first + i
            lo, hi = max(j * C, start), min((j + 1) * C, end)
            if hi <= lo:  # outside what vLLM asked for (its own prefix cache has it)
                self.catalog.finish_load([slot])
                continue
            chunks.append(ChunkLoad(slot, st.lks[j], st.chunk_blocks(j, per_chunk), lo - j * C, hi - lo))
        for i in got.failed:
            j = st.hit_first + i
            lo, hi = max(j * C, start), min((j + 1) * C, end)
            blocks = st.chunk_blocks(j, per_chunk)
            failed_blocks.extend(self.groups.token_blocks(blocks, lo - j * C, hi - j * C, bs))
            op.tokens -= max(0, hi - lo)
        op.slots.extend(c.slot for c in chunks)
        last = not got.waiting
        if not chunks and not failed_blocks and not last:
            return None
        if last:
            del self._async[req_id]
            self._memo.save(self.costs.export())
            log.info(
                "hpkv: async load of request %s: %d chunks sent to the engine as they reached memory, "
                "the last %.1f ms after the lookup%s",
                req_id,
                len(op.slots),
                (time.monotonic() - st.since) * 1e3,
                f"; {len(failed_blocks)} blocks could not be read and are recomputed"
                if failed_blocks
                else "",
            )
        return LoadRequest(
            st.async_op,
            req_id,
            chunks,
            st.prompt_len,
            st.load_tokens,
            st.hit_tiers,
            asynchronous=True,
            last=last,
            failed_blocks=[] if gone else failed_blocks,
            since=st.since,
        )

    def _plan(
        self, meta: HpkvMeta, req_id: str, st: ReqState, computed_before: int, computed_after: int
    ) -> None:
        """This step's load of the request (if scheduled) and the stores of the chunks it completes.
        ``computed_before``: the request's computed tokens before the step; a chunk starting
        before what every group still holds then (a window's freed blocks) is not stored."""
        C, bs = self.chunk_size, self.block_size
        per_chunk = C // bs
        if st.load is LoadPhase.SCHEDULED:
            st.to(LoadPhase.NONE)
            chunks = st.leased_chunks(C, bs)
            op = self._new_op(Op("load", st.lease, remaining=self.world_size, tokens=st.load_tokens))
            meta.loads.append(LoadRequest(op, req_id, chunks, st.prompt_len, st.load_tokens, st.hit_tiers))
            st.lease = []  # now owned by the op, released when every rank has copied
            st.next_store = max(st.next_store, (st.load_start + st.load_tokens) // C)
        if not self.store_enabled or not st.lks:
            return
        limit = min(computed_after, st.prompt_len, len(st.lks) * C) // C
        if st.next_store >= limit:
            return
        first, st.next_store = st.next_store, limit
        first = max(first, -(-self.groups.kept_from(computed_before) // C))
        # A window's null blocks (a hit's, vLLM's or hpkv's) are at the front: nothing to store.
        while first < limit and self.groups.count > 1 and NULL_BLOCK in st.chunk_blocks(first, per_chunk):
            first += 1
        if first >= limit:
            return
        # A chunk a slower tier holds is not written again, unless the hit left it to the engine as
        # slower to read than to compute: the engine's KV of it then goes into memory, so the next
        # hit loads it from there (the write-behind finds storage holding it). One batch per
        # request and step: the memory tier is asked twice, not twice per chunk.
        targets = self.catalog.begin_stores(st.lks[first:limit], st.tenant, rewrite=st.left_out)
        for j, reserved in enumerate(targets, start=first):
            lk = st.lks[j]
            if reserved == NO_ROOM:
                self._counters["stores_skipped_pool_full"] += 1
                self._pool_full.skipped(req_id)
                continue
            if not isinstance(reserved, int):
                continue
            blocks = st.chunk_blocks(j, per_chunk)
            op = self._new_op(
                Op("store", [reserved], lk=lk, remaining=self.world_size, tokens=C, tenant=st.tenant)
            )
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
        for nbytes, seconds in wm.copies:
            self.costs.copied(nbytes, seconds)
        if wm.attached:
            self._attached += wm.attached
            if self._attached >= self.world_size:
                # Every rank has mapped its pool: the names are no longer needed, and without
                # them no way of ending (SIGKILL included) can leave a pool file holding RAM.
                self.catalog.unlink_pool_files()
        stores: list[Op] = []
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
                stores.append(op)
            else:
                st = self._reqs.get(op.req_id)
                if st is not None and st.async_op == op_id:
                    st.async_op, st.async_hit = 0, 0  # a later lookup (preemption) pins from memory
                    st.to(LoadPhase.NONE)
                if op.failed:
                    self.catalog.finish_load(op.slots)
                    self._counters["load_failures"] += 1
                else:
                    # Bytes every rank copied (each its own shard of every chunk).
                    nbytes = len(op.slots) * self.catalog.payload_bytes * self.world_size
                    self.catalog.finish_load(op.slots, loaded=len(op.slots), nbytes=nbytes)
                    self._counters["loaded_tokens"] += op.tokens
        # The step's stores made visible together: one question to the memory tier, not one per chunk.
        done = self.catalog.finish_stores([(op.lk, op.slots[0], not op.failed, op.tenant) for op in stores])
        for op, visible in zip(stores, done, strict=True):
            if visible:
                self._counters["stored_tokens"] += op.tokens
            elif op.failed:
                self._counters["store_failures"] += 1

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
                delay = True
                st.to(LoadPhase.ABANDONED)
                if request.request_id not in self._async:
                    self.catalog.release(st.lookup)
            else:
                self._end_async(st)
        return delay

    def reset_cache(self) -> bool:
        """``POST /reset_prefix_cache?reset_external=true``: drop the memory pool's chunks."""
        self.catalog.clear((MEMORY,))
        self.stats_file.write(self.stats, force=True)
        log.info("hpkv: memory pool cleared (reset_external)")
        return True

    def _idle_wait(self) -> None:
        pending: list[Future[Any]] = []
        for st in list(self._reqs.values()):
            pending.extend(st.lookup.pending_io())
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
        compute, every running request's next token included, waits for it (several hits admitted
        together stack up). A slow hit async sends each chunk to the engine as it arrives, so its
        copies overlap the reads. A memory hit alone keeps the synchronous load (no reads to
        overlap, and one engine step less), as does a load shorter than a chunk (the tail after
        vLLM's own prefix-cache hit, the commonest: its copy is far shorter than the engine step
        an async load adds)."""
        if self.groups.count > 1:
            # vLLM takes a failed block only from a model with one KV cache group; with several, a
            # load that fails must be the request's (failed_recving), which an async load is.
            return tokens > 0
        mode = self.config.async_load
        if mode == "auto":
            return self.gpu and tokens >= self.chunk_size and (slow or self._busy())
        return slow and mode == "true"

    def _busy(self) -> bool:
        """Another request is known (queued, running or loading), or a computing step is out."""
        return len(self._reqs) != 1 or self.catalog.engine_busy_now

    def _release_lease(self, st: ReqState) -> None:
        if st.lease:
            self.catalog.finish_load(st.lease)
            st.lease = []
        if st.load in (LoadPhase.LEASED, LoadPhase.SCHEDULED):
            st.to(LoadPhase.NONE)

    # -- observability ---------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters, plus ``pending``: work whose counters are still to come (loads and stores the
        workers have not reported, lookups staging). A reader that waits for ``pending == 0`` in a
        file written after its request sees every count of that request (bench.server.settled_stats)."""
        staging = sum(1 for st in list(self._reqs.values()) if st.lookup.pending_io())
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
