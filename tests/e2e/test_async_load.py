"""vLLM's async KV load (``HPKV_ASYNC_LOAD=true``) end to end on a real vLLM CPU server.

A storage hit is answered at once and its chunks reach the engine as they arrive in memory, while
the request waits in vLLM's WAITING_FOR_REMOTE_KVS; the greedy text must equal the cold run's, the
counters must show the tier, and a corrupted chunk file must end the load there (vLLM recomputes
from its blocks, told through the load-error blocks), never be served.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from hpkv.bench.server import Server
from tests.e2e.conftest import CHUNK, Counters, make_server, text, wait_for, words_prompt

LENGTHS = (700, 2100)


@pytest.fixture(scope="module")
def server(demo_model: str) -> Iterator[Server]:
    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-async-")
    s = make_server(demo_model, tmp, "async", 8437, env={"HPKV_ASYNC_LOAD": "true"})
    s.start()
    yield s
    s.stop()
    shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


def from_storage_only(server: Server) -> None:
    """Every stored chunk written to storage, then the engine's cache and the memory pool emptied."""

    def written() -> bool:
        m = server.hpkv_stats()["tiers"]["memory"]
        return m["cascade_pending"] == 0 and m["pinned_slots"] == 0

    wait_for(written, what="storage writes to finish")
    server.reset_prefix_cache(external=True)


def log_lines(server: Server, needle: str) -> list[str]:
    with open(server.log_path, errors="replace") as f:
        return [line for line in f if needle in line]


def test_async_storage_hits_give_the_cold_text(server: Server, demo_model: str) -> None:
    prompts = {n: words_prompt(demo_model, n, seed=7000 + n) for n in LENGTHS}
    cold = {n: text(server, p) for n, p in prompts.items()}
    from_storage_only(server)
    said = len(log_lines(server, "async load of request"))
    for n, p in prompts.items():
        c = Counters(server)
        assert text(server, p) == cold[n], f"{n}-token prompt: an async storage hit changed the output"
        assert c.delta("storage", "hits") == n // CHUNK
        assert c.delta("memory", "promotions") == n // CHUNK
        assert c.delta("connector", "loaded_tokens") == (n // CHUNK) * CHUNK
        assert c.delta("connector", "load_failures") == 0
    # Each went through vLLM's async load (not "ask again"), and said how long it took.
    assert len(log_lines(server, "async load of request")) - said == len(LENGTHS)
    assert any("async," in line for line in log_lines(server, "Retrieved"))


def test_async_a_corrupted_chunk_is_recomputed_not_served(server: Server, demo_model: str) -> None:
    n = 1500  # 5 full chunks
    p = words_prompt(demo_model, n, seed=7777)
    before = storage_files(server)
    cold = text(server, p)
    from_storage_only(server)
    mine = sorted(storage_files(server) - before)
    assert len(mine) == n // CHUNK
    with open(mine[1], "r+b") as f:  # one of its chunk files (which one does not matter)
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x5A]))
    c = Counters(server)
    assert text(server, p) == cold
    assert c.delta("storage", "corrupt") == 1
    assert c.delta("connector", "loaded_tokens") < (n // CHUNK) * CHUNK  # ended at the bad chunk


def storage_files(server: Server) -> set[str]:
    root = server.env["HPKV_KV_STORAGE_PATH"]
    return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")}
