"""Faults under load: ``hpkv bench serve --fault KIND``.

A fault is put in place just before the first request of one turn is sent (``at_turn``: every user's
requests of that turn and later see it) and taken away before the first request of the next turn, so
a run's turns fall into windows: before, during, after. The serve bench reports each window's TTFT,
throughput, failed requests and wrong texts (against vLLM alone's on the same requests), and hpkv's
counters (errors, corrupt records, skipped writes, the remote tier's reconnects).

The faults act on real parts: the embedded valkey-server is killed or stopped with SIGSTOP, the
storage directory is a tmpfs mount that gets filled, chunk files are corrupted or deleted in place,
the engine's process is restarted. Nothing in hpkv is told about them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

FAULTS = {
    "valkey-kill": "valkey-server killed (SIGKILL), started again empty for the next turn",
    "valkey-pause": "valkey-server stopped (SIGSTOP) for longer than hpkv's valkey timeouts, then resumed",
    "disk-full": "the storage directory's file system (a tmpfs) filled up, the space freed for the next turn",
    "corrupt": "one byte flipped in every chunk file in storage, and hpkv's memory tier emptied",
    "delete": "every chunk file in storage deleted, and hpkv's memory tier emptied",
    "restart": "the engine restarted between two turns (its host pool and storage kept)",
}
NEEDS_VALKEY = ("valkey-kill", "valkey-pause")


def request_tag(index: int, user: int, turn: int) -> str:
    """The request id the bench sends (``X-Request-Id``): the engine's ids and hpkv's log lines
    contain it, so each request's tiers can be found in the server's log."""
    return f"hpkvb-{index}-u{user}-t{turn}"


def tag_turn(request_id: str | None) -> int:
    if not request_id or "-t" not in request_id:
        return -1
    return int(request_id.rsplit("-t", 1)[1])


@dataclass
class Fault:
    """One fault on one running system: ``runner`` is the TTFT bench's Runner (server, valkey,
    storage directory). ``hold_s``: the fault lasts at least this long."""

    kind: str
    at_turn: int
    runner: Any
    hold_s: float = 0.0
    disk_size: str = "4G"  # the storage tmpfs of a disk-full run: room for the run's chunks
    events: list[tuple[str, float]] = field(default_factory=list)  # (what, time.perf_counter())
    _mounted: str | None = None
    _filler: str | None = None
    _began: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULTS:
            raise ValueError(f"--fault {self.kind!r}: choose from {', '.join(FAULTS)}")
        if self.kind == "valkey-pause":
            # Longer than a request's timeout, so hpkv meets timeouts and not just a slow server.
            timeout = float(os.environ.get("HPKV_VALKEY_REQUEST_TIMEOUT", "5"))
            self.hold_s = max(self.hold_s, 2 * timeout + 1)

    @property
    def until_turn(self) -> int:
        return self.at_turn + 1

    @property
    def drains(self) -> bool:
        """Whether the turns before ``at_turn`` must have finished first (a restart between turns)."""
        return self.kind == "restart"

    # -- before the server starts, after it stops --------------------------------------------

    def prepare(self, storage: str) -> None:
        """Before the server starts: a disk-full run's storage directory becomes a tmpfs mount."""
        if self.kind != "disk-full":
            return
        os.makedirs(storage, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={self.disk_size},mode=0700", "tmpfs", storage]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(
                f"--fault disk-full mounts a tmpfs on the storage directory and could not: "
                f"{(r.stderr or r.stdout).strip()} (it needs root or CAP_SYS_ADMIN)"
            )
        self._mounted = storage

    def close(self) -> None:
        if self._filler:
            with contextlib.suppress(OSError):
                os.unlink(self._filler)
        if self._mounted:
            subprocess.run(["umount", "-l", self._mounted], capture_output=True)
            self._mounted = None
        if self.kind == "valkey-pause" and self.runner.valkey is not None:
            self._signal_valkey(signal.SIGCONT)

    # -- during the load ---------------------------------------------------------------------

    def begin(self) -> None:
        self._began = time.monotonic()
        self.events.append(("begin", time.perf_counter()))
        if self.kind == "valkey-kill":
            self.runner.valkey.kill()
        elif self.kind == "valkey-pause":
            self._signal_valkey(signal.SIGSTOP)
        elif self.kind == "disk-full":
            self._fill(self.runner._storage_dir())
        elif self.kind in ("corrupt", "delete"):
            touched = chunk_files(self.runner._storage_dir())
            for path in touched:
                with contextlib.suppress(OSError):
                    if self.kind == "delete":
                        os.unlink(path)
                    else:
                        flip_byte(path)
            done = "deleted" if self.kind == "delete" else "corrupted"
            self.events.append((f"{len(touched)} chunk files {done}", time.perf_counter()))
            self.runner.server.reset_prefix_cache(external=True)  # the hits must come from storage
        elif self.kind == "restart":
            server = self.runner.server
            server.drained_stats()  # what the write-behind holds reaches the tiers first, as on a
            keep, server.keep_pool = server.keep_pool, True  # clean stop; the host pool stays
            server.stop()
            server.keep_pool = keep
            server.start()
        self.events.append(("in place", time.perf_counter()))

    def end(self) -> None:
        left = self.hold_s - (time.monotonic() - self._began)
        if left > 0:
            time.sleep(left)
        if self.kind != "restart":
            # The writes of the turn that ran with the fault meet it too: hpkv writes behind, up
            # to a second after a store, and the next turn waits at the gate meanwhile.
            self.runner.server.drained_stats(timeout=60)
        if self.kind in NEEDS_VALKEY:
            if self.kind == "valkey-kill":
                self.runner.valkey.restart()
            else:
                self._signal_valkey(signal.SIGCONT)
            # The next turn is sent once hpkv has reached the server again (it retries every few
            # seconds): how long that took is part of the recovery, in the events.
            self._wait_connected(timeout=60)
        elif self.kind == "disk-full" and self._filler:
            os.unlink(self._filler)
            self._filler = None
        self.events.append(("end", time.perf_counter()))

    def _wait_connected(self, timeout: float) -> None:
        since = time.perf_counter()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tiers = self.runner.server.hpkv_stats().get("tiers", {})
            if tiers.get("valkey", {}).get("connected"):
                waited = time.perf_counter() - since
                self.events.append((f"hpkv reached valkey again {waited:.1f} s later", time.perf_counter()))
                return
            time.sleep(0.1)
        self.events.append((f"hpkv had not reached valkey again after {timeout:.0f} s", time.perf_counter()))

    def _signal_valkey(self, sig: int) -> None:
        for node in self.runner.valkey.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(sig)

    def _fill(self, directory: str) -> None:
        """Allocate a filler file over the file system's free space, then write until ENOSPC."""
        self._filler = os.path.join(directory, "filler.hpkv-bench")
        st = os.statvfs(directory)
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)
            os.lseek(fd, 0, os.SEEK_END)
            block = b"\0" * 4096
            try:
                while True:
                    os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
        finally:
            os.close(fd)


