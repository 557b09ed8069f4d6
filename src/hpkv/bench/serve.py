"""hpkv bench serve: hpkv under concurrent load, next to vLLM alone and its peers, with vLLM's load generator.

The workload is multi-turn sessions whose reuse comes back after eviction: ``--users`` users, each with
a long context of ``--context`` tokens; turn t of user u is that context plus a short new question, and
turns go round-robin over the users, so between two turns of one user every other user's context
passes through the engine. The engine's own KV cache is capped (``--engine-blocks``, vLLM's
``--num-gpu-blocks-override``) below the working set, so a revisit finds its context evicted from the
engine and either recomputes it or gets it from a tier below.

The requests are sent by vLLM's own benchmark client (``vllm.benchmarks.serve.benchmark``: the
request loop, Poisson arrivals or a concurrency limit, streaming TTFT / inter-token / end-to-end
metrics as ``vllm bench serve`` prints them), at each load level in ``--concurrency`` (closed loop)
or ``--rate`` (Poisson, requests/s). Every system gets the same requests, seed, engine flags and
thread binding; every (system, level) starts a fresh server with empty tiers and sends unrelated
warm-up requests first (not counted): two short prompts and one as long as a user's context, so the
one-time costs of a fresh server's first long prompt (new kernel shapes, first page faults: on the CPU
build that first prompt was every system's slowest) are not charged to the load.

What this adds to vLLM's numbers: where each prompt token came from, from the servers' own counters
(vLLM: its prefix cache and the connector's external hits; hpkv: chunks per tier), whether the
generated texts equal vLLM alone's on the same requests, the side-by-side table, JSON and charts.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from hpkv.bench.faults import FAULTS
from hpkv.bench.serve_report import charts, print_faults, print_run, print_spread, print_table
from hpkv.bench.serve_run import demo_model_dir, fault_turn, hpkv_tiers, one_run
from hpkv.bench.texts import compare_texts, print_wrong
from hpkv.bench.workload import sessions, warmups

# hpkv-*: hpkv with settings of its own (see ttft.VARIANT_ENV)
SYSTEMS = ("hpkv", "hpkv-engine", "hpkv-sync", "hpkv-async", "none", "lmcache", "native")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--compare", default="hpkv,none", help=f"systems, from {','.join(SYSTEMS)}")
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096, help="tokens of each user's shared context")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--question", type=int, default=32, help="new tokens per turn")
    ap.add_argument("--output", type=int, default=16, help="output tokens per request (ignore_eos)")
    ap.add_argument("--concurrency", default="1,4,8", help="closed-loop levels (clients in flight)")
    ap.add_argument("--rate", default=None, help="Poisson levels instead, requests/s, e.g. 0.5,1,2")
    ap.add_argument("--engine-blocks", type=int, default=400, help="vLLM's --num-gpu-blocks-override")
    ap.add_argument("--pool-size", default="256M", help="hpkv's memory pool (and LMCache's L1)")
    ap.add_argument("--valkey", action="store_true", help="give hpkv (and LMCache) an embedded valkey too")
    ap.add_argument(
        "--tiers",
        default="memory,storage",
        help="hpkv's tiers: memory, with storage and/or valkey (an embedded server), e.g. memory,valkey",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of every (level, system); system order alternates"
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engines per system behind a round-robin router (each user's turns alternate between them); "
        "hpkv's replicas share one pool directory and one storage directory",
    )
    ap.add_argument(
        "--fault",
        default="",
        help=f"also run the first hpkv system with each of these faults, between turns: {', '.join(FAULTS)}",
    )
    ap.add_argument(
        "--fault-turn",
        type=int,
        default=None,
        help="the turn sent with the fault in place (default: turns - 2, at least 1)",
    )
    ap.add_argument(
        "--fault-disk",
        default="4G",
        help="the tmpfs a disk-full run's storage is on (holds the run's chunks)",
    )
    ap.add_argument(
        "--logprobs",
        type=int,
        default=0,
        help="keep each token's top N log-probabilities: a text that differs from vLLM alone's only "
        "after a tie (bf16 on GPUs) is then told from a wrong one (e.g. 5)",
    )
    ap.add_argument(
        "--logprob-tolerance",
        type=float,
        default=0.1,
        help="with --logprobs: how far two runs' log-probabilities may differ, and how close a tie is",
    )
    ap.add_argument("--port", type=int, default=8341)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--vllm-args", default="--enforce-eager")
    ap.add_argument("--out", default="out/bench-serve")
    args = ap.parse_args(argv)
    systems = [s for s in args.compare.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    tiers = hpkv_tiers(args)
    if "memory" not in tiers or not set(tiers) <= {"memory", "storage", "valkey"}:
        ap.error(f"--tiers {args.tiers!r}: memory and any of storage, valkey, e.g. --tiers memory,valkey")
    faults = [f for f in args.fault.split(",") if f]
    if {"disk-full", "corrupt", "delete"} & set(faults) and "storage" not in tiers:
        ap.error("--fault disk-full, corrupt and delete act on the storage tier: keep storage in --tiers")
    for f in faults:
        if f not in FAULTS:
            ap.error(f"--fault {f!r}: choose from {', '.join(FAULTS)}, e.g. --fault valkey-kill,disk-full")
    faulted = next((s for s in systems if s.startswith("hpkv")), None)
    if faults and (faulted is None or args.replicas > 1):
        ap.error("--fault runs an hpkv system on one engine: --compare hpkv,none (and no --replicas)")
    if faults and not 0 < fault_turn(args) < args.turns:
        ap.error(f"--fault-turn {fault_turn(args)}: a turn after the first and before --turns {args.turns}")
    if args.rate:
        levels = [{"rate": float(x)} for x in args.rate.split(",")]
    else:
        levels = [{"concurrency": float(x)} for x in args.concurrency.split(",")]
    os.makedirs(args.out, exist_ok=True)
    model = args.model or demo_model_dir(args.out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = (256, min(len(tokenizer), 4096))  # real byte-level tokens of the demo tokenizer
    requests = sessions(args.users, args.context, args.turns, args.question, args.seed, vocab)
    warm = warmups(args.context, args.seed, vocab)
    chunk = 256
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeat):
        for level in levels:
            for system in systems if rep % 2 == 0 else systems[::-1]:
                if args.replicas > 1:
                    from hpkv.bench.replicas import replicated_run as go
                else:
                    go = one_run
                runs.append(
                    go(args, system, model, tokenizer, requests, level, chunk, warm) | {"repeat": rep}
                )
                print_run(runs[-1])
                if system == faulted:
                    for kind in faults:
                        runs.append(
                            one_run(args, system, model, tokenizer, requests, level, chunk, warm, kind)
                            | {"repeat": rep}
                        )
                        print_run(runs[-1])
    compare_texts(runs, args.logprob_tolerance)
    report = {"args": vars(args), "model": model, "requests": len(requests), "runs": runs}
    path = os.path.join(args.out, "serve.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print_table(runs, args)
    print_wrong(runs)
    print_faults(runs)
    if args.repeat > 1:
        print_spread(runs)
    print(f"every run: {path}")
    print(f"charts: {charts(runs, args.out)}")
    return 0 if all(not r.get("error") for r in runs) else 1
