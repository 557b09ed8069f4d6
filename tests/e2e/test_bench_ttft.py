"""``hpkv bench ttft`` end to end on the tiny demo model: every hpkv scenario proven by the counters
(valkey against an embedded server), the JSON and the chart written; a peer that cannot start here is
reported with its error instead of being left out."""

from __future__ import annotations

import json
import os
from typing import Any

from hpkv.bench.ttft import main as ttft_main


def test_every_scenario_is_proven_and_reported(demo_model: str, tmp_path: Any, capsys: Any) -> None:
    out = str(tmp_path / "ttft")
    rc = ttft_main(
        ["--model", demo_model, "--tokens", "1100", "--prompts", "2", "--prompt-kind", "random",
         "--port", "8471", "--pause", "0", "--out", out]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    with open(os.path.join(out, "ttft.json")) as f:
        res = json.load(f)
    rows = {r["scenario"]: r for r in res["systems"][0]["rows"]}
    assert list(rows) == ["prefill", "gpu", "memory", "storage", "mixed", "valkey"]
    assert all(r["valid"] for r in rows.values()), [r["proof"] for r in rows.values()]
    assert rows["valkey"]["deltas"]["keyspace_hits"] == 2 * 4  # 2 prompts x 4 full chunks, one GET each
    assert rows["mixed"]["deltas"]["storage_hits"] == 2 * 2  # half of each prompt came from memory
    assert len(res["requests"]) == 6 * 2
    assert os.path.getsize(os.path.join(out, "ttft.png")) > 1000
    assert "INVALID" not in text


def test_a_peer_that_cannot_start_is_reported_with_its_error(
    demo_model: str, tmp_path: Any, capsys: Any
) -> None:
    out = str(tmp_path / "peer")
    rc = ttft_main(
        ["--model", demo_model, "--tokens", "600", "--prompts", "1", "--compare", "none,native,lmcache",
         "--scenarios", "prefill,gpu,memory", "--port", "8472", "--pause", "0", "--out", out]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0, text
    with open(os.path.join(out, "ttft.json")) as f:
        res = json.load(f)
    none, native, lmcache = res["systems"]
    assert [r["scenario"] for r in none["rows"]] == ["prefill", "gpu"]
    assert none["skipped"] == [["memory", "hpkv's tiers are not in a 'none' run"]]
    assert native["error"] and not native["rows"]
    assert "== native ==" in text and "could not run here" in text
    assert lmcache["error"] == "LMCache is not installed in this environment" and not lmcache["rows"]
