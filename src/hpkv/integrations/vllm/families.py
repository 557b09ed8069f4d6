"""What kinds of layers a model has, read from its ``config.json``, and whether hpkv can serve it on
vLLM.

hpkv's connector serves vLLM's hybrid KV cache manager (``SupportsHMA``, vLLM ≥ 0.32): a model
whose layers all keep attention KV per token (full attention, sliding-window or chunked local layers,
MLA's latent) runs with a KV cache group per kind of layer, and hpkv stores every group's KV of a
chunk (kvgroups.py). A model with linear-attention or Mamba layers keeps a state per request instead,
which hpkv does not store yet: the connector stops at start naming the group, and :func:`refusal`
says so before vLLM starts.
"""

from __future__ import annotations

from typing import Any

FULL = "full attention"
SLIDING = "sliding-window attention"
LINEAR = "linear attention"
MAMBA = "Mamba"
MLA = "multi-head latent attention"

# Layer kinds that keep a state per request rather than KV per token.
STATE = (LINEAR, MAMBA)


def layer_kinds(cfg: dict[str, Any]) -> list[str]:
    """The kinds of the model's token-mixing layers, in a fixed order."""
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
    cfg = text or cfg
    mamba_params = any(k in cfg for k in ("ssm_state_size", "mamba_d_state", "mamba_num_heads", "state_size"))
    kinds: set[str] = set()
    types = cfg.get("layer_types") or cfg.get("layers_block_type") or []
    for t in types if isinstance(types, list) else []:
        t = str(t)
        if t in ("full_attention", "attention"):
            kinds.add(FULL)
        elif t in ("sliding_attention", "chunked_attention"):
            kinds.add(SLIDING)
        elif t in ("linear_attention", "mamba", "mamba2"):
            kinds.add(MAMBA if mamba_params else LINEAR)
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        kinds |= {MAMBA} if "M" in pattern else set()
        kinds |= {FULL} if "*" in pattern else set()
    if "attn_layer_period" in cfg:  # Jamba: attention every period layers, Mamba between
        kinds |= {MAMBA, FULL}
    if str(cfg.get("model_type", "")).startswith("mamba"):
        kinds.add(MAMBA)
    if cfg.get("kv_lora_rank"):
        kinds.add(MLA)
    elif not kinds:  # no per-layer list: every layer alike (Mistral's window applies to all)
        window = cfg.get("sliding_window") and cfg.get("use_sliding_window", True)
        kinds.add(SLIDING if window else FULL)
    return [k for k in (FULL, SLIDING, MLA, LINEAR, MAMBA) if k in kinds]


def refusal(cfg: dict[str, Any]) -> str | None:
    """Why hpkv cannot serve this model on vLLM, naming its layer kinds and what to do; None if it can."""
    kinds = layer_kinds(cfg)
    state = [k for k in kinds if k in STATE]
    if not state:
        return None
    arch = ", ".join(cfg.get("architectures") or [str(cfg.get("model_type", "this model"))])
    return (
        f"hpkv cannot serve {arch} on vLLM yet: it has {' and '.join(kinds)} layers, and its "
        f"{' and '.join(state)} layers keep a state per request (not KV per token), which hpkv does not "
        "store. Serve this model without hpkv (vllm serve MODEL, no --kv-transfer-config)."
    )
