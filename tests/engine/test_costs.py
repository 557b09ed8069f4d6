"""Cost-aware loads (engine/costs.py): which prefix of a hit is worth loading, from measured rates."""

from __future__ import annotations

import json
import os

from hpkv.engine.costs import (
    MIN_PREFILL_TOKENS,
    SAMPLE_TTL_S,
    WRITE_PRIOR_READERS,
    LoadCosts,
    Rate,
    RateMemo,
)

CHUNK_TOKENS = 256
CHUNK_BYTES = 14 * 2**20  # a 7B-shaped chunk (Qwen2-7B, bf16)


def costs(prefill: float | None = 40_000.0) -> LoadCosts:
    c = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES)
    if prefill is not None:
        c.computed(8192, 8192 / prefill)
    return c


def test_without_a_prefill_rate_every_hit_loads_whole() -> None:
    c = costs(prefill=None)
    c.read("storage-device", 10 * CHUNK_BYTES, 10.0)  # absurdly slow, but nothing to compare with
    assert c.plan(["storage-device"] * 8).load == 8


def test_a_tier_slower_than_recomputing_is_left_to_the_engine() -> None:
    # 40k tokens/s: a chunk costs 6.4 ms to compute; at 1 GB/s its 14.7 MB take 14.7 ms to read.
    c = costs()
    c.read("storage-device", 32 * CHUNK_BYTES, 32 * CHUNK_BYTES / 1e9)
    plan = c.plan(["storage-device"] * 32)
    assert (plan.load, plan.left) == (0, 32)
    assert "storage-device 1.00 GB/s" in plan.why and "prefill 40.0k tokens/s" in plan.why


def test_a_tier_faster_than_recomputing_loads_whole() -> None:
    c = costs()
    c.read("storage", 32 * CHUNK_BYTES, 32 * CHUNK_BYTES / 15e9)
    assert c.plan(["storage"] * 32).load == 32


def test_memory_is_always_loaded_and_the_slow_rest_is_recomputed() -> None:
    c = costs()
    c.read("valkey", CHUNK_BYTES, CHUNK_BYTES / 0.5e9)
    plan = c.plan(["memory"] * 12 + ["valkey"] * 20)
    assert (plan.load, plan.found, plan.left) == (12, 32, 20)


def test_a_near_tie_is_recomputed() -> None:
    c = costs()
    tie = CHUNK_BYTES / (CHUNK_TOKENS / 40_000.0)  # bytes/s at which loading equals computing
    c.read("storage", CHUNK_BYTES, CHUNK_BYTES / (tie * 1.05))  # 5% faster: inside the margin
    assert c.plan(["storage"] * 4).load == 0
    c2 = costs()
    c2.read("storage", CHUNK_BYTES, CHUNK_BYTES / (tie * 1.5))
    assert c2.plan(["storage"] * 4).load == 4


def test_an_unmeasured_tier_is_tried_unless_its_writes_show_it_far_too_slow() -> None:
    c = costs()
    assert c.plan(["valkey"] * 4).load == 4  # nothing known: read it (and so measure it)
    # One writer at 2 MB/s: even WRITE_PRIOR_READERS readers at that rate lose to the prefill.
    c.wrote("valkey", CHUNK_BYTES, CHUNK_BYTES / 2e6)
    assert c.read_rate("valkey") == 2e6 * WRITE_PRIOR_READERS
    assert c.plan(["valkey"] * 4).load == 0
    # Measured reads replace what the writes suggested.
    c.read("valkey", 4 * CHUNK_BYTES, 4 * CHUNK_BYTES / 10e9)
    assert c.plan(["valkey"] * 4).load == 4


