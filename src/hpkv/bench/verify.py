"""The TTFT benchmark's verdicts: a row counts only when the counters show the tier it claims.

hpkv's own rows are judged by its per-tier counters (and vLLM's prefix-cache counter: the engine's own
cache must not have served a hit row); a peer's rows by vLLM's counters alone.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from hpkv.bench.server import counter

SCENARIOS = ("prefill", "gpu", "memory", "storage", "storage-cold", "mixed", "valkey")
HITS = ("memory", "storage", "storage-cold", "mixed", "valkey")


@dataclass
class TimedRow:
    """One row of a TTFT table, whatever the engine: its requests' TTFTs and whether (and by what)
    the row is proven."""

    scenario: str
    ttfts: list[float]
    valid: bool
    proof: str

    @property
    def median(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else float("nan")


@dataclass
class Row(TimedRow):
    """A vLLM row: the hpkv counters that proved it and each load's copy rate."""

    deltas: dict[str, int] = field(default_factory=dict)
    copies: list[float] = field(default_factory=list)  # GB/s of each whole load, from hpkv's log

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttfts)


@dataclass
class System:
    """One system's run: its rows, or why it could not run."""

    name: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    error: str = ""
    # scenario -> (what the reference is, its GB/s), measured in the same run on the same data
    refs: dict[str, tuple[str, float]] = field(default_factory=dict)


def delta(before: dict[str, Any], after: dict[str, Any], tier: str, name: str) -> int:
    return counter(after, tier, name) - counter(before, tier, name)


# The hpkv counters the benches prove their rows with: name -> (tier, counter).
HPKV_COUNTERS = {
    "loaded_tokens": ("connector", "loaded_tokens"),
    "stored_tokens": ("connector", "stored_tokens"),
    "memory_hits": ("memory", "hits"),
    "memory_promotions": ("memory", "promotions"),
    "storage_hits": ("storage", "hits"),
    "page_cache_reads": ("storage", "page_cache_reads"),
    "valkey_hits": ("valkey", "hits"),
    "memory_bytes_read": ("memory", "bytes_read"),
    "left": ("connector", "chunks_left_to_recompute"),
    "not_worth": ("connector", "lookups_not_worth_a_load"),
}


def hpkv_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """What hpkv did between two snapshots of its counters (storage and valkey: every rank's shard)."""
    return {key: delta(before, after, tier, what) for key, (tier, what) in HPKV_COUNTERS.items()}


@dataclass(frozen=True)
class Expect:
    """What a scenario over ``prompts`` prompts must show: ``chunks`` chunks a hit loads per
    prompt, ``in_memory`` of them already in the pool (mixed), ``ranks`` TP ranks."""

    prompts: int
    chunks: int
    tokens: int
    block_size: int = 64
    ranks: int = 1
    in_memory: int = 0


