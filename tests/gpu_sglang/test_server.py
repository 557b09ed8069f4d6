"""hpkv under a real SGLang server (HiCache's L3 backend through SGLang's ``dynamic`` loader).

Runs where SGLang's server runs: an NVIDIA GPU with SGLang installed (``make test-gpu-sglang`` after
scripts/sglang-gpu/install.sh). The shape of SGLang's own storage-backend test: a 768-token random
prompt, another request, ``POST /flush_cache``, the prompt again; then restarts, where only hpkv's
tiers survive. Every hit is proven twice: SGLang's ``cached_tokens_details`` says the prefix came
from L3 storage, and hpkv's counters say which of its tiers served the pages. Greedy texts on a hit
must equal the cold text (``SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1``).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hpkv.bench.server import counter
from hpkv.bench.sglang_server import Reply, SGLangServer

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU: SGLang's server has no CPU build"
)

PAGE = 64
TOKENS = 768  # 12 pages; SGLang caches all but the page holding the last prompt token: 704
SERVED = TOKENS - PAGE
PORT = 30111


def _env(**hpkv: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPKV_")}
    env.update(SGLANG_ENABLE_DETERMINISTIC_INFERENCE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(hpkv)
    return env


@pytest.fixture(scope="module")
def work() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="hpkv-sgl-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def model(work: str) -> str:
    from hpkv.bench.demo_model import write_demo_model

    path = os.path.join(work, "model")
    write_demo_model(path, "small")
    return path


def prompt(model: str, seed: int) -> str:
    """``TOKENS`` random vocabulary words: one token each with the demo tokenizer."""
    with open(os.path.join(model, "hpkv-words.txt")) as f:
        words = f.read().split()
    return " ".join(random.Random(seed).choices(words, k=TOKENS))


def server(model: str, work: str, name: str, env: dict[str, str]) -> SGLangServer:
    logs = os.environ.get("SGLANG_TEST_LOG_DIR") or work  # kept there after the run when set
    os.makedirs(logs, exist_ok=True)
    return SGLangServer(model, PORT, env, os.path.join(logs, f"sglang-{name}.log"), backend="hpkv",
                        page_size=PAGE, hicache_gb=4, max_total_tokens=65536)  # fmt: skip


def pages_files(storage: str) -> dict[str, float]:
    out = {}
    for d, _, names in os.walk(storage):
        for n in names:
            if n.endswith(".kv"):
                p = os.path.join(d, n)
                out[p] = os.path.getmtime(p)
    return out


def from_l3(r: Reply) -> None:
    assert r.prompt_tokens == TOKENS, r.meta
    assert r.cached >= SERVED and r.storage >= SERVED, f"not served from L3: {r.meta}"


@pytest.fixture(scope="class")
def dirs(work: str) -> Iterator[dict[str, str]]:
    """TestStorage's storage and pool directories, shared by its servers."""
    shm = tempfile.mkdtemp(prefix="hpkv-sgl-", dir="/dev/shm")
    d = {"storage": os.path.join(work, "storage"), "shm": shm}
    os.makedirs(d["storage"], mode=0o700)
    yield d
    shutil.rmtree(d["shm"], ignore_errors=True)


@pytest.fixture(scope="class")
def state() -> Iterator[dict[str, Any]]:
    """What TestStorage's tests hand on: the running server and the cold text."""
    st: dict[str, Any] = {}
    yield st
    if "server" in st:
        st["server"].stop()


def no_page_shared(s: SGLangServer, model: str) -> Reply:
    """Start ``s`` over a storage directory that holds prompt 1's pages under another namespace:
    SGLang finds nothing cached and hpkv serves no page."""
    s.start()
    try:
        r = s.generate(prompt(model, 1), max_new_tokens=16)
        st = s.settled_stats()
        assert r.cached == 0 and r.storage == 0, r.meta
        assert counter(st, "storage", "hits") == 0, st
        return r
    finally:
        s.stop()


