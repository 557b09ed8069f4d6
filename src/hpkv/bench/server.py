"""Start, probe and stop a vLLM OpenAI server with hpkv, and talk to it the way the seed's script does.

Used by ``hpkv bench ttft`` and by the end-to-end tests.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpkv.core.procs import stop_group
from hpkv.integrations.statsfile import read_all
from hpkv.integrations.vllm.launch import serve_env, vllm_command

# The worker's per-load line (integrations/vllm/worker.py, _log_load).
LOAD_LINE = re.compile(r"hpkv: Retrieved (\d+) out of .*? throughput: ([\d.]+) GB/s \(([^)]*)\)")


# HPKV_* variables a bench's servers take from the caller's environment: how hpkv runs (its thread
# counts, direct I/O), not where its tiers are or what it stores, which each bench sets itself. The
# benches' references read the same variables, so a reference and the engine use one thread count.
TUNING_ENV = (
    "HPKV_STORAGE_IO_THREADS",
    "HPKV_VALKEY_NUM_WORKERS",
    "HPKV_STORAGE_O_DIRECT",
    "HPKV_STORAGE_DIRECT_WRITES",
    "HPKV_WRITE_BEHIND",
    "HPKV_COST_AWARE_LOADS",  # a run that counts every tier's reads loads every hit whole
    "HPKV_STEP_TRACE",  # observes, changes nothing
)


def bench_env() -> dict[str, str]:
    """This process's environment for a bench's server: every HPKV_* variable dropped except
    :data:`TUNING_ENV`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HPKV_") or k in TUNING_ENV}


class ServerError(RuntimeError):
    pass


def first_error(text: str) -> str:
    """The root cause in a failed start's log tail: the first ``SomeError: message`` line (an
    exception as Python prints it), else the first line that mentions an error."""

    lines = [ln.strip() for ln in text.splitlines()]
    # A traceback's last line, alone or after a log line's "ERROR ... [file.py:N] " prefix.
    exc = re.compile(r"^(?:.*\bERROR\b.*?\] )?([\w.]*(?:Error|Exception): .+)$")
    found = [m.group(1) for ln in lines if (m := exc.match(ln))]
    # vLLM re-raises a worker's failure as "... See root cause above": prefer the cause itself.
    for msg in sorted(found, key=lambda m: "root cause above" in m):
        return msg[:300]
    for ln in lines:
        if "error" in ln.lower():
            return ln[-300:]
    return lines[0][-300:] if text.strip() else "unknown error"


def stopped(results: Iterable[Any], e: BaseException) -> None:
    """A run stopped by ``e``: each system's result keeps its first error, and the reason is printed."""
    why = first_error(str(e))
    for out in results:
        out.error = out.error or why
    print(f"stopped: {why}", flush=True)


def read_log_since(path: str, offset: int) -> str:
    """What a server logged to ``path`` after byte ``offset`` ("" if the log cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def http_request(
    port: int, method: str, path: str, body: Any = None, timeout: float = 600
) -> tuple[int, bytes]:
    """One request to a server on loopback, a JSON body if given; returns the status and the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@dataclass
