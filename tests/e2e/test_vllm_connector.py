"""HpkvConnectorV1 end to end on a real vLLM CPU server with the demo model.

The tests of this module share one server and run in file order: first the
cold runs and memory hits, then a restart for storage hits, mixed hits and a
corrupted chunk file. Every claim about a tier is checked with hpkv's
counters; every hit is checked by comparing greedy text with the cold run.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from hpkv.bench.server import Server, counter
from tests.e2e.conftest import BLOCK, CHUNK, Counters, _has_cuda, make_server, text, wait_for, words_prompt

SEED_JSON = '{"kv_connector":"HpkvConnectorV1", "kv_role":"kv_both"}'  # the seed's exact text
LENGTHS = (300, 1000, 3000)


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, object]]:
    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-")
    yield {"tmp": tmp, "cold": {}}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server(demo_model: str, env: dict[str, object]) -> Iterator[Server]:
    # By name, exactly as the seed writes it: resolved through hpkv's vLLM plugin.
    s = make_server(demo_model, str(env["tmp"]), "main", 8431, connector_json=SEED_JSON)
    s.start()
    yield s
    s.stop()
    shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)


def storage_files(server: Server) -> set[str]:
    root = server.env["HPKV_KV_STORAGE_PATH"]
    return {os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".kv")}


def wait_cascaded(server: Server) -> None:
    """Until every chunk queued for storage is written (the cascade holds a slot's pin until then)."""

    def done() -> bool:
        m = server.hpkv_stats()["tiers"]["memory"]
        return m["cascade_pending"] == 0 and m["pinned_slots"] == 0

    wait_for(done, what="storage writes to finish")


def pool_files(server: Server) -> list[str]:
    shm = server.env["HPKV_SHARE_MEM_FILE_PATH"]
    return sorted(n for n in os.listdir(shm) if n.endswith(".shm"))


# -- start ---------------------------------------------------------------------------------


def test_the_worker_maps_the_host_pool_at_start_and_it_outlives_the_request(
    server: Server, demo_model: str
) -> None:
    """vLLM sets up the worker's KV caches before it builds the scheduler: the worker maps (and on
    CUDA page-locks) its rank's file of the host pool then, so the first request does not pay for
    it; the file belongs to the pool process and stays."""
    from hpkv.tiers.memory.hostslots import pool_status

    names = pool_files(server)  # before any request
    assert len(names) == 1 and re.fullmatch(r"hpkv-\d+-[0-9a-f]{16}w1s\d+r0\.shm", names[0]), names
    st = pool_status(server.env["HPKV_SHARE_MEM_FILE_PATH"])
    assert st is not None and len(st["engines"]) == 1  # the scheduler's connection
    started = server.log_tail(100_000)
    if _has_cuda():
        assert "registered with CUDA" in started
    text(server, words_prompt(demo_model, 40, seed=7))
    assert pool_files(server) == names
    log = server.log_tail(100_000)
    assert "mapped at the first request instead" not in log
    assert log.count("registered with CUDA") == started.count("registered with CUDA")


# -- cold runs, GPU hits, memory hits -------------------------------------------------------


def test_cold_runs_store_every_full_chunk(server: Server, demo_model: str, env: dict) -> None:
    cold: dict[str, str] = env["cold"]  # type: ignore[assignment]
    for n in LENGTHS:
        c = Counters(server)
        before_files = storage_files(server)
        p = words_prompt(demo_model, n, seed=n)
        cold[p] = text(server, p)
        assert c.delta("connector", "loaded_tokens") == 0
        assert c.delta("connector", "stored_tokens") == (n // CHUNK) * CHUNK
        wait_for(
            lambda n=n, b=before_files: len(storage_files(server) - b) == n // CHUNK,
            what=f"{n // CHUNK} chunk files",
        )
        if n == 1000:
            env["files_1000"] = sorted(storage_files(server) - before_files)


def test_gpu_hit_is_the_engines_own(server: Server, demo_model: str, env: dict) -> None:
    cold: dict[str, str] = env["cold"]  # type: ignore[assignment]
    p = words_prompt(demo_model, 3000, seed=3000)
    c = Counters(server)
    assert text(server, p) == cold[p]
    assert c.delta("connector", "loaded_tokens") <= BLOCK  # at most the last partial block
    assert c.delta("memory", "promotions") == 0


def test_memory_hits_after_reset_prefix_cache_give_the_cold_text(
    server: Server, demo_model: str, env: dict
) -> None:
    cold: dict[str, str] = env["cold"]  # type: ignore[assignment]
    server.reset_prefix_cache()
    for n in LENGTHS:
        p = words_prompt(demo_model, n, seed=n)
        c = Counters(server)
        assert text(server, p) == cold[p], f"{n}-token prompt: memory hit changed the output"
        chunks = n // CHUNK
        assert c.delta("memory", "hits") == chunks
        assert c.delta("connector", "loaded_tokens") == chunks * CHUNK
        assert c.delta("memory", "promotions") == 0 and c.delta("storage", "hits") == 0


def test_shared_prefix_loads_exactly_the_shared_chunks(server: Server, demo_model: str) -> None:
    base = words_prompt(demo_model, 5 * CHUNK, seed=55).split()
    x = " ".join(base + words_prompt(demo_model, 200, seed=56).split())
    y = " ".join(base + words_prompt(demo_model, 300, seed=57).split())
    text(server, x)
    server.reset_prefix_cache()
    c = Counters(server)
    text(server, y)
    assert c.delta("memory", "hits") == 5
    assert c.delta("connector", "loaded_tokens") == 5 * CHUNK
    assert c.delta("connector", "stored_tokens") == CHUNK  # y's own sixth chunk (300 new words > 256)


def test_chunked_prefill_is_fully_stored_and_fully_hit(server: Server, demo_model: str, env: dict) -> None:
    n = 5000  # > --max-num-batched-tokens 2048: prefilled over three steps
    p = words_prompt(demo_model, n, seed=5000)
    c = Counters(server)
    cold = env["cold"][p] = text(server, p)
    assert c.delta("connector", "stored_tokens") == (n // CHUNK) * CHUNK
    server.reset_prefix_cache()
    c = Counters(server)
    assert text(server, p) == cold
    assert c.delta("connector", "loaded_tokens") == (n // CHUNK) * CHUNK
    assert c.delta("memory", "hits") == n // CHUNK


def test_eight_concurrent_requests_with_hits(server: Server, demo_model: str) -> None:
    prompts = [words_prompt(demo_model, 600 + 37 * i, seed=800 + i) for i in range(8)]
    with cf.ThreadPoolExecutor(8) as ex:
        cold = list(ex.map(lambda p: text(server, p), prompts))
    server.reset_prefix_cache()
    c = Counters(server)
    with cf.ThreadPoolExecutor(8) as ex:
        hot = list(ex.map(lambda p: text(server, p), prompts))
    assert hot == cold
    expected = sum(len(p.split()) // CHUNK for p in prompts)
    assert c.delta("memory", "hits") == expected
    # HPKV_ASYNC_LOAD=auto: on a GPU, hits found while the others are queued load asynchronously (their
    # copies hold no step); on the CPU build every hit loads inside its first step.
    async_loads = c.delta("connector", "async_loads")
    assert async_loads >= 1 if _has_cuda() else async_loads == 0


def test_seed_letter_prompts_gpu_then_memory(server: Server) -> None:
    prompt = " ".join(["A"] * 2048)
    c = Counters(server)
    _, first = server.complete(prompt, max_tokens=1)
    assert first["usage"]["prompt_tokens"] == 2048
    assert c.delta("connector", "stored_tokens") == 2048
    c = Counters(server)
    server.complete(prompt, max_tokens=1)
    assert c.delta("connector", "loaded_tokens") <= BLOCK
    server.reset_prefix_cache()
    c = Counters(server)
    server.complete(prompt, max_tokens=1)
    assert c.delta("memory", "hits") == 8  # ceil(2047 / 256): the engine computes the last token itself
    assert c.delta("connector", "loaded_tokens") == 2047


def test_reset_external_clears_the_memory_pool(server: Server, demo_model: str) -> None:
    p = words_prompt(demo_model, 300, seed=300)
    server.reset_prefix_cache(external=True)
    assert server.hpkv_stats()["tiers"]["memory"]["chunks"] == 0
    c = Counters(server)
    text(server, p)
    assert c.delta("memory", "hits") == 1 and c.delta("memory", "promotions") == 1  # from storage again


def test_metrics_endpoint_and_stats_command(server: Server) -> None:
    status, body = server.request("GET", "/metrics")
    assert status == 200
    assert b'hpkv_tier_hits_total{pid="' in body and b'tier="memory"' in body
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "hpkv.cli.main", "stats", "--dir", server.env["HPKV_SHARE_MEM_FILE_PATH"]],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "memory" in out.stdout and "storage" in out.stdout


def test_every_metric_the_grafana_dashboard_queries_is_served(server: Server) -> None:
    """deploy/grafana/hpkv.json queries hpkv's metrics beside vLLM's: each metric it names, and each
    ``what`` it selects, is in a real server's /metrics."""
    import json
    import pathlib
    import re

    dash = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "hpkv.json"
    exprs = [t["expr"] for p in json.loads(dash.read_text())["panels"] for t in p["targets"]]
    assert exprs
    status, body = server.request("GET", "/metrics")
    assert status == 200
    served = body.decode()
    names = {m.group(1) for e in exprs for m in re.finditer(r"\b((?:hpkv_|vllm:)[A-Za-z0-9_:]+)", e)}
    assert any(n.startswith("hpkv_") for n in names) and any(n.startswith("vllm:") for n in names)
    for name in names:
        assert re.search(rf"^{re.escape(name)}[{{ ]", served, re.M), f"/metrics has no {name}"
    for e in exprs:
        for m in re.finditer(r"((?:hpkv_)[A-Za-z0-9_]+)\{what=\"(\w+)\"\}", e):
            sample = rf'^{re.escape(m.group(1))}\{{[^}}]*what="{m.group(2)}"'
            assert re.search(sample, served, re.M), f"/metrics has no {m.group(1)} with what={m.group(2)}"


def test_benchmark_marks_a_memory_row_invalid_when_the_engine_served_it(server: Server) -> None:
    """The TTFT benchmark's proof: without /reset_prefix_cache the engine's own cache answers,
    so a row claiming "memory" must come out INVALID rather than be reported."""
    from hpkv.bench.prompts import letter_prompts
    from hpkv.bench.ttft_run import run_scenario
    from hpkv.bench.verify import Expect

    prompts = letter_prompts(2, 1024)
    log: list[dict[str, object]] = []
    expect = Expect(prompts=2, chunks=4, tokens=1024, block_size=BLOCK)
    run_scenario(server, "prefill", prompts, 0.0, expect, log)
    row = run_scenario(server, "memory", prompts, 0.0, expect, log)  # no reset: a GPU hit in disguise
    assert not row.valid and row.proof.startswith("INVALID")
    assert row.deltas["prefix_cache_hits"] > 0  # vLLM's own counter says who served it
    server.reset_prefix_cache()
    row = run_scenario(server, "memory", prompts, 0.0, expect, log)
    assert row.valid, row.proof


# -- after a restart: storage hits, mixed hits, a corrupted chunk -------------------------------


def test_restart_serves_storage_hits_with_the_cold_text(server: Server, demo_model: str, env: dict) -> None:
    cold: dict[str, str] = env["cold"]  # type: ignore[assignment]
    wait_cascaded(server)
    # Corrupt one of the 1000-token prompt's chunk files while the engine is down.
    bad = env["files_1000"][1]
    server.stop()
    with open(bad, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))
    server.start()
    waited = Counters(server)
    for n in (300, 3000):
        p = words_prompt(demo_model, n, seed=n)
        c = Counters(server)
        assert text(server, p) == cold[p], f"{n}-token prompt: storage hit changed the output"
        assert c.delta("storage", "hits") == n // CHUNK
        assert c.delta("memory", "promotions") == n // CHUNK
        assert c.delta("connector", "loaded_tokens") == (n // CHUNK) * CHUNK
    if _has_cuda():  # HPKV_ASYNC_LOAD=auto: on a GPU a storage hit loads asynchronously, alone too
        assert waited.delta("connector", "async_loads") == 2
    else:  # each request was all the engine had: its lookup waited for its own reads, no empty step
        assert waited.delta("connector", "lookups_waited_alone") >= 1


def test_corrupted_chunk_file_is_recomputed_not_served(server: Server, demo_model: str, env: dict) -> None:
    cold: dict[str, str] = env["cold"]  # type: ignore[assignment]
    p = words_prompt(demo_model, 1000, seed=1000)
    c = Counters(server)
    assert text(server, p) == cold[p]
    assert c.delta("storage", "corrupt") == 1
    assert c.delta("connector", "loaded_tokens") < 3 * CHUNK  # the hit stopped at the bad chunk


def test_mixed_hit_memory_then_storage(server: Server, demo_model: str, env: dict) -> None:
    n = 5000  # stored before the restart; 19 chunks in storage
    words = words_prompt(demo_model, n, seed=5000).split()
    full = " ".join(words)
    head = " ".join(words[: 4 * CHUNK + 10])
    text(server, head)  # promotes the first four chunks into memory
    server.reset_prefix_cache()
    c = Counters(server)
    assert text(server, full) == env["cold"][full]
    assert c.delta("memory", "hits") == n // CHUNK
    assert c.delta("memory", "promotions") == n // CHUNK - 4  # the rest came from storage


def test_bad_hpkv_value_refuses_to_start(demo_model: str, env: dict) -> None:
    s = make_server(demo_model, str(env["tmp"]), "bad", 8433, env={"HPKV_KV_MEM_POOL_SIZE": "16X"})
    with pytest.raises(Exception) as e:
        s.start(timeout=300)
    s.stop()
    log = s.log_tail(100000)  # the whole log: on a GPU the engine's own shutdown lines follow the error
    said = [line for line in log.splitlines() if "HPKV" in line or "hpkv" in line.lower() or "Error" in line]
    assert "HPKV_KV_MEM_POOL_SIZE='16X' is not a size; use e.g. 16G" in str(e.value) + log, "\n".join(
        said[-30:]
    )


def test_counters_are_consistent_after_everything(server: Server) -> None:
    t = server.hpkv_stats()["tiers"]
    assert t["memory"]["pinned_slots"] == 0 or counter(server.hpkv_stats(), "memory", "cascade_pending") > 0
    assert t["storage"]["errors"] == 0
