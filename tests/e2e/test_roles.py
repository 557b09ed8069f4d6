"""kv_producer stores and never loads; kv_consumer loads and never stores.

The consumer runs with VLLM_ENABLE_HPKV=0 (no plugin registration), so it also
proves that "kv_connector_module_path" alone finds the connector.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import CHUNK, Counters, make_server, text, words_prompt

MODULE_JSON = (
    '{"kv_connector":"HpkvConnectorV1","kv_connector_module_path":"hpkv.integrations.vllm.connector",'
    '"kv_role":"%s"}'
)


@pytest.fixture(scope="module")
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hpkv-e2e-roles-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_producer_stores_but_never_loads_then_consumer_loads_but_never_stores(
    demo_model: str, tmp: str
) -> None:
    storage = os.path.join(tmp, "shared-storage")
    p = words_prompt(demo_model, 1100, seed=11)
    fresh = words_prompt(demo_model, 700, seed=12)

    prod = make_server(
        demo_model,
        tmp,
        "producer",
        8441,
        role="kv_producer",
        storage=storage,
        connector_json=MODULE_JSON % "kv_producer",
    )
    prod.start()
    try:
        c = Counters(prod)
        cold = text(prod, p)
        assert c.delta("connector", "stored_tokens") == 4 * CHUNK
        prod.reset_prefix_cache()
        c = Counters(prod)
        assert text(prod, p) == cold
        assert c.delta("connector", "loaded_tokens") == 0 and c.delta("connector", "lookups") == 0
        # wait for the cascade: the consumer reads storage only
        from tests.e2e.conftest import wait_for

        wait_for(lambda: prod.hpkv_stats()["tiers"]["storage"]["writes"] >= 4, what="storage writes")
    finally:
        prod.stop()

    cons = make_server(
        demo_model,
        tmp,
        "consumer",
        8442,
        role="kv_consumer",
        storage=storage,
        env={"VLLM_ENABLE_HPKV": "0"},
        connector_json=MODULE_JSON % "kv_consumer",
    )
    cons.start()
    try:
        c = Counters(cons)
        assert text(cons, p) == cold
        assert c.delta("storage", "hits") == 4 and c.delta("connector", "loaded_tokens") == 4 * CHUNK
        assert c.delta("connector", "stored_tokens") == 0
        c = Counters(cons)
        text(cons, fresh)
        assert c.delta("connector", "stored_tokens") == 0 and c.delta("memory", "writes") == 0
    finally:
        cons.stop()
    for s in (prod, cons):
        shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
