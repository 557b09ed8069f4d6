"""The rows of ``hpkv bench ttft --engine sglang`` (what each system measured) and their report: the
table per system, hpkv's read rates against the references, the side-by-side medians, and the JSON
record of every request."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from hpkv.bench.verify import TimedRow

L3_TIERS = ("storage", "valkey")  # hpkv's tiers under SGLang (its memory tier is off)
SCENARIOS = ("prefill", "gpu", "host", "storage", "storage-cold", "mixed", "valkey")
L3_ROWS = ("storage", "storage-cold", "mixed", "valkey")


@dataclass
class Row(TimedRow):
    """An SGLang row: how much of each prompt came from L3, and hpkv's own read rate."""

    l3_tokens: int = 0  # tokens per prompt that came from L3 (median)
    # hpkv: the rate of its own reads into SGLang's host pages (pages x page bytes / time in them)
    backend_gbps: float = 0.0


@dataclass
class Result:
    name: str
    rows: list[Row] = field(default_factory=list)
    refs: dict[str, tuple[str, float]] = field(default_factory=dict)
    starts: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    page_bytes: int = 0  # bytes of one page as hpkv's counters saw it (0: not seen)


def kv_bytes_per_token(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    width = 4 if str(cfg.get("dtype") or cfg.get("torch_dtype")) == "float32" else 2
    return 2 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * head_dim * width


def report(args: argparse.Namespace, model: str, results: list[Result]) -> None:
    # The page size hpkv's counters saw is what the server used; the config's dtype may not be (SGLang
    # serves a float32 config as float16).
    seen = next((x.page_bytes for x in results if x.page_bytes), 0)
    per_token = seen // args.page_size if seen else kv_bytes_per_token(model)
    print()
    print(
        f"hpkv bench ttft --engine sglang: {args.prompts} random prompts x {args.tokens} tokens, "
        f"model {model} (--load-format {args.load_format}), page {args.page_size}, "
        f"KV {per_token * args.tokens / 2**20:.0f} MiB per prompt"
    )
    for x in results:
        print(
            f"\n{x.name}: SGLang HiCache"
            + ("" if x.name == "none" else f" + L3 {x.name}")
            + (f"  (starts: {', '.join(f'{s:.0f}' for s in x.starts)} s)" if x.starts else "")
        )
        if x.error:
            print(f"  stopped: {x.error}")
        gpu = next((r.median for r in x.rows if r.scenario == "gpu" and r.valid), None)
        print(f"  {'row':13}{'median s':>10}{'min':>9}{'max':>9}{'L3 GB/s':>9}{'x ref':>8}  proof")
        for r in x.rows:
            rate = ""
            xref = ""
            if r.scenario in L3_ROWS and gpu is not None and r.valid and r.median > gpu:
                gbps = r.l3_tokens * per_token / (r.median - gpu) / 1e9
                rate = f"{gbps:.2f}"
                ref = x.refs.get(r.scenario)
                if ref and ref[1] > 0:
                    xref = f"{gbps / ref[1]:.2f}"
            print(
                f"  {r.scenario:13}{r.median:10.4f}{min(r.ttfts):9.4f}{max(r.ttfts):9.4f}{rate:>9}{xref:>8}  "
                f"{r.proof}"
            )
        for r in x.rows:
            if r.backend_gbps:
                ref = x.refs.get(r.scenario)
                vs = f" = {r.backend_gbps / ref[1]:.2f}x the reference" if ref and ref[1] > 0 else ""
                print(
                    f"  {r.scenario}: hpkv's reads into the host pages ran at {r.backend_gbps:.2f} GB/s "
                    f"(pages read x page bytes / time in SGLang's batch_get_v1 calls){vs}"
                )
        for s, why in x.skipped:
            print(f"  {s:13} skipped: {why}")
        for s, (what, gbps) in x.refs.items():
            print(f"  reference for {s}: {what}: {gbps:.2f} GB/s")
    names = [x.name for x in results]
    if len(results) > 1:
        print("\nmedian TTFT (s) side by side:")
        print(f"  {'row':13}" + "".join(f"{n:>10}" for n in names))
        for s in SCENARIOS:
            cells = []
            for x in results:
                got = next((r for r in x.rows if r.scenario == s), None)
                cells.append("-" if got is None else (f"{got.median:.4f}" if got.valid else "INVALID"))
            if any(c != "-" for c in cells):
                print(f"  {s:13}" + "".join(f"{c:>10}" for c in cells))
        base = next((x for x in results if x.name == "none"), None)
        for x in results:
            if base is None or x is base:
                continue
            a = next((r for r in x.rows if r.scenario == "prefill"), None)
            b = next((r for r in base.rows if r.scenario == "prefill"), None)
            if a and b:
                print(
                    f"  cold prefill with L3 {x.name}: {a.median / b.median:.3f}x SGLang HiCache without L3"
                )


def write_json(
    args: argparse.Namespace, model: str, results: list[Result], log: list[dict[str, Any]]
) -> None:
    doc = {
        "model": model,
        "load_format": args.load_format,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "kv_bytes_per_token": kv_bytes_per_token(model),
        "systems": [
            {
                "name": x.name,
                "error": x.error,
                "skipped": x.skipped,
                "starts_s": x.starts,
                "refs": {k: {"what": w, "gbps": g} for k, (w, g) in x.refs.items()},
                "rows": [asdict(r) | {"median": r.median} for r in x.rows],
            }
            for x in results
        ],
        "requests": log,
    }
    with open(os.path.join(args.out, "ttft-sglang.json"), "w") as f:
        json.dump(doc, f, indent=1)
