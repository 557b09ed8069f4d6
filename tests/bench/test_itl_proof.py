"""``python -m bench.itl`` refuses a table whose counters do not show the case each row claims."""

from __future__ import annotations

from typing import Any

from bench.itl import unproven_runs


def test_a_short_load_or_a_page_cache_read_is_not_proven() -> None:
    def run(**kw: Any) -> dict[str, Any]:
        return {"tokens_in_window": 3, **kw}

    fine = {
        "alone": [run(tokens_in_window=0)],
        "engine": [run(prefix_cache_tokens=8128, hpkv_loaded_tokens=63)],
        "prefill": [run(tokens_in_window=0)],
        "storage": [run(hits=32, page_cache_reads=0)],
        "valkey": [run(hits=32)],
    }
    assert unproven_runs(fine, 8192) == []
    bad = {
        "engine": [run(prefix_cache_tokens=0, hpkv_loaded_tokens=8191)],
        "storage": [run(hits=32, page_cache_reads=4), run(hits=31, page_cache_reads=0)],
        "valkey": [run(hits=32, tokens_in_window=0), run(hits=12)],
    }
    assert unproven_runs(bad, 8192) == [
        "engine run 0: vLLM's cache served 0 tokens, hpkv 8191",
        "storage run 0: 4 reads from the page cache",
        "storage run 1: 31 storage hits of 32 chunks",
        "valkey run 0: the decode had no gap that overlaps the load (it ended first)",
        "valkey run 1: 12 valkey hits of 32 chunks",
    ]
