"""The serve bench's text check: each request's greedy text against vLLM alone's for the same request,
and, for any that differ, which of hpkv's tiers served that request (from the server's log).

The check only means something where vLLM alone gives the same text for a request however it was
batched: on the CPU build (float32 here) it does, and the bench shows it by running vLLM alone twice
(``--repeat 2``) and comparing the two runs the same way. In bf16 on a GPU it does not quite; there
the bench keeps each token's log-probabilities (``--logprobs``) and tells a text that parts only
after a tie from a wrong one (:mod:`hpkv.bench.logprobs`).
"""

from __future__ import annotations

import re
from typing import Any

from hpkv.bench.logprobs import check, power

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


def compare_texts(runs: list[dict[str, Any]], tolerance: float = 0.1) -> None:
    """Per run: how many texts equal vLLM alone's for the same requests at the same level
    (``texts_equal_to_none``), and each request that differs (``wrong``: index, user, turn, what
    hpkv served it from). vLLM alone's second run is compared with its first: its own consistency.

    Where both runs kept log-probabilities (``steps``), a text that differs only after a tie is right
    (:func:`hpkv.bench.logprobs.check`; listed in ``ties``), ``texts_right`` counts the right ones,
    ``logprob_diff`` is the largest difference seen before any text parted, and ``check_power`` is
    how many requests the same check passes against another prompt's (:func:`_neighbours`)."""
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
        steps = r.get("steps") if r.get("steps") and ref.get("steps") else None
        wrong, ties, largest = [], [], 0.0
        served = r.get("served_by", {})
        turns = r.get("turns", [(None, None)] * len(r["texts"]))
        for i, (a, b) in enumerate(zip(r["texts"], ref["texts"], strict=True)):
            if i in r.get("failed_indices", []) or i in ref.get("failed_indices", []):
                continue
            why = ""
            if steps is not None:
                right, _, diff, why = check(steps[i], ref["steps"][i], tolerance)
                largest = max(largest, diff)
                if a == b and right:
                    continue
            elif a == b:
                continue
            user, turn = turns[i]
            where = served.get(i) or served.get(str(i)) or "nothing from hpkv (recomputed)"
            entry = {"request": i, "user": user, "turn": turn, "served": where} | (
                {"why": why} if why else {}
            )
            if steps is not None and a != b and right:
                ties.append(entry)
            else:
                wrong.append(entry)
        r["texts_equal_to_none"] = [len(r["texts"]) - len(wrong) - len(ties), len(ref["texts"])]
        r["wrong"] = wrong
        if steps is not None:
            r["ties"] = ties
            r["texts_right"] = [len(r["texts"]) - len(wrong), len(ref["texts"])]
            r["logprob_diff"] = largest
            others = _neighbours(turns)
            r["check_power"] = [power(steps, ref["steps"], others, tolerance), len(others)]


def _neighbours(turns: list[Any]) -> list[int]:
    """For each request, a request with another prompt that shares the most with it: the same
    user's next turn (the same context, another question), else the next user's request."""
    at = {(u, t): i for i, (u, t) in enumerate(turns)}
    users = sorted({u for u, _ in turns})
    rounds = sorted({t for _, t in turns})
    out = []
    for i, (u, t) in enumerate(turns):
        same_user = at.get((u, rounds[(rounds.index(t) + 1) % len(rounds)]), i)
        next_user = at.get((users[(users.index(u) + 1) % len(users)], t), i)
        out.append(same_user if same_user != i else next_user)
    return out


def print_wrong(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        if "texts_right" in r:
            name = r["system"] + (f" (fault {r['fault']})" if r.get("fault") else "")
            right, n = r["texts_right"]
            passed, tried = r["check_power"]
            print(
                f"{name}: {right}/{n} texts right ({r['texts_equal_to_none'][0]} equal to vLLM alone's, "
                f"{len(r['ties'])} parting only after a tie); log-probabilities agreed within "
                f"{r['logprob_diff']:.3g} up to where any text parted; the same check against another prompt "
                f"(the same user's next turn: its context, another question) passes {passed} of {tried}"
            )
        for w in r.get("wrong", [])[:20]:
            print(
                f"text differs from vLLM alone's: {r['system']}"
                f"{' (fault ' + r['fault'] + ')' if r.get('fault') else ''}, request {w['request']} "
                f"(user {w['user']}, turn {w['turn']}), served by {w['served']}"
                + (f": {w['why']}" if w.get("why") else "")
            )
