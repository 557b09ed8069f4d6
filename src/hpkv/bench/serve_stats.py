"""``hpkv bench serve``'s statistics: percentiles and the summary of vLLM's client result, and where
each prompt token came from by the servers' own counters."""

from __future__ import annotations

from typing import Any


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize(result: dict[str, Any], first_turns: int = 0) -> dict[str, float]:
    """The numbers of one run, from vLLM's client: per-request TTFTs, inter-token gaps, latencies.
    ``first_turns``: how many requests, from the first, are first turns (cold for every system:
    no tier holds their context yet); their TTFT and that of the later turns are also given apart,
    since a run's p99 is often only its slowest cold prompts."""
    ok = [e is None or e == "" for e in result["errors"]]
    ttfts = [t for t, good in zip(result["ttfts"], ok, strict=True) if good]
    first = [t for t, good in zip(result["ttfts"][:first_turns], ok[:first_turns], strict=True) if good]
    later = [t for t, good in zip(result["ttfts"][first_turns:], ok[first_turns:], strict=True) if good]
    itls = [x for row, good in zip(result["itls"], ok, strict=True) if good for x in row]
    # vLLM 0.32 reports each request's latency; 0.26 does not: its first token plus the gaps after it.
    latencies = result.get("latencies") or [
        t + sum(g) for t, g in zip(result["ttfts"], result["itls"], strict=True)
    ]
    lat = [x for x, good in zip(latencies, ok, strict=True) if good]
    return {
        "completed": float(result["completed"]),
        "failed": float(result.get("failed", 0)),
        "duration_s": result["duration"],
        "requests_per_s": result["request_throughput"],
        "output_tokens_per_s": result["output_throughput"],
        **{f"ttft_p{p}_ms": percentile(ttfts, p) * 1e3 for p in (50, 90, 99)},
        **{f"itl_p{p}_ms": percentile(itls, p) * 1e3 for p in (50, 99)},
        "e2e_p99_ms": percentile(lat, 99) * 1e3,
        "ttft_first_p50_ms": percentile(first, 50) * 1e3,
        "ttft_first_max_ms": max(first, default=float("nan")) * 1e3,
        "ttft_later_p50_ms": percentile(later, 50) * 1e3,
        "ttft_later_p99_ms": percentile(later, 99) * 1e3,
    }


def sources(
    prompt_tokens: int, engine: dict[str, int], hp: dict[str, int] | None, chunk: int, ranks: int = 1
) -> dict[str, int]:
    """Where the prompt tokens came from: vLLM's own cache, a connector (for hpkv split by tier, from
    its chunk counters: a tier's share can include the prompt's last partial chunk), recomputed."""
    own = engine.get("prefix_cache_hits", 0)
    ext = engine.get("external_prefix_cache_hits", 0)
    out = {"prompt": prompt_tokens, "engine_cache": own, "connector": ext}
    if hp is not None:
        promoted = hp.get("memory_promotions", 0)
        out["hpkv_memory"] = max(hp.get("memory_hits", 0) - promoted, 0) * chunk
        # Storage and valkey count each tensor-parallel rank's shard of a chunk.
        out["hpkv_storage"] = hp.get("storage_hits", 0) // ranks * chunk
        out["hpkv_valkey"] = hp.get("valkey_hits", 0) // ranks * chunk
    out["recomputed"] = max(prompt_tokens - own - ext, 0)
    return out
