"""``python -m bench.itl``: does a running decode slow down while another request loads from a slow tier?

One vLLM server with hpkv (memory + storage + an embedded valkey-server). A decoding request D (a
short prompt, ``--decode-tokens`` tokens, streamed) runs alone, then again while a second request P
(``--tokens`` tokens) arrives: P is served from the storage tier with its files dropped from the page
cache, from valkey (the server restarted without its storage tier), or computed from scratch (a fresh
prompt: the reference of what recomputing costs D), or found whole in vLLM's own prefix cache (sent
once just before: what any request of that length costs D with no tier I/O at all, the reference a
load is held to: its tokenization, scheduling and last-token step). Reported per case: D's inter-token latency
(p50, p99, max) over its gaps that overlap P's flight, P's TTFT, and the counters proving
where P came from. The engine's own prefix cache and hpkv's memory are emptied before each case
(the engine-cache case: before P's first send).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any

from hpkv.bench.cold import fresh_prompts
from hpkv.bench.refs import drop_page_cache
from hpkv.bench.server import Server, ServerError, bench_env, counter, read_stat, stat_cpu_seconds
from hpkv.bench.ttft_run import model_dtype

CHUNK = 256
ALONE_WINDOW_S = 0.35  # about as long as a load from storage or valkey takes on the H200


def stream_times(server: Server, prompt: str, n: int, times: list[float]) -> None:
    """Append to ``times``, as they arrive, the arrival times (perf_counter) of each streamed token of
    a greedy completion of ``n`` tokens."""
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"/v1/completions answered {r.status}: {r.read()[:300]!r}")
        for line in r:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    finally:
        conn.close()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of ``pid`` so far, by thread name with its
    trailing number dropped (``hpkv-io_3`` counts as ``hpkv-io``; hpkv names its threads at the OS
    level): ``main`` is the process's first thread (vLLM's engine loop; at TP=1 on a GPU also the
    model runner), ``python`` the other threads that kept the process's name; {} where /proc cannot say."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        with open(f"/proc/{pid}/comm") as f:
            proc_name = f.read().strip()
    except OSError:
        return out
    for tid in tids:
        st = read_stat(f"/proc/{pid}/task/{tid}/stat")
        if st is None:
            continue
        comm, fields = st
        name = "main" if tid == str(pid) else "python" if comm == proc_name else comm
        name = name.rstrip("0123456789").rstrip("-_:") or comm
        out[name] = out.get(name, 0.0) + stat_cpu_seconds(fields)
    return out


class Watch:
    """What the engine's process did while P was in flight: each thread's CPU time and, with
    ``py_spy`` (the path of py-spy), a sampled profile of its threads written under ``out``
    (``gil``: only the thread holding the GIL is sampled, so the counts say who held it; else every
    thread that is not idle)."""

    def __init__(self, pid: int, py_spy: str | None, out: str) -> None:
        self.pid, self.py_spy, self.out = pid, py_spy, out
        self._prof: subprocess.Popen[bytes] | None = None
        self._cpu: dict[str, float] = {}

    def start_profile(self, name: str, gil: bool) -> None:
        if self.py_spy:
            path = os.path.join(self.out, f"profile-{name}-{'gil' if gil else 'active'}.txt")
            cmd = [
                self.py_spy,
                "record",
                "--pid",
                str(self.pid),
                "--nonblocking",
                "--threads",
                "--rate",
                "250",
            ]
            cmd += ["--gil"] * gil + ["--format", "raw", "-o", path]
            self._prof = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # attached before P is sent

    def begin(self) -> None:
        self._cpu = thread_cpu(self.pid)

    def end(self) -> dict[str, float]:
        now = thread_cpu(self.pid)
        if self._prof is not None:
            self._prof.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            try:
                self._prof.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._prof.kill()
            self._prof = None
        used = {k: v - self._cpu.get(k, 0.0) for k, v in now.items()}
        return {k: round(v, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0}


def run_case(
    server: Server,
    decode: str,
    n: int,
    load: str | None,
    after: int,
    watch: Watch | None = None,
    name: str = "",
    gil: bool = False,
) -> dict[str, Any]:
    """D alone (``load`` None) or with P sent once D has produced ``after`` tokens. With ``watch``,
    also each engine thread's CPU seconds while P was in flight (D alone: over ALONE_WINDOW_S)."""
    window: list[float] = []
    ttft: list[float] = []
    times: list[float] = []
    threads: dict[str, float] = {}
    t = threading.Thread(target=stream_times, args=(server, decode, n, times))
    t.start()
    while len(times) < after and t.is_alive():  # stream_times appends as tokens arrive
        time.sleep(0.002)
    if watch is not None:
        watch.start_profile(name, gil)
        watch.begin()
    if load is not None:
        t0 = time.perf_counter()
        ttft.append(server.complete(load, max_tokens=1)[0])
        window = [t0, time.perf_counter()]
    elif watch is not None:
        time.sleep(ALONE_WINDOW_S)
    if watch is not None:
        threads = watch.end()
    t.join()
    gaps = [(b - a, b) for a, b in itertools.pairwise(times)]
    # Every gap of D that overlaps P's flight, the ones in progress when P was sent and when its answer
    # came included: a load that stalls D for its whole flight is that one long gap, not no gap.
    inside = [g for g, at in gaps if at >= window[0] and at - g <= window[1]] if window else []
    alone = [g for g, _ in gaps[after:]] if not window else []
    use = inside if window else alone
    return {
        "itl_p50_ms": 1e3 * pct(use, 0.5),
        "itl_p99_ms": 1e3 * pct(use, 0.99),
        "itl_max_ms": 1e3 * max(use) if use else float("nan"),
        "tokens_in_window": len(use),
        "load_ttft_s": ttft[0] if ttft else None,
        "engine_threads_cpu_s": threads,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.itl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="model directory (default: build the demo model)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the loading request")
    ap.add_argument("--decode-tokens", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3, help="times each case runs (a fresh P each time)")
    ap.add_argument("--port", type=int, default=8371)
    ap.add_argument("--out", default="out/bench-itl")
    ap.add_argument("--vllm-args", default="--enforce-eager")
    ap.add_argument(
        "--async-load",
        default="auto",
        choices=["auto", "true", "false"],
        help="HPKV_ASYNC_LOAD for the server (false: P's hit is loaded inside the step that admits it)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also sample the engine process with py-spy while P is in flight (runs alternate --gil, "
        "which samples only the GIL's holder, and every active thread); raw stacks in --out",
    )
    args = ap.parse_args(argv)
    py_spy = shutil.which("py-spy") if args.profile else None
    if args.profile and py_spy is None:
        ap.error("--profile needs py-spy on PATH (pip install py-spy)")
    os.makedirs(args.out, exist_ok=True)
    model = args.model
    if model is None:
        model = os.path.join(args.out, "demo-model-small")
        if not os.path.exists(os.path.join(model, "config.json")):
            from hpkv.bench.demo_model import write_demo_model

            write_demo_model(model, "small")
    from hpkv.bench.valkey import ValkeyServers

    work = tempfile.mkdtemp(prefix="hpkv-bench-itl-")
    shm = tempfile.mkdtemp(prefix="hpkv-bench-itl-", dir="/dev/shm")
    storage = os.path.join(work, "storage")
    valkey = ValkeyServers(directory=os.path.join(work, "valkey")).start()
    env = bench_env()
    cpus = sorted(os.sched_getaffinity(0))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cpus[0]}-{cpus[-1]}")
    env.update(
        HPKV_KV_MEM_POOL_SIZE="2G",
        HPKV_SHARE_MEM_FILE_PATH=shm,
        HPKV_KV_STORAGE_PATH=storage,
        HPKV_REMOTE_URL=valkey.url,
        HPKV_ASYNC_LOAD=args.async_load,
        VLLM_SERVER_DEV_MODE="1",
    )
    vargs = ["--max-model-len", str(max(args.tokens + 64, 2048)), "--max-num-batched-tokens", "2048"]
    vargs += ["--dtype", model_dtype(model), *args.vllm_args.split()]
    s = Server(model, args.port, env, os.path.join(args.out, "vllm-hpkv.log"), vllm_args=vargs)
    decode = fresh_prompts(model, 1, 64, seed=7_000)[0]
    loads = fresh_prompts(model, 2 * args.repeat, args.tokens, seed=7_001)
    fresh = fresh_prompts(model, args.repeat, args.tokens, seed=7_002)
    after = 20
    results: dict[str, list[dict[str, Any]]] = {
        "alone": [],
        "engine": [],
        "prefill": [],
        "storage": [],
        "valkey": [],
    }
    proofs: dict[str, list[str]] = {k: [] for k in results}

    def short(hits: int) -> str:  # a load that stopped at a gap is not the load the case is about
        return "" if hits >= args.tokens // CHUNK else f" (! of {args.tokens // CHUNK}: a shorter load)"

    try:
        s.start()
        for p in loads:  # stored to memory, storage and valkey
            s.complete(p)
            # Each prompt reaches every tier before the next is stored: the write-behind holds a
            # prompt's memory slots until storage and valkey have it, and back to back a 7B-shaped
            # prompt set (six of 448 MiB) outruns the 2 GiB pool, whose stores are then skipped.
            s.drained_stats()
        st0 = s.settled_stats()
        skipped = counter(st0, "connector", "stores_skipped_pool_full")
        if skipped:
            raise ServerError(
                f"{skipped} chunk(s) of the prompts to load were not stored (memory pool full): "
                "the storage and valkey cases would measure a shorter load"
            )
        watch = Watch(int(st0["pid"]), py_spy, args.out)

        def reset() -> None:
            s.reset_prefix_cache(external=True)

        for i in range(args.repeat):
            reset()
            results["alone"].append(
                run_case(s, decode, args.decode_tokens, None, after, watch, f"alone-{i}", i % 2 == 0)
            )
            reset()
            warm = fresh_prompts(model, 1, args.tokens, seed=7_003 + i)[0]
            s.complete(warm, max_tokens=1)  # computed now; in vLLM's prefix cache for the case
            before, vb = s.settled_stats(), s.engine_counters()
            results["engine"].append(
                run_case(s, decode, args.decode_tokens, warm, after, watch, f"engine-{i}", i % 2 == 0)
            )
            st, va = s.settled_stats(), s.engine_counters()
            loaded = counter(st, "connector", "loaded_tokens") - counter(before, "connector", "loaded_tokens")
            own = va.get("prefix_cache_hits", 0) - vb.get("prefix_cache_hits", 0)
            results["engine"][-1].update(prefix_cache_tokens=own, hpkv_loaded_tokens=loaded)
            proofs["engine"].append(f"vLLM prefix-cache hit tokens {own}, hpkv loaded {loaded}")
            reset()
            results["prefill"].append(
                run_case(s, decode, args.decode_tokens, fresh[i], after, watch, f"prefill-{i}", i % 2 == 0)
            )
            reset()
            drop_page_cache(storage)
            before = s.settled_stats()
            results["storage"].append(
                run_case(s, decode, args.decode_tokens, loads[i], after, watch, f"storage-{i}", i % 2 == 0)
            )
            st = s.settled_stats()

            def d(tier: str, name: str) -> int:
                return counter(st, tier, name) - counter(before, tier, name)  # noqa: B023

            results["storage"][-1].update(
                hits=d("storage", "hits"), page_cache_reads=d("storage", "page_cache_reads")
            )
            proofs["storage"].append(
                f"storage hits {d('storage', 'hits')}{short(d('storage', 'hits'))}, "
                f"page-cache reads {d('storage', 'page_cache_reads')}"
            )
        # Valkey: the same server without its storage tier (memory empty after the restart).
        s.stop()
        s.env.pop("HPKV_KV_STORAGE_PATH")
        s.start()
        watch = Watch(int(s.settled_stats()["pid"]), py_spy, args.out)
        for i in range(args.repeat):
            reset()
            before = s.settled_stats()
            results["valkey"].append(
                run_case(
                    s,
                    decode,
                    args.decode_tokens,
                    loads[args.repeat + i],
                    after,
                    watch,
                    f"valkey-{i}",
                    i % 2 == 0,
                )
            )
            st = s.settled_stats()
            hits = counter(st, "valkey", "hits") - counter(before, "valkey", "hits")
            results["valkey"][-1]["hits"] = hits
            proofs["valkey"].append(f"valkey hits {hits}{short(hits)}")
    finally:
        s.stop()
        valkey.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    chunks = args.tokens // CHUNK
    print()
    print(
        f"bench.itl: decode of {args.decode_tokens} tokens, a {args.tokens}-token request arriving "
        f"after {after}; {args.repeat} runs per case; medians over runs (each run: D's gaps that overlap "
        "P's flight)"
    )
    print(f"{'case':10} {'ITL p50':>9} {'ITL p99':>9} {'ITL max':>9} {'P TTFT':>8}  tokens  proof")
    for case, rs in results.items():
        med = {k: statistics.median([r[k] for r in rs]) for k in ("itl_p50_ms", "itl_p99_ms", "itl_max_ms")}
        tt = [r["load_ttft_s"] for r in rs if r["load_ttft_s"] is not None]
        ttft = statistics.median(tt) if tt else float("nan")
        n = sum(r["tokens_in_window"] for r in rs)
        print(
            f"{case:10} {med['itl_p50_ms']:8.1f}ms {med['itl_p99_ms']:8.1f}ms {med['itl_max_ms']:8.1f}ms "
            f"{ttft:7.3f}s  {n:6}  " + "; ".join(proofs[case])
        )
    print(f"(a load from a tier is proven by {chunks} hits per run)")
    print("engine process, CPU seconds per thread while P was in flight (D alone: 0.35 s), median over runs:")
    for case, rs in results.items():
        names = {k for r in rs for k in r["engine_threads_cpu_s"]}
        med = {k: statistics.median([r["engine_threads_cpu_s"].get(k, 0.0) for r in rs]) for k in names}
        top = sorted(med.items(), key=lambda kv: -kv[1])[:8]
        print(f"  {case:10} " + ", ".join(f"{k} {v:.3f}" for k, v in top if v > 0))
    unproven = unproven_runs(results, args.tokens)
    for why in unproven:
        print(f"NOT PROVEN: {why}")
    with open(os.path.join(args.out, "itl.json"), "w") as f:
        json.dump({"results": results, "proofs": proofs, "chunks": chunks, "unproven": unproven}, f, indent=1)
    return 1 if unproven else 0


