"""The layer kinds hpkv reads from a model's config, and the families it refuses on vLLM at start
(with the kinds named and what to do) rather than letting vLLM stop with its own error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpkv.bench.demo_model import write_demo_model
from hpkv.integrations.vllm.families import FULL, LINEAR, MAMBA, MLA, SLIDING, layer_kinds, refusal

KINDS = {
    "qwen2": [FULL],
    "gemma3": [FULL, SLIDING],
    "gpt-oss": [FULL, SLIDING],
    "deepseek-v3": [MLA],
    "qwen3-next": [FULL, LINEAR],
    "nemotron-h": [FULL, MAMBA],
    "jamba": [FULL, MAMBA],
}


@pytest.mark.parametrize("arch", sorted(KINDS))
def test_each_demo_family_has_its_layer_kinds(tmp_path: Path, arch: str) -> None:
    write_demo_model(str(tmp_path), arch=arch, weights=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert layer_kinds(cfg) == KINDS[arch]
    why = refusal(cfg)
    if LINEAR in KINDS[arch] or MAMBA in KINDS[arch]:
        assert why is not None and cfg["architectures"][0] in why and "without hpkv" in why
        assert (LINEAR if LINEAR in KINDS[arch] else MAMBA) in why
    else:
        assert why is None


def test_kinds_from_configs_without_a_layer_list() -> None:
    assert layer_kinds({"model_type": "mistral", "sliding_window": 4096}) == [SLIDING]
    assert layer_kinds({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}) == [FULL]
    assert layer_kinds({"model_type": "mamba2", "state_size": 128}) == [MAMBA]
    # A multimodal model's text part decides.
    assert layer_kinds({"text_config": {"layer_types": ["sliding_attention", "full_attention"]}}) == [
        FULL,
        SLIDING,
    ]