def test_an_unmeasured_tier_gives_a_few_chunks_to_measure_it_and_the_rest_is_computed() -> None:
    c = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES, probe_chunks=4)
    c.computed(8192, 8192 / 40_000.0)
    plan = c.plan(["memory"] * 2 + ["valkey"] * 30)  # memory is always loaded, then 4 to measure
    assert (plan.load, plan.left) == (6, 26)
    assert "valkey not measured yet, 4 chunks read to measure it" in plan.why
    # Reads at 0.8 GB/s (a chunk costs 18 ms against 6.4 ms to compute): the next hit computes it all.
    c.read("valkey", 4 * CHUNK_BYTES, 4 * CHUNK_BYTES / 0.8e9)
    assert c.plan(["valkey"] * 32).load == 0
    # Reads at 10 GB/s: the next hit loads whole.
    c2 = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES, probe_chunks=4)
    c2.computed(8192, 8192 / 40_000.0)
    c2.read("storage", 4 * CHUNK_BYTES, 4 * CHUNK_BYTES / 10e9)
    assert c2.plan(["storage"] * 32).load == 32
    # A hit shorter than the probe loads whole; with cost-aware loads off nothing is held back.
    assert c2.plan(["valkey"] * 3).load == 3
    off = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES, enabled=False, probe_chunks=4)
    off.computed(8192, 8192 / 40_000.0)
    assert off.plan(["valkey"] * 32).load == 32


def test_the_median_rides_out_an_outlier_and_old_samples_are_forgotten() -> None:
    r = Rate(ttl=SAMPLE_TTL_S)
    for _ in range(5):
        r.add(10.0, 1.0, now=100.0)
    r.add(10.0, 100.0, now=100.0)  # one stalled read
    assert r.value(now=100.0) == 10.0
    assert r.value(now=100.0 + SAMPLE_TTL_S + 1) is None


def test_small_steps_do_not_measure_the_prefill() -> None:
    c = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES)
    c.computed(MIN_PREFILL_TOKENS - 1, 0.001)  # a decode step: overhead, not prefill
    assert c.prefill_rate() is None
    c.computed(2048, 0.1)
    assert c.prefill_rate() == 20480.0


def test_cost_aware_loading_off_measures_but_never_cuts() -> None:
    c = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES, enabled=False)
    c.computed(8192, 0.2)
    c.read("storage-device", CHUNK_BYTES, 1.0)
    assert c.plan(["storage-device"] * 4).load == 4
    assert c.snapshot()["storage-device_read_bytes_per_s"] == CHUNK_BYTES


def test_the_estimates_are_kept_per_model_and_device(tmp_path: object) -> None:
    storage, pool = os.path.join(str(tmp_path), "storage"), os.path.join(str(tmp_path), "pool")
    os.makedirs(storage)
    os.makedirs(pool)
    c = costs(prefill=41_000.0)
    c.read("storage-device", CHUNK_BYTES, CHUNK_BYTES / 1.9e9)
    c.wrote("valkey", CHUNK_BYTES, CHUNK_BYTES / 2e6)
    kept = c.export()
    assert kept == {"prefill": 41_000.0, "read:storage-device": 1.9e9, "write:valkey": 2e6}
    RateMemo([storage, pool], "model-a|NVIDIA H200").save(kept, force=True)
    RateMemo([storage, pool], "model-b|cpu").save({"prefill": 900.0}, force=True)
    assert RateMemo([storage, pool], "model-b|cpu").load() == {"prefill": 900.0}
    path = os.path.join(storage, RateMemo.NAME)
    with open(path) as f:
        assert set(json.load(f)) == {"model-a|NVIDIA H200", "model-b|cpu"}
    os.unlink(path)  # the storage directory emptied: the pool's copy still answers
    restarted = costs(prefill=None)
    restarted.seed(RateMemo([storage, pool], "model-a|NVIDIA H200").load())
    assert restarted.prefill_rate() == 41_000.0
    assert restarted.read_rate("storage-device") == 1.9e9
    assert restarted.read_rate("valkey") == 2e6 * WRITE_PRIOR_READERS  # still only the writes' bound
    assert restarted.plan(["storage-device"] * 4).load == 0  # decided before any new measurement
    with open(os.path.join(pool, RateMemo.NAME), "w") as f:
        f.write("{not json")
    assert RateMemo([storage, pool], "model-a|NVIDIA H200").load() == {}  # learned again, no error
    assert RateMemo([None], "x").load() == {}


