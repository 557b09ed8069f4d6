"""Paced write-behind: it prefers the engine's idle time, for at most CASCADE_PACE_S per chunk.

A real catalog (pool file, storage directory); the engine's steps are announced as the vLLM
scheduler announces them (``step_scheduled`` and ``step_done``)."""

from __future__ import annotations

import time

from hpkv import HpkvConfig
from hpkv.core.keys import Namespace
from hpkv.engine.cascade import CASCADE_PACE_S
from hpkv.engine.catalog import Catalog
from tests.conftest import CHUNK, SMALL
from tests.engine.test_catalog_reset import store


def make(shm_dir: str, storage_dir: str, queue: int = 8, pool: str = "4M") -> Catalog:
    cfg = HpkvConfig(
        mem_pool_size=pool,
        share_mem_file_path=shm_dir,
        storage_path=storage_dir,
        chunk_size=CHUNK,
        cascade_queue_chunks=queue,
    )
    return Catalog(cfg, Namespace("defer", SMALL, CHUNK), defer_cascade=True)


def test_writes_wait_while_the_engine_computes(shm_dir: str, storage_dir: str) -> None:
    cat = make(shm_dir, storage_dir)
    try:
        cat.step_scheduled(True)
        lk = cat.keys(list(range(CHUNK)))[0]
        assert cat.finish_store(lk, store(cat, lk), True)
        time.sleep(0.3)
        assert not cat.in_storage(lk)  # held back: a step is running
        cat.step_done()
        deadline = time.monotonic() + 5
        while not cat.in_storage(lk) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cat.in_storage(lk)  # written once the engine went idle
        cat.flush()  # the writer unpins the slot just after the file lands: wait for that step
        assert cat.stats()["memory"]["pinned_slots"] == 0
    finally:
        cat.close()


def test_a_busy_engine_still_gets_each_chunk_written_within_the_pace_bound(
    shm_dir: str, storage_dir: str
) -> None:
    """An engine that never idles (prompts back to back): no chunk waits for idle time that never
    comes; each is written about CASCADE_PACE_S after it was queued, by the cascade's own clock."""
    cat = make(shm_dir, storage_dir, queue=64)
    try:
        cat.step_scheduled(True)  # and never done
        lks = [cat.keys(list(range(i, i + CHUNK)))[0] for i in range(4)]
        for lk in lks:
            assert cat.finish_store(lk, store(cat, lk), True)
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while cat.write_behind()["written"] < len(lks) and time.monotonic() < deadline:
            time.sleep(0.02)
        wb = cat.write_behind()
        assert wb["written"] == len(lks) and all(cat.in_storage(lk) for lk in lks)
        assert CASCADE_PACE_S * 1e3 <= wb["delay_max_ms"] <= CASCADE_PACE_S * 1e3 + 500, wb
        assert cat.stats()["storage"]["writes"] == len(lks)
        assert cat.costs.read_rate("storage") is None  # writes time the tier, reads are what count
    finally:
        cat.close()


def test_close_writes_what_is_queued_within_its_limit(shm_dir: str, storage_dir: str) -> None:
    """vLLM's SIGTERM: the engine stops; what the write-behind holds is written at once."""
    cat = make(shm_dir, storage_dir, queue=64)
    cat.step_scheduled(True)
    lks = [cat.keys(list(range(i, i + CHUNK)))[0] for i in range(6)]
    for lk in lks:
        assert cat.finish_store(lk, store(cat, lk), True)
    t0 = time.monotonic()
    cat.close(limit=4.0)
    assert time.monotonic() - t0 < CASCADE_PACE_S  # no pacing once stopping
    reopened = make(shm_dir, storage_dir)
    try:
        assert all(reopened.in_storage(lk) for lk in lks)
    finally:
        reopened.close()


def test_a_half_full_queue_or_a_flush_writes_anyway(shm_dir: str, storage_dir: str) -> None:
    cat = make(shm_dir, storage_dir, queue=4)
    try:
        cat.step_scheduled(True)  # and it stays busy: sustained load
        lks = [cat.keys(list(range(i, i + CHUNK)))[0] for i in range(3)]
        for lk in lks:
            assert cat.finish_store(lk, store(cat, lk), True)
        time.sleep(0.3)
        assert sum(cat.in_storage(lk) for lk in lks) >= 1  # the backlog reached half the queue
        cat.flush()  # a flush (clear, close, a reset) never waits for idle time
        assert all(cat.in_storage(lk) for lk in lks)
    finally:
        cat.close()


