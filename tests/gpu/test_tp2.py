"""Tensor parallel size 2 on two GPUs: vLLM (CUDA build) with hpkv, each rank moving its own shard.

Runs on a machine with two CUDA GPUs (the device's nvidia-h200-x2, `make test-gpu-tp2` there); elsewhere
skipped with a reason naming the missing GPUs. The model has 8 KV heads, so each rank holds 4: a rank
reading the other's shard would show as different text. Checked for prompts of 333, 2900 and 8192
tokens: greedy text from memory hits and, after a restart, from storage hits equals the cold text, and
each rank's own storage counters show its shard of every chunk.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.e2e.conftest import CHUNK, Counters, Greedy, greedy, make_server, wait_for, words_prompt


def _cuda_devices() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


pytestmark = pytest.mark.skipif(_cuda_devices() < 2, reason="needs two CUDA GPUs: fewer found")

LENGTHS = (333, 2900, 8192)


def chunks_loaded(tokens: int) -> int:
    """Chunks a hit loads: full chunks, the engine computing at least the prompt's last token."""
    return min(tokens // CHUNK, -(-(tokens - 1) // CHUNK))


@pytest.fixture(scope="module")
def model_8kv() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hpkv-8kv-")
    # Built in a child process: this one must not hold a CUDA context the engine's ranks would share.
    subprocess.run([sys.executable, "-m", "hpkv.cli.main", "demo-model", d, "--size", "8kv"], check=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def same(cold: list[Greedy], hit: list[Greedy], tier: str) -> None:
    """Greedy output on hits equals the cold output (up to bf16 ties: see tests.e2e.conftest)."""
    for n, a, b in zip(LENGTHS, cold, hit, strict=True):
        at = a.parts_at_tie(b)
        if at is not None:
            print(f"{n} tokens from {tier}: parted from the cold run at a tie, token {at}")


def test_tp2_memory_and_storage_hits_per_rank(model_8kv: str) -> None:
    tmp = tempfile.mkdtemp(prefix="hpkv-gpu-tp2-")
    s = make_server(
        model_8kv,
        tmp,
        "gputp2",
        8461,
        env={"HPKV_KV_MEM_POOL_SIZE": "2G", "NCCL_NVLS_ENABLE": "0"},
        vllm_args=["--tensor-parallel-size", "2", "--max-model-len", "8448"],
    )
    prompts = [words_prompt(model_8kv, n, seed=40 + i) for i, n in enumerate(LENGTHS)]
    total = sum(chunks_loaded(n) for n in LENGTHS)
    tokens = sum(min(chunks_loaded(n) * CHUNK, n - 1) for n in LENGTHS)  # the last token is computed
    s.start()
    try:
        cold = [greedy(s, p) for p in prompts]
        s.reset_prefix_cache()
        c = Counters(s)
        same(cold, [greedy(s, p) for p in prompts], "memory")
        assert c.delta("memory", "hits") == total
        assert c.delta("connector", "loaded_tokens") == tokens
        wait_for(
            lambda: all(s.hpkv_stats()["tiers"][f"storage.rank{r}"]["writes"] >= total for r in (0, 1)),
            timeout=120,
            what=f"{total} chunks on disk for each rank",
        )
        s.restart()
        c = Counters(s)
        same(cold, [greedy(s, p) for p in prompts], "storage")
        for r in (0, 1):
            assert c.delta(f"storage.rank{r}", "hits") == total, f"rank {r}"
            per_chunk = c.delta(f"storage.rank{r}", "bytes_read") // total
            assert per_chunk > 0
        # The two ranks' shards are the same size (4 KV heads each), and together the whole chunk.
        assert c.delta("storage.rank0", "bytes_read") == c.delta("storage.rank1", "bytes_read")
        assert c.delta("storage", "hits") == 2 * total
        assert c.delta("connector", "loaded_tokens") == tokens
    finally:
        s.stop()
        shutil.rmtree(s.env["HPKV_SHARE_MEM_FILE_PATH"], ignore_errors=True)
        out = os.environ.get("OUT")  # the device machine's result folder: keep the engine's log
        if out and os.path.isdir(out) and os.path.exists(os.path.join(tmp, "vllm-gputp2.log")):
            shutil.copy(os.path.join(tmp, "vllm-gputp2.log"), os.path.join(out, "vllm-gputp2.log"))
        shutil.rmtree(tmp, ignore_errors=True)