def chunk_files(root: str) -> list[str]:
    """The chunk records under a storage directory (not temp files, not the bench's filler)."""
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if not n.endswith((".tmp", ".hpkv-bench"))]
    return out


def flip_byte(path: str) -> None:
    """Flip one byte in the middle of a file (in the payload, past any header)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))


RequestFunc = Callable[..., Awaitable[Any]]


class Gate:
    """Wraps vLLM's request function: before a request of turn ``fault.at_turn`` is sent the fault
    is put in place (once; the others wait), before one of ``fault.until_turn`` it is taken away.
    A restart fault first waits for the earlier turns' requests to finish, and the requests after
    it use a new HTTP session (the old one's connections went with the old server)."""

    def __init__(self, inner: RequestFunc, fault: Fault, turns_of: dict[str, int]) -> None:
        self.inner, self.fault, self.turns_of = inner, fault, turns_of
        self._lock = asyncio.Lock()
        self._begun = self._ended = False
        self._open: dict[int, int] = {}  # turn -> requests sent and not finished
        self._idle = asyncio.Condition()
        self._session: Any = None

    async def __call__(self, request_func_input: Any, session: Any = None, pbar: Any = None) -> Any:
        turn = self.turns_of.get(request_func_input.request_id, -1)
        if turn >= self.fault.at_turn and not self._begun:
            async with self._lock:
                if not self._begun:
                    if self.fault.drains:
                        async with self._idle:
                            await self._idle.wait_for(
                                lambda: not any(n for t, n in self._open.items() if t < turn)
                            )
                    await asyncio.to_thread(self.fault.begin)
                    if self.fault.drains:
                        import aiohttp

                        self._session = aiohttp.ClientSession(
                            timeout=aiohttp.ClientTimeout(total=6 * 60 * 60)
                        )
                    self._begun = True
        if turn >= self.fault.until_turn and not self._ended:
            async with self._lock:
                if not self._ended:
                    await asyncio.to_thread(self.fault.end)
                    self._ended = True
        self._open[turn] = self._open.get(turn, 0) + 1
        try:
            return await self.inner(
                request_func_input=request_func_input, session=self._session or session, pbar=pbar
            )
        finally:
            async with self._idle:
                self._open[turn] -= 1
                self._idle.notify_all()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


# -- what a run's turns saw ------------------------------------------------------------------------


def by_turn(result: dict[str, Any], requests: list[Any]) -> list[dict[str, float]]:
    """Per turn (every user's request of that turn): TTFT p50/p99, requests per second over the
    turn's span (its first request sent to its last finished), failed requests."""
    from hpkv.bench.serve_stats import percentile

    starts = result.get("start_times") or []
    lat = result.get("latencies") or [
        t + sum(g) for t, g in zip(result["ttfts"], result["itls"], strict=True)
    ]
    out = []
    for turn in sorted({r.turn for r in requests}):
        idx = [i for i, r in enumerate(requests) if r.turn == turn]
        ok = [i for i in idx if not result["errors"][i]]
        ttfts = [result["ttfts"][i] for i in ok]
        span = 0.0
        if starts and ok:
            span = max(starts[i] + lat[i] for i in ok) - min(starts[i] for i in idx)
        out.append(
            {
                "turn": float(turn),
                "requests": float(len(idx)),
                "failed": float(len(idx) - len(ok)),
                "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
                "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
                "requests_per_s": len(ok) / span if span > 0 else float("nan"),
            }
        )
    return out


# The counters a fault moves: (tier, counter).
FAULT_COUNTERS = (
    ("memory", "hits"),
    ("storage", "hits"),
    ("storage", "corrupt"),
    ("storage", "errors"),
    ("storage", "writes"),
    ("storage", "writes_skipped"),
    ("valkey", "hits"),
    ("valkey", "errors"),
    ("valkey", "writes"),
    ("valkey", "writes_skipped"),
    ("valkey", "reconnects"),
    ("connector", "chunks_left_to_recompute"),
)


def fault_counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """hpkv's counters over the run, ``tier.counter`` -> delta (absent tiers left out)."""
    from hpkv.bench.verify import delta

    tiers = after.get("tiers", {})
    return {
        f"{tier}.{name}": delta(before, after, tier, name)
        for tier, name in FAULT_COUNTERS
        if tier in tiers or tier == "connector"
    }