class TestStorage:
    """One pool and storage directory, the server restarted over it."""

    def env(self, dirs: dict[str, str], **more: str) -> dict[str, str]:
        return _env(HPKV_KV_STORAGE_PATH=dirs["storage"], HPKV_SHARE_MEM_FILE_PATH=dirs["shm"], **more)

    def test_flush_then_the_prompt_comes_back_from_hpkv(self, model, work, dirs, state) -> None:
        s = server(model, work, "storage", self.env(dirs))
        s.start()
        state["server"] = s
        a = prompt(model, 1)
        cold = s.generate(a, max_new_tokens=16)
        assert cold.cached == 0, cold.meta
        again = s.generate(a, max_new_tokens=16)
        assert again.device >= SERVED and again.text == cold.text, again.meta
        s.generate(prompt(model, 2), max_new_tokens=16)
        before = s.settled_stats()
        assert counter(before, "storage", "writes") >= 2 * (TOKENS // PAGE) - 2, before
        s.flush_cache()
        hit = s.generate(a, max_new_tokens=16)
        after = s.settled_stats()
        from_l3(hit)
        assert counter(after, "storage", "hits") - counter(before, "storage", "hits") >= SERVED // PAGE
        assert after["connector"]["read"] - before["connector"]["read"] >= SERVED // PAGE
        assert hit.text == cold.text
        state["cold"] = cold.text

    def test_after_a_restart_the_pages_come_from_storage(self, model, dirs, state) -> None:
        s: SGLangServer = state["server"]
        s.stop()
        s.start()
        hit = s.generate(prompt(model, 1), max_new_tokens=16)
        st = s.settled_stats()
        from_l3(hit)
        assert counter(st, "storage", "hits") >= SERVED // PAGE, st
        assert hit.text == state["cold"]

    @pytest.mark.parametrize("fault", ["corrupt", "missing"])
    def test_a_bad_page_file_ends_the_prefix_there(self, model, dirs, state, fault) -> None:
        s: SGLangServer = state["server"]
        c = prompt(model, 10 if fault == "corrupt" else 11)
        old = set(pages_files(dirs["storage"]))
        cold = s.generate(c, max_new_tokens=16)
        s.settled_stats()
        new = sorted((t, p) for p, t in pages_files(dirs["storage"]).items() if p not in old)
        assert len(new) >= SERVED // PAGE, new
        victim = new[len(new) // 2][1]  # a page in the middle of the prompt
        if fault == "corrupt":
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        else:
            os.unlink(victim)
        before = s.settled_stats()
        s.flush_cache()
        r = s.generate(c, max_new_tokens=16)
        after = s.settled_stats()
        assert r.storage % PAGE == 0 and r.storage < SERVED, f"the prefix went past the bad page: {r.meta}"
        if fault == "corrupt":
            assert counter(after, "storage", "corrupt") > counter(before, "storage", "corrupt"), after
        assert r.text == cold.text

    def test_another_tenant_shares_no_page(self, model, work, dirs, state) -> None:
        state["server"].stop()
        r = no_page_shared(server(model, work, "salt", self.env(dirs, HPKV_SALT="tenant-b")), model)
        assert r.text == state["cold"]

    def test_another_model_shares_no_page(self, model, work, dirs, state) -> None:
        twin = os.path.join(work, "model-twin")  # the same weights under another name
        shutil.copytree(model, twin, dirs_exist_ok=True)
        no_page_shared(server(twin, work, "twin", self.env(dirs)), model)


class TestValkey:
    """No storage directory: the pages survive a restart in Valkey only."""

    def test_after_a_restart_the_pages_come_from_valkey(self, model, work) -> None:
        from hpkv.bench.valkey import ValkeyServers

        shm = tempfile.mkdtemp(prefix="hpkv-sgl-", dir="/dev/shm")
        valkey = ValkeyServers(directory=os.path.join(work, "valkey")).start()
        s = server(model, work, "valkey", _env(HPKV_REMOTE_URL=valkey.url, HPKV_SHARE_MEM_FILE_PATH=shm))
        try:
            s.start()
            a = prompt(model, 3)
            cold = s.generate(a, max_new_tokens=16)
            st = s.settled_stats()
            assert counter(st, "valkey", "writes") >= SERVED // PAGE, st
            s.stop()
            s.start()
            hit = s.generate(a, max_new_tokens=16)
            st = s.settled_stats()
            from_l3(hit)
            assert counter(st, "valkey", "hits") >= SERVED // PAGE, st
            assert hit.text == cold.text
        finally:
            s.stop()
            valkey.stop()
            shutil.rmtree(shm, ignore_errors=True)
