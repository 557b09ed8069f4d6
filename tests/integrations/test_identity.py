"""Chunk identity from vLLM's own request objects: what the engine keys its cache by, hpkv keys by.

Built with ``vllm.v1.request.Request`` (the object the scheduler hands the connector),
``LoRARequest`` and ``MultiModalFeatureSpec``/``PlaceholderRange``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from hpkv.bench.demo_model import write_demo_lora
from hpkv.core.keys import chunk_keys, tenant_tag
from hpkv.integrations.vllm.identity import IdentityReader

C = 16
SEED = bytes(range(16))
TOKENS = list(range(100, 100 + 4 * C))


@pytest.fixture
def demo_model_dir(tmp_path: Any) -> str:
    """What write_demo_lora reads of a model: its config (the tiny demo model's shape)."""
    d = tmp_path / "model"
    d.mkdir()
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    (d / "config.json").write_text(json.dumps(cfg | {"dtype": "float32"}))
    return str(d)


def req(tokens: list[int] | None = None, **kw: Any) -> Request:
    return Request("r", TOKENS if tokens is None else tokens, SamplingParams(max_tokens=1), None, **kw)


def keys(reader: IdentityReader, r: Request) -> list[bytes]:
    ident = reader.of(r)
    assert ident.skip is None, ident.skip
    n = r.num_prompt_tokens
    return chunk_keys(ident.seed, r.prompt_token_ids or [0] * n, C, extras=ident.extras)


def image(ident: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", ident, PlaceholderRange(offset=offset, length=length))


def test_plain_request_keys_are_the_namespace_keys() -> None:
    reader = IdentityReader(SEED, C)
    assert keys(reader, req()) == chunk_keys(SEED, TOKENS, C)
    assert reader.of(req()).tenant == "shared"


def test_cache_salt_separates_every_chunk_and_names_a_tenant() -> None:
    reader = IdentityReader(SEED, C)
    plain = keys(reader, req())
    t1 = keys(reader, req(cache_salt="tenant-1"))
    t2 = keys(reader, req(cache_salt="tenant-2"))
    assert keys(reader, req(cache_salt="tenant-1")) == t1
    assert not set(t1) & set(t2) and not set(t1) & set(plain)
    assert reader.of(req(cache_salt="tenant-1")).tenant == tenant_tag("", "tenant-1") != "shared"
    assert tenant_tag("", "tenant-1") != tenant_tag("", "tenant-2")
    assert "tenant" not in tenant_tag("", "tenant-1")  # the salt never appears in a key name
    # HPKV_SALT is part of the tenant too: two deployments' tenants of the same name stay apart.
    assert IdentityReader(SEED, C, salt="dep-2").of(req(cache_salt="tenant-1")).tenant != tenant_tag(
        "", "tenant-1"
    )


def test_lora_identity_follows_the_adapters_content(tmp_path: Any, demo_model_dir: str) -> None:
    a = write_demo_lora(str(tmp_path / "a"), demo_model_dir, seed=1)
    b = write_demo_lora(str(tmp_path / "b"), demo_model_dir, seed=2)
    reader = IdentityReader(SEED, C)
    ka = keys(reader, req(lora_request=LoRARequest("a", 1, a)))
    kb = keys(reader, req(lora_request=LoRARequest("b", 2, b)))
    plain = keys(reader, req())
    assert not set(ka) & set(kb) and not set(ka) & set(plain)
    # Renamed and moved, same content: the same chunks.
    moved = str(tmp_path / "a-renamed")
    os.rename(a, moved)
    assert keys(reader, req(lora_request=LoRARequest("other-name", 7, moved))) == ka
    # Retrained under the same name and path: new chunks.
    write_demo_lora(moved, demo_model_dir, seed=3)
    retrained = keys(reader, req(lora_request=LoRARequest("a", 1, moved)))
    assert not set(retrained) & set(ka)


def test_an_unreadable_adapter_is_not_touched(tmp_path: Any) -> None:
    reader = IdentityReader(SEED, C)
    ident = reader.of(req(lora_request=LoRARequest("hub", 1, "some-org/some-adapter-on-a-hub")))
    assert ident.skip == "lora_unreadable"
    (tmp_path / "empty").mkdir()
    assert reader.of(req(lora_request=LoRARequest("e", 2, str(tmp_path / "empty")))).skip == "lora_unreadable"
    assert reader.skipped == {"lora_unreadable": 2}


def test_two_images_at_the_same_placeholders_get_different_keys() -> None:
    """Same token ids (the placeholders), other image: vLLM does not share these blocks, nor may hpkv."""
    reader = IdentityReader(SEED, C)
    cat = keys(reader, req(mm_features=[image("hash-of-cat", 20, 24)]))
    dog = keys(reader, req(mm_features=[image("hash-of-dog", 20, 24)]))
    plain = keys(reader, req())
    assert cat[0] == dog[0] == plain[0]  # chunk 0 (tokens 0..15) holds no image
    assert cat[1] != dog[1] and cat[2] != dog[2]  # chunks 1 and 2 hold it ...
    assert cat[3] != dog[3]  # ... and every later key follows the chain
    assert cat[1] != plain[1]
    assert keys(reader, req(mm_features=[image("hash-of-cat", 20, 24)])) == cat


def test_the_same_image_elsewhere_in_the_chunk_is_another_chunk() -> None:
    reader = IdentityReader(SEED, C)
    a = keys(reader, req(mm_features=[image("img", 18, 4)]))
    b = keys(reader, req(mm_features=[image("img", 20, 4)]))
    assert a[0] == b[0] and a[1] != b[1]


def test_a_multimodal_input_without_a_hash_is_not_touched() -> None:
    reader = IdentityReader(SEED, C)
    assert reader.of(req(mm_features=[image("", 20, 4)])).skip == "multimodal_unhashed"


def test_prompt_embeddings_are_keyed_by_their_values() -> None:
    reader = IdentityReader(SEED, C)
    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(4 * C, 8, generator=g)
    e2 = e1.clone()
    e2[3 * C + 1, 0] += 1.0  # differs in chunk 3 only
    r1 = Request("r", None, SamplingParams(max_tokens=1), None, prompt_embeds=e1)
    r2 = Request("r", None, SamplingParams(max_tokens=1), None, prompt_embeds=e2)
    k1, k2 = keys(reader, r1), keys(reader, r2)
    assert len(k1) == 4
    assert k1[:3] == k2[:3] and k1[3] != k2[3]
    assert (
        keys(reader, Request("r", None, SamplingParams(max_tokens=1), None, prompt_embeds=e1.clone())) == k1
    )


def test_keys_with_identity_are_stable_across_fresh_processes(tmp_path: Any, demo_model_dir: str) -> None:
    """Storage and Valkey hits survive restarts: nothing depends on PYTHONHASHSEED or object ids."""
    a = write_demo_lora(str(tmp_path / "a"), demo_model_dir, seed=1)
    code = (
        "from vllm.lora.request import LoRARequest\n"
        "from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange\n"
        "from tests.integrations.test_identity import IdentityReader, SEED, C, keys, req, image\n"
        f"r = req(cache_salt='t', lora_request=LoRARequest('a', 1, {a!r}), mm_features=[image('x', 20, 4)])\n"
        "print(b''.join(keys(IdentityReader(SEED, C), r)).hex())\n"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(out.stdout.strip())
    assert len(outs) == 1 and len(outs.pop()) == 2 * 16 * 4
