"""``hpkv bench cold``: what hpkv costs a prompt no tier holds, interleaved with vLLM alone.

Two servers on the same model, flags and thread binding run side by side: vLLM with hpkv storing to
every tier it has (memory + storage + valkey by default, an embedded valkey-server) and vLLM alone.
Each round sends ``--prompts`` fresh prompts (never seen by either engine: cold everywhere) to one
system, waits until hpkv's background writes of that round are done (so they never overlap the other
system's requests) and, for either system, until its processes have gone quiet (vLLM's workers
busy-poll for a second after their last step), then the same number to the other; the order
alternates every round (hpkv, none, none, hpkv, ...). Only one server computes at a time. With
``--pairs N`` that is done with N fresh pairs of servers in turn, started in alternating order (on a
shared VM one server can run a few percent faster than another for its whole life).

Reported: the median TTFT per system and round, the median over rounds, the spread (min-max over
rounds), the ratio hpkv/none of the medians and its range over rounds, and with pairs each pair's
ratio. hpkv's counters prove that it stored every chunk of every prompt (else the round is marked).

On the CPU build hpkv's tier work (engine-core process) and the model (worker process) share the
machine's cores, so whatever that work costs shows up here; on a GPU the same command measures the
GPU engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
from typing import Any

from hpkv.bench.server import Server, ServerError, bench_env, counter
from hpkv.bench.ttft_run import model_dtype

CHUNK = 256


def fresh_prompts(model: str, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` prompts of ``tokens`` random vocabulary words (one token each with the demo tokenizer)."""
    with open(os.path.join(model, "hpkv-words.txt")) as f:
        words = f.read().split()
    return [" ".join(random.Random(seed * 1000 + i).choice(words) for _ in range(tokens)) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench cold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--size", default="small", help="demo model size when --model is not given")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per system per round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per pair of servers")
    ap.add_argument(
        "--pairs", type=int, default=1, help="fresh server pairs, one after another, start order alternating"
    )
    ap.add_argument("--tiers", default="memory,storage,valkey", help="hpkv's tiers, of memory,storage,valkey")
    ap.add_argument(
        "--role",
        default="kv_both",
        choices=("kv_both", "kv_consumer"),
        help="hpkv's kv_role: kv_both stores every prompt; kv_consumer only looks up (with valkey: the "
        "remote existence check of every cold prompt) and stores nothing, which separates the lookup's "
        "cost from the write-behind's",
    )
    ap.add_argument("--pool-size", default="2G")
    ap.add_argument("--port", type=int, default=8351)
    ap.add_argument("--out", default="out/bench-cold")
    ap.add_argument("--vllm-args", default="--enforce-eager")
    args = ap.parse_args(argv)
    tiers = {t for t in args.tiers.split(",") if t}
    if not tiers <= {"memory", "storage", "valkey"} or "memory" not in tiers:
        ap.error(f"--tiers {args.tiers!r}: use memory plus any of storage, valkey (e.g. memory,valkey)")

    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if model is None:
        model = os.path.join(args.out, f"demo-model-{args.size}")
        if not os.path.exists(os.path.join(model, "config.json")):
            from hpkv.bench.demo_model import write_demo_model

            write_demo_model(model, args.size)
    work = tempfile.mkdtemp(prefix="hpkv-bench-cold-")
    shm = tempfile.mkdtemp(prefix="hpkv-bench-cold-", dir="/dev/shm")
    valkey: Any = None
    servers: dict[str, Server] = {}
    try:
        base = bench_env()
        cpus = sorted(os.sched_getaffinity(0))
        base.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")  # the same for both
        env = dict(base, HPKV_KV_MEM_POOL_SIZE=args.pool_size, HPKV_SHARE_MEM_FILE_PATH=shm)
        if "storage" in tiers:
            env["HPKV_KV_STORAGE_PATH"] = os.path.join(work, "storage")
        if "valkey" in tiers:
            from hpkv.bench.valkey import ValkeyServers

            valkey = ValkeyServers(directory=os.path.join(work, "valkey")).start()
            env["HPKV_REMOTE_URL"] = valkey.url
        vargs = ["--max-model-len", str(max(args.tokens + 64, 2048)), "--max-num-batched-tokens", "2048"]
        vargs += ["--dtype", model_dtype(model), *args.vllm_args.split()]
        rows: dict[str, list[float]] = {"hpkv": [], "none": []}
        per_round: list[dict[str, float]] = []
        invalid: list[str] = []
        r = 0
        for pair in range(args.pairs):
            # A fresh pair of servers, started in alternating order: on a shared VM one server can run
            # several percent faster than another for its whole life (placement), which a single pair
            # would charge to one system.
            order0 = ["hpkv", "none"] if pair % 2 == 0 else ["none", "hpkv"]
            for i, (name, e, conn) in enumerate((("hpkv", env, None), ("none", base, ""))):
                servers[name] = Server(
                    model,
                    args.port + i,
                    e,
                    os.path.join(args.out, f"vllm-{name}.log"),
                    connector_json=conn,
                    vllm_args=vargs,
                    kv_role=args.role if name == "hpkv" else "kv_both",
                )
            for name in order0:  # one after the other: starting competes for the CPU
                print(f"[pair {pair}, {name}] starting vLLM (log: {servers[name].log_path})", flush=True)
                servers[name].start()
            for s in servers.values():  # warm both: the first request after a start pays one-off costs
                s.complete(fresh_prompts(model, 1, 256, seed=999_999)[0])
            servers["hpkv"].drained_stats()
            for s in servers.values():
                s.quiet()
            for _ in range(args.rounds):
                order = ["hpkv", "none"] if r % 2 == 0 else ["none", "hpkv"]
                med: dict[str, float] = {}
                for name in order:
                    s = servers[name]
                    prompts = fresh_prompts(model, args.prompts, args.tokens, seed=2 * r + (name == "none"))
                    before = s.settled_stats() if name == "hpkv" else None
                    times = [s.complete(p)[0] for p in prompts]
                    if name == "hpkv":
                        after = s.drained_stats()
                        stored = counter(after, "connector", "stored_tokens") - counter(
                            before or {}, "connector", "stored_tokens"
                        )
                        want = args.prompts * (args.tokens // CHUNK) * CHUNK if args.role == "kv_both" else 0
                        if stored != want:
                            invalid.append(f"round {r}: hpkv stored {stored} of {want} tokens")
                    # Both alike: the next system starts once this one has gone quiet (vLLM's
                    # workers busy-poll for a second after their last step; hpkv's write-behind).
                    s.quiet()
                    med[name] = statistics.median(times)
                    rows[name].extend(times)
                per_round.append(med | {"pair": pair})
                print(
                    f"pair {pair} round {r}: "
                    + "  ".join(f"{n} {med[n]:.3f} s" for n in order)
                    + f"  hpkv/none {med['hpkv'] / med['none']:.3f}",
                    flush=True,
                )
                r += 1
            if pair + 1 < args.pairs:
                for s in servers.values():
                    s.stop()
        tiers_of = servers["hpkv"].settled_stats().get("tiers", {})
        where = ",".join(sorted(t for t in tiers_of if "." not in t))
        if args.role == "kv_consumer":
            where = f"nothing (kv_consumer: it only looks up in {where})"
        report = report_rounds(per_round, args, invalid, where)
        print(report["text"])
        with open(os.path.join(args.out, "cold.json"), "w") as f:
            json.dump({k: v for k, v in report.items() if k != "text"} | {"requests": rows}, f, indent=1)
        return 0 if not invalid else 1
    except ServerError as e:
        print(f"stopped: {e}")
        return 1
    finally:
        for s in servers.values():
            s.stop()
        if valkey is not None:
            valkey.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def report_rounds(
    per_round: list[dict[str, float]], args: argparse.Namespace, invalid: list[str], tiers: str
) -> dict[str, Any]:
    """The summary of the rounds (each ``{"hpkv": s, "none": s, "pair": i}``: the systems' median
    TTFTs in that round): text and the numbers for cold.json."""
    h = [m["hpkv"] for m in per_round]
    n = [m["none"] for m in per_round]
    ratios = [a / b for a, b in zip(h, n, strict=True)]
    mh, mn = statistics.median(h), statistics.median(n)
    lines = [
        "",
        f"hpkv bench cold: {len(per_round)} rounds ({args.pairs} server pair(s)) x {args.prompts} fresh "
        f"prompts x {args.tokens} tokens per system, interleaved (order alternating); hpkv stores to {tiers}",
        f"  vLLM + hpkv : median {mh:.3f} s  (round medians {min(h):.3f}-{max(h):.3f})",
        f"  vLLM alone  : median {mn:.3f} s  (round medians {min(n):.3f}-{max(n):.3f})",
        # A round is the paired unit (both systems, back to back, same servers): its ratio is the
        # headline; the ratio of the overall medians mixes server pairs of different speeds.
        f"  hpkv / none : median of the per-round ratios {statistics.median(ratios):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}x); of the overall medians {mh / mn:.3f}x",
    ]
    pairs = sorted({int(m.get("pair", 0)) for m in per_round})
    if len(pairs) > 1:
        per_pair = []
        for p in pairs:
            hp = statistics.median([m["hpkv"] for m in per_round if m.get("pair", 0) == p])
            nn = statistics.median([m["none"] for m in per_round if m.get("pair", 0) == p])
            per_pair.append(hp / nn)
        lines.append(
            "  per server pair (hpkv / none of its medians): " + ", ".join(f"{x:.3f}x" for x in per_pair)
        )
    lines += [f"  INVALID {x}" for x in invalid]
    return {
        "text": "\n".join(lines),
        "hpkv_median_s": mh,
        "none_median_s": mn,
        "ratio_of_medians": mh / mn,
        "median_round_ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "per_round": per_round,
        "invalid": invalid,
    }
