"""hpkv bench serve's own parts: the multi-turn workload, the summary of vLLM's client result, the
token sources. (The e2e run against a real server is tests/e2e/test_bench_serve.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hpkv.bench.serve_report import charts
from hpkv.bench.serve_stats import percentile, sources, summarize
from hpkv.bench.workload import sessions, warmups


def test_turns_are_round_robin_and_reuse_each_users_context() -> None:
    turns = sessions(users=3, context=50, turns=2, question=4, seed=1, vocab=(256, 1000))
    assert [(t.user, t.turn) for t in turns] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    by = {(t.user, t.turn): t.prompt for t in turns}
    for u in range(3):
        assert by[(u, 0)][:50] == by[(u, 1)][:50]  # the same context ...
        assert by[(u, 0)][50:] != by[(u, 1)][50:]  # ... a new question
        assert len(by[(u, 1)]) == 54
    assert by[(0, 0)][:50] != by[(1, 0)][:50]
    assert all(256 <= x < 1000 for t in turns for x in t.prompt)
    assert sessions(3, 50, 2, 4, 1, (256, 1000)) == turns  # a seed repeats the run


def test_the_warm_up_has_a_long_prompt_that_shares_no_chunk_with_the_users() -> None:
    """Each fresh server's first long prompt costs every system more (first kernel shapes, first
    page faults): the warm-up sends one as long as a context, which no user's prompt starts like."""
    turns = sessions(users=4, context=600, turns=2, question=4, seed=3, vocab=(256, 1000))
    warm = warmups(context=600, seed=3, vocab=(256, 1000))
    assert [len(w) for w in warm] == [64, 64, 600]
    assert all(256 <= t < 1000 for t in warm[2])
    assert all(t.prompt[:256] != warm[2][:256] for t in turns)  # not even the first chunk
    assert warmups(600, 3, (256, 1000)) == warm and warmups(600, 4, (256, 1000)) != warm


def test_percentiles_interpolate_like_numpy() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert math.isclose(percentile(xs, 90), 4.6)
    assert percentile([2.0], 99) == 2.0


def test_charts_say_so_when_no_run_finished(tmp_path: Path) -> None:
    # Seen on the H200: every server failed to start, and the chart step then raised IndexError,
    # hiding the table's reasons behind a traceback.
    runs = [{"level": {"concurrency": 4}, "system": s, "error": "could not start"} for s in ("hpkv", "none")]
    assert charts(runs, str(tmp_path)).startswith("none: no run finished")
    assert not (tmp_path / "serve.png").exists()


def test_summary_leaves_failed_requests_out() -> None:
    result = {
        "completed": 2,
        "failed": 1,
        "duration": 2.0,
        "request_throughput": 1.0,
        "output_throughput": 8.0,
        "ttfts": [0.1, 0.3, 9.0],
        "itls": [[0.01, 0.02], [0.03], []],
        "latencies": [0.2, 0.4, 9.0],
        "errors": [None, "", "timeout"],
    }
    m = summarize(result)
    assert m["ttft_p50_ms"] == 200.0 and m["ttft_p99_ms"] < 300.0
    assert m["itl_p50_ms"] == 20.0
    assert m["e2e_p99_ms"] < 400.0


def test_summary_gives_the_cold_first_turns_apart_from_the_revisits() -> None:
    result = {
        "completed": 5,
        "failed": 1,
        "duration": 5.0,
        "request_throughput": 1.0,
        "output_throughput": 8.0,
        "ttfts": [1.0, 1.4, 9.0, 0.1, 0.05, 0.2],  # two users' first turns, then their revisits
        "itls": [[0.01]] * 6,
        "latencies": [1.0] * 6,
        "errors": [None, None, None, None, "", "timeout"],
    }
    result["ttfts"][2], result["errors"][2] = 1.2, None
    m = summarize(result, first_turns=3)
    assert m["ttft_first_p50_ms"] == pytest.approx(1200.0) and m["ttft_first_max_ms"] == pytest.approx(1400.0)
    # the failed revisit is left out: the later turns are 0.1 and 0.05 s
    assert m["ttft_later_p50_ms"] == pytest.approx(75.0) and m["ttft_later_p99_ms"] < 100.0
    assert m["ttft_p99_ms"] > 1300.0  # the run's p99 is a cold prompt's


def test_sources_split_the_prompt_tokens() -> None:
    engine = {"prefix_cache_hits": 1000, "external_prefix_cache_hits": 3000}
    hp = {"memory_hits": 10, "memory_promotions": 4, "storage_hits": 3, "valkey_hits": 1}
    s = sources(10_000, engine, hp, 256)
    assert s["engine_cache"] == 1000 and s["connector"] == 3000 and s["recomputed"] == 6000
    assert (s["hpkv_memory"], s["hpkv_storage"], s["hpkv_valkey"]) == (6 * 256, 3 * 256, 1 * 256)
    assert "hpkv_memory" not in sources(10_000, engine, None, 256)
    two = sources(10_000, engine, {**hp, "storage_hits": 6, "valkey_hits": 2}, 256, ranks=2)
    assert (two["hpkv_storage"], two["hpkv_valkey"]) == (3 * 256, 1 * 256)  # each rank counts its shard
