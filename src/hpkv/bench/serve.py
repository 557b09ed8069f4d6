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
import asyncio
import json
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

from hpkv.bench.faults import FAULTS, NEEDS_VALKEY, Fault, Gate, by_turn, fault_counters, request_tag
from hpkv.bench.logprobs import LogprobClient
from hpkv.bench.serve_report import charts, print_faults, print_run, print_spread, print_table
from hpkv.bench.server import Server, ServerError
from hpkv.bench.texts import compare_texts, print_wrong

# hpkv-*: hpkv with settings of its own (see ttft.VARIANT_ENV)
SYSTEMS = ("hpkv", "hpkv-engine", "hpkv-sync", "hpkv-async", "none", "lmcache", "native")


@dataclass(frozen=True)
class Turn:
    user: int
    turn: int
    prompt: list[int]


def sessions(
    users: int, context: int, turns: int, question: int, seed: int, vocab: tuple[int, int]
) -> list[Turn]:
    """Turn-major, round-robin: every user's turn t before anyone's turn t+1. Token ids drawn from
    ``vocab`` [lo, hi) with ``seed``, so every system and run gets the same prompts."""
    rng = random.Random(seed)
    lo, hi = vocab
    ctx = [[rng.randrange(lo, hi) for _ in range(context)] for _ in range(users)]
    out = []
    for t in range(turns):
        for u in range(users):
            out.append(Turn(u, t, ctx[u] + [rng.randrange(lo, hi) for _ in range(question)]))
    return out


def warmups(context: int, seed: int, vocab: tuple[int, int]) -> list[list[int]]:
    """Two short prompts and one of ``context`` tokens, none sharing a chunk with any user's prompts
    (their own random stream): sent to each fresh server before the load, not counted."""
    rng = random.Random(f"warm-up {seed}")
    lo, hi = vocab
    return [[7] * 64, [8] * 64, [rng.randrange(lo, hi) for _ in range(context)]]


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


def run_load(
    server: Server,
    tokenizer: Any,
    requests: list[Turn],
    output_len: int,
    level: dict[str, float],
    fault: Fault | None = None,
    logprobs: int = 0,
) -> dict[str, Any]:
    """One load level through vLLM's benchmark client (completions endpoint, streamed, greedy), each
    request sent with the id :func:`request_tag` gives it; ``fault``: put in place between turns;
    ``logprobs``: each token's top log-probabilities are kept too (``steps``, per request)."""
    from vllm.benchmarks import serve as vllm_serve
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS as funcs

    base = f"http://127.0.0.1:{server.port}"
    tags = [request_tag(i, t.user, t.turn) for i, t in enumerate(requests)]
    reqs = [
        SampleRequest(
            prompt=t.prompt, prompt_len=len(t.prompt), expected_output_len=output_len, request_id=tag
        )
        for t, tag in zip(requests, tags, strict=True)
    ]
    inner = funcs["openai"]
    client = None
    if logprobs:
        inner = client = LogprobClient(logprobs)
    gate = None
    if fault is not None:
        inner = gate = Gate(inner, fault, {tag: t.turn for tag, t in zip(tags, requests, strict=True)})
    endpoint = "hpkv-bench"  # vLLM's client looks its request function up by this name
    funcs[endpoint] = inner
    try:
        result = asyncio.run(_benchmark(vllm_serve, endpoint, base, server, tokenizer, reqs, level, gate))
    finally:
        funcs.pop(endpoint, None)
    if client is not None:
        result["steps"] = [client.steps.get(tag, []) for tag in tags]
    return result


async def _benchmark(
    vllm_serve: Any,
    endpoint: str,
    base: str,
    server: Server,
    tokenizer: Any,
    reqs: list[Any],
    level: dict[str, float],
    gate: Gate | None,
) -> dict[str, Any]:
    try:
        result: dict[str, Any] = await vllm_serve.benchmark(
            task_type=_task_type(),
            endpoint_type=endpoint,
            api_url=base + "/v1/completions",
            base_url=base,
            model_id=server.model,
            model_name=server.model,
            tokenizer=tokenizer,
            input_requests=reqs,
            logprobs=None,
            request_rate=level.get("rate", float("inf")),
            burstiness=1.0,  # Poisson arrivals at ``rate``
            disable_tqdm=True,
            num_warmups=0,  # vLLM's warm-up repeats the first request: it would cache user 0's context
            profile=False,
            selected_percentile_metrics=["ttft", "itl", "e2el"],
            selected_percentiles=[50, 90, 99],
            ignore_eos=True,
            goodput_config_dict={},
            max_concurrency=int(level["concurrency"]) if "concurrency" in level else None,
            lora_modules=None,
            extra_headers=None,
            extra_body={"temperature": 0},
            ready_check_timeout_sec=0,  # the server is up; its check would also send user 0's prompt
        )
        return result
    finally:
        if gate is not None:
            await gate.aclose()


def _task_type() -> Any:
    from vllm.benchmarks import serve

    return serve.TaskType.GENERATION


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
    model = args.model or _demo_model(args.out)
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


