"""``hpkv bench cold``'s own parts: the paired summary of its rounds, and the wait for a server to go
quiet (real processes burning and not burning CPU). The runs against real servers are by hand
(BENCHMARKS.md): they take minutes per pair."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from hpkv.bench.cold import report_rounds
from hpkv.bench.server import Server, group_cpu_seconds


def _args(pairs: int) -> argparse.Namespace:
    return argparse.Namespace(pairs=pairs, prompts=2, tokens=4096)


def test_the_headline_is_the_paired_ratio_not_the_ratio_of_medians_across_pairs() -> None:
    # Pair 0's servers are fast, pair 1's slow; hpkv is 2% slower than vLLM alone in every round.
    rounds = [{"hpkv": 1.02, "none": 1.00, "pair": 0}, {"hpkv": 1.02, "none": 1.00, "pair": 0}]
    rounds += [{"hpkv": 2.04, "none": 2.00, "pair": 1}, {"hpkv": 2.04, "none": 2.00, "pair": 1}]
    rounds += [{"hpkv": 2.04, "none": 2.00, "pair": 1}]
    rep = report_rounds(rounds, _args(2), [], "memory,storage")
    assert rep["median_round_ratio"] == pytest.approx(1.02)
    assert "median of the per-round ratios 1.020x" in rep["text"]
    assert "per server pair (hpkv / none of its medians): 1.020x, 1.020x" in rep["text"]
    assert "5 rounds (2 server pair(s))" in rep["text"] and "stores to memory,storage" in rep["text"]
    assert report_rounds(rounds, _args(2), ["round 3: hpkv stored 0 of 8192 tokens"], "m")["invalid"]


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_quiet_waits_while_the_server_group_burns_cpu_and_not_after() -> None:
    # A "server" that computes for 1.5 s and then sits idle, as vLLM's worker busy-polls then sleeps.
    busy = _child("import time\nt = time.time()\nwhile time.time() - t < 1.5: pass\ntime.sleep(60)")
    try:
        s = Server("m", 1, {}, "/dev/null", proc=busy)
        time.sleep(0.3)
        assert group_cpu_seconds(busy.pid) > 0.1  # it is counted while it burns
        waited = s.quiet()
        assert 0.8 <= waited < 10  # until the busy loop ended, not the 15 s limit
        t0 = time.monotonic()
        assert s.quiet() < 1.0 and time.monotonic() - t0 < 1.0  # idle now: one window
    finally:
        busy.kill()
        busy.wait()


def test_role_is_kv_both_or_kv_consumer() -> None:
    """``--role kv_consumer`` (lookups only) is how the lookup's cost is told from the write-behind's;
    any other role is refused before a server starts."""
    from hpkv.bench.cold import main

    with pytest.raises(SystemExit) as e:
        main(["--role", "kv_producer"])
    assert e.value.code == 2
