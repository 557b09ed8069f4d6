"""``hpkv bench ttft`` end to end on the tiny demo model: every hpkv scenario proven by the counters
(valkey against an embedded server), references measured, the JSON and the chart written; a row the
counters do not back is INVALID; LMCache (from ``make peers``) runs side by side and its rows are proven
by vLLM's counters; a peer that cannot start here is reported with its error instead of being left out."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from hpkv.bench.ttft import main as ttft_main


def run(args: list[str], out: str, capsys: Any) -> tuple[int, dict[str, Any], str]:
    rc = ttft_main([*args, "--pause", "0", "--out", out])
    text = capsys.readouterr().out
    with open(os.path.join(out, "ttft.json")) as f:
        return rc, json.load(f), text


def test_every_scenario_is_proven_and_reported(
    demo_model: str, tmp_path: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every hit row must load (its copy rates are asserted below): a busy machine may measure a
    # load dearer than its compute, so the cost policy, tested on its own in test_tier_policy, is off.
    monkeypatch.setenv("HPKV_COST_AWARE_LOADS", "false")
    rc, res, text = run(
        ["--model", demo_model, "--tokens", "1100", "--prompts", "2", "--prompt-kind", "random",
         "--port", "8471"],
        str(tmp_path / "ttft"), capsys,
    )  # fmt: skip
    assert rc == 0, text
    hp = res["systems"][0]
    rows = {r["scenario"]: r for r in hp["rows"]}
    assert list(rows) == ["prefill", "gpu", "memory", "storage", "storage-cold", "mixed", "valkey"]
    assert all(r["valid"] for r in rows.values()), [r["proof"] for r in rows.values()]
    # What was loaded plus what was left to recompute is what was found (nothing is left with the
    # policy off; the bench's own proof counts both).
    valkey, mixed = rows["valkey"]["deltas"], rows["mixed"]["deltas"]

    def left(d: dict[str, int], per_prompt: int = 4) -> int:
        return d.get("left", 0) + d.get("not_worth", 0) * per_prompt

    # 2 prompts x 4 chunks: an EXISTS each (asked when the request arrives), a GET each loaded.
    assert valkey["keyspace_hits"] == 2 * 4 + (2 * 4 - left(valkey))
    assert valkey["valkey_hits"] + left(valkey) == 2 * 4
    # Half of each prompt came from memory, the rest from storage unless left to the engine.
    assert mixed["storage_hits"] + left(mixed, per_prompt=2) == 2 * 2
    assert rows["storage-cold"]["deltas"]["page_cache_reads"] == 0
    assert rows["memory"]["deltas"]["prefix_cache_hits"] == 0  # vLLM's own cache did not serve it
    assert rows["gpu"]["deltas"]["prefix_cache_hits"] >= 2 * 1024
    # The references were measured on this run's data.
    assert set(hp["refs"]) == {"memory", "storage", "storage-cold", "valkey"}
    assert all(r["gbps"] > 0 for r in hp["refs"].values()), hp["refs"]
    assert len(res["requests"]) == 7 * 2
    # Each hit row carries its loads' own copy rates, one per prompt, from the worker's log line.
    for name in ("memory", "storage", "storage-cold", "mixed", "valkey"):
        assert len(rows[name]["copies"]) == 2 and all(g > 0 for g in rows[name]["copies"]), rows[name]
    assert rows["prefill"]["copies"] == [] and rows["gpu"]["copies"] == []
    assert "copies, each load's own time" in text
    assert os.path.getsize(os.path.join(out_png := str(tmp_path / "ttft" / "ttft.png"))) > 1000, out_png
    assert "INVALID" not in text and "x ref" in text


def test_a_memory_row_the_engine_served_is_invalid(demo_model: str, tmp_path: Any, capsys: Any) -> None:
    """Without /reset_prefix_cache, vLLM's own cache serves the memory row: it must not be reported."""
    rc, res, text = run(
        ["--model", demo_model, "--tokens", "600", "--prompts", "2", "--scenarios", "prefill,gpu,memory",
         "--skip-reset", "--port", "8473"],
        str(tmp_path / "noreset"), capsys,
    )  # fmt: skip
    assert rc == 1, text
    rows = {r["scenario"]: r for r in res["systems"][0]["rows"]}
    assert rows["prefill"]["valid"] and rows["gpu"]["valid"]
    assert not rows["memory"]["valid"]
    assert rows["memory"]["proof"].startswith("INVALID: memory pool hits 0/4 chunks")
    assert rows["memory"]["deltas"]["prefix_cache_hits"] > 0
    assert "INVALID" in text


def test_peers_side_by_side(demo_model: str, tmp_path: Any, capsys: Any) -> None:
    """vLLM alone, vLLM's native offloading (refuses the CPU build: its error is shown) and LMCache
    in its multi-process mode, on the same prompts."""
    from hpkv.bench.peers import lmcache_python

    py, why = lmcache_python()
    assert py is not None, why  # `make test` installs the peers (make peers) first
    rc, res, text = run(
        ["--model", demo_model, "--tokens", "600", "--prompts", "2", "--compare", "none,native,lmcache",
         "--scenarios", "prefill,gpu,memory,storage", "--port", "8472"],
        str(tmp_path / "peers"), capsys,
    )  # fmt: skip
    assert rc == 0, text
    none, native, lmcache = res["systems"]
    assert [r["scenario"] for r in none["rows"]] == ["prefill", "gpu"]
    assert none["skipped"] == [
        ["memory", "no such KV connector tier in a 'none' run"],
        ["storage", "no such KV connector tier in a 'none' run"],
    ]
    assert native["error"] and not native["rows"]
    assert "== native ==" in text and "could not run here" in text
    rows = {r["scenario"]: r for r in lmcache["rows"]}
    assert list(rows) == ["prefill", "gpu", "memory", "storage"], lmcache["error"]
    assert all(r["valid"] for r in rows.values()), [r["proof"] for r in rows.values()]
    # The connector, not vLLM's own cache, supplied the hit rows.
    assert rows["memory"]["deltas"]["external_prefix_cache_hits"] >= 2 * 512
    assert rows["storage"]["deltas"]["prefix_cache_hits"] == 0
    assert "side by side" in text


def test_a_missing_peer_is_reported_not_left_out(
    demo_model: str, tmp_path: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HPKV_PEERS_PYTHON", str(tmp_path / "no-such-python"))
    rc, res, text = run(
        ["--model", demo_model, "--tokens", "600", "--prompts", "1", "--compare", "lmcache",
         "--scenarios", "prefill", "--port", "8474"],
        str(tmp_path / "missing"), capsys,
    )  # fmt: skip
    assert rc == 0, text
    (lm,) = res["systems"]
    assert "no-such-python is not executable" in lm["error"] and not lm["rows"]
    assert "could not run here" in text and "chart: not drawn (no system produced a row)" in text
