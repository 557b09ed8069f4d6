"""``hpkv bench l2`` end to end on embedded servers: the verdict follows the servers' keyspace_hits."""

from __future__ import annotations

import json
import os
from typing import Any

from hpkv.bench.l2 import main as l2_main


def test_l2_confirmed_on_a_cluster(demo_model: str, tmp_path: Any, capsys: Any) -> None:
    out = str(tmp_path / "l2")
    rc = l2_main(
        ["run", "--model", demo_model, "--tokens", "1536", "--cluster", "3", "--out", out, "--port", "8461"]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "L2 RETRIEVAL CONFIRMED" in text
    with open(os.path.join(out, "l2.json")) as f:
        res = json.load(f)
    assert res["keyspace_hits_delta"] == res["expected"] == 12  # 6 chunks, 1 EXISTS + 1 GET each
    assert "hpkv counters: valkey hits 6" in text


def test_l2_not_detected_when_memory_keeps_the_prompt(demo_model: str, tmp_path: Any, capsys: Any) -> None:
    out = str(tmp_path / "l2")
    rc = l2_main(
        [
            "run",
            "--model",
            demo_model,
            "--tokens",
            "1536",
            "--pool-size",
            "256M",
            "--out",
            out,
            "--port",
            "8462",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1
    assert "L2 RETRIEVAL NOT DETECTED" in text and "keyspace_hits delta: 0" in text
    assert "HPKV_KV_MEM_POOL_SIZE too large" in text
