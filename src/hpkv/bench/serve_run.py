"""``hpkv bench serve``'s runner: one server at one load level through vLLM's benchmark client,
with a fault put in place between turns, its counters read around the load."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from hpkv.bench.faults import NEEDS_VALKEY, Fault, Gate, by_turn, fault_counters, request_tag
from hpkv.bench.logprobs import LogprobClient
from hpkv.bench.serve_stats import sources, summarize
from hpkv.bench.server import Server, ServerError
from hpkv.bench.workload import Turn


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


def demo_model_dir(out: str) -> str:
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
    from hpkv.bench.ttft_run import Runner
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
