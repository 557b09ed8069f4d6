"""The serve bench's output: a line per run, the side-by-side table, the spread across repeats, each
fault's table (turn by turn, next to the run without it) and the charts."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from hpkv.bench.faults import FAULTS


def label(r: dict[str, Any]) -> str:
    """A run's name in the tables: its system, and the fault it ran with."""
    return str(r["system"]) + (f"+{r['fault']}" if r.get("fault") else "")


def _level_name(level: dict[str, float]) -> str:
    return f"concurrency {level['concurrency']:g}" if "concurrency" in level else f"rate {level['rate']:g}/s"


def print_run(r: dict[str, Any]) -> None:
    if r.get("error"):
        print(f"[{label(r)}, {_level_name(r['level'])}] not run: {r['error']}", flush=True)
        return
    m = r["metrics"]
    print(
        f"[{label(r)}, {_level_name(r['level'])}] {m['requests_per_s']:.2f} req/s, "
        f"TTFT p50/p99 {m['ttft_p50_ms']:.0f}/{m['ttft_p99_ms']:.0f} ms, "
        f"{r.get('preemptions', '?')} requests preempted by the engine",
        flush=True,
    )


def print_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    n = args.users * args.turns
    print(
        f"\nhpkv bench serve: {args.users} users x {args.turns} turns ({n} requests), context {args.context} "
        f"tokens + {args.question} new per turn, {args.output} output tokens; engine cache "
        f"{args.engine_blocks} blocks x {args.block_size} tokens; hpkv pool {args.pool_size}; "
        f"seed {args.seed}"
    )
    cols = (
        f"{'level':<16}{'system':<18}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>9}{'p90':>7}{'p99':>7}"
        f"{'ITL p50':>8}{'p99':>6}{'E2E p99':>8}  prompt tokens from: engine / connector (hpkv mem / "
        "storage / valkey) / recomputed; texts = vLLM alone's"
    )
    print(cols)
    for r in runs:
        name = _level_name(r["level"])
        if r.get("error"):
            print(f"{name:<16}{label(r):<18} not run: {r['error']}")
            continue
        m, s = r["metrics"], r["sources"]
        p = max(s["prompt"], 1)
        tiers = ""
        if "hpkv_memory" in s:
            tiers = (
                f" ({100 * s['hpkv_memory'] / p:.0f}% / {100 * s['hpkv_storage'] / p:.0f}% / "
                f"{100 * s['hpkv_valkey'] / p:.0f}%)"
            )
        same = r.get("texts_equal_to_none")
        texts = f"; texts {same[0]}/{same[1]}" if same and r["system"] != "none" else ""
        if texts and "texts_right" in r:
            texts += f" equal, {r['texts_right'][0]}/{r['texts_right'][1]} right"
        fails = f"; {len(r['errors'])} failed" if r.get("errors") else ""
        print(
            f"{name:<16}{label(r):<18}{m['requests_per_s']:>7.2f}{m['output_tokens_per_s']:>10.1f}"
            f"{m['ttft_p50_ms']:>9.0f}{m['ttft_p90_ms']:>7.0f}{m['ttft_p99_ms']:>7.0f}"
            f"{m['itl_p50_ms']:>8.0f}{m['itl_p99_ms']:>6.0f}{m['e2e_p99_ms']:>8.0f}  "
            f"{100 * s['engine_cache'] / p:.0f}% / {100 * s['connector'] / p:.0f}%{tiers} / "
            f"{100 * s['recomputed'] / p:.0f}%{texts}{fails}"
        )
    print(
        "times in ms (vLLM's client: TTFT to the first streamed token, ITL between tokens, E2E per request)"
    )
    print(f"\n{'TTFT, ms':<34}{'first turns (cold) p50':>23}{'max':>7}{'later turns p50':>17}{'p99':>7}")
    for r in runs:
        if r.get("error"):
            continue
        m = r["metrics"]
        if "ttft_first_p50_ms" not in m:
            continue
        print(
            f"{_level_name(r['level']):<16}{label(r):<18}{m['ttft_first_p50_ms']:>23.0f}"
            f"{m['ttft_first_max_ms']:>7.0f}{m['ttft_later_p50_ms']:>17.0f}{m['ttft_later_p99_ms']:>7.0f}"
        )