def test_a_new_estimate_is_kept_at_once_a_moved_one_at_most_every_interval(tmp_path: object) -> None:
    """vLLM may kill the engine at any moment after a SIGTERM: what was learned first is on disk
    already; later moves are written at most every MIN_INTERVAL_S (or when forced, at a stop)."""
    d = str(tmp_path)
    m = RateMemo([d], "k")
    m.save({"prefill": 100.0})
    m.save({"prefill": 100.0, "write:valkey": 5.0})  # a new estimate: kept at once
    assert RateMemo([d], "k").load() == {"prefill": 100.0, "write:valkey": 5.0}
    m.save({"prefill": 200.0, "write:valkey": 5.0})  # moved, but within the interval
    assert RateMemo([d], "k").load()["prefill"] == 100.0
    m.save({"prefill": 200.0, "write:valkey": 5.0}, force=True)
    assert RateMemo([d], "k").load()["prefill"] == 200.0


def test_a_step_has_a_floor_so_a_prompts_last_partial_block_is_not_worth_a_load() -> None:
    """On a GPU a step of 1 token and one of 64 take the same time (the weights are read once
    either way): loading the 63 tokens vLLM's own cache leaves saves nothing, and costs a copy."""
    c = costs(prefill=40_000.0)
    assert c.step_floor() is None and c.worth_loading(63, 1, CHUNK_BYTES)  # not measured: load
    for tokens in (1, 64, 1, 64):
        c.computed(tokens, 0.012)  # 12 ms whatever the count: far above tokens / rate
    assert c.step_floor() == 0.012
    assert c.step_seconds(64) == c.step_seconds(1) == 0.012
    assert c.step_seconds(8192) == 8192 / 40_000.0
    assert not c.worth_loading(63, 1, CHUNK_BYTES)  # saves nothing
    assert c.worth_loading(8191, 1, 32 * CHUNK_BYTES)  # a whole prompt: saves 200 ms
    assert c.snapshot()["step_floor_ms"] == 12.0


def test_where_small_steps_scale_with_their_tokens_there_is_no_floor() -> None:
    """A CPU engine computes 64 tokens in 64 times a token's time: such steps set no floor, and
    the tail of a prompt is loaded when its copy is cheaper than its compute."""
    c = costs(prefill=2_000.0)
    for tokens in (64, 32, 64):
        c.computed(tokens, tokens / 2_000.0)
    assert c.step_floor() is None
    assert c.worth_loading(63, 1, CHUNK_BYTES)


def test_a_loads_own_cost_is_measured_and_weighed() -> None:
    c = costs(prefill=2_000.0)
    assert c.copy_cost(CHUNK_BYTES) is None
    c.copied(32 * CHUNK_BYTES, 32 * CHUNK_BYTES / 50e9 + 0.001)  # 1 ms fixed, then 50 GB/s
    c.copied(CHUNK_BYTES, CHUNK_BYTES / 50e9 + 0.001)
    rate, fixed = c.export()["copy"], c.export()["copy_fixed"]
    assert 45e9 < rate <= 50e9 and 0.0005 < fixed < 0.0015
    assert c.worth_loading(63, 1, CHUNK_BYTES)  # 31 ms of compute against ~1.3 ms of copy
    assert not c.worth_loading(2, 1, CHUNK_BYTES)  # 1 ms of compute against ~1.3 ms of copy
    restarted = costs(prefill=None)
    restarted.seed(c.export())
    cost = restarted.copy_cost(CHUNK_BYTES)
    assert cost is not None and abs(cost - c.copy_cost(CHUNK_BYTES)) < 1e-6  # type: ignore[operator]


def test_cost_aware_loading_off_loads_every_tail() -> None:
    c = LoadCosts(CHUNK_TOKENS, CHUNK_BYTES, enabled=False)
    c.computed(8192, 0.2)
    c.computed(1, 0.012)
    assert c.worth_loading(63, 1, CHUNK_BYTES)
