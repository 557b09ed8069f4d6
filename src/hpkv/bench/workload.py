"""``hpkv bench serve``'s workload: multi-turn sessions whose contexts come back after eviction
(see :mod:`hpkv.bench.serve`), and the warm-up prompts sent before a load is timed."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    prompt: list[int]


def sessions(
    users: int, context: int, turns: int, question: int, seed: int, vocab: tuple[int, int]
) -> list[Turn]:
    """Turn-major, round-robin: every user's turn t before anyone's turn t+1. Token ids drawn from
    ``vocab`` [lo, hi) with ``seed``, so every system and run gets the same prompts."""
    rng = random.Random(seed)
    lo, hi = vocab
    ctx = [[rng.randrange(lo, hi) for _ in range(context)] for _ in range(users)]
    out = []
    for t in range(turns):
        for u in range(users):
            out.append(Turn(u, t, ctx[u] + [rng.randrange(lo, hi) for _ in range(question)]))
    return out


def warmups(context: int, seed: int, vocab: tuple[int, int]) -> list[list[int]]:
    """Two short prompts and one of ``context`` tokens, none sharing a chunk with any user's prompts
    (their own random stream): sent to each fresh server before the load, not counted."""
    rng = random.Random(f"warm-up {seed}")
    lo, hi = vocab
    return [[7] * 64, [8] * 64, [rng.randrange(lo, hi) for _ in range(context)]]
