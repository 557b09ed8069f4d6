"""vLLM with hpkv's valkey tier, configured the seed's way (kv_connector_extra_config), against a real
valkey-server: a restart with memory and storage emptied is served from valkey with the cold text,
one GET per chunk; a killed server means recomputation, not a stuck engine."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from hpkv.bench.server import Server
from hpkv.bench.valkey import ValkeyServers
from tests.e2e.conftest import CHUNK, Counters, make_server, text, wait_for, words_prompt


@pytest.fixture(scope="module")
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hpkv-e2e-valkey-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def valkey(tmp: str) -> Iterator[ValkeyServers]:
    with ValkeyServers(directory=os.path.join(tmp, "valkey")) as v:
        yield v


@pytest.fixture(scope="module")
def server(demo_model: str, tmp: str, valkey: ValkeyServers) -> Iterator[Server]:
    extra = {
        "remote_url": valkey.url,
        "valkey_num_workers": 4,
        "request_timeout": 2.0,
        "remote_serde": "naive",
    }
    cfg = json.dumps(
        {"kv_connector": "HpkvConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    s = make_server(demo_model, tmp, "valkey", 8451, connector_json=cfg)
    s.start()
    yield s
    s.stop()
    shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)


def test_restart_with_memory_and_storage_emptied_is_a_valkey_hit(
    server: Server, demo_model: str, valkey: ValkeyServers
) -> None:
    p = words_prompt(demo_model, 1100, seed=41)  # 4 full chunks
    c = Counters(server)
    cold = text(server, p)
    assert c.delta("connector", "stored_tokens") == 4 * CHUNK
    # vLLM handed the request over on arrival (on_new_request): the lookup used that existence check.
    assert c.delta("connector", "remote_checks_at_arrival") == 1
    wait_for(lambda: server.hpkv_stats()["tiers"]["valkey"]["writes"] >= 4, what="valkey writes")
    assert sum(valkey.key_counts()) == 4

    server.stop()
    shutil.rmtree(server.env["HPKV_KV_STORAGE_PATH"])  # storage emptied; the pool dies with the engine
    server.start()
    c = Counters(server)
    hits = valkey.keyspace_hits()
    assert text(server, p) == cold
    # The lookup's one batched EXISTS and one GET per chunk (TP 1): both count as keyspace hits.
    assert valkey.keyspace_hits() - hits == 8
    assert c.delta("connector", "remote_checks_at_arrival") == 1  # no second check
    assert c.delta("valkey", "hits") == 4
    assert c.delta("storage", "hits") == 0
    assert c.delta("connector", "loaded_tokens") == 4 * CHUNK
    assert "valkey: 4 chunks" in server.log_tail(200)


def test_killed_valkey_means_recompute_not_a_stuck_engine(
    server: Server, demo_model: str, valkey: ValkeyServers
) -> None:
    p = words_prompt(demo_model, 800, seed=43)
    c = Counters(server)
    cold = text(server, p)
    wait_for(lambda: c.delta("valkey", "writes") >= 3, what="valkey writes")
    valkey.kill()
    try:
        # A prompt nothing holds: its lookup asks the dead server (bounded by request_timeout,
        # then misses at once) and the engine computes it.
        fresh = words_prompt(demo_model, 900, seed=44)
        t0 = time.monotonic()
        first = text(server, fresh)
        assert time.monotonic() - t0 < 60
        assert server.hpkv_stats()["tiers"]["valkey"]["connected"] == 0
        assert text(server, p) == cold  # the local tiers keep serving
        server.reset_prefix_cache()
        assert text(server, fresh) == first
    finally:
        valkey.restart()
    wait_for(lambda: server.hpkv_stats()["tiers"]["valkey"]["connected"] == 1, what="reconnect")