def _groups(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs that went through, by (level, system), in the order they ran."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if not r.get("error"):
            out.setdefault((_level_name(r["level"]), label(r)), []).append(r)
    return out


def print_spread(runs: list[dict[str, Any]]) -> None:
    """Across the repeats: the median and the range of the numbers a deployment is judged by."""
    print("\nacross repeats: median (min-max)")
    print(f"{'level':<16}{'system':<18}{'req/s':>22}{'TTFT p50 ms':>22}{'TTFT p99 ms':>22}")
    for (name, system), rs in _groups(runs).items():
        cells = []
        for key, fmt in (("requests_per_s", ".2f"), ("ttft_p50_ms", ".0f"), ("ttft_p99_ms", ".0f")):
            xs = [r["metrics"][key] for r in rs]
            cells.append(f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})")
        print(f"{name:<16}{system:<18}" + "".join(f"{c:>22}" for c in cells))


def charts(runs: list[dict[str, Any]], out: str) -> str:
    """TTFT distribution per system and level; throughput and p99 TTFT against load."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (the table and JSON have everything)"
    ok = [r for r in runs if not r.get("error")]
    if not ok:
        return "none: no run finished (the table says why)"
    levels = sorted({_level_name(r["level"]) for r in ok}, key=lambda n: float(n.split()[1].rstrip("/s")))
    systems = list(dict.fromkeys(label(r) for r in ok))
    fig, axes = plt.subplots(1, len(levels) + 2, figsize=(4.2 * (len(levels) + 2), 3.6))
    groups = _groups(runs)
    for ax, name in zip(axes, levels, strict=False):
        for s in systems:
            xs = sorted(t * 1e3 for r in groups.get((name, s), []) for t in r["ttfts"])  # every repeat
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=s)
        ax.set_title(f"TTFT, {name}")
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests")
        ax.set_xscale("log")
        ax.legend()
    for ax, key, title in (
        (axes[-2], "requests_per_s", "throughput (req/s), median and range"),
        (axes[-1], "ttft_p99_ms", "p99 TTFT (ms), median and range"),
    ):
        for s in systems:
            pts = []
            for name in levels:
                vals = [r["metrics"][key] for r in groups.get((name, s), [])]
                if vals:
                    pts.append((float(name.split()[1].rstrip("/s")), vals))
            med = [statistics.median(v) for _, v in pts]
            ax.errorbar(
                [x for x, _ in pts],
                med,
                yerr=[[m - min(v) for m, (_, v) in zip(med, pts, strict=True)],
                      [max(v) - m for m, (_, v) in zip(med, pts, strict=True)]],
                marker="o",
                capsize=3,
                label=s,
            )  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("load (" + ("concurrency" if "concurrency" in ok[0]["level"] else "req/s") + ")")
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "serve.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_faults(runs: list[dict[str, Any]]) -> None:
    """One table per fault: each turn of the run with the fault next to the same turn without it."""
    base = next(
        (r for r in runs if r["system"].startswith("hpkv") and not r.get("fault") and "by_turn" in r), None
    )
    for r in runs:
        if not r.get("fault") or "by_turn" not in r:
            continue
        print(f"\nfault {r['fault']}: {FAULTS[r['fault']]}; in place for turn {r['fault_turn']}")
        print(
            f"{'turn':<14}{'TTFT p50':>10}{'p99':>8}{'req/s':>8}{'failed':>8}{'wrong':>7}"
            "   without the fault: p50 / p99 / req/s"
        )
        wrong_turns = [w["turn"] for w in r.get("wrong", [])]
        for t in r["by_turn"]:
            n = int(t["turn"])
            what = "during" if n == r["fault_turn"] else ("before" if n < r["fault_turn"] else "after")
            ref = ""
            if base is not None and n < len(base["by_turn"]):
                b = base["by_turn"][n]
                ref = f"   {b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f} / {b['requests_per_s']:.2f}"
            print(
                f"{f'{n} ({what})':<14}{t['ttft_p50_ms']:>10.0f}{t['ttft_p99_ms']:>8.0f}"
                f"{t['requests_per_s']:>8.2f}{int(t['failed']):>8}{wrong_turns.count(n):>7}{ref}"
            )
        counters = ", ".join(f"{k} {v}" for k, v in r.get("fault_counters", {}).items() if v)
        print(f"hpkv's counters over the run: {counters or 'none moved'}")
