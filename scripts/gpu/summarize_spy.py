"""Summarize py-spy's raw output (``--format raw --threads``): the share of samples per thread, and the
most sampled innermost frames per thread. Usage: python3 summarize_spy.py FILE [FILE ...]"""

from __future__ import annotations

import collections
import sys


def summarize(path: str, top: int = 6) -> None:
    per_thread: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            thread, n = frames[0], int(count)
            total += n
            per_thread[thread] += n
            leaves[thread][" < ".join(reversed(frames[-3:]))] += n
    print(f"== {path}: {total} samples")
    for thread, n in per_thread.most_common(12):
        print(f"  {n / total:6.1%}  {thread}")
        for leaf, m in leaves[thread].most_common(top):
            print(f"           {m / total:6.1%}  {leaf[:160]}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        summarize(p)
