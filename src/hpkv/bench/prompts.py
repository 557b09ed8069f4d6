"""The TTFT benches' prompts (vLLM's and SGLang's alike), and the order systems take turns in.

With the demo model's tokenizer every vocabulary word and every capital letter is one token, so a
prompt of ``tokens`` words is exactly ``tokens`` tokens long.
"""

from __future__ import annotations

import os
import random
import string
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def letter_prompts(n: int, tokens: int) -> list[str]:
    """The seed's prompts: ``tokens`` copies of one capital letter, a different letter each."""
    return [" ".join([chr(ord("A") + i % 26)] * tokens) for i in range(n)]


def random_prompts(model: str, n: int, tokens: int, seed: int = 1000) -> list[str]:
    """``n`` prompts of ``tokens`` random vocabulary words of ``model`` (its ``hpkv-words.txt``, else
    made-up words), prompt ``i`` drawn with ``seed + i``: the same prompts for every system."""
    words_file = os.path.join(model, "hpkv-words.txt")
    if os.path.exists(words_file):
        with open(words_file) as f:
            words = f.read().split()
    else:
        words = [
            "".join(random.Random(i).choice(string.ascii_lowercase) for _ in range(6)) for i in range(5000)
        ]
    return [" ".join(random.Random(seed + i).choices(words, k=tokens)) for i in range(n)]


def in_turn(systems: Sequence[T], i: int) -> Sequence[T]:
    """The systems in the order they send prompt ``i``: turned at every prompt, so none always
    goes first (the first after an idle moment meets the coldest caches)."""
    return systems if i % 2 == 0 else systems[::-1]