def test_writes_that_pin_half_the_pool_go_out_under_sustained_load(shm_dir: str, storage_dir: str) -> None:
    """A pool of few slots and a long queue: queued writes pinning the pool must not wait for idle
    time, or every later chunk finds no slot and reaches no tier (seen under `hpkv bench serve`)."""
    cat = make(shm_dir, storage_dir, queue=256, pool="64K")
    try:
        assert 4 <= cat.num_slots < 64, cat.num_slots
        cat.step_scheduled(True)  # the engine never idles
        lks = [cat.keys(list(range(i, i + CHUNK)))[0] for i in range(3 * cat.num_slots)]
        stored = 0
        for lk in lks:
            slot = cat.memory.reserve()
            deadline = time.monotonic() + 0.5  # well below CASCADE_PACE_S
            while slot is None and time.monotonic() < deadline:  # the cascade frees slots meanwhile
                time.sleep(0.01)
                slot = cat.memory.reserve()
            if slot is not None:
                cat.memory.abort(slot)
                stored += cat.finish_store(lk, store(cat, lk), True)
        assert stored == len(lks)  # every chunk found a slot ...
        cat.flush()
        assert all(cat.in_storage(lk) for lk in lks)  # ... and reached storage, while still busy
        assert cat.stats()["storage"]["writes_skipped"] == 0
        cat.check()
    finally:
        cat.close()


def test_with_async_scheduling_an_answered_step_does_not_make_the_engine_idle(
    shm_dir: str, storage_dir: str
) -> None:
    """vLLM's async scheduling (its default) schedules step 2 before step 1's output is back, and
    after step 2 a step with nothing to compute: step 1's output must not release the writes
    while step 2 computes (on vLLM-CPU they took the cores from its prefill)."""
    cat = make(shm_dir, storage_dir)
    try:
        lk = cat.keys(list(range(CHUNK)))[0]
        cat.step_scheduled(True)  # step 1: the prompt's first 2048 tokens
        cat.step_scheduled(True)  # step 2, scheduled while step 1 runs
        assert cat.finish_store(lk, store(cat, lk), True)
        cat.step_done()  # step 1 answered; step 2 still computes
        cat.step_scheduled(False)  # nothing more to schedule until step 2's token
        time.sleep(0.3)
        assert not cat.in_storage(lk)  # held back
        cat.step_done()  # step 2 answered
        cat.step_done()  # the empty step too
        deadline = time.monotonic() + 5
        while not cat.in_storage(lk) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cat.in_storage(lk)  # written once nothing computes
    finally:
        cat.close()


def test_steps_never_answered_are_forgotten_past_the_batch_queue(shm_dir: str, storage_dir: str) -> None:
    """An output that never comes (a path of vLLM's without a connector output) must not hold
    write-behind back for good: past STEPS_IN_FLIGHT_MAX scheduled steps the oldest are dropped."""
    from hpkv.engine.cascade import STEPS_IN_FLIGHT_MAX

    cat = make(shm_dir, storage_dir)
    try:
        lk = cat.keys(list(range(CHUNK)))[0]
        cat.step_scheduled(True)  # never answered
        assert cat.finish_store(lk, store(cat, lk), True)
        for _ in range(STEPS_IN_FLIGHT_MAX):
            cat.step_scheduled(False)  # idle steps, answered below
        for _ in range(STEPS_IN_FLIGHT_MAX - 1):
            cat.step_done()
        deadline = time.monotonic() + 5
        while not cat.in_storage(lk) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cat.in_storage(lk)
    finally:
        cat.close()


def test_an_empty_step_is_never_taken_for_a_computing_one(shm_dir: str, storage_dir: str) -> None:
    """Answers say which kind of step they end (the workers report it every step); one that never
    comes (vLLM hands on an empty step's output only when a worker said something) must not make
    a later computing step's answer end the empty one and leave the engine busy for good."""
    cat = make(shm_dir, storage_dir)
    try:
        cat.step_scheduled(False)  # empty, its output never handed on
        cat.step_scheduled(True)
        assert cat.engine_busy_now
        cat.step_done(True)
        assert not cat.engine_busy_now  # the empty step still counted, but nothing computes
        cat.step_scheduled(True)
        cat.step_scheduled(False)
        cat.step_done(False)  # the empty step's answer came first: the computing one is still out
        assert cat.engine_busy_now
        cat.step_done(True)
        assert not cat.engine_busy_now
        cat.step_done(True)  # an answer with no step of its kind out changes nothing
        assert not cat.engine_busy_now
    finally:
        cat.close()
