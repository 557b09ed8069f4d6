"""The vLLM scheduler side of the connector, step by step, without a server.

A real ``HpkvScheduler`` (real pool files, a real storage directory, a real valkey server where one is
named) and real vLLM ``Request`` objects; the scheduler outputs are synthetic (what vLLM's scheduler
would hand over: the fields the connector reads), and the workers' part (filling pool slots, reporting
per rank) is done here the way the workers do it. The only stand-in is a gate that holds a storage read
(a real disk cannot be made slow on demand). Each test asserts exact counters and pins.

The first tests run "ask again" (a hit is answered once every chunk is in memory: the default on the
CPU build, and on a GPU for a request alone); the ``async`` ones at the end run vLLM's async load
(``async_load=True``, and the default on a GPU while other requests are in the engine).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

from hpkv import HpkvConfig
from hpkv.core import record
from hpkv.core.keys import Namespace
from hpkv.engine.interface import MEMORY
from hpkv.integrations.vllm.meta import HpkvMeta, HpkvWorkerMeta
from hpkv.integrations.vllm.scheduler import HpkvScheduler
from hpkv.tiers.base import STORAGE
from hpkv.tiers.memory.pool import slot_bytes
from tests.conftest import SMALL, random_tokens

BLOCK = 16
CHUNK = 32  # two blocks per chunk


class Sim:
    """vLLM's scheduler as the connector sees it, and the workers' side of each op."""

    def __init__(self, sched: HpkvScheduler) -> None:
        self.s = sched
        self.cat = sched.catalog
        self.next_block = 0
        self.blocks: dict[str, list[int]] = {}

    def request(self, rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=4), None)

    def arrive(self, req: Request) -> Request:
        """vLLM queues ``req`` and it waits there until its probe (what the lookup asks on an I/O
        thread: the remote tiers, where each read below memory comes from) is in."""
        self.s.on_new_request(req)
        ahead = self.s._reqs[req.request_id].lookup.ahead
        if ahead is not None:
            ahead.answer.result(5)
        return req

    def lookup(self, req: Request, computed: int = 0) -> int | None:
        n, asynchronous = self.s.get_num_new_matched_tokens(req, computed)
        assert asynchronous is False
        return n

    def lookup_settled(self, req: Request, timeout: float = 10.0) -> int:
        """Ask as vLLM does, step after step, until the answer is not "later" (idle steps between)."""
        deadline = time.monotonic() + timeout
        while True:
            n = self.lookup(req)
            if n is not None:
                return n
            assert time.monotonic() < deadline, "the lookup never settled"
            self.s.build_connector_meta(self.step_output())

    def admit(self, req: Request, external: int) -> list[int]:
        need = -(-len(req.prompt_token_ids or []) // BLOCK)
        ids = list(range(self.next_block, self.next_block + need))
        self.next_block += need
        self.blocks[req.request_id] = ids
        # vLLM hands over every block of the request (KVCacheBlocks.get_block_ids(), one group).
        self.s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), external)
        return ids

    def step_output(self, new: list[tuple[Request, int, int]] | None = None) -> Any:
        """A scheduler output scheduling ``(request, computed, scheduled)`` as new requests."""
        news = [
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=(self.blocks[r.request_id],),
                num_computed_tokens=computed,
            )
            for r, computed, _ in new or []
        ]
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
        sched = {r.request_id: n for r, _, n in new or []}
        return SimpleNamespace(
            scheduled_new_reqs=news,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()),
        )

    def step(self, new: list[tuple[Request, int, int]] | None = None) -> HpkvMeta:
        return self.s.build_connector_meta(self.step_output(new))

    def fill(self, meta: HpkvMeta) -> None:
        """The workers' part of each store: the chunk's record sealed into its slot, on every rank."""
        for st in meta.stores:
            for r in range(self.cat.world_size):
                off = st.slot * self.cat.slot_bytes
                view = self.cat.pools[r].view[off : off + self.cat.record_bytes]
                view[record.HEADER_BYTES :] = bytes([r + 1]) * self.cat.payload_bytes
                rd = self.cat.rank_digests[r]
                record.seal(view, rd, self.cat.record_key(r, st.lk), self.cat.payload_bytes)

    def report(self, results: dict[int, tuple[int, int]], computed: bool = True) -> None:
        """The workers' report of a step (``computed``: a step with tokens to compute)."""
        self.s.update_connector_output(
            SimpleNamespace(kv_connector_worker_meta=HpkvWorkerMeta(results=results, computed=computed))
        )

    def ops(self, meta: HpkvMeta) -> list[int]:
        return [x.op_id for x in meta.stores] + [x.op_id for x in meta.loads]

    def cold(self, rid: str, tokens: list[int]) -> int:
        """A cold request that stores its full chunks (every rank confirms). Returns chunks stored."""
        req = self.request(rid, tokens)
        assert self.lookup_settled(req) == 0
        self.admit(req, 0)
        meta = self.step([(req, 0, len(tokens))])
        self.fill(meta)
        self.report({op: (self.cat.world_size, 0) for op in self.ops(meta)})
        self.s.request_finished(req)
        self.cat.flush()  # the cascade to storage done: its pins released
        return len(meta.stores)

    def hit_and_load(self, rid: str, tokens: list[int], chunks: int) -> tuple[Request, Any]:
        """Store ``tokens`` cold, then a second request: its lookup hits ``chunks`` chunks and the
        next step sends their load to the workers (not yet reported)."""
        assert self.cold(f"{rid}-cold", tokens) == chunks
        req = self.request(rid, tokens)
        assert self.lookup_settled(req) == chunks * CHUNK
        self.admit(req, chunks * CHUNK)
        [load] = self.step([(req, chunks * CHUNK, 1)]).loads
        return req, load

    def running(self, rid: str = "running") -> Request:
        """Another request in the engine (looked up, admitted, computing): a lookup then never waits
        (see HpkvScheduler._wait_alone)."""
        req = self.request(rid, random_tokens(CHUNK // 2, seed=hash(rid) % 1000))
        assert self.lookup(req) == 0
        self.admit(req, 0)
        return req

    def pinned(self) -> int:
        return int(self.cat.stats()[MEMORY]["pinned_slots"])

    def counters(self) -> dict[str, int]:
        return dict(self.s.stats()["connector"])


@pytest.fixture
def make_sim(shm_dir: str, storage_dir: str) -> Iterator[Any]:
    made: list[HpkvScheduler] = []

    def factory(world_size: int = 1, gpu: bool = False, **cfg: Any) -> Sim:
        cfg.setdefault("mem_pool_size", "8M")
        cfg.setdefault("share_mem_file_path", shm_dir)
        cfg.setdefault("storage_path", storage_dir)
        cfg.setdefault("chunk_size", CHUNK)
        cfg.setdefault("memory_pool", "engine")  # each scheduler starts with an empty pool
        ns = Namespace("steps", SMALL, CHUNK, 0, world_size)
        s = HpkvScheduler(HpkvConfig(**cfg), ns, BLOCK, load=True, store=True, gpu=gpu)
        made.append(s)
        return Sim(s)

    yield factory
    for s in made:
        s.shutdown()


def with_slots(make_sim: Any, slots: int, **cfg: Any) -> Sim:
    """A scheduler whose pool holds exactly ``slots`` chunks."""
    per = slot_bytes(record.record_bytes(SMALL.chunk_bytes(CHUNK)))
    return make_sim(mem_pool_size=str(slots * per), **cfg)  # type: ignore[no-any-return]


def prompt(chunks: int, seed: int) -> list[int]:
    return random_tokens(chunks * CHUNK + 1, seed)  # the engine computes the last token itself


class Gate:
    """Holds every storage read of rank 0 until released (and says when one is held)."""

    def __init__(self, sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reading, self.release = threading.Event(), threading.Event()
        tier = sim.cat.tier(STORAGE)[0]
        real = tier.fetch_many

        def held(keys: list[bytes], bufs: list[memoryview], threads: int = 1) -> Any:
            self.reading.set()
            self.release.wait(20)
            return real(keys, bufs, threads)

        monkeypatch.setattr(tier, "fetch_many", held)


def test_a_lookup_never_waits_for_a_slow_tier(make_sim: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sim = make_sim()
    tokens = prompt(4, seed=1)
    assert sim.cold("a", tokens) == 4
    sim.cat.flush()
    sim.s.reset_cache()  # memory emptied; the chunks stay in storage
    gate = Gate(sim, monkeypatch)
    sim.running()  # another request whose steps a wait here would delay
    req = sim.arrive(sim.request("b", tokens))
    answers: list[int | None] = []
    t = threading.Thread(target=lambda: answers.append(sim.lookup(req)))
    t.start()
    t.join(5)
    assert not t.is_alive(), "get_num_new_matched_tokens waited for a storage read"
    assert answers == [None]  # ask again: the promotions are under way
    # Their reads start when vLLM's scheduling pass ends (build_connector_meta), not inside the pass,
    # whose other lookups the reading threads would slow down (the GIL).
    assert not gate.reading.wait(0.2)
    sim.step()
    assert gate.reading.wait(5)
    assert sim.lookup(req) is None  # still held: still "later", still no wait
    gate.release.set()
    assert sim.lookup_settled(req) == 4 * CHUNK
    assert sim.cat.stats()[MEMORY]["promotions"] == 4
    assert sim.pinned() == 4  # the lease of the hit
    sim.s.request_finished(req)
    assert sim.pinned() == 0
    assert sim.counters()["lookup_hit_tokens"] == 4 * CHUNK


def test_an_empty_step_waits_for_staging_only_with_no_computing_step_out(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's async scheduling schedules the next step before the last one's output is back: an
    empty step then must not sit waiting for another request's promotions, since the output of the
    computing step still out is processed on the same thread after it."""
    from hpkv.integrations.vllm import scheduler as mod

    sim = make_sim()
    tokens = prompt(4, seed=11)
    assert sim.cold("a", tokens) == 4
    sim.s.reset_cache()  # memory emptied; the chunks stay in storage
    running = sim.request("c", prompt(2, seed=12))
    assert sim.lookup_settled(running) == 0
    sim.admit(running, 0)
    gate = Gate(sim, monkeypatch)
    req = sim.arrive(sim.request("b", tokens))
    assert sim.lookup(req) is None  # staging, held at its first read
    sim.cat.start_deferred()  # as the scheduling pass's end does (build_connector_meta)
    assert gate.reading.wait(5)
    waits: list[int] = []
    real = mod.wait

    def recorded(fs: Any, **kw: Any) -> Any:
        waits.append(len(fs))
        return real(fs, **kw)

    monkeypatch.setattr(mod, "wait", recorded)
    assert not sim.cat.engine_busy_now
    computing = sim.step([(running, 0, len(running.prompt_token_ids or []))])
    assert sim.cat.engine_busy_now
    sim.step()  # empty, scheduled while the computing step is out
    assert waits == []
    sim.report({op: (1, 0) for op in sim.ops(computing)})  # the computing step's output
    sim.report({}, computed=False)  # the empty step's
    assert not sim.cat.engine_busy_now
    sim.step()  # empty with nothing out: waits (at most IDLE_WAIT_S) for b's promotions
    assert waits == [4]
    # An empty step whose output never reaches the connector (vLLM drops an empty step's output
    # that no worker said anything in) must not leave the next computing step counted as out
    # once that one is answered: the empty steps of the next staging would not wait, but spin.
    computing = sim.step([(running, len(running.prompt_token_ids or []) - 1, 1)])
    sim.report({op: (1, 0) for op in sim.ops(computing)})
    assert not sim.cat.engine_busy_now
    sim.step()
    assert waits == [4, 4]
    gate.release.set()
    assert sim.lookup_settled(req) == 4 * CHUNK
    sim.s.request_finished(req)
    sim.s.request_finished(running)


def test_promotions_never_evict_the_requests_own_chunks(make_sim: Any) -> None:
    # A pool of exactly 6 slots, full: the request's first 2 chunks and 4 chunks of others.
    sim = with_slots(make_sim, 6, storage_io_threads=1)
    assert sim.cat.num_slots == 6
    tokens = prompt(6, seed=2)
    assert sim.cold("a", tokens) == 6
    sim.cat.flush()
    sim.s.reset_cache()
    head = sim.cat.keys(tokens)[:2]
    for lk in head:
        assert sim.cat.stage([lk])[0].result(10)
    assert sim.cold("other", prompt(4, seed=3)) == 4
    assert sim.cat.stats()[MEMORY]["chunks"] == 6
    req = sim.request("b", tokens)
    assert sim.lookup_settled(req) == 6 * CHUNK  # 2 resident + 4 promoted, evicting only the others
    assert all(sim.cat.in_memory(lk) for lk in sim.cat.keys(tokens))
    assert sim.pinned() == 6
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_a_pool_too_small_for_the_prompt_gives_a_shorter_hit(make_sim: Any) -> None:
    sim = with_slots(make_sim, 5, storage_io_threads=1)
    tokens = prompt(6, seed=4)
    assert sim.cold("a", tokens) == 5  # the sixth chunk found every slot pinned by the first five
    sim.cat.flush()
    sim.s.reset_cache()
    before = sim.cat.stats()[MEMORY]
    req = sim.request("b", tokens)
    assert sim.lookup_settled(req) == 5 * CHUNK  # five promoted (FIFO, one thread), then no slot
    after = sim.cat.stats()[MEMORY]
    assert after["promotions"] - before["promotions"] == 5
    assert after["evictions"] - before["evictions"] == 0  # nothing of its own thrown out
    assert sim.pinned() == 5
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_a_hit_waits_for_room_that_other_requests_hold_instead_of_coming_out_short(make_sim: Any) -> None:
    # Under load the pool's slots are held for a while by requests admitted but not yet loaded (and
    # by the write-behind): a hit whose promotions found no slot would come out short and its rest
    # be recomputed by an engine that is busy already. It waits for the room instead.
    sim = with_slots(make_sim, 8, storage_io_threads=1)
    mine = prompt(4, seed=21)
    assert sim.cold("a", mine) == 4
    sim.s.reset_cache()  # memory emptied; storage keeps the four chunks
    other = prompt(6, seed=22)
    assert sim.cold("o", other) == 6
    holder = sim.request("h", other)
    assert sim.lookup_settled(holder) == 6 * CHUNK  # its lease pins 6 of the 8 slots
    assert sim.pinned() == 6
    before = sim.cat.stats()[MEMORY]
    req = sim.request("b", mine)
    for _ in range(3):
        assert sim.lookup(req) is None  # 4 chunks to promote, room for 2: asked again, nothing started
        sim.step()
    after = sim.cat.stats()[MEMORY]
    assert after["promotions"] == before["promotions"]
    assert after["writes_skipped"] == before["writes_skipped"] == 0
    assert sim.counters()["lookups_waited_for_room"] == 1
    sim.s.request_finished(holder)  # the other request leaves: its lease is released
    assert sim.pinned() == 0
    assert sim.lookup_settled(req) == 4 * CHUNK  # the whole hit
    assert sim.cat.stats()[MEMORY]["promotions"] - before["promotions"] == 4
    assert sim.pinned() == 4
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_a_hit_waits_for_room_only_so_long_then_comes_out_short(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("hpkv.engine.lookups.ROOM_WAIT_S", 0.3)
    sim = with_slots(make_sim, 8, storage_io_threads=1)
    mine = prompt(4, seed=23)
    assert sim.cold("a", mine) == 4
    sim.s.reset_cache()
    other = prompt(6, seed=24)
    assert sim.cold("o", other) == 6
    holder = sim.request("h", other)
    assert sim.lookup_settled(holder) == 6 * CHUNK  # holds 6 of the 8 slots and never leaves
    req = sim.arrive(sim.request("b", mine))
    assert sim.lookup(req) is None
    time.sleep(0.35)
    assert sim.lookup_settled(req) == 2 * CHUNK  # promoted as far as the room went
    assert sim.counters()["lookups_waited_for_room"] == 1
    for r in (holder, req):
        sim.s.request_finished(r)
    assert sim.pinned() == 0


def test_ranks_reporting_out_of_order_and_one_rank_failing(make_sim: Any) -> None:
    sim = make_sim(world_size=2)
    tokens = prompt(2, seed=5)
    req = sim.request("a", tokens)
    assert sim.lookup_settled(req) == 0
    sim.admit(req, 0)
    meta = sim.step([(req, 0, len(tokens))])
    assert len(meta.stores) == 2
    sim.fill(meta)
    a, b = (x.op_id for x in meta.stores)
    sim.report({b: (1, 0)})  # rank 1 first, for the second chunk only
    assert not any(sim.cat.in_memory(x.lk) for x in meta.stores)  # one rank is not enough
    sim.report({a: (1, 0)})
    sim.report({a: (1, 0), b: (1, 0)})  # rank 0, later
    assert all(sim.cat.in_memory(x.lk) for x in meta.stores)
    assert sim.counters()["stored_tokens"] == 2 * CHUNK
    sim.s.request_finished(req)
    sim.cat.flush()

    req2 = sim.request("b", tokens)
    assert sim.lookup_settled(req2) == 2 * CHUNK
    sim.admit(req2, 2 * CHUNK)
    meta = sim.step([(req2, 2 * CHUNK, 1)])
    [load] = meta.loads
    assert sim.pinned() == 2
    sim.report({load.op_id: (1, 0)})
    assert sim.pinned() == 2  # rank 0 still copying
    sim.report({load.op_id: (0, 1)})  # rank 1 failed (a record failed its check there)
    assert sim.pinned() == 0
    c = sim.counters()
    assert c["load_failures"] == 1 and c["loaded_tokens"] == 0
    assert sim.cat.stats()[MEMORY]["hits"] == 0
    sim.s.request_finished(req2)


def test_a_reset_during_staging_leaves_nothing_visible(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = make_sim(storage_io_threads=1)
    tokens = prompt(3, seed=6)
    assert sim.cold("a", tokens) == 3
    sim.cat.flush()
    sim.s.reset_cache()
    gate = Gate(sim, monkeypatch)
    req = sim.request("b", tokens)
    assert sim.lookup(req) is None
    assert gate.reading.wait(5)
    sim.s.reset_cache()  # POST /reset_prefix_cache?reset_external=true while the chunk is read
    gate.release.set()
    assert sim.lookup_settled(req) == 0
    # The chunk read across the reset never became visible (the two behind it, read after the
    # reset on the one I/O thread, did: they are valid, but no hit can start past a gap).
    assert not sim.cat.in_memory(sim.cat.keys(tokens)[0])
    assert sim.pinned() == 0
    sim.s.request_finished(req)
    sim.cat.check()


def test_a_request_aborted_mid_load_releases_its_slots_once(make_sim: Any) -> None:
    sim = make_sim()
    tokens = prompt(3, seed=7)
    req, load = sim.hit_and_load("b", tokens, 3)
    sim.s.request_finished(req)  # aborted while the workers copy
    assert sim.pinned() == 3  # the copy in flight still reads the slots
    sim.report({load.op_id: (1, 0)})
    assert sim.pinned() == 0
    assert sim.counters()["loaded_tokens"] == 3 * CHUNK

    # Aborted after its lookup, before it was scheduled: the lease goes with it.
    req = sim.request("c", tokens)
    assert sim.lookup_settled(req) == 3 * CHUNK
    assert sim.pinned() == 3
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_a_preempted_request_looks_up_again_without_leaking_pins(make_sim: Any) -> None:
    sim = make_sim()
    tokens = prompt(2, seed=8)
    req, load = sim.hit_and_load("b", tokens, 2)
    # Preempted before the workers reported; vLLM asks again when it resumes the request.
    assert sim.lookup(req) == 2 * CHUNK
    assert sim.pinned() == 2  # slots pinned: the op's and the new lease's pins are on the same two
    sim.report({load.op_id: (1, 0)})
    assert sim.pinned() == 2  # the lease's pins remain
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_a_leased_chunk_is_not_evicted_before_its_load(
    make_sim: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = with_slots(make_sim, 4, storage_path=None)
    tokens = prompt(2, seed=9)
    assert sim.cold("a", tokens) == 2
    req = sim.request("b", tokens)
    assert sim.lookup_settled(req) == 2 * CHUNK
    lks = sim.cat.keys(tokens)
    # Other requests store 4 chunks meanwhile: only the 2 free slots may be taken.
    with caplog.at_level("WARNING", logger="hpkv"):
        assert sim.cold("other", prompt(4, seed=10)) == 2
    assert all(sim.cat.in_memory(lk) for lk in lks)
    # The two chunks that found no slot are counted and said once, with the setting that helps.
    assert sim.counters()["stores_skipped_pool_full"] == 2
    said = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    assert len(said) == 1 and "4 of 4 slots" in said[0], said
    assert f"a larger {sim.s.config.where('mem_pool_size')} (now" in said[0]
    sim.admit(req, 2 * CHUNK)
    meta = sim.step([(req, 2 * CHUNK, 1)])
    [load] = meta.loads
    assert [c.lk for c in load.chunks] == lks
    sim.report({load.op_id: (1, 0)})
    assert sim.pinned() == 0
    assert sim.counters()["loaded_tokens"] == 2 * CHUNK


def test_a_miss_on_valkey_is_one_existence_check_and_reserves_nothing(
    make_sim: Any, valkey_server: Any
) -> None:
    sim = make_sim(
        storage_path=None, remote_url=valkey_server.url, request_timeout=2.0, connection_timeout=2.0
    )
    misses0, hits0 = valkey_server.keyspace_misses(), valkey_server.keyspace_hits()
    req = sim.request("a", prompt(8, seed=11))
    before = sim.cat.stats()[MEMORY]
    assert sim.lookup_settled(req) == 0
    after = sim.cat.stats()[MEMORY]
    assert after["promotions"] == before["promotions"] == 0
    assert after["evictions"] == before["evictions"] and after["writes_skipped"] == before["writes_skipped"]
    assert not sim.cat._promoter.pending()  # no promotion was even started for a prompt no tier holds
    assert valkey_server.keyspace_misses() - misses0 == 8  # one EXISTS per chunk, in one batch
    assert valkey_server.keyspace_hits() == hits0
    sim.s.request_finished(req)


def spy_probes(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of chunks of each existence check the scheduler sends to the remote tiers (the
    real check runs; only its calls are counted)."""
    sent: list[int] = []
    real = sim.cat.probe

    def counted(gaps: list[bytes], held: Any, tenant: str = "shared", *, remote: bool = True) -> Any:
        if remote:
            sent.append(len(gaps))
        return real(gaps, held, tenant, remote=remote)

    monkeypatch.setattr(sim.cat, "probe", counted)
    return sent


def test_a_request_that_waited_in_the_queue_is_answered_at_its_first_lookup(
    make_sim: Any, valkey_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM hands each new request to the connector as it queues it: the existence check in valkey
    starts then, so the first lookup of a request that waited finds the answer in, a miss and a hit
    alike (no step spent asking again), and no second check is sent."""
    sim = make_sim(
        storage_path=None,
        remote_url=valkey_server.url,
        async_load=True,
        request_timeout=2.0,
        connection_timeout=2.0,
    )
    held = prompt(4, seed=31)
    assert sim.cold("held", held) == 4
    sim.s.reset_cache()  # valkey alone holds them now
    sent = spy_probes(sim, monkeypatch)
    miss, hit = sim.request("miss", prompt(8, seed=32)), sim.request("hit", held)
    for req in (miss, hit):
        sim.s.on_new_request(req)
    assert sent == [8, 4]  # every chunk the local tiers lack, asked at arrival
    for req in (miss, hit):  # while the requests wait in vLLM's queue
        sim.s._reqs[req.request_id].lookup.ahead.answer.result(5)
    misses0 = valkey_server.keyspace_misses()
    assert sim.s.get_num_new_matched_tokens(miss, 0) == (0, False)
    assert sim.s.get_num_new_matched_tokens(hit, 0) == (4 * CHUNK, True)
    assert sent == [8, 4] and valkey_server.keyspace_misses() == misses0
    assert sim.counters()["remote_checks_at_arrival"] == 2
    for req in (miss, hit):
        sim.s.request_finished(req)


def test_an_arrival_answer_that_is_old_or_misses_a_chunk_is_asked_again(
    make_sim: Any, valkey_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another engine may store the chunks after the arrival's check, and a chunk may leave the
    local tiers meanwhile: an answer older than AHEAD_FRESH_S, or one that did not cover a
    chunk the lookup now lacks, is not used; the lookup asks again."""
    from hpkv.engine import lookup as arrival

    sim = make_sim(
        storage_path=None, remote_url=valkey_server.url, request_timeout=2.0, connection_timeout=2.0
    )
    sent = spy_probes(sim, monkeypatch)
    monkeypatch.setattr(arrival, "AHEAD_FRESH_S", 0.0)
    sim.running()  # so the lookups answer "ask again" rather than wait (see the test after this one)
    old = sim.request("old", prompt(2, seed=33))
    sim.s.on_new_request(old)
    sim.s._reqs["old"].lookup.ahead.answer.result(5)
    time.sleep(0.01)
    assert sim.lookup(old) is None  # asked again
    assert sim.lookup_settled(old) == 0 and sent == [2, 2]
    assert sim.counters()["remote_checks_at_arrival"] == 0
    sim.s.request_finished(old)

    monkeypatch.setattr(arrival, "AHEAD_FRESH_S", 2.0)
    tokens = prompt(2, seed=34)
    assert sim.cold("stored", tokens) == 2  # in memory, and in valkey once flushed
    del sent[:]
    left = sim.request("left", tokens)
    sim.s.on_new_request(left)
    assert sim.s._reqs["left"].lookup.ahead is None and sent == []  # memory held every chunk
    sim.s.reset_cache()  # they leave memory before the lookup
    assert sim.lookup(left) is None and sent == [2]
    assert sim.lookup_settled(left) == 2 * CHUNK  # found in valkey, promoted
    assert sim.cat.stats()[MEMORY]["promotions"] == 2
    sim.s.request_finished(left)


def test_a_request_alone_in_the_engine_is_answered_without_an_empty_step(
    make_sim: Any, valkey_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing else in the engine, "ask again" would cost an empty step that waits for the same
    I/O: the lookup waits for it itself (at most IDLE_WAIT_S). A cold prompt's existence check and a
    storage hit's promotions are then answered at the first lookup; with another request in the
    engine the same lookups answer "ask again" at once."""
    from hpkv.integrations.vllm import scheduler as mod

    monkeypatch.setattr(mod, "IDLE_WAIT_S", 2.0)  # a loaded CI box's round trip stays inside it
    sim = make_sim(remote_url=valkey_server.url, request_timeout=2.0, connection_timeout=2.0)
    sent = spy_probes(sim, monkeypatch)
    cold = sim.request("cold", prompt(3, seed=41))
    sim.s.on_new_request(cold)
    assert sim.lookup(cold) == 0 and sent == [3]  # one check, at arrival, waited for
    sim.s.request_finished(cold)

    tokens = prompt(4, seed=42)
    assert sim.cold("stored", tokens) == 4
    sim.cat.flush()
    sim.s.reset_cache()  # memory emptied: storage holds them (and valkey)
    hit = sim.request("hit", tokens)
    assert sim.lookup(hit) == 4 * CHUNK  # promoted from storage inside the first lookup
    assert sim.cat.stats()[MEMORY]["promotions"] == 4 and sim.pinned() == 4
    assert sim.counters()["lookups_waited_alone"] >= 1
    sim.s.request_finished(hit)
    assert sim.pinned() == 0

    # A read slower than the bound: the lookup waits IDLE_WAIT_S, then answers "ask again".
    monkeypatch.setattr(mod, "IDLE_WAIT_S", 0.05)
    sim.s.reset_cache()
    gate = Gate(sim, monkeypatch)
    slow = sim.request("slow", tokens)
    t0 = time.monotonic()
    assert sim.lookup(slow) is None
    assert time.monotonic() - t0 >= 0.05 and gate.reading.is_set()
    gate.release.set()
    assert sim.lookup_settled(slow) == 4 * CHUNK
    sim.s.request_finished(slow)

    # Another request in the engine: no wait at all; the answer comes a step later.
    sim.s.reset_cache()
    waited = sim.counters()["lookups_waited_alone"]
    sim.running()
    again = sim.request("again", tokens)
    assert sim.lookup(again) is None
    assert sim.lookup_settled(again) == 4 * CHUNK
    assert sim.counters()["lookups_waited_alone"] == waited
    sim.s.request_finished(again)


# -- vLLM's async load ---------------------------------------------------------------------------


def in_storage_only(sim: Sim, tokens: list[int], chunks: int) -> list[bytes]:
    """Store ``tokens`` cold, then empty memory: every chunk is left in storage alone."""
    assert sim.cold("cold", tokens) == chunks
    sim.cat.flush()
    sim.s.reset_cache()
    return sim.cat.keys(tokens)


def head_in_memory_rest_held(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch, chunks: int, seed: int
) -> tuple[Sim, list[int], list[bytes], Gate]:
    """An async-load scheduler with one I/O thread; a prompt whose first chunk is in memory and the
    rest in storage, every storage read held by the gate until released."""
    sim = make_sim(async_load=True, storage_io_threads=1)
    tokens = prompt(chunks, seed=seed)
    lks = in_storage_only(sim, tokens, chunks)
    assert sim.cat.stage([lks[0]])[0].result(10)
    return sim, tokens, lks, Gate(sim, monkeypatch)


def parts_until_last(sim: Sim, timeout: float = 10.0) -> list[Any]:
    """Idle steps, as vLLM takes while the request waits for its KV, until the load's last part."""
    parts: list[Any] = []
    deadline = time.monotonic() + timeout
    while not parts or not parts[-1].last:
        assert time.monotonic() < deadline, "the async load never sent its last part"
        parts.extend(sim.step().loads)
    return parts


def test_async_a_storage_hit_is_answered_at_once_and_each_chunk_sent_as_it_arrives(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, tokens, lks, gate = head_in_memory_rest_held(make_sim, monkeypatch, 4, seed=21)
    req = sim.request("b", tokens)
    t0 = time.monotonic()
    assert sim.s.get_num_new_matched_tokens(req, 0) == (4 * CHUNK, True)  # no "later", no wait
    assert time.monotonic() - t0 < 1.0
    ids = sim.admit(req, 4 * CHUNK)
    [first] = sim.step().loads  # the chunk in memory goes at once; the others are still read
    assert gate.reading.wait(5)  # started by that step (the end of the lookup's scheduling pass)
    assert first.asynchronous and not first.last
    assert [c.lk for c in first.chunks] == lks[:1] and first.chunks[0].block_ids == ids[:2]
    assert sim.step().loads == []  # nothing new while the reads are held
    gate.release.set()
    rest = parts_until_last(sim)
    assert {p.op_id for p in rest} == {first.op_id}
    sent = [c for p in [first, *rest] for c in p.chunks]
    assert [c.lk for c in sent] == lks
    assert [c.block_ids for c in sent] == [ids[2 * j : 2 * j + 2] for j in range(4)]
    assert all(not p.failed_blocks for p in rest)
    assert sim.pinned() == 4  # every chunk sent is held until the workers have copied it
    assert sim.s.has_pending_ops()
    sim.report({first.op_id: (1, 0)})
    assert sim.pinned() == 0 and not sim.s.has_pending_ops()
    c = sim.counters()
    assert c["loaded_tokens"] == 4 * CHUNK and c["lookup_hit_tokens"] == 4 * CHUNK
    assert sim.cat.stats()[MEMORY]["promotions"] == 4 and sim.cat.stats()[MEMORY]["hits"] == 4
    assert sim.s.request_finished(req) is False  # received: vLLM may free the blocks now
    # Scheduled after its load: it stores nothing it loaded, and a preemption's lookup pins memory.
    sim.cat.check()


def test_async_a_corrupt_chunk_ends_the_load_there_and_its_blocks_are_recomputed(make_sim: Any) -> None:
    from tests.engine.test_promotion import flip_payload_byte

    sim = make_sim(async_load=True, storage_io_threads=1)
    tokens = prompt(4, seed=22)
    lks = in_storage_only(sim, tokens, 4)
    flip_payload_byte(sim.cat.tier(STORAGE)[0].path(sim.cat.record_key(0, lks[2])))
    req = sim.request("b", tokens)
    assert sim.s.get_num_new_matched_tokens(req, 0) == (4 * CHUNK, True)
    ids = sim.admit(req, 4 * CHUNK)
    parts = parts_until_last(sim)
    sent = [c.lk for p in parts for c in p.chunks]
    assert sent == lks[:2]  # chunk 2 failed its check: it and all after it are not loaded
    assert [b for p in parts for b in p.failed_blocks] == ids[4:8]  # vLLM recomputes from block 4
    assert sim.pinned() == 2
    sim.report({parts[0].op_id: (1, 0)})
    assert sim.pinned() == 0
    assert sim.counters()["loaded_tokens"] == 2 * CHUNK
    assert sim.cat.stats()["storage"]["corrupt"] == 1
    sim.s.request_finished(req)
    sim.cat.check()


def test_async_a_request_aborted_mid_load_keeps_its_blocks_until_the_workers_report(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, tokens, _, gate = head_in_memory_rest_held(make_sim, monkeypatch, 3, seed=23)
    req = sim.request("b", tokens)
    assert sim.s.get_num_new_matched_tokens(req, 0) == (3 * CHUNK, True)
    sim.admit(req, 3 * CHUNK)
    [first] = sim.step().loads
    # the chunk sent, and the slots of both promotions (reserved when they were started)
    assert len(first.chunks) == 1 and sim.pinned() == 3
    assert sim.s.request_finished(req) is True  # a copy may still write its blocks: vLLM keeps them
    [last] = sim.step().loads  # the remaining part: nothing more to copy, no blocks to recompute
    assert last.last and last.chunks == [] and last.failed_blocks == []
    gate.release.set()
    for _ in range(50):  # the held reads finish into memory, unpinned and unprotected
        if not sim.cat._promoter.pending():
            break
        time.sleep(0.1)
    assert sim.pinned() == 1  # the copy in flight
    sim.report({first.op_id: (1, 0)})  # the workers report it received: vLLM frees the blocks
    assert sim.pinned() == 0 and not sim.s.has_pending_ops()
    assert sim.cat.memory._protected == {}
    sim.cat.check()


def test_async_asked_again_before_allocation_gives_the_same_answer_and_stages_once(
    make_sim: Any,
) -> None:
    sim = make_sim(async_load=True)
    tokens = prompt(2, seed=24)
    in_storage_only(sim, tokens, 2)
    req = sim.request("b", tokens)
    lookups = sim.counters()["lookups"]
    assert sim.s.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    promotions = sim.cat.stats()[MEMORY]["promotions"]
    # vLLM could not allocate the blocks this step: it asks again at the next one.
    assert sim.s.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    # ... and once more after its own cache came to hold the first chunk: the rest is loaded.
    assert sim.s.get_num_new_matched_tokens(req, CHUNK) == (CHUNK, True)
    sim.admit(req, CHUNK)
    parts = parts_until_last(sim)
    sent = [c for p in parts for c in p.chunks]
    assert [c.lk for c in sent] == sim.cat.keys(tokens)[1:2] and sent[0].first == 0
    assert sim.cat.stats()[MEMORY]["promotions"] - promotions <= 2
    assert sim.counters()["lookups"] - lookups == 1
    assert sim.pinned() == 1  # the first chunk's pin was let go when it turned out not to be needed
    sim.report({parts[0].op_id: (1, 0)})
    assert sim.counters()["loaded_tokens"] == CHUNK
    req2 = sim.request("c", tokens)
    assert sim.s.get_num_new_matched_tokens(req2, 0) == (2 * CHUNK, False)  # both in memory now
    sim.s.request_finished(req2)
    assert sim.pinned() == 0
    sim.s.request_finished(req)


def test_async_chunks_that_arrive_together_go_out_in_one_step(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle step of an async load wakes at the first arrival and takes the chunks that follow it
    shortly in the same part, not one step per chunk (each step holds the GIL the reads need)."""
    from hpkv.integrations.vllm import scheduler as mod

    sim, tokens, lks, gate = head_in_memory_rest_held(make_sim, monkeypatch, 4, seed=25)
    monkeypatch.setattr(mod, "ASYNC_GATHER_S", 10.0)  # three reads in a row, well inside it
    tier = sim.cat.tier(STORAGE)[0]
    gated = tier.fetch_many

    def slow(keys: list[bytes], bufs: list[memoryview], threads: int = 1) -> Any:
        time.sleep(
            0.05 * len(keys)
        )  # each read takes a while: the next arrives after the first one's step began
        return gated(keys, bufs, threads)

    monkeypatch.setattr(tier, "fetch_many", slow)
    req = sim.request("b", tokens)
    assert sim.s.get_num_new_matched_tokens(req, 0) == (4 * CHUNK, True)
    sim.admit(req, 4 * CHUNK)
    [first] = sim.step().loads  # the chunk in memory
    assert gate.reading.wait(5)
    assert [c.lk for c in first.chunks] == lks[:1]
    gate.release.set()
    rest = parts_until_last(sim)
    assert [[c.lk for c in p.chunks] for p in rest] == [lks[1:]]  # one step, all three
    assert rest[0].last
    sim.report({first.op_id: (1, 0)})
    assert sim.counters()["loaded_tokens"] == 4 * CHUNK
    sim.s.request_finished(req)
    assert sim.pinned() == 0


def test_async_auto_on_a_gpu_a_hit_found_while_others_run_loads_without_holding_their_step(
    make_sim: Any,
) -> None:
    """``HPKV_ASYNC_LOAD=auto`` (the default). On a GPU a synchronous load is copied inside the step
    that admits the request and that step's compute waits for it, so a hit found while other
    requests run (a memory hit here) goes asynchronously; alone, or on the CPU build, synchronously."""
    cases = [(True, "auto", True), (False, "auto", False), (True, "false", False)]
    for seed, (gpu, mode, busy_async) in enumerate(cases, start=31):
        sim = make_sim(gpu=gpu, async_load=mode)
        tokens = prompt(2, seed=seed)  # a fresh prompt: the storage directory is shared
        assert sim.cold("cold", tokens) == 2
        alone = sim.request("alone", tokens)
        assert sim.s.get_num_new_matched_tokens(alone, 0) == (2 * CHUNK, False)
        sim.s.request_finished(alone)
        assert sim.pinned() == 0
        sim.running()
        hits = sim.cat.stats()[MEMORY]["hits"]
        hit = sim.request("hit", tokens)
        assert sim.s.get_num_new_matched_tokens(hit, 0) == (2 * CHUNK, busy_async), (gpu, mode)
        ids = sim.admit(hit, 2 * CHUNK)
        if not busy_async:
            [load] = sim.step([(hit, 2 * CHUNK, 1)]).loads
            assert not load.asynchronous and len(load.chunks) == 2
            sim.report({load.op_id: (1, 0)})
        else:
            [part] = sim.step().loads  # both chunks are in memory: one part, the last, at once
            assert part.asynchronous and part.last
            assert [c.block_ids for c in part.chunks] == [ids[0:2], ids[2:4]]
            assert sim.pinned() == 2  # held until the workers have copied them
            sim.report({part.op_id: (1, 0)})
        assert sim.pinned() == 0 and not sim.s.has_pending_ops()
        assert sim.counters()["loaded_tokens"] == 2 * CHUNK
        assert sim.cat.stats()[MEMORY]["hits"] - hits == 2  # counted alike in both modes
        assert sim.counters()["async_loads"] == int(busy_async)
        sim.s.request_finished(hit)
        sim.cat.check()


def test_async_auto_a_load_shorter_than_a_chunk_stays_synchronous(make_sim: Any) -> None:
    """On a GPU under load, "auto" sends a load of less than a chunk synchronously: the tail after
    vLLM's own prefix-cache hit (the commonest hit) copies in a fraction of a millisecond, and as an
    async load it cost the request one or two engine steps (30 ms on the H200: its bench itl control)."""
    sim = make_sim(gpu=True, async_load="auto")
    tokens = prompt(2, seed=41)
    assert sim.cold("cold", tokens) == 2
    sim.running()
    for rid, computed, want in [("tail", 2 * CHUNK - BLOCK, False), ("chunk", CHUNK, True)]:
        req = sim.request(rid, tokens)  # vLLM's own cache holds the first ``computed`` tokens
        assert sim.s.get_num_new_matched_tokens(req, computed) == (2 * CHUNK - computed, want), rid
        sim.admit(req, 2 * CHUNK - computed)
        if want:
            [part] = sim.step().loads
            assert part.asynchronous and part.last and [c.count for c in part.chunks] == [CHUNK]
        else:
            [part] = sim.step([(req, 2 * CHUNK, 1)]).loads
            assert not part.asynchronous and [(c.first, c.count) for c in part.chunks] == [
                (CHUNK - BLOCK, BLOCK)
            ]
        sim.report({part.op_id: (1, 0)})
        sim.s.request_finished(req)
        assert sim.pinned() == 0 and not sim.s.has_pending_ops()
    assert sim.counters()["async_loads"] == 1
    assert sim.counters()["loaded_tokens"] == BLOCK + CHUNK
    sim.cat.check()


def test_the_step_trace_records_each_lookup_step_report_and_finish(make_sim: Any, tmp_path: Any) -> None:
    """``HPKV_STEP_TRACE``: one JSON line per lookup answered, step scheduled, step reported and
    request finished, each stamped with time.monotonic(); what a hit's step carried is in it."""
    sim = make_sim(step_trace=str(tmp_path))
    tokens = prompt(2, seed=51)
    req, load = sim.hit_and_load("hit", tokens, 2)
    sim.report({load.op_id: (1, 0)})
    sim.s.request_finished(req)
    sim.s.shutdown()
    [path] = tmp_path.glob("steps-*")
    assert path.name == f"steps-{os.getpid()}.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["ev"] for e in events] == ["lookup", "step", "done", "finished"] * 2
    ts = [e["t"] for e in events]
    assert ts == sorted(ts) and ts[-1] <= time.monotonic()
    cold_lookup, cold_step = events[0], events[1]
    assert (cold_lookup["id"], cold_lookup["len"], cold_lookup["hit"], cold_lookup["async"]) == (
        "hit-cold",
        len(tokens),
        0,
        False,
    )
    assert cold_step["tokens"] == len(tokens) and cold_step["stores"] == 2 and cold_step["loads"] == []
    hit_lookup, hit_step, report = events[4], events[5], events[6]
    assert (hit_lookup["id"], hit_lookup["hit"]) == ("hit", 2 * CHUNK)
    assert hit_step["reqs"] == {"hit": 1} and hit_step["loads"] == [["hit", 2, False]]
    assert report["computed"] is True


def test_async_auto_on_a_gpu_a_storage_hit_alone_loads_asynchronously(make_sim: Any) -> None:
    """``HPKV_ASYNC_LOAD=auto`` on a GPU: a hit that needs storage goes through the async load even
    with nothing else in the engine (its chunks' copies then overlap the later reads: with CUDA
    graphs 79.3 against 90.3 ms on the H200), while a memory hit alone stays synchronous."""
    sim = make_sim(gpu=True, async_load="auto")
    tokens = prompt(3, seed=61)
    lks = in_storage_only(sim, tokens, 3)
    alone = sim.arrive(sim.request("alone", tokens))
    assert sim.s.get_num_new_matched_tokens(alone, 0) == (3 * CHUNK, True)
    ids = sim.admit(alone, 3 * CHUNK)
    parts = parts_until_last(sim)
    sent = [c for p in parts for c in p.chunks]
    assert [c.lk for c in sent] == lks and [c.block_ids for c in sent] == [
        ids[2 * j : 2 * j + 2] for j in range(3)
    ]
    sim.report({parts[0].op_id: (1, 0)})
    assert sim.pinned() == 0 and not sim.s.has_pending_ops()
    assert sim.counters()["async_loads"] == 1 and sim.counters()["loaded_tokens"] == 3 * CHUNK
    assert sim.counters()["lookups_waited_alone"] == 0  # answered at once: nothing to wait for
    sim.s.request_finished(alone)
    again = sim.request("again", tokens)  # every chunk in memory now: a memory hit alone
    assert sim.s.get_num_new_matched_tokens(again, 0) == (3 * CHUNK, False)
    sim.s.request_finished(again)
    assert sim.pinned() == 0
    sim.cat.check()


def test_the_engines_steps_measure_its_prefill_rate_and_a_restart_keeps_it(
    make_sim: Any, storage_dir: str
) -> None:
    sim = make_sim()
    assert sim.s.costs.prefill_rate() is None
    assert sim.cold("a", prompt(9, seed=30)) == 9  # one step of 289 tokens, reported
    rate = sim.s.costs.prefill_rate()
    assert rate is not None and rate > 0
    with open(os.path.join(storage_dir, ".hpkv-rates.json")) as f:
        assert list(json.load(f).values()) == [{"prefill": float(f"{rate:.6g}")}]
    again = make_sim()  # the same model and device, after a restart
    assert again.s.costs.prefill_rate() == float(f"{rate:.6g}")


def test_a_hit_slower_than_recomputing_is_left_to_the_engine_and_then_kept_in_memory(make_sim: Any) -> None:
    sim = make_sim()
    tokens = prompt(4, seed=31)
    assert sim.cold("a", tokens) == 4
    sim.s.reset_cache()  # memory emptied; the chunks stay in storage
    writes = sim.cat.stats()["storage"]["writes"]
    costs = sim.s.costs
    costs.computed(4096, 0.1)  # the engine computes 41k tokens/s: a chunk in 0.8 ms
    for src in ("storage", "storage-device"):  # storage, wherever it reads from, far slower
        costs.read(src, 4 * costs.chunk_bytes, 10.0)
    req = sim.request("b", tokens)
    assert sim.lookup_settled(req) == 0
    assert sim.counters()["chunks_left_to_recompute"] == 4
    assert sim.counters()["lookups_cut_by_cost"] == 1
    assert sim.cat.stats()[MEMORY]["promotions"] == 0  # nothing read
    sim.admit(req, 0)
    meta = sim.step([(req, 0, len(tokens))])
    # The engine computed what was left to it: its KV goes into memory, though storage holds it.
    assert len(meta.stores) == 4
    sim.fill(meta)
    sim.report({op: (1, 0) for op in sim.ops(meta)})
    sim.s.request_finished(req)
    sim.cat.flush()
    assert sim.cat.stats()["storage"]["writes"] == writes  # not written to storage again
    req = sim.request("c", tokens)
    assert sim.lookup_settled(req) == 4 * CHUNK  # now a memory hit, always worth loading
    assert sim.counters()["chunks_left_to_recompute"] == 4
    sim.s.request_finished(req)


def test_the_scheduler_thread_makes_no_system_call_per_chunk(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's connector contract: what the scheduler thread does must be light and never block. A
    lookup, a storage hit's staging and the stores of a step ask nothing of a chunk file on that
    thread: the storage index answers from memory, and where a read would come from (a look into
    the page cache per file) is asked on an I/O thread."""
    import hpkv.tiers.disk.io as io
    import hpkv.tiers.disk.tier as tier

    sim = make_sim()
    tokens = prompt(4, seed=71)
    in_storage_only(sim, tokens, 4)
    calls: list[str] = []
    main = threading.main_thread()

    def spied(name: str, real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            if threading.current_thread() is main:
                calls.append(name)
            return real(*args, **kw)

        return call

    for mod, name in ((tier.os, "lstat"), (tier.os, "stat"), (io.os, "open"), (tier, "in_page_cache")):
        monkeypatch.setattr(mod, name, spied(name, getattr(mod, name)))
    cold = sim.request("new", prompt(4, seed=72))  # a miss: stores four chunks
    assert sim.lookup_settled(cold) == 0
    sim.admit(cold, 0)
    meta = sim.step([(cold, 0, 4 * CHUNK + 1)])
    sim.fill(meta)
    sim.report({op: (1, 0) for op in sim.ops(meta)})
    hit = sim.arrive(sim.request("hit", tokens))
    assert sim.lookup_settled(hit) == 4 * CHUNK  # from storage
    assert sim.cat.stats()[STORAGE]["hits"] == 4
    assert calls == []
    for r in (cold, hit):
        sim.s.request_finished(r)


def test_a_steps_stores_ask_the_host_pool_a_fixed_number_of_questions(make_sim: Any) -> None:
    """With the host pool every question to the memory tier is a round trip to another process: the
    stores of a request in a step ask twice (which chunks are resident, slots for the rest) and
    their completions once, however many chunks there are."""
    sim = make_sim(memory_pool="shared", storage_path="")
    slots = sim.cat.memory
    asked: list[str] = []
    real = slots._ask

    def counted(message: dict[str, Any]) -> Any:
        asked.append(str(message["op"]))
        return real(message)

    slots._ask = counted  # type: ignore[method-assign]
    for chunks, seed in ((2, 73), (6, 74)):
        req = sim.request(f"r{chunks}", prompt(chunks, seed=seed))
        assert sim.lookup_settled(req) == 0
        sim.admit(req, 0)
        asked.clear()
        meta = sim.step([(req, 0, chunks * CHUNK + 1)])
        sim.fill(meta)
        sim.report({op: (1, 0) for op in sim.ops(meta)})
        assert len(meta.stores) == chunks
        assert asked == ["pin_each", "reserve_many", "commit_many"], asked
        sim.s.request_finished(req)


def test_a_prompts_last_partial_block_is_left_to_the_engine_where_a_step_has_a_floor(
    make_sim: Any,
) -> None:
    """vLLM's own cache holds every block but the last, partial one: hpkv holds the chunk around it,
    but where a step of a few tokens costs what a step of one does (a GPU), loading them saves
    nothing and costs a copy; nothing is asked of any tier and nothing is pinned."""
    sim = make_sim()
    tokens = prompt(4, seed=75)
    assert sim.cold("a", tokens) == 4
    tail = len(tokens) - 1 - (4 * CHUNK - BLOCK)  # what hpkv would load past vLLM's own hit
    req = sim.request("b", tokens)
    assert sim.lookup(req, 4 * CHUNK - BLOCK) == tail  # no floor measured yet: loaded
    sim.s.request_finished(req)
    sim.s.costs.computed(8192, 0.2)
    for n in (1, BLOCK):
        sim.s.costs.computed(n, 0.012)
    hits = sim.cat.stats()[MEMORY]["hits"]
    again = sim.request("c", tokens)
    assert sim.lookup(again, 4 * CHUNK - BLOCK) == 0
    assert sim.counters()["lookups_not_worth_a_load"] == 1
    assert sim.pinned() == 0 and sim.cat.stats()[MEMORY]["hits"] == hits
    sim.s.request_finished(again)
    assert sim.pinned() == 0


def test_with_a_window_a_chunk_is_stored_only_while_its_blocks_are_held_and_hits_load_async(
    shm_dir: str, storage_dir: str
) -> None:
    """Two KV cache groups, full attention and a 16-token window (vLLM's hybrid KV cache manager):
    a chunk whose window blocks vLLM may have freed before the step that completes it is not
    stored (its blocks could hold another request's KV by then), nor one whose window blocks are
    the null block; and every hit loads asynchronously (vLLM takes a failed load of such a model
    only as the request's)."""
    from hpkv.integrations.vllm.kvgroups import NULL_BLOCK, KVGroup, KVGroups

    groups = KVGroups((KVGroup("full", 1), KVGroup("sliding", SMALL.num_layers - 1, window=16)))
    cfg = HpkvConfig(
        mem_pool_size="8M",
        share_mem_file_path=shm_dir,
        storage_path=storage_dir,
        chunk_size=CHUNK,
        memory_pool="engine",
    )
    s = HpkvScheduler(
        cfg, Namespace("steps", SMALL, CHUNK, 0, 1), BLOCK, load=True, store=True, groups=groups
    )
    sim = Sim(s)
    try:
        tokens = prompt(4, seed=71)
        req = sim.arrive(sim.request("w", tokens))
        assert sim.lookup_settled(req) == 0
        full, window = list(range(1, 10)), list(range(20, 29))
        s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (full, window)), 0)
        out = sim.step_output()
        out.scheduled_new_reqs = [
            SimpleNamespace(
                req_id="w", prompt_token_ids=tokens, block_ids=(full, window), num_computed_tokens=0
            )
        ]
        out.num_scheduled_tokens = {"w": 48}  # chunk 0 whole, chunk 1 half
        out.total_num_scheduled_tokens = 48
        first = s.build_connector_meta(out)
        assert [st.block_ids for st in first.stores] == [[1, 2, 20, 21]]  # chunk 0, group after group
        # The next step computes from 48: the window's blocks before token 33 may be freed by now.
        cached = SimpleNamespace(
            req_ids=["w"], new_block_ids=[None], resumed_req_ids=set(), num_computed_tokens=[48]
        )
        out2 = SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={"w": len(tokens) - 48},
            total_num_scheduled_tokens=len(tokens) - 48,
        )
        second = s.build_connector_meta(out2)
        assert [st.block_ids for st in second.stores] == [[5, 6, 24, 25], [7, 8, 26, 27]]  # not chunk 1
        sim.fill(first)
        sim.fill(second)
        sim.report({op: (1, 0) for op in sim.ops(first) + sim.ops(second)})
        s.request_finished(req)

        # A hit of chunk 0 from memory loads asynchronously; the window's null blocks stay in the list.
        again = sim.arrive(sim.request("w2", tokens[: CHUNK + 1]))
        n, asynchronous = s.get_num_new_matched_tokens(again, 0)
        assert (n, asynchronous) == (CHUNK, True)
        s.update_state_after_alloc(
            again, SimpleNamespace(get_block_ids=lambda: ([40, 41, 42], [NULL_BLOCK, 51, 52])), CHUNK
        )
        [load] = s.build_connector_meta(sim.step_output()).loads
        assert load.asynchronous and [c.block_ids for c in load.chunks] == [[40, 41, NULL_BLOCK, 51]]
        # Less than a chunk past the engine's own hit: not worth the step an async load costs.
        tail = sim.arrive(sim.request("w3", tokens[: 2 * CHUNK + 5]))
        assert s.get_num_new_matched_tokens(tail, 2 * CHUNK) == (0, False)
    finally:
        s.shutdown()