def unproven_runs(results: dict[str, list[dict[str, Any]]], tokens: int) -> list[str]:
    """The runs whose counters do not show the case they are reported as: a tier load short of the
    prompt's chunks, a storage load served from the page cache, a control that vLLM's own cache did
    not serve, or a load with none of the decode's tokens beside it. A table with such a run is not
    the measurement it claims to be, so the bench exits 1."""
    chunks = tokens // CHUNK
    out = []
    for case, rs in results.items():
        for i, r in enumerate(rs):
            if case in ("storage", "valkey") and r.get("hits", 0) < chunks:
                out.append(f"{case} run {i}: {r.get('hits', 0)} {case} hits of {chunks} chunks")
            if case == "storage" and r.get("page_cache_reads", 0):
                out.append(f"storage run {i}: {r['page_cache_reads']} reads from the page cache")
            if case == "engine" and (
                r.get("hpkv_loaded_tokens", 0) >= CHUNK or r.get("prefix_cache_tokens", 0) < tokens - CHUNK
            ):
                out.append(
                    f"engine run {i}: vLLM's cache served {r.get('prefix_cache_tokens', 0)} tokens, "
                    f"hpkv {r.get('hpkv_loaded_tokens', 0)}"
                )
            if case in ("storage", "valkey") and not r["tokens_in_window"]:
                out.append(f"{case} run {i}: the decode had no gap that overlaps the load (it ended first)")
    return out
