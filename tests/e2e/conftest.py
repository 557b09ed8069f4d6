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
    from hpkv.cli.demo_model import write_demo_model

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
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1" if (os.cpu_count() or 1) > 1 else "0",
        }
    )
    if env:
        e.update(env)
    from hpkv.bench.ttft import model_dtype

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
