"""Start, probe and stop an SGLang server with HiCache, and hpkv (or SGLang's ``file`` backend, or no
L3) under it; talk to it over its native API.

Used by ``hpkv bench ttft --engine sglang`` and by the SGLang server tests (tests/gpu_sglang). SGLang
reports where each request's cached prefix came from (``--enable-cache-report``:
``meta_info.cached_tokens_details`` = device, host, storage), and hpkv's backend writes its counters
to a stats file in its pool directory, so every hit here can be proven twice.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from hpkv.bench.server import ServerError, first_error, http_request, read_log_since, read_stat
from hpkv.core.procs import stop_group
from hpkv.integrations.statsfile import read_all

# The L3 backends a server can run with: none (HiCache's device and host tiers only), SGLang's own
# file backend, hpkv through SGLang's dynamic loader.
BACKENDS = ("none", "file", "hpkv")
HPKV_EXTRA = {
    "backend_name": "hpkv",
    "module_path": "hpkv.integrations.sglang",
    "class_name": "HpkvHiCacheStorage",
    "interface_v1": 1,
}


def sglang_command(
    model: str,
    *,
    port: int,
    backend: str,
    page_size: int = 64,
    hicache_gb: int = 8,
    max_total_tokens: int | None = None,
    mem_fraction: float = 0.5,
    load_format: str | None = None,
    extra_args: list[str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The launch line: HiCache on (write-through to host and L3, prefetch waits for L3 to complete,
    as SGLang's own storage tests run), the triton attention backend, no CUDA graphs (the same for
    every backend compared), and ``backend`` as L3."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown SGLang L3 backend {backend!r}; choose from {', '.join(BACKENDS)}")
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", model,
        "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--disable-cuda-graph",
        "--mem-fraction-static", str(mem_fraction),
        "--page-size", str(page_size),
        "--enable-hierarchical-cache", "--hicache-size", str(hicache_gb),
        "--hicache-write-policy", "write_through",
        "--enable-cache-report",
    ]  # fmt: skip
    if max_total_tokens:
        cmd += ["--max-total-tokens", str(max_total_tokens)]
    if load_format:
        cmd += ["--load-format", load_format]
    if backend != "none":
        cmd += ["--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend"]
        cmd += ["file"] if backend == "file" else ["dynamic", "--hicache-storage-backend-extra-config"]
        if backend == "hpkv":
            cmd.append(json.dumps(HPKV_EXTRA))
    return cmd + list(extra_args or [])


@dataclass
class Reply:
    """One /generate: client-side TTFT (first streamed chunk), the text, and where the cached
    prefix came from by SGLang's own report."""

    ttft: float
    text: str
    prompt_tokens: int
    cached: int
    device: int
    host: int
    storage: int
    meta: dict[str, Any]


