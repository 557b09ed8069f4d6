"""The serve bench's fault gate and text check, on their own: when a fault is put in place relative to
the requests of each turn, and how a request that differs from vLLM alone's is named."""

from __future__ import annotations

import asyncio
import os
import types
from typing import Any

from hpkv.bench.faults import Gate, by_turn, chunk_files, flip_byte, request_tag
from hpkv.bench.texts import compare_texts, served_by


class Steps:
    """A fault that records when it began and ended among the requests' starts and ends."""

    def __init__(self, at_turn: int, drains: bool = False) -> None:
        self.at_turn, self.until_turn, self.drains = at_turn, at_turn + 1, drains
        self.log: list[str] = []

    def begin(self) -> None:
        self.log.append("begin")

    def end(self) -> None:
        self.log.append("end")


def _run_gate(fault: Steps, turns: list[int], concurrency: int) -> list[str]:
    tags = [request_tag(i, 0, t) for i, t in enumerate(turns)]

    async def inner(request_func_input: Any, session: Any = None, pbar: Any = None) -> None:
        fault.log.append(f"start {request_func_input.request_id}")
        await asyncio.sleep(0.01 * (1 + int(request_func_input.request_id.split("-")[1]) % 3))
        fault.log.append(f"done {request_func_input.request_id}")

    async def main() -> None:
        gate = Gate(inner, fault, dict(zip(tags, turns, strict=True)))
        sem = asyncio.Semaphore(concurrency)

        async def one(tag: str) -> None:
            async with sem:
                await gate(types.SimpleNamespace(request_id=tag))

        await asyncio.gather(*(one(t) for t in tags))
        await gate.aclose()

    asyncio.run(main())
    return fault.log


def test_the_fault_is_in_place_from_the_first_request_of_its_turn_until_the_next_turn() -> None:
    turns = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    log = _run_gate(Steps(at_turn=1), turns, concurrency=2)
    begin, end = log.index("begin"), log.index("end")
    starts = {e.split()[1]: i for i, e in enumerate(log) if e.startswith("start")}
    for tag, i in starts.items():
        turn = int(tag.rsplit("-t", 1)[1])
        assert (i > begin) == (turn >= 1), (tag, log)
        assert (i > end) == (turn >= 2), (tag, log)
    assert log.count("begin") == 1 and log.count("end") == 1


def test_a_restart_fault_waits_for_the_earlier_turns_to_finish() -> None:
    turns = [0, 0, 0, 0, 1, 1, 1, 1]
    log = _run_gate(Steps(at_turn=1, drains=True), turns, concurrency=3)
    begin = log.index("begin")
    done_turn0 = [i for i, e in enumerate(log) if e.startswith("done") and e.endswith("-t0")]
    assert max(done_turn0) < begin, log


def test_by_turn_splits_a_run_into_its_turns() -> None:
    requests = [types.SimpleNamespace(turn=t) for t in (0, 0, 1, 1)]
    result = {
        "ttfts": [0.1, 0.3, 0.02, 0.04],
        "itls": [[0.01], [0.01], [0.01], [0.01]],
        "errors": ["", "", "", "boom"],
        "start_times": [0.0, 0.0, 1.0, 1.0],
    }
    rows = by_turn(result, requests)
    assert [r["failed"] for r in rows] == [0, 1]
    assert rows[0]["ttft_p50_ms"] == 200.0
    assert rows[1]["ttft_p50_ms"] == 20.0
    assert abs(rows[0]["requests_per_s"] - 2 / 0.31) < 1e-9


def test_a_differing_text_names_its_request_and_the_tiers_that_served_it() -> None:
    line = (
        "(EngineCore pid=7) INFO 12-05 12:26:12 [hpkv] hpkv: Retrieved 512 out of 512 required tokens "
        "(from 600 total tokens). size: 0.0010 gb, cost 1.0 ms, throughput: 1.0000 GB/s (storage: 2 "
        f"chunks; async, 1 parts); request cmpl-{request_tag(1, 3, 2)}-0-b7070aa6\n"
    )
    served = served_by("noise\n" + line)
    assert served == {1: "512 tokens (storage: 2 chunks)"}
    level = {"concurrency": 2.0}
    runs = [
        {"system": "none", "level": level, "repeat": 0, "texts": ["a", "b", "c"]},
        {
            "system": "hpkv",
            "level": level,
            "repeat": 0,
            "texts": ["a", "x", ""],
            "failed_indices": [2],  # a failed request is counted as failed, not as a wrong text
            "turns": [(0, 0), (3, 2), (1, 0)],
            "served_by": served,
        },
        {"system": "none", "level": level, "repeat": 1, "texts": ["a", "b", "c"]},
    ]
    compare_texts(runs)
    assert runs[1]["texts_equal_to_none"] == [2, 3]
    assert runs[1]["wrong"] == [
        {"request": 1, "user": 3, "turn": 2, "served": "512 tokens (storage: 2 chunks)"}
    ]
    assert runs[2]["texts_equal_to_none"] == [3, 3]  # vLLM alone against its first run


def test_corrupting_flips_one_byte_of_each_chunk_file(tmp_path: Any) -> None:
    d = tmp_path / "ns" / "ab"
    d.mkdir(parents=True)
    for name in ("c1", "c2", "x.tmp"):
        (d / name).write_bytes(bytes(range(64)))
    files = sorted(os.path.basename(p) for p in chunk_files(str(tmp_path)))
    assert files == ["c1", "c2"]
    flip_byte(str(d / "c1"))
    got = (d / "c1").read_bytes()
    assert [i for i in range(64) if got[i] != i] == [32]