def verify_hpkv(name: str, d: dict[str, int], e: Expect) -> tuple[bool, str]:
    """Whether hpkv's counter deltas ``d`` show the tier scenario ``name`` claims, and the proof."""
    n, need, ranks = e.prompts, e.prompts * e.chunks, e.ranks
    engine = d.get("prefix_cache_hits", 0)
    if name == "prefill":
        ok = d["loaded_tokens"] == 0 and d["stored_tokens"] > 0 and engine == 0
        return ok, f"hpkv loaded 0 tokens and stored {d['stored_tokens']}; engine cache hits {engine}"
    if name == "gpu":
        # The engine keeps whole blocks only; hpkv may supply the prompt's last partial block.
        ok = (
            d["loaded_tokens"] <= n * e.block_size
            and d["memory_promotions"] == 0
            and engine >= n * (e.tokens - 2 * e.block_size)
        )
        return ok, (
            f"the engine's prefix cache served {engine} tokens (hpkv supplied {d['loaded_tokens']}, "
            f"at most one partial block per prompt)"
        )
    # A hit row: hpkv must have supplied the prompt, not the engine's own cache.
    own = f"; engine cache hits {engine}" if engine else ""
    # Chunks hpkv found but left to the engine, as slower to read than to compute or read only in
    # part to measure a tier (engine/costs.py):
    # a hit row loads the rest, and says so. A prompt whose whole hit would not pay for its load
    # (the engine's measured steps; a busy machine can measure it so) is not looked up at all.
    skipped = d.get("not_worth", 0)
    left = d.get("left", 0) + skipped * e.chunks
    loaded = need - left
    spared = (
        f", {left} left to recompute (slower to read than to compute, or measured on a few)" if left else ""
    )
    if name == "memory":
        ok = d["memory_hits"] == loaded and d["memory_promotions"] == 0 and d["storage_hits"] == 0
        proof = (
            f"memory pool hits {d['memory_hits']}/{need} chunks, "
            f"promotions from storage {d['memory_promotions']}"
        )
    elif name in ("storage", "storage-cold"):
        cached = d.get("page_cache_reads", 0)
        ok = d["storage_hits"] == loaded * ranks and d["memory_promotions"] == loaded
        if name == "storage-cold":
            ok = ok and cached == 0
        proof = (
            f"storage hits {d['storage_hits']}/{need * ranks} chunks, all staged through memory, "
            f"{cached} read from the page cache"
        )
    elif name == "mixed":
        rest = n * (e.chunks - e.in_memory)
        below = rest - d.get("left", 0) - skipped * (e.chunks - e.in_memory)  # read from storage
        ok = (
            d["memory_hits"] == loaded
            and d["storage_hits"] == below * ranks
            and d["memory_promotions"] == below
            and 0 < rest < need
            and d.get("left", 0) <= rest
        )
        proof = (
            f"{loaded - d['memory_promotions']}/{need} chunks already in memory, "
            f"{d['storage_hits']} from storage"
        )
    else:  # valkey
        # Per chunk and rank one EXISTS (the lookup's batched check) and one GET for each chunk
        # loaded; both are keyspace hits. LMCache's ValkeyConnector counts the same: seed 002's 508
        # for 254 chunks.
        want = (need + loaded) * ranks
        gets = d.get("keyspace_hits", want)
        ok = d["valkey_hits"] == loaded * ranks and d["storage_hits"] == 0 and gets == want
        proof = f"valkey hits {d['valkey_hits']}/{need * ranks} chunks, storage hits {d['storage_hits']}" + (
            f", keyspace_hits +{gets} (one EXISTS per chunk, one GET per chunk loaded)"
            if "keyspace_hits" in d
            else ""
        )
    return ok and engine == 0 and 0 <= left <= need and skipped <= n, proof + spared + own


def verify_engine(name: str, d: dict[str, int], e: Expect, where: str = "") -> tuple[bool, str]:
    """A peer's row from vLLM's own counters: the engine's cache served the GPU row; on a hit row
    the connector supplied all but at most the last block of each prompt and the engine's cache
    nothing. ``where``: what the run left in the peer's tiers (the tier claim)."""
    n = e.prompts
    own, ext = d.get("prefix_cache_hits", 0), d.get("external_prefix_cache_hits", 0)
    if name == "prefill":
        return own == 0 and ext == 0, f"vLLM: engine cache hits {own}, connector hits {ext} tokens"
    if name == "gpu":
        ok = own >= n * (e.tokens - 2 * e.block_size)
        return ok, f"vLLM: the engine's prefix cache served {own} tokens"
    ok = own == 0 and ext >= n * (e.tokens - 2 * e.block_size)
    proof = f"vLLM: the connector supplied {ext} tokens, the engine's cache {own}"
    if "keyspace_hits" in d:
        ok = ok and d["keyspace_hits"] > 0
        proof += f", keyspace_hits +{d['keyspace_hits']}"
    return ok, proof + (f"; {where}" if where else "")
