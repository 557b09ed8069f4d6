from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpkv.cli.serve import vllm_command


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HPKV_")}
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "hpkv.cli.main", *args], capture_output=True, text=True, env=e, timeout=120
    )


def test_serve_refuses_a_bad_setting_with_hpkvs_message() -> None:
    r = run("serve", "/nonexistent-model", env={"HPKV_KV_MEM_POOL_SIZE": "16X"})
    assert r.returncode == 2
    assert "HPKV_KV_MEM_POOL_SIZE='16X' is not a size; use e.g. 16G" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_command_line() -> None:
    cmd = vllm_command("m", port=9000, block_size=64, kv_role="kv_consumer", vllm_args=["--foo"], python="py")
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in cmd and cmd[-1] == "--foo"
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc["kv_connector"] == "HpkvConnectorV1" and ktc["kv_role"] == "kv_consumer"


def test_stats_without_an_engine(tmp_path: Path) -> None:
    r = run("stats", "--dir", str(tmp_path))
    assert r.returncode == 1 and "no running hpkv engine" in r.stdout


def test_clear_removes_chunk_files(tmp_path: Path) -> None:
    d = tmp_path / "v1" / "ab"
    d.mkdir(parents=True)
    (d / ("ab" * 16 + ".kv")).write_bytes(b"x")
    (d / "keep.txt").write_bytes(b"y")
    r = run("clear", "--storage", str(tmp_path))
    assert r.returncode == 0 and "removed 1 chunk files" in r.stdout
    assert (d / "keep.txt").exists() and not (d / ("ab" * 16 + ".kv")).exists()


def test_demo_model_token_counts(tmp_path: Path) -> None:
    """The seed's prompt is exactly one token per letter; random vocabulary words one token each."""
    import random

    from transformers import AutoTokenizer

    from hpkv.bench.demo_model import load_words, write_demo_model

    write_demo_model(str(tmp_path), "tiny")
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok(" ".join(["A"] * 8192))["input_ids"]) == 8192
    words = load_words(str(tmp_path))
    r = random.Random(3)
    prompt = " ".join(r.choice(words) for _ in range(777))
    ids = tok(prompt)["input_ids"]
    assert len(ids) == 777 and tok.decode(ids) == prompt
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_key_value_heads"] == 2


def test_a_config_only_demo_model_is_what_an_engine_with_random_weights_reads(tmp_path: Path) -> None:
    """``--config-only`` (for SGLang's ``--load-format dummy``): config and tokenizer as a saved model
    has them, architectures included, and no weights."""
    r = run("demo-model", str(tmp_path), "--size", "tiny", "--config-only")
    assert r.returncode == 0, r.stderr
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["num_hidden_layers"] == 4
    assert {"tokenizer.json", "tokenizer_config.json", "hpkv-words.txt"} <= set(os.listdir(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]


@pytest.mark.parametrize("arch", ["gemma3", "gpt-oss", "qwen3-next", "nemotron-h", "jamba", "deepseek-v3"])
def test_demo_models_of_each_family_have_their_familys_layers(tmp_path: Path, arch: str) -> None:
    """``--arch``: a small model of the family, with the layer kinds that make it that family, and the
    demo tokenizer (so its prompts are as many tokens as words)."""
    from hpkv.bench.demo_archs import ARCHS
    from hpkv.bench.demo_model import load_words, write_demo_model

    write_demo_model(str(tmp_path), arch=arch)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHS[arch].model]
    kinds = {
        "gemma3": lambda c: {"sliding_attention", "full_attention"} == set(c["layer_types"]),
        "gpt-oss": lambda c: {"sliding_attention", "full_attention"} == set(c["layer_types"]),
        "qwen3-next": lambda c: {"linear_attention", "full_attention"} == set(c["layer_types"]),
        "jamba": lambda c: c["attn_layer_period"] == 4 and c["num_hidden_layers"] == 4,
        "nemotron-h": lambda c: {"linear_attention", "full_attention"} <= set(c["layers_block_type"]),
        "deepseek-v3": lambda c: c["kv_lora_rank"] == 512 and c["qk_rope_head_dim"] == 64,
    }
    assert kinds[arch](cfg), cfg
    assert [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert len(load_words(str(tmp_path))) > 1000
    r = run("demo-model", str(tmp_path / "x"), "--arch", "mamba-9")
    assert r.returncode != 0 and "mamba-9" in r.stderr and "gemma3" in r.stderr


def test_serve_refuses_a_model_with_state_layers_naming_them(tmp_path: Path) -> None:
    """A linear-attention hybrid would stop vLLM at start with hpkv attached: hpkv serve says why
    first, and what to do."""
    from hpkv.bench.demo_model import write_demo_model

    write_demo_model(str(tmp_path), arch="qwen3-next", weights=False)
    r = run("serve", str(tmp_path))
    assert r.returncode == 2
    assert "Qwen3NextForCausalLM" in r.stderr and "linear attention" in r.stderr
    assert "without hpkv" in r.stderr


def test_tenant_prefix_is_the_one_the_valkey_tier_writes_under() -> None:
    from hpkv.core.keys import tenant_tag

    r = run("tenant-prefix", "tenant-1")
    assert r.returncode == 0 and r.stdout.strip() == f"hpkv:{tenant_tag('', 'tenant-1')}:"
    assert "ACL SETUSER" in r.stderr
    r = run("tenant-prefix", "tenant-1", env={"HPKV_SALT": "deploy-2"})
    assert r.stdout.strip() == f"hpkv:{tenant_tag('deploy-2', 'tenant-1')}:"
    assert run("tenant-prefix").stdout.strip() == "hpkv:shared:"
