"""The serve bench's text check: each request's greedy text against vLLM alone's for the same request,
and, for any that differ, which of hpkv's tiers served that request (from the server's log).

The check only means something where vLLM alone gives the same text for a request however it was
batched: on the CPU build (float32 here) it does, and the bench shows it by running vLLM alone twice
(``--repeat 2``) and comparing the two runs the same way.
"""

from __future__ import annotations

import re
from typing import Any

# The worker's per-load line ends with the request id (integrations/vllm/worker.py, _log_load);
# the bench's ids carry the request's index (faults.request_tag).
_SERVED = re.compile(r"hpkv: Retrieved (\d+) out of .*?GB/s \(([^)]*)\).*; request \S*?hpkvb-(\d+)-u")
_LEFT = re.compile(r"hpkv: request \S*?hpkvb-(\d+)-u\S*: loading (\d+) of (\d+) chunks found")


def served_by(log_text: str) -> dict[int, str]:
    """Request index -> what hpkv loaded for it, e.g. ``"512 tokens (memory: 2 chunks)"``."""
    out: dict[int, list[str]] = {}
    for m in _SERVED.finditer(log_text):
        tokens, tiers, idx = m.group(1), m.group(2), int(m.group(3))
        out.setdefault(idx, []).append(f"{tokens} tokens ({tiers.split(';')[0]})")
    for m in _LEFT.finditer(log_text):
        out.setdefault(int(m.group(1)), []).append(f"{m.group(2)} of {m.group(3)} chunks loaded")
    return {k: "; ".join(v) for k, v in out.items()}


def read_from(path: str, offset: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def reference_for(runs: list[dict[str, Any]], r: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM alone's run at ``r``'s level (the same repeat if there is one, else the first)."""
    alone = [x for x in runs if x["system"] == "none" and x["level"] == r["level"] and "texts" in x]
    same = [x for x in alone if x.get("repeat") == r.get("repeat") and x is not r]
    rest = same or [x for x in alone if x is not r]
    return rest[0] if rest else None


def compare_texts(runs: list[dict[str, Any]]) -> None:
    """Per run: how many texts equal vLLM alone's for the same requests at the same level
    (``texts_equal_to_none``), and each request that differs (``wrong``: index, user, turn, what
    hpkv served it from). vLLM alone's second run is compared with its first: its own consistency."""
    for r in runs:
        if "texts" not in r:
            continue
        if r["system"] == "none":
            first = [x for x in runs if x["system"] == "none" and x["level"] == r["level"] and "texts" in x]
            ref = first[0] if first and first[0] is not r else None
        else:
            ref = reference_for(runs, r)
        if ref is None:
            continue
        wrong = []
        served = r.get("served_by", {})
        for i, (a, b) in enumerate(zip(r["texts"], ref["texts"], strict=True)):
            if a != b and i not in r.get("failed_indices", []):
                user, turn = r.get("turns", [(None, None)] * len(r["texts"]))[i]
                where = served.get(i) or served.get(str(i)) or "nothing from hpkv (recomputed)"
                wrong.append({"request": i, "user": user, "turn": turn, "served": where})
        r["texts_equal_to_none"] = [len(r["texts"]) - len(wrong), len(ref["texts"])]
        r["wrong"] = wrong


def print_wrong(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for w in r.get("wrong", [])[:20]:
            print(
                f"text differs from vLLM alone's: {r['system']}"
                f"{' (fault ' + r['fault'] + ')' if r.get('fault') else ''}, request {w['request']} "
                f"(user {w['user']}, turn {w['turn']}), served by {w['served']}"
            )
