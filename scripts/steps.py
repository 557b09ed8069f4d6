"""Summarize an ``HPKV_STEP_TRACE`` file: where each request's prefill went, step by step.

    python3 scripts/steps.py TRACE.jsonl [--top 5] [--req ID] [--from-s S]

For each request: its first lookup, the step that computed its last prompt token (its first
token is sampled there), how many steps that took and how many of their tokens were its own.
The slowest (first lookup to the end of that step) are listed, then the steps of the slowest
one (or of ``--req``) with what shared them: other requests' tokens, loads, stores, and each
step's time to its workers' report. ``--from-s`` keeps requests first looked up after S seconds
from the trace's start (to skip a warm-up).
"""

from __future__ import annotations

import argparse
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Req:
    rid: str
    length: int = 0
    first_lookup: float = 0.0
    start: int = 0  # tokens vLLM's cache and hpkv gave it (the last answered lookup)
    hit: int = 0
    asynchronous: bool = False
    computed: int = 0
    steps: list[int] = field(default_factory=list)  # indexes into the step list
    prefill_done: int | None = None  # the step that computed its last prompt token


def load(path: str) -> tuple[list[dict[str, Any]], dict[str, Req]]:
    steps: list[dict[str, Any]] = []
    reqs: dict[str, Req] = {}
    out: deque[int] = deque()  # steps scheduled, not yet reported
    with open(path, encoding="utf-8") as f:
        for line in f:
            e = json.loads(line)
            if e["ev"] == "lookup":
                r = reqs.setdefault(e["id"], Req(e["id"], e["len"], e["t"]))
                if e["hit"] is not None:
                    r.start, r.hit, r.asynchronous = e["computed"] + e["hit"], e["hit"], e["async"]
                    r.computed = r.start
            elif e["ev"] == "step":
                e["i"] = len(steps)
                steps.append(e)
                out.append(e["i"])
                for rid, n in e["reqs"].items():
                    r = reqs.get(rid)
                    if r is None:
                        continue
                    r.steps.append(e["i"])
                    before = r.computed
                    r.computed += n
                    if before < r.length <= r.computed and r.prefill_done is None:
                        r.prefill_done = e["i"]
            elif e["ev"] == "done" and out:
                steps[out.popleft()]["done"] = e["t"]
    return steps, reqs


def step_line(s: dict[str, Any], rid: str, t0: float) -> str:
    mine = s["reqs"].get(rid, 0)
    others = {k: v for k, v in s["reqs"].items() if k != rid}
    took = f"{(s['done'] - s['t']) * 1e3:6.1f}" if "done" in s else "     ?"
    loads = ", ".join(f"{lid[-6:]}:{n}{'a' if a else 's'}" for lid, n, a in s["loads"])
    return (
        f"  {(s['t'] - t0) * 1e3:8.1f} ms  step {s['i']:5d}  {took} ms  tokens {s['tokens']:5d}"
        f"  its {mine:5d}  others {sum(others.values()):5d} in {len(others):2d}"
        f"  stores {s['stores']:2d}  loads [{loads}]"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--req", default=None)
    ap.add_argument("--from-s", type=float, default=0.0)
    a = ap.parse_args()
    steps, reqs = load(a.trace)
    if not steps:
        raise SystemExit(f"{a.trace}: no steps")
    t0 = steps[0]["t"]
    done = [
        r
        for r in reqs.values()
        if r.prefill_done is not None and r.first_lookup - t0 >= a.from_s and "done" in steps[r.prefill_done]
    ]

    def took(r: Req) -> float:
        return float(steps[r.prefill_done]["done"]) - r.first_lookup  # type: ignore[index]

    done.sort(key=took, reverse=True)
    print(f"{len(steps)} steps, {len(reqs)} requests, {len(done)} with their prefill in the trace")
    print("slowest, first lookup to the end of the step that computed its last prompt token:")
    for r in done[: a.top]:
        own = sum(steps[i]["reqs"][r.rid] for i in r.steps if steps[i]["i"] <= (r.prefill_done or 0))
        print(
            f"  {r.rid}: {took(r) * 1e3:.1f} ms from {(r.first_lookup - t0) * 1e3:.1f} ms; "
            f"{r.length} tokens, "
            f"{r.start} from caches ({r.hit} hpkv{', async' if r.asynchronous else ''}), "
            f"{own} computed in {sum(1 for i in r.steps if i <= (r.prefill_done or 0))} steps"
        )
    pick = reqs.get(a.req) if a.req else (done[0] if done else None)
    if pick is None:
        return
    last = pick.prefill_done if pick.prefill_done is not None else steps[-1]["i"]
    first = min(pick.steps) if pick.steps else last
    print(f"steps of {pick.rid} (ms from the trace's start):")
    for s in steps[first : last + 1]:
        print(step_line(s, pick.rid, t0))


if __name__ == "__main__":
    main()
