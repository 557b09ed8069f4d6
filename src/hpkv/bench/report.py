"""The TTFT benchmark's output: one table per system, the side-by-side table, the bar chart, and the
root cause of a system that could not start."""

from __future__ import annotations

import random
import statistics

from hpkv.bench.verify import HITS, SCENARIOS, Row, System


def print_system(x: System, kv_bytes: int, label: bool) -> None:
    if label:
        print(f"\n== {x.name} ==")
    if x.error:
        print(f"could not run here: {x.error}")
        if not x.rows:
            return
    base = next((r for r in x.rows if r.scenario == "prefill"), None)
    gpu = next((r for r in x.rows if r.scenario == "gpu"), None)
    print(
        f"{'scenario':12} {'mean TTFT':>10} {'median':>9} {'min-max':>15} {'speedup':>9} {'load rate':>11} "
        f"{'x ref (95% interval)':>21}  proof"
    )
    notes = set()
    for r in x.rows:
        sp = f"{base.mean / r.mean:8.2f}x" if base and r.valid else "        -"
        rate, vs = "", ""
        if r.scenario in HITS and gpu and r.valid:
            lo, hi = diff_interval(r, gpu)
            if r.deltas.get("left", 0):  # part of each hit was recomputed: its TTFT is no load's
                rate = "recomputed"
                notes.add("recomputed")
            elif lo <= 0 or r.median <= gpu.median:
                rate = "unresolved"
                notes.add("unresolved")
            else:
                gbps = kv_bytes / (r.median - gpu.median) / 1e9
                rate = f"{gbps:6.2f} GB/s"
                if x.refs.get(r.scenario, ("", 0.0))[1] > 0:
                    ref = x.refs[r.scenario][1]
                    ratio = gbps / ref
                    # The interval of the medians' difference, as a rate: slow end first.
                    vs = f"{ratio:5.2f}x" + ("!" if ratio > 1 else "") + f" ({kv_bytes / hi / 1e9 / ref:.2f}-"
                    vs += f"{kv_bytes / lo / 1e9 / ref:.2f})"
                    if ratio > 1:
                        notes.add("above")
        spread = f"{min(r.ttfts):.4f}-{max(r.ttfts):.4f}"
        head = f"{r.scenario:12} {r.mean:9.4f}s {r.median:8.4f}s {spread:>15} {sp} {rate:>11}"
        print(f"{head} {vs:>21}  {r.proof}")
    if "unresolved" in notes:
        print(
            "unresolved: the 95% interval of the difference between the row's median and the GPU-hit "
            "row's (bootstrap) reaches zero, so their difference is noise and no load rate is claimed; "
            "more --prompts narrow it (about as 1/sqrt(prompts)); on a GPU a memory load's copy also "
            "overlaps the step's own launch work, so the TTFT may never show it: the copy lines below "
            "give the load's own rate"
        )
    elif any(r.scenario in HITS for r in x.rows):
        print(
            "(95% interval): of the ratio, from a bootstrap of the difference between the row's median "
            "and the GPU-hit row's"
        )
    if "recomputed" in notes:
        print(
            "recomputed: hpkv left part of the row's hits to the engine, as slower to read than to "
            "compute (its proof says how many chunks): the row's TTFT is not a load's, so no load rate "
            "is claimed; set it against the prefill row"
        )
    if "above" in notes:
        print(
            "!: above the reference: the row loads fewer bytes than a whole prompt's KV in the time "
            "measured (the GPU-hit row also computes the last block), or the medians' difference is "
            "within the spread"
        )
    print_copies(x)
    for s, why in x.skipped:
        print(f"{s:12} skipped: {why}")


def print_copies(x: System) -> None:
    """The loads' own copy rate per hit row, from hpkv's per-load log line (CUDA events on a GPU),
    against the memory reference (pinned host-to-GPU on a GPU). A TTFT difference cannot give it
    there: the copy overlaps the step's own launch work, so hit minus GPU hit can be less than the
    copy takes."""
    rows = [r for r in x.rows if r.copies and r.valid]
    if not rows:
        return
    ref = x.refs.get("memory", ("", 0.0))
    print(f"copies, each load's own time ({len(rows[0].copies)} loads a row; the worker's log line):")
    for r in rows:
        med = statistics.median(r.copies)
        q = statistics.quantiles(r.copies, n=4) if len(r.copies) > 1 else [med, med, med]
        line = f"  {r.scenario:10} {med:6.2f} GB/s median (middle half {q[0]:.2f}-{q[2]:.2f}, "
        line += f"min {min(r.copies):.2f}, {len(r.copies)} loads)"
        if ref[1] > 0:
            line += f" = {med / ref[1]:.2f}x {ref[0]} ({ref[1]:.2f} GB/s)"
        print(line)


