"""``hpkv bench serve --replicas N``: N engines of one system on one host behind a round-robin router
(:mod:`hpkv.bench.router`), the multi-turn load through it, counters summed over the replicas.

hpkv's replicas share one pool directory and one storage directory, as engines on one host do: with
``hpkv`` that is one memory pool (the host pool), with ``hpkv-engine`` a pool per engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from hpkv.bench.serve_run import hpkv_tiers, run_load, runner_args
from hpkv.bench.serve_stats import sources, summarize
from hpkv.bench.server import ServerError
from hpkv.bench.workload import Turn


def replicated_run(
    args: argparse.Namespace,
    system: str,
    model: str,
    tokenizer: Any,
    requests: list[Turn],
    level: dict[str, float],
    chunk: int,
    warm: list[list[int]],
) -> dict[str, Any]:
    """``--replicas`` fresh servers of ``system`` on one host (one pool directory, one storage
    directory), a round-robin router in front, the load through it; counters summed over replicas."""
    import types

    from hpkv.bench.router import Router
    from hpkv.bench.texts import read_from, served_by
    from hpkv.bench.ttft_run import Runner
    from hpkv.bench.verify import Expect, hpkv_deltas
    from hpkv.tiers.memory.hostslots import stop_pool

    run: dict[str, Any] = {"system": system, "level": level, "replicas": args.replicas}
    runners: list[Any] = []
    router: Router | None = None
    try:
        for i in range(args.replicas):
            out = os.path.join(args.out, f"replica{i}")
            os.makedirs(out, exist_ok=True)
            r = Runner(runner_args(args, args.port + i, out), system, model, [], Expect(0, 0, 0), [])
            if runners:  # one host: the first replica's pool and storage directories
                shutil.rmtree(r.shm, ignore_errors=True)
                shutil.rmtree(r.work, ignore_errors=True)
                r.shm, r.work = runners[0].shm, runners[0].work
            runners.append(r)
            tiers = hpkv_tiers(args)
            r.storage = "storage" in tiers
            if not r.start(tiers):
                run["error"] = r.out.error
                return run
            assert r.server is not None
            r.server.keep_pool = True  # the replicas' pool outlives each of them until all stop
        servers = [r.server for r in runners]
        for s in servers:
            for prompt in warm:
                s.complete(prompt, max_tokens=2)
        hpkv = runners[0].hpkv
        before = [s.settled_stats() for s in servers] if hpkv else None
        eng0 = [s.engine_counters() for s in servers]
        log_at = [s.log_size() for s in servers]
        router = Router(args.port + 50, [s.port for s in servers]).start()
        front = types.SimpleNamespace(port=router.port, model=servers[0].model)
        result = run_load(front, tokenizer, requests, args.output, level)  # type: ignore[arg-type]
        run["per_replica_requests"] = list(router.sent)
        after = [s.drained_stats() for s in servers] if hpkv else None
        eng1 = [s.engine_counters() for s in servers]
        engine: dict[str, int] = {}
        for e0, e1 in zip(eng0, eng1, strict=True):
            for k in e1:
                engine[k] = engine.get(k, 0) + e1.get(k, 0) - e0.get(k, 0)
        hp: dict[str, int] | None = None
        if before is not None and after is not None:
            hp = {}
            for b, a in zip(before, after, strict=True):
                for k, v in hpkv_deltas(b, a).items():
                    hp[k] = hp.get(k, 0) + v
        run["metrics"] = summarize(result, first_turns=len({t.user for t in requests}))
        run["sources"] = sources(sum(result["input_lens"]), engine, hp, chunk)
        run["ttfts"] = result["ttfts"]
        run["texts"] = result["generated_texts"]
        run["errors"] = [e for e in result["errors"] if e]
        run["failed_indices"] = [i for i, e in enumerate(result["errors"]) if e]
        run["turns"] = [(t.user, t.turn) for t in requests]
        run["served_by"] = {}
        for s, at in zip(servers, log_at, strict=True):
            for i, what in served_by(read_from(s.log_path, at)).items():
                run["served_by"][i] = f"{what} on :{s.port}"
    except (ServerError, RuntimeError, OSError) as e:
        run["error"] = str(e).splitlines()[0][:300]
    finally:
        if router is not None:
            router.stop()
        for r in runners:
            r.close()
        if runners:
            stop_pool(runners[0].shm)
    return run