@dataclass
class SGLangServer:
    model: str
    port: int
    env: dict[str, str]
    log_path: str
    backend: str = "hpkv"
    page_size: int = 64
    hicache_gb: int = 8
    max_total_tokens: int | None = None
    mem_fraction: float = 0.5
    load_format: str | None = None
    extra_args: list[str] = field(default_factory=list)
    python: str = sys.executable
    proc: subprocess.Popen[bytes] | None = None
    start_offset: int = field(default=0, repr=False)

    def command(self) -> list[str]:
        return sglang_command(
            self.model,
            port=self.port,
            backend=self.backend,
            page_size=self.page_size,
            hicache_gb=self.hicache_gb,
            max_total_tokens=self.max_total_tokens,
            mem_fraction=self.mem_fraction,
            load_format=self.load_format,
            extra_args=self.extra_args,
            python=self.python,
        )

    @property
    def pool_dir(self) -> str | None:
        return self.env.get("HPKV_SHARE_MEM_FILE_PATH")

    def start(self, timeout: float = 300.0) -> float:
        """Start and wait for /health; returns the seconds it took."""
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.start_offset = log.tell()
            self.proc = subprocess.Popen(
                self.command(), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                text = self.log_since(self.start_offset)
                self._reap()
                raise ServerError(
                    f"SGLang exited with {self.proc.returncode if self.proc else '?'} while starting; see "
                    f"{self.log_path}:\nroot cause: {first_error(text)}\n{text[-3000:]}"
                )
            with contextlib.suppress(OSError):
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return time.monotonic() - t0
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"SGLang did not become ready in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server's process group, then SIGKILL to whatever of it remains (SGLang's
        scheduler and detokenizer outlive its main process otherwise, holding the GPU)."""
        if self.proc is None:
            return
        stop_group(self.proc, timeout=60)
        self._reap()

    def _reap(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        deadline = time.monotonic() + 30
        while _group_members(pgid) and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.5)
        self.proc = None

    def process(self, title: str) -> int | None:
        """The live process of this server whose command line starts with ``title`` (SGLang names
        its scheduler ``sglang::scheduler``), or None."""
        if self.proc is None:
            return None
        for pid in _group_members(self.proc.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].decode(errors="replace").startswith(title):
                    return pid
        return None

    def log_since(self, offset: int) -> str:
        return read_log_since(self.log_path, offset)

    # -- HTTP ------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float = 600) -> tuple[int, bytes]:
        return http_request(self.port, method, path, body, timeout)

    def generate(self, text: str, max_new_tokens: int = 1, timeout: float = 600, **extra: Any) -> Reply:
        """POST /generate, greedy, streamed: TTFT is the time to the first streamed chunk."""
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            "stream": True,
            **extra,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            t0 = time.perf_counter()
            conn.request("POST", "/generate", body=json.dumps(body).encode(),
                         headers={"content-type": "application/json"})  # fmt: skip
            r = conn.getresponse()
            if r.status != 200:
                raise ServerError(f"/generate answered {r.status}: {r.read()[:500]!r}")
            ttft = None
            last: dict[str, Any] = {}
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                if ttft is None:
                    ttft = time.perf_counter() - t0
                last = json.loads(data)
        finally:
            conn.close()
        if "error" in last or "meta_info" not in last:
            raise ServerError(f"/generate gave no result: {json.dumps(last)[:500]}")
        meta = last["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        return Reply(
            ttft=ttft if ttft is not None else time.perf_counter() - t0,
            text=str(last.get("text", "")),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            cached=int(meta.get("cached_tokens", 0)),
            device=int(details.get("device", 0)),
            host=int(details.get("host", 0)),
            storage=int(details.get("storage", 0)),
            meta=meta,
        )

    def flush_cache(self) -> None:
        """POST /flush_cache: SGLang empties its device and host tiers (L3 keeps what it holds)."""
        status, body = self.request("POST", "/flush_cache?timeout=30", timeout=60)
        if status != 200:
            raise ServerError(f"/flush_cache answered {status}: {body[:300]!r}")

    # -- hpkv's counters ---------------------------------------------------------------------

    def hpkv_stats(self) -> dict[str, Any]:
        """hpkv's counters summed over the server's scheduler processes (one per TP rank)."""
        if not self.pool_dir:
            return {}
        return sum_docs(read_all(self.pool_dir))

    def settled_stats(self, quiet_s: float = 1.5, timeout: float = 60.0) -> dict[str, Any]:
        """hpkv's counters once nothing has changed for ``quiet_s`` seconds: SGLang backs pages up
        to L3 from a thread of its own and hpkv writes them behind, so a restart that must find
        them waits for this first."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        since = time.monotonic()
        while time.monotonic() < deadline:
            now = self.hpkv_stats()
            moving = {k: v for k, v in now.items() if k != "time"}
            if moving != last:
                last, since = moving, time.monotonic()
            elif last and time.monotonic() - since >= quiet_s:
                return now
            time.sleep(0.25)
        return last


def sum_docs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's view of several ranks' stats files: the per-tier and per-page counters summed."""
    tiers: dict[str, dict[str, int]] = {}
    pages: dict[str, int] = {}
    for doc in docs:
        for tier, counters in doc.get("tiers", {}).items():
            t = tiers.setdefault(tier, {})
            for k, v in counters.items():
                if isinstance(v, int):
                    t[k] = t.get(k, 0) + v
        for k, v in doc.get("connector", {}).items():
            if isinstance(v, int):
                pages[k] = pages.get(k, 0) + v
    return {"tiers": tiers, "connector": pages, "engines": len(docs)}


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    out = []
    for d in os.listdir("/proc"):
        st = read_stat(f"/proc/{d}/stat") if d.isdigit() else None
        if st is not None and int(st[1][2]) == pgid and st[1][0] != "Z":
            out.append(int(d))
    return out