class Server:
    model: str
    port: int
    env: dict[str, str]
    log_path: str
    block_size: int = 64
    kv_role: str = "kv_both"
    connector_json: str | None = None  # the seed's exact --kv-transfer-config, when set
    vllm_args: list[str] = field(default_factory=list)
    python: str = sys.executable  # the interpreter vLLM runs under (a peer's environment)
    proc: subprocess.Popen[bytes] | None = None
    start_offset: int = field(default=0, repr=False)  # where this start's lines begin in the log
    # A stop stops hpkv's host pool of this server's directory too (the seed's restart empties the
    # memory tier), unless other servers share it.
    keep_pool: bool = False

    def command(self) -> list[str]:
        cmd = vllm_command(
            self.model,
            port=self.port,
            block_size=self.block_size,
            kv_role=self.kv_role,
            vllm_args=self.vllm_args,
            python=self.python,
        )
        if self.connector_json is not None:
            i = cmd.index("--kv-transfer-config")
            if self.connector_json == "":
                del cmd[i : i + 2]
            else:
                cmd[i + 1] = self.connector_json
        return cmd

    def start(self, timeout: float = 400.0) -> None:
        with open(self.log_path, "ab") as log:
            self.start_offset = log.tell()
            self.proc = subprocess.Popen(
                self.command(),
                env=serve_env(self.env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"vLLM exited with {self.proc.returncode} while starting; "
                    f"see {self.log_path}:\nroot cause: {first_error(self.log_since(self.start_offset))}\n"
                    f"{self.log_tail()}"
                )
            try:
                status, _ = self.request("GET", "/v1/models", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"vLLM did not become ready in {timeout:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        stop_group(self.proc, timeout=60)
        self.proc = None
        pool = self.env.get("HPKV_SHARE_MEM_FILE_PATH")
        if pool and not self.keep_pool:
            from hpkv.tiers.memory.hostslots import stop_pool

            stop_pool(pool)

    def _own(self, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The stats documents of this server's processes (its engine runs in a child of the
        server, in the server's process group), where other servers share the directory."""
        if self.proc is None:
            return docs
        mine = []
        for d in docs:
            try:
                if os.getpgid(int(d.get("pid", -1))) == self.proc.pid:
                    mine.append(d)
            except (OSError, ValueError):
                continue
        return mine

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        """What the server logged after byte ``offset`` ("" if the log cannot be read)."""
        return read_log_since(self.log_path, offset)

    def load_rates(self, since: int, min_tokens: int) -> list[float]:
        """GB/s of each of hpkv's loads of at least ``min_tokens`` tokens logged after byte ``since``:
        the copies' own time (CUDA events on a GPU, the copy loop's clock on CPU), not a TTFT."""
        text = self.log_since(since)
        return [
            float(m.group(2))
            for m in LOAD_LINE.finditer(text)
            if int(m.group(1)) >= min_tokens and "async" not in m.group(3)
        ]

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    # -- HTTP ------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, timeout: float = 600) -> tuple[int, bytes]:
        return http_request(self.port, method, path, body, timeout)

    def complete(
        self,
        prompt: str | list[int],
        max_tokens: int = 1,
        timeout: float = 600,
        *,
        model: str | None = None,
        **extra: Any,
    ) -> tuple[float, dict[str, Any]]:
        """POST /v1/completions (temperature 0, not streamed); returns (time to first byte, response).
        ``model`` names a served LoRA adapter instead of the base model; ``extra`` goes into the
        body as is (e.g. ``cache_salt``)."""
        body = {
            "model": model or self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": False,
            **extra,
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            t0 = time.perf_counter()
            conn.request(
                "POST",
                "/v1/completions",
                body=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            r = conn.getresponse()  # returns once the status line and headers arrived
            first = r.read(1)
            ttfb = time.perf_counter() - t0
            rest = r.read()
            if r.status != 200:
                raise ServerError(f"/v1/completions answered {r.status}: {(first + rest)[:500]!r}")
            return ttfb, json.loads(first + rest)
        finally:
            conn.close()

    def reset_prefix_cache(self, external: bool = False) -> None:
        path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
        status, body = self.request("POST", path)
        if status != 200:
            raise ServerError(f"{path} answered {status}: {body[:300]!r}")

    def hpkv_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The counters of this server's engine as they are now: its stats file when it runs here
        with a known pool directory, once one written after this call is there (the engine's
        refresher rewrites it within a fraction of a second, a second while it computes; after
        ``timeout`` seconds the newest), else its ``/metrics`` (``hpkv_tier_*``, ``hpkv_connector``)."""
        path = self.env.get("HPKV_SHARE_MEM_FILE_PATH")
        if path:
            since, deadline = time.time(), time.monotonic() + timeout
            while True:
                docs = self._own(read_all(path))
                doc = max(docs, key=lambda d: d.get("time", 0)) if docs else None
                if doc is None:  # no engine of hpkv's here (a peer), or none started yet
                    break
                if doc.get("time", 0) >= since or time.monotonic() > deadline:
                    return doc
                time.sleep(0.02)
        return self.metrics_stats()

    def settled_stats(self, since: float | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """The engine's counters once they include everything up to now: from a stats file written
        after ``since`` (``time.time()``; default: now) by an engine with no loads, stores or lookups
        still to report (``pending == 0``). Without a stats file here: ``/metrics`` as is."""
        since = time.time() if since is None else since
        path = self.env.get("HPKV_SHARE_MEM_FILE_PATH")
        if not path:
            return self.metrics_stats()
        deadline = time.monotonic() + timeout
        while True:
            docs = self._own(read_all(path))
            doc = max(docs, key=lambda d: d.get("time", 0)) if docs else None
            if doc is not None and doc.get("time", 0) >= since and not doc.get("pending", 0):
                return doc
            if time.monotonic() > deadline:
                raise ServerError(f"hpkv's counters did not settle within {timeout:.0f} s (last: {doc})")
            time.sleep(0.02)

    def drained_stats(self, timeout: float = 120.0) -> dict[str, Any]:
        """hpkv's counters once its loads, stores and write-behind are done (nothing queued for the
        lower tiers, no slot pinned), or after ``timeout`` seconds. Before stopping a server whose
        tiers a later start must find whole: vLLM stops its engine without waiting by default
        (``--shutdown-timeout 0``), and what the write-behind had not written is then lost."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.settled_stats()
            mem = st.get("tiers", {}).get("memory", {})
            if (
                not mem.get("cascade_pending", 0) and not mem.get("pinned_slots", 0)
            ) or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def quiet(self, timeout: float = 15.0) -> float:
        """Wait until the server's processes (its process group) use less than QUIET_CORES of CPU
        over a QUIET_WINDOW_S window, or ``timeout`` seconds; returns the seconds waited. vLLM's
        workers busy-poll their queue for a second after every step (its shared-memory message
        queue), and a benchmark that sends the next request to *another* server meanwhile charges
        that server for it; waiting for quiet after every batch treats the systems alike."""
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        last = group_cpu_seconds(self.proc.pid)
        while time.monotonic() - t0 < timeout:
            time.sleep(QUIET_WINDOW_S)
            now = group_cpu_seconds(self.proc.pid)
            if now - last < QUIET_CORES * QUIET_WINDOW_S:
                break
            last = now
        return time.monotonic() - t0

    def metrics_stats(self) -> dict[str, Any]:
        """hpkv's counters from the server's Prometheus endpoint, summed over engine processes."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.request("GET", "/metrics", timeout=30)
        if status != 200:
            raise ServerError(f"/metrics answered {status}")
        tiers: dict[str, dict[str, int]] = {}
        conn: dict[str, int] = {}
        for fam in text_string_to_metric_families(body.decode()):
            for sample in fam.samples:
                name = sample.name.removesuffix("_total")
                if name.startswith("hpkv_tier_") and "tier" in sample.labels:
                    t = tiers.setdefault(sample.labels["tier"], {})
                    key = name[len("hpkv_tier_") :]
                    t[key] = t.get(key, 0) + int(sample.value)
                elif name == "hpkv_connector" and "what" in sample.labels:
                    conn[sample.labels["what"]] = conn.get(sample.labels["what"], 0) + int(sample.value)
        if not tiers and not conn:
            raise ServerError("the server's /metrics has no hpkv counters: is hpkv's connector running?")
        return {"tiers": tiers, "connector": conn}

    def engine_counters(self) -> dict[str, int]:
        """vLLM's own prefix-cache counters from ``/metrics`` (tokens): ``prefix_cache_hits`` (its
        GPU/engine cache) and ``external_prefix_cache_hits`` (what a KV connector supplied), summed over
        engines. They prove a peer's rows, where hpkv's counters do not apply."""
        from prometheus_client.parser import text_string_to_metric_families

        status, body = self.request("GET", "/metrics", timeout=30)
        if status != 200:
            raise ServerError(f"/metrics answered {status}")
        out: dict[str, int] = {}
        for fam in text_string_to_metric_families(body.decode()):
            for sample in fam.samples:
                name = sample.name.removeprefix("vllm:").removesuffix("_total")
                if name in ENGINE_COUNTERS:
                    out[name] = out.get(name, 0) + int(sample.value)
        return out


QUIET_WINDOW_S = 0.25
QUIET_CORES = 0.05  # below this share of one core the server is idle (its housekeeping threads)


def read_stat(path: str) -> tuple[str, list[str]] | None:
    """A /proc ``stat`` file (a process's or a thread's): its command name and the fields after it
    (state, ppid, pgrp, ..., utime at [11], stime at [12]); None when it cannot be read."""
    try:
        with open(path) as f:
            head, tail = f.read().rsplit(")", 1)
    except (OSError, ValueError):
        return None
    return head.split("(", 1)[1], tail.split()


def stat_cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds from the fields :func:`read_stat` returns."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc;
    0 elsewhere)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0.0
    total = 0.0
    for name in names:
        st = read_stat(f"/proc/{name}/stat") if name.isdigit() else None
        if st is not None and int(st[1][2]) == pgid:
            total += stat_cpu_seconds(st[1])
    return total


ENGINE_COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "num_preemptions",  # requests the engine preempted (their KV dropped, to be recomputed or reloaded)
)


def counter(stats: Mapping[str, Any], tier: str, name: str) -> int:
    if tier == "connector":
        return int(stats.get("connector", {}).get(name, 0))
    return int(stats.get("tiers", {}).get(tier, {}).get(name, 0))
