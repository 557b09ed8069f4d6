"""Peers for ``hpkv bench ttft --compare``: where to find them and how to run them.

* ``none``: vLLM without a KV connector.
* ``native``: vLLM's own ``OffloadingConnector`` (CPU pool). On vLLM's CPU build it refuses
  to start; the table shows its error.
* ``lmcache``: LMCache in its multi-process mode, the one that runs on vLLM's CPU build: a
  cache server (L1 in shared memory; L2 adapters for a directory and for Valkey) and vLLM
  with ``LMCacheMPConnector``. LMCache lives in its own environment (``make peers`` puts it in
  ``.venv-peers``, layered over ``.venv`` for vLLM and torch), so hpkv's stays clean.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpkv.core.procs import stop_group

PEERS_VENV = ".venv-peers"


def lmcache_python() -> tuple[str | None, str]:
    """The interpreter that can import LMCache, or None and how to get one."""
    env = os.environ.get("HPKV_PEERS_PYTHON")
    if env:
        return (env, "") if os.access(env, os.X_OK) else (None, f"HPKV_PEERS_PYTHON={env} is not executable")
    if importlib.util.find_spec("lmcache") is not None:
        return sys.executable, ""
    here = Path(__file__).resolve().parents[3]  # the checkout, for an editable install
    for root in (Path.cwd(), here):
        py = root / PEERS_VENV / "bin" / "python"
        if py.exists():
            return str(py), ""
    return None, "LMCache is not installed: `make peers` installs it into .venv-peers"


def lmcache_connector(port: int) -> str:
    """vLLM's ``--kv-transfer-config`` for an LMCache server on ``port`` (LMCache's documented form)."""
    return json.dumps(
        {
            "kv_connector": "LMCacheMPConnector",
            "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
        }
    )


@dataclass
class LMCacheServer:
    """LMCache's multi-process cache server with the capacities hpkv gets in the same run."""

    python: str
    port: int
    log_path: str
    l1_gb: float = 2.0
    chunk_size: int = 256
    fs_dir: str | None = None  # L2: a directory (LMCache's "fs" adapter)
    valkey: tuple[str, int] | None = None  # L2: Valkey through LMCache's native RESP client
    shm_name: str = field(default_factory=lambda: f"hpkv-bench-lmcache-{os.getpid()}")
    proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [
            self.python, "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--chunk-size", str(self.chunk_size),
            "--l1-size-gb", str(self.l1_gb), "--no-l1-use-lazy",
            "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto",
            "--shm-name", self.shm_name,
            "--disable-observability",
        ]  # fmt: skip
        if self.fs_dir:
            cmd += ["--l2-adapter", json.dumps({"type": "fs", "base_path": self.fs_dir})]
        if self.valkey:
            host, port = self.valkey
            cmd += ["--l2-adapter", json.dumps({"type": "resp", "host": host, "port": port})]
        return cmd

    def start(self, timeout: float = 120.0) -> None:
        if self.fs_dir:
            os.makedirs(self.fs_dir, exist_ok=True)
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"LMCache's server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                time.sleep(1.0)  # the port opens before the adapters are ready
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"LMCache's server did not listen on {self.port} in {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_group(self.proc, timeout=30)
        self.proc = None
        with contextlib.suppress(OSError):  # a killed server leaves its shared-memory segment behind
            os.unlink(f"/dev/shm/{self.shm_name}")
