"""``hpkv demo-model DIR``: a random-weight model (Qwen2, or another family: ``--arch``) and a
tokenizer, built offline.

Random weights give real KV shapes and real prefill compute, which is all a KV
cache benchmark needs; nothing is downloaded. The tokenizer is byte-level BPE
(the kind Qwen2 uses), with every vocabulary word and every capital letter a
single token in both its first-word and space-prefixed forms, so the seed's
prompt ``"A A ... A"`` (8192 letters) is exactly 8192 tokens and a prompt of
N random vocabulary words is exactly N tokens. ``tokenizer_class`` is the
generic fast tokenizer: transformers 5 rebuilds a ``Qwen2Tokenizer`` with its
own split rules, which would silently change these counts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

from hpkv.bench.demo_archs import ARCHS

SIZES = {
    # 4 layers × 2 KV heads × 64: 2 KiB of KV per token in bf16 (4 KiB in fp32); fast enough for tests.
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # 12 layers × 2 KV heads × 64: 48 MiB of KV per 8192-token prompt in bf16 (96 MiB in fp32).
    "small": {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    },
    # 16 layers × 8 KV heads × 128 (512 MiB of KV per 8192-token prompt in bf16, 256 MiB per rank at
    # tensor parallel size 2): for two GPUs, so each rank holds 4 KV heads; ~1.4B random weights.
    "8kv": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    # Qwen2-7B's shape (28 layers × 4 KV heads × 128: 448 MiB of KV per 8192-token prompt in bf16),
    # random weights: for GPUs (built on the GPU in seconds; ~15 GB on disk).
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
}
QWEN2 = "qwen2"  # the default family: dense, full attention
NUM_WORDS = 3000
MAX_POSITIONS = 32768


@dataclass(frozen=True)
class DemoModel:
    path: str
    words: tuple[str, ...]


def vocabulary_words(n: int = NUM_WORDS, seed: int = 7) -> list[str]:
    """Distinct lower-case pseudo-words (3–8 letters), the same on every machine."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: set[str] = set()
    while len(out) < n:
        out.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 8))))
    return sorted(out)


def build_tokenizer(words: list[str]) -> object:
    """A byte-level BPE tokenizer in which each word and each capital letter is one token.

    The merges are learned by the tokenizers library's own BPE trainer from a
    corpus of the vocabulary, so applying them in rank order always rebuilds
    each whole word (hand-written merges can conflict across words).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    pieces = [*words, *(chr(c) for c in range(ord("A"), ord("Z") + 1))]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1_000_000,  # never the limit: training stops when every word is whole
        min_frequency=1,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"{w} {w}" for w in pieces]  # both forms: first word, and after a space
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def default_dtype() -> str:
    """bfloat16 where the hardware computes it natively (a GPU, AVX-512 BF16 or AMX), else float32:
    on an AVX2-only CPU vLLM emulates bf16 matmuls, which made an 8192-token prefill of the
    small model take 53 s instead of 21 s here."""
    import torch

    if torch.cuda.is_available():
        return "bfloat16"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def write_demo_model(
    path: str,
    size: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    *,
    weights: bool = True,
    arch: str = QWEN2,
) -> DemoModel:
    """Write config, random weights (safetensors) and tokenizer files to ``path``; ``weights=False``
    leaves the weights out, for an engine that makes random ones itself (``--load-format dummy``).
    ``arch``: Qwen2 in the shape ``size``, or one of :data:`hpkv.bench.demo_archs.ARCHS` (its own
    small shape)."""
    import importlib

    import torch

    transformers: Any = importlib.import_module("transformers")

    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not one of {', '.join(SIZES)}")
    if arch != QWEN2 and arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one of {', '.join([QWEN2, *ARCHS])}")
    dtype = dtype or default_dtype()
    os.makedirs(path, exist_ok=True)
    words = vocabulary_words()
    tok = build_tokenizer(words)
    tok.save(os.path.join(path, "tokenizer.json"))  # type: ignore[attr-defined]
    vocab_size = tok.get_vocab_size()  # type: ignore[attr-defined]
    padded_vocab = -(-vocab_size // 64) * 64
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": MAX_POSITIONS,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=1,
        )
    shared: dict[str, Any] = dict(
        vocab_size=padded_vocab,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
        dtype=dtype,
    )
    if arch == QWEN2:
        config_cls, model_name = transformers.Qwen2Config, "Qwen2ForCausalLM"
        kwargs = dict(
            shared,
            max_window_layers=SIZES[size]["num_hidden_layers"],
            rope_theta=1_000_000.0,
            **SIZES[size],
        )
    else:
        a = ARCHS[arch]
        config_cls, model_name = getattr(transformers, a.config), a.model
        kwargs = dict(shared, **a.kwargs)
    cfg = config_cls(**kwargs)
    model_cls = getattr(transformers, model_name)
    if not weights:
        cfg.architectures = [model_name]  # what saving a model records; engines read it
        cfg.save_pretrained(path)
        with open(os.path.join(path, "hpkv-words.txt"), "w") as f:
            f.write("\n".join(words) + "\n")
        return DemoModel(path, tuple(words))
    torch.manual_seed(seed)
    # Built where it is fastest: 7B random weights take seconds on a GPU, minutes on a CPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = model_cls(cfg)
        model.save_pretrained(path, safe_serialization=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()  # the engine started next needs the GPU's memory
    finally:
        torch.set_default_dtype(previous)
    with open(os.path.join(path, "hpkv-words.txt"), "w") as f:
        f.write("\n".join(words) + "\n")
    return DemoModel(path, tuple(words))


def load_words(path: str) -> list[str]:
    with open(os.path.join(path, "hpkv-words.txt")) as f:
        return [w for w in f.read().split() if w]


def write_demo_lora(path: str, model: str, seed: int, rank: int = 8) -> str:
    """A random PEFT-format LoRA adapter for the demo model at ``model`` that changes ``k_proj``
    and ``v_proj`` of every layer (so the KV itself differs from the base model's and from
    another seed's adapter). Returns ``path``."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    kv_out = int(cfg["num_key_value_heads"]) * head_dim
    dtype = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for proj in ("k_proj", "v_proj"):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = (torch.randn(rank, hidden, generator=g) * 0.1).to(dtype)
            tensors[f"{base}.lora_B.weight"] = (torch.randn(kv_out, rank, generator=g) * 0.1).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": model,
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": ["k_proj", "v_proj"],
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            },
            f,
            indent=1,
        )
    return path
