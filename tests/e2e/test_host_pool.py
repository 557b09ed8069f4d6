"""Two real vLLM (CPU build) servers on one host share hpkv's memory tier (``HPKV_MEMORY_POOL=shared``,
the default): one pool directory, no storage tier, so every hit below is the host pool's.

A prompt computed on A is a memory hit on B with A's text; a restarted A finds it in memory; a
server with another salt finds nothing; and a server killed with SIGKILL in the middle of a request
leaves the pool with nothing pinned while the other keeps serving the right text."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hpkv.bench.server import Server
from hpkv.tiers.memory.hostslots import pool_status, stop_pool
from tests.e2e.conftest import CHUNK, Counters, make_server, text, wait_for, words_prompt

TOKENS = 1100  # four whole chunks to load, the rest computed


@pytest.fixture(scope="module")
def pair(demo_model: str) -> Iterator[tuple[Server, Server, dict[str, Any]]]:
    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-host-")
    shm = os.path.join("/dev/shm", f"hpkv-e2e-{os.getpid()}-host")
    env = {"HPKV_SHARE_MEM_FILE_PATH": shm, "HPKV_KV_STORAGE_PATH": ""}  # memory is the only tier
    a = make_server(demo_model, tmp, "host-a", 8401, env=env)
    b = make_server(demo_model, tmp, "host-b", 8402, env=env)
    a.keep_pool = b.keep_pool = True
    a.start()
    b.start()
    yield a, b, {"shm": shm, "tmp": tmp}
    a.stop()
    b.stop()
    stop_pool(shm)
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)


def external(server: Server) -> int:
    return server.engine_counters().get("external_prefix_cache_hits", 0)


def pinned(shm: str) -> int:
    st = pool_status(shm)
    assert st is not None, "the host pool is not running"
    return sum(g["pinned"] for g in st["groups"].values())


def computed_on(server: Server, prompt: str) -> str:
    """``prompt``'s text on ``server``, once its chunks are in the pool (no store still pinned)."""
    out = text(server, prompt)
    wait_for(lambda: server.hpkv_stats()["tiers"]["memory"]["pinned_slots"] == 0, what="the stores to land")
    return out


def assert_memory_hit(server: Server, prompt: str, want: str) -> None:
    """``prompt`` on ``server`` gives ``want``, its whole chunks loaded from the pool."""
    c, e0 = Counters(server), external(server)
    assert text(server, prompt) == want
    assert c.delta("memory", "hits") == TOKENS // CHUNK
    assert external(server) - e0 >= (TOKENS // CHUNK) * CHUNK


def test_a_prompt_computed_on_one_server_is_a_memory_hit_on_the_other(
    pair: tuple[Server, Server, dict[str, Any]], demo_model: str
) -> None:
    a, b, _ = pair
    p = words_prompt(demo_model, TOKENS, seed=4400)
    assert_memory_hit(b, p, computed_on(a, p))


def test_a_restarted_server_finds_its_prompt_in_memory(
    pair: tuple[Server, Server, dict[str, Any]], demo_model: str
) -> None:
    a, _, _ = pair
    p = words_prompt(demo_model, TOKENS, seed=4401)
    cold = computed_on(a, p)
    a.restart()  # the engine and vLLM's own cache are new; the host pool is not
    assert_memory_hit(a, p, cold)


def test_a_server_killed_mid_request_leaves_nothing_pinned_and_the_other_serves_right(
    pair: tuple[Server, Server, dict[str, Any]], demo_model: str
) -> None:
    a, b, info = pair
    shared = words_prompt(demo_model, TOKENS, seed=4402)
    cold = computed_on(b, shared)
    text(a, shared)  # A loads it from the pool: its pins come and go
    long = words_prompt(demo_model, 6000, seed=4403)  # several seconds of prefill on A, storing as it goes
    failed: list[BaseException] = []

    def ask_a() -> None:
        try:
            text(a, long)
        except BaseException as e:  # the kill cuts the connection: expected
            failed.append(e)

    wrote = a.hpkv_stats()["tiers"]["memory"]["writes"]
    t = threading.Thread(target=ask_a)
    t.start()
    wait_for(lambda: a.hpkv_stats()["tiers"]["memory"]["writes"] > wrote, timeout=60, what="A to store")
    assert a.proc is not None
    os.killpg(a.proc.pid, signal.SIGKILL)
    t.join(timeout=60)
    a.proc.wait()
    a.proc = None
    b.reset_prefix_cache()  # vLLM's own cache on B forgets it; the pool does not
    assert_memory_hit(b, shared, cold)  # B serves on, from the pool
    wait_for(lambda: pinned(info["shm"]) == 0, what="the pool to let go of A's pins and reservations")
    a.start()  # the killed server comes back to the same pool
    assert_memory_hit(a, shared, cold)


def test_a_server_with_another_salt_shares_nothing(
    pair: tuple[Server, Server, dict[str, Any]], demo_model: str
) -> None:
    a, b, _ = pair
    p = words_prompt(demo_model, TOKENS, seed=4404)
    cold = computed_on(a, p)
    b.stop()
    b.env["HPKV_SALT"] = "tenant-b"
    try:
        b.start()
        c, e0 = Counters(b), external(b)
        assert text(b, p) == cold  # computed: the model is the same
        assert c.delta("memory", "hits") == 0 and external(b) == e0
    finally:
        b.stop()
        del b.env["HPKV_SALT"]
        b.start()