def hpkv_tiers(args: argparse.Namespace, fault_kind: str | None = None) -> list[str]:
    tiers = [t for t in args.tiers.split(",") if t]
    if args.valkey or fault_kind in NEEDS_VALKEY:
        tiers.append("valkey")
    return list(dict.fromkeys(tiers))


def fault_turn(args: argparse.Namespace) -> int:
    """The turn sent with ``--fault`` in place: ``--fault-turn``, else the second-to-last (the
    first turns are cold for every system; the last shows the recovery)."""
    return int(args.fault_turn) if args.fault_turn is not None else max(1, int(args.turns) - 2)


def runner_args(args: argparse.Namespace, port: int, out: str) -> argparse.Namespace:
    """What the TTFT bench's Runner needs to start one server of this load's shape."""
    return argparse.Namespace(
        url=None,
        pool_size=args.pool_size,
        remote_url=None,
        valkey_link_mbs=0,
        tokens=args.context + args.question + args.output,
        vllm_args=f"{args.vllm_args} --num-gpu-blocks-override {args.engine_blocks}",
        port=port,
        block_size=args.block_size,
        out=out,
    )


def _demo_model(out: str) -> str:
    from hpkv.bench.demo_model import write_demo_model

    path = os.path.join(out, "demo-model-small")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_demo_model(path, "small")
    return path


def one_run(
    args: argparse.Namespace,
    system: str,
    model: str,
    tokenizer: Any,
    requests: list[Turn],
    level: dict[str, float],
    chunk: int,
    warm: list[list[int]],
    fault_kind: str | None = None,
) -> dict[str, Any]:
    """A fresh server for ``system`` (tiers empty), warm-up (``warm``), the load (with ``fault_kind``
    put in place between turns), the counters around it."""
    from hpkv.bench.texts import read_from, served_by
    from hpkv.bench.ttft import Runner
    from hpkv.bench.verify import Expect, hpkv_deltas

    run: dict[str, Any] = {"system": system, "level": level}
    runner = Runner(runner_args(args, args.port, args.out), system, model, [], Expect(0, 0, 0), [])
    fault = None
    try:
        tiers = hpkv_tiers(args, fault_kind)
        runner.storage = "storage" in tiers
        if fault_kind is not None:
            run["fault"] = fault_kind
            fault = Fault(fault_kind, fault_turn(args), runner, disk_size=args.fault_disk)
            fault.prepare(runner._storage_dir())
        if not runner.start(tiers):
            run["error"] = runner.out.error
            return run
        server = runner.server
        assert server is not None
        for prompt in warm:  # nobody revisits them
            server.complete(prompt, max_tokens=2)
        is_hpkv = runner.hpkv
        before = server.settled_stats() if is_hpkv else None
        eng0 = server.engine_counters()
        log_at = server.log_size()
        result = run_load(server, tokenizer, requests, args.output, level, fault, args.logprobs)
        after = server.drained_stats() if is_hpkv else None
        run["served_by"] = served_by(read_from(server.log_path, log_at))
        eng1 = server.engine_counters()
        engine = {k: eng1.get(k, 0) - eng0.get(k, 0) for k in eng1}
        hp = None
        if before is not None and after is not None:
            hp = hpkv_deltas(before, after)
            run["hpkv_tiers"] = after.get("tiers", {})
        run["metrics"] = summarize(result, first_turns=len({t.user for t in requests}))
        ranks = int(after.get("ranks", 1)) if after is not None else 1
        run["sources"] = sources(sum(result["input_lens"]), engine, hp, chunk, ranks)
        run["preemptions"] = engine.get("num_preemptions")  # None: this vLLM does not export it
        run["ttfts"] = result["ttfts"]
        sent = result.get("start_times") or []  # with the TTFTs: which request overtook which
        run["sent_s"] = [t - min(sent) for t in sent]
        run["sent_at"] = sent  # perf_counter: CLOCK_MONOTONIC on Linux, as an HPKV_STEP_TRACE's stamps
        run["texts"] = result["generated_texts"]
        if "steps" in result:
            run["steps"] = result["steps"]
        run["errors"] = [e for e in result["errors"] if e]
        run["failed_indices"] = [i for i, e in enumerate(result["errors"]) if e]
        run["turns"] = [(t.user, t.turn) for t in requests]
        run["by_turn"] = by_turn(result, requests)
        if fault is not None:
            run["fault_turn"] = fault.at_turn
            run["fault_events"] = [(what, t - min(sent)) for what, t in fault.events] if sent else []
            if before is not None and after is not None:
                run["fault_counters"] = fault_counters(before, after)
    except (ServerError, RuntimeError, OSError) as e:
        run["error"] = str(e).splitlines()[0][:300]
    finally:
        if fault is not None:  # first: a stopped valkey-server resumes, so it can be stopped
            fault.close()
        runner.close()
    return run


if __name__ == "__main__":
    sys.exit(main())
