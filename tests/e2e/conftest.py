"""A real vLLM (CPU build) server with hpkv, shared by the tests of a module.

A start takes about a minute here, so each module starts one server and
restarts it only where a scenario needs an empty memory pool.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hpkv.bench.server import Server, counter

CHUNK = 256
BLOCK = 64


@pytest.fixture(scope="session")
def demo_model() -> Iterator[str]:
    from hpkv.bench.demo_model import write_demo_model

    d = tempfile.mkdtemp(prefix="hpkv-demo-model-")
    write_demo_model(d, "tiny")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def words_prompt(model: str, n: int, seed: int) -> str:
    """A prompt of exactly ``n`` tokens: random vocabulary words (each one token in the demo tokenizer)."""
    with open(os.path.join(model, "hpkv-words.txt")) as f:
        words = f.read().split()
    r = random.Random(seed)
    return " ".join(r.choice(words) for _ in range(n))


def make_server(
    model: str,
    tmp: str,
    name: str,
    port: int,
    *,
    role: str = "kv_both",
    env: dict[str, str] | None = None,
    storage: str | None = None,
    connector_json: str | None = None,
    vllm_args: list[str] | None = None,
) -> Server:
    shm = os.path.join("/dev/shm", f"hpkv-e2e-{os.getpid()}-{name}")
    e = dict(os.environ)
    for k in list(e):
        if k.startswith("HPKV_"):
            del e[k]
    e.update(
        {
            "HPKV_KV_MEM_POOL_SIZE": "256M",
            "HPKV_SHARE_MEM_FILE_PATH": shm,
            "HPKV_KV_STORAGE_PATH": storage or os.path.join(tmp, f"storage-{name}"),
            "VLLM_SERVER_DEV_MODE": "1",
            # Tests count the reads of each tier exactly: every hit loads whole, so that a busy
            # machine (a slower tier measured) cannot turn a read into a recompute. The policy's
            # own tests turn it back on.
            "HPKV_COST_AWARE_LOADS": "false",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1" if (os.cpu_count() or 1) > 1 else "0",
        }
    )
    if env:
        e.update(env)
    from hpkv.bench.ttft_run import model_dtype

    args = [
        "--max-model-len",
        "8192",
        "--max-num-batched-tokens",
        "2048",
        "--dtype",
        model_dtype(model),
        # vLLM-CPU 0.32 fails to load its compile cache and compiles again at every start (~40 s);
        # eager mode starts in half the time and runs the same connector paths.
        "--enforce-eager",
        # On a GPU (make test-gpu-e2e): room for a second server beside the module's (a test that
        # starts one with a bad setting); vLLM's default 0.92 leaves no memory for it.
        *(["--gpu-memory-utilization", "0.3"] if _has_cuda() else []),
        *(vllm_args or []),
    ]
    return Server(
        model,
        port,
        e,
        os.path.join(tmp, f"vllm-{name}.log"),
        block_size=BLOCK,
        kv_role=role,
        connector_json=connector_json,
        vllm_args=args,
    )


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def wait_for(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class Counters:
    """Deltas of hpkv's counters around a block of requests."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.before = server.settled_stats()

    def delta(self, tier: str, name: str) -> int:
        # Settled: on CUDA a store's copy lands (and is counted) after the response was sent.
        return counter(self.server.settled_stats(), tier, name) - counter(self.before, tier, name)


def text(server: Server, prompt: str, n: int = 16) -> str:
    _, resp = server.complete(prompt, max_tokens=n)
    out: Any = resp["choices"][0]["text"]
    assert isinstance(out, str)
    return out


# Two greedy continuations may part at a tie: a random-weight model's next-token distribution is
# nearly flat, and in bf16 two logits often round to the same value. Which one wins then depends on
# the order of the sums, which changes with the shape of the computation (a prefix loaded, not
# computed) — vLLM's own prefix cache parts there too (seen on the H200: both at the same token,
# margin 1/64). A tie is accepted only when it is one: every token before it equal with log-probs
# within TIE_LOGPROB, the cold run's top two within TIE_MARGIN (two bf16 steps at |logprob| 4-8),
# and the other run's token within TIE_MARGIN of the cold run's best there (three-way ties occur).
# Wrong KV moves every log-prob, not one tie.
TIE_LOGPROB = 0.1
TIE_MARGIN = 0.07
TOP = 5


class Greedy:
    """A greedy continuation with its per-token log-probs and top alternatives."""

    def __init__(self, resp: dict[str, Any]) -> None:
        ch = resp["choices"][0]
        self.text: str = ch["text"]
        lp = ch["logprobs"]
        self.tokens: list[str] = lp["tokens"]
        self.logprobs: list[float] = lp["token_logprobs"]
        self.top: list[dict[str, float]] = lp["top_logprobs"]

    def parts_at_tie(self, other: Greedy) -> int | None:
        """The position where ``other`` parts from this (cold) run at a tie, None if identical;
        raises AssertionError (saying why) if they differ in any other way."""
        if self.tokens == other.tokens:
            return None
        i = next((k for k, (a, b) in enumerate(zip(self.tokens, other.tokens, strict=False)) if a != b), None)
        assert i is not None, f"one continuation is a prefix of the other: {self.text!r} vs {other.text!r}"
        for k in range(i):
            d = abs(self.logprobs[k] - other.logprobs[k])
            assert d <= TIE_LOGPROB, f"log-prob of token {k} moved by {d:.3f} (> {TIE_LOGPROB}): not a tie"
        took, best = other.tokens[i], max(self.top[i].values())
        assert took in self.top[i], f"parted at token {i} to {took!r}, not among the cold run's top {TOP}"
        margin = best - self.top[i][took]
        assert margin <= TIE_MARGIN, f"parted at token {i} with a margin of {margin:.3f} (> {TIE_MARGIN})"
        return i


def greedy(server: Server, prompt: str, n: int = 16) -> Greedy:
    _, resp = server.complete(prompt, max_tokens=n, logprobs=TOP)
    return Greedy(resp)