BOOTSTRAP = 4000  # resamples; seeded, so a report is the same every time it is printed


def diff_interval(hit: Row, gpu: Row, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` interval of median(hit) - median(gpu), by bootstrap (each row resampled with
    replacement): it narrows as the rows get more samples, unlike the rows' own spreads, which is
    what lets more prompts resolve a hit that loads in less time than the GPU-hit row varies by."""
    rnd = random.Random(0)
    h, g = hit.ttfts, gpu.ttfts
    diffs = sorted(
        statistics.median(rnd.choices(h, k=len(h))) - statistics.median(rnd.choices(g, k=len(g)))
        for _ in range(BOOTSTRAP)
    )
    tail = (1 - level) / 2
    return diffs[int(tail * BOOTSTRAP)], diffs[min(BOOTSTRAP - 1, int((1 - tail) * BOOTSTRAP))]


def resolved(hit: Row, gpu: Row) -> bool:
    """Whether a hit row's distance from the GPU-hit row is above the noise: the 95% interval of the
    medians' difference lies above zero."""
    return diff_interval(hit, gpu)[0] > 0


def print_comparison(results: list[System]) -> None:
    """Median TTFT per scenario side by side, and hpkv's ratio to each peer (< 1: hpkv is faster)."""
    ran = [x for x in results if x.rows]
    print("\n== side by side: median TTFT (s); hpkv / peer < 1 means hpkv is faster ==")
    hp = next((x for x in ran if x.name == "hpkv"), None)
    head = f"{'scenario':12}" + "".join(f"{x.name:>12}" for x in ran)
    peers = [x for x in ran if x.name != "hpkv"] if hp else []
    head += "".join(f"{'hpkv/' + x.name:>14}" for x in peers)
    print(head)
    for scen in SCENARIOS:
        cells = []
        med: dict[str, float] = {}
        for x in ran:
            r = next((r for r in x.rows if r.scenario == scen), None)
            if r is None:
                cells.append(f"{'-':>12}")
            elif not r.valid:
                cells.append(f"{'invalid':>12}")
            else:
                med[x.name] = r.median
                cells.append(f"{r.median:12.4f}")
        if not med:
            continue
        line = f"{scen:12}" + "".join(cells)
        for x in peers:
            ratio = med["hpkv"] / med[x.name] if "hpkv" in med and x.name in med else None
            line += f"{ratio:13.2f}x" if ratio else f"{'-':>14}"
        print(line)
    for x in results:
        if x.error:
            print(f"{x.name}: could not run here: {x.error}")


def chart(results: list[System], path: str) -> str:
    """A bar chart of median TTFT per scenario (and system); returns the path or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn (pip install matplotlib)"
    names = [s for s in SCENARIOS if any(r.scenario == s for x in results for r in x.rows)]
    if not names:
        return "not drawn (no system produced a row)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(results))
    for k, x in enumerate(results):
        med = {r.scenario: r.median for r in x.rows}
        xs = [i + k * width for i, s in enumerate(names) if s in med]
        ys = [med[s] for s in names if s in med]
        bars = ax.bar(xs, ys, width, label=x.name)
        ax.bar_label(bars, labels=[f"{y:.3f}s" for y in ys], fontsize=7)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("median TTFT (s, log scale)")
    ax.set_title("hpkv bench ttft")
    if len(results) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kv_bytes_per_prompt(rows: list[Row], prompts: int) -> int:
    """KV bytes one hit loads per prompt, from the memory tier's byte counter."""
    for r in rows:
        if r.scenario in ("memory", "storage") and r.deltas.get("memory_bytes_read"):
            return r.deltas["memory_bytes_read"] // max(prompts, 1)
    return 0
