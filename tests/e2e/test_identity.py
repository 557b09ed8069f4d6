"""Chunk identity on a real vLLM (CPU build): LoRA adapters and cache_salt tenants never share KV.

One server with two random LoRA adapters (both change k_proj and v_proj, so their KV
differs from each other's and from the base model's). Every isolation claim is
checked with vLLM's own ``external_prefix_cache_hits`` and hpkv's counters being
zero; every hit claim with both being non-zero and the greedy text equal to the
cold text of the same adapter/tenant.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from hpkv.bench.server import Server
from tests.e2e.conftest import CHUNK, Counters, make_server, words_prompt

N = 1300  # 5 full chunks
FULL = (N // CHUNK) * CHUNK


@pytest.fixture(scope="module")
def env(demo_model: str) -> Iterator[dict[str, Any]]:
    from hpkv.bench.demo_model import write_demo_lora

    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-ident-")
    a = write_demo_lora(os.path.join(tmp, "lora-a"), demo_model, seed=1)
    b = write_demo_lora(os.path.join(tmp, "lora-b"), demo_model, seed=2)
    yield {"tmp": tmp, "a": a, "b": b, "cold": {}}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server(demo_model: str, env: dict[str, Any]) -> Iterator[Server]:
    s = make_server(
        demo_model,
        env["tmp"],
        "ident",
        8441,
        vllm_args=[
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "2",
            "--lora-modules",
            f"a={env['a']}",
            f"b={env['b']}",
        ],
    )
    s.start()
    yield s
    s.stop()
    shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)


class Seen:
    """What one request did: hpkv's counters and vLLM's own external-hit counter around it."""

    def __init__(self, server: Server, prompt: str, **kw: Any) -> None:
        server.reset_prefix_cache()  # the engine's own cache must not serve it
        c = Counters(server)
        e0 = server.engine_counters()
        _, resp = server.complete(prompt, max_tokens=12, **kw)
        self.text: str = resp["choices"][0]["text"]
        self.loaded = c.delta("connector", "loaded_tokens")
        self.stored = c.delta("connector", "stored_tokens")
        self.storage_hits = c.delta("storage", "hits")
        self.external = server.engine_counters().get("external_prefix_cache_hits", 0) - e0.get(
            "external_prefix_cache_hits", 0
        )


def test_adapters_never_share_kv(server: Server, demo_model: str, env: dict[str, Any]) -> None:
    p = words_prompt(demo_model, N, seed=11)
    a = Seen(server, p, model="a")
    assert (a.loaded, a.external, a.stored) == (0, 0, FULL)
    b = Seen(server, p, model="b")
    # Same tokens, other adapter: nothing of a's KV is handed to b, and b stores its own.
    assert (b.loaded, b.external, b.stored) == (0, 0, FULL)
    base = Seen(server, p)
    assert (base.loaded, base.external) == (0, 0)
    assert len({a.text, b.text, base.text}) == 3, "the adapters must change the greedy text"
    # Each adapter hits its own chunks and gets its own cold text back.
    for name, cold in (("a", a), ("b", b)):
        hit = Seen(server, p, model=name)
        assert hit.loaded == hit.external == FULL, name
        assert hit.text == cold.text, name
    env["cold"] = {"prompt": p, "a": a.text, "b": b.text}


def test_cache_salt_tenants_never_share_kv(server: Server, demo_model: str, env: dict[str, Any]) -> None:
    q = words_prompt(demo_model, N, seed=12)
    t1 = Seen(server, q, cache_salt="tenant-1")
    assert (t1.loaded, t1.external, t1.stored) == (0, 0, FULL)
    t2 = Seen(server, q, cache_salt="tenant-2")
    assert (t2.loaded, t2.external) == (0, 0)
    plain = Seen(server, q)
    assert (plain.loaded, plain.external) == (0, 0), "an unsalted request loaded a salted request's chunks"
    again = Seen(server, q, cache_salt="tenant-1")
    assert again.loaded == again.external == FULL
    assert again.text == t1.text
    env["salted"] = {"prompt": q, "text": t1.text}


def test_restart_hits_from_storage_per_adapter_and_tenant(server: Server, env: dict[str, Any]) -> None:
    server.restart()  # memory pool and the engine's cache are empty; storage stays
    cold = env["cold"]
    a = Seen(server, cold["prompt"], model="a")
    assert a.loaded == a.external == FULL and a.storage_hits == FULL // CHUNK
    assert a.text == cold["a"]
    salted = env["salted"]
    t1 = Seen(server, salted["prompt"], cache_salt="tenant-1")
    assert t1.loaded == t1.external == FULL and t1.storage_hits == FULL // CHUNK
    assert t1.text == salted["text"]
    t2 = Seen(server, salted["prompt"], cache_salt="tenant-2")  # stored before the restart, by tenant-2
    assert t2.loaded == t2.external == FULL


def test_a_server_stopped_with_sigterm_leaves_no_pool_file(server: Server, demo_model: str) -> None:
    """The host pool's files belong to its process, not to the engine, and go when the pool stops
    (here with the server, as nothing else shares its directory): nothing is left in /dev/shm
    holding RAM."""
    shm = server.env["HPKV_SHARE_MEM_FILE_PATH"]
    Seen(server, words_prompt(demo_model, 600, seed=13))
    assert [n for n in os.listdir(shm) if n.endswith(".shm")]  # the pool holds the chunk
    again = Seen(server, words_prompt(demo_model, 600, seed=13))
    assert again.loaded == again.external == 512
    server.stop()
    assert not [n for n in os.listdir(shm) if n.endswith(".shm")]
