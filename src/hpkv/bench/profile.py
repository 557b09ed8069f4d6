"""Where an engine process's threads spend a benchmark row, sampled from outside by py-spy.

hpkv's page I/O under SGLang runs on threads of SGLang's scheduler process, beside a scheduler
thread that holds Python's GIL whenever it can. A row's TTFT says how long a load took, not
whether its threads were reading, hashing or waiting for the GIL. py-spy samples every thread's
Python stack without stopping the process (``--nonblocking``) or touching the GIL; a thread that
sits on the line of a system call longer than the call takes is waiting to get the GIL back.

The summary adds up, per group of threads (a thread's name less its number: ``hpkv-io``, the
scheduler's ``MainThread``, ...), the samples on each innermost line, as milliseconds of that
group's threads per page the row read. Lines where a thread waits for work are left out.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections import Counter, defaultdict
from dataclasses import dataclass, field

# Innermost frames of a thread with nothing to do: a pool worker or queue waiting for a task.
IDLE_FRAMES = ("_worker (", "wait (threading.py", "get (queue.py", "_wait_for_tstate_lock", "select (")
_NUMBER = re.compile(r"[-_]\d+$")


@dataclass
class Recorder:
    """``py-spy record`` of one process, from :meth:`start` until :meth:`stop` (SIGINT, on which
    py-spy writes what it sampled)."""

    pid: int
    path: str
    rate: int = 1000
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @staticmethod
    def available() -> str | None:
        return shutil.which("py-spy")

    def start(self) -> None:
        exe = self.available()
        if exe is None:
            raise FileNotFoundError("py-spy is not on PATH (scripts/sglang-gpu/install.sh puts it there)")
        cmd = [exe, "record", "--pid", str(self.pid), "--rate", str(self.rate), "--threads", "--idle"]
        cmd += ["--nonblocking", "--format", "raw", "--output", self.path]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> str:
        """Stop sampling; the raw samples (``thread (tid): name;frame;...;frame count`` lines), or
        raises RuntimeError with py-spy's own words."""
        if self.proc is None:
            raise RuntimeError("py-spy was not started")
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not os.path.exists(self.path):
            raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace').strip()[-400:]}")
        with open(self.path) as f:
            return f.read()


@dataclass(frozen=True)
class Line:
    group: str
    frame: str
    ms_per_page: float


def summarize(raw: str, rate: int, pages: int, top: int = 6) -> dict[str, list[Line]]:
    """Per thread group, its busiest innermost lines (waiting for work left out) as milliseconds
    of that group's threads per page read: samples / rate / pages."""
    by_group: dict[str, Counter[str]] = defaultdict(Counter)
    for row in raw.splitlines():
        head, _, count = row.rpartition(" ")
        if not head.startswith("thread (") or not count.isdigit():
            continue
        frames = head.split(";")
        name = frames[0].split(": ", 1)[-1] if ": " in frames[0] else frames[0]
        leaf = frames[-1] if len(frames) > 1 else "(no Python frame)"
        if any(marker in leaf for marker in IDLE_FRAMES):
            continue
        by_group[_NUMBER.sub("", name)][leaf] += int(count)
    per = 1e3 / rate / max(pages, 1)
    out: dict[str, list[Line]] = {}
    for group, leaves in sorted(by_group.items(), key=lambda kv: -sum(kv[1].values())):
        out[group] = [Line(group, leaf, n * per) for leaf, n in leaves.most_common(top)]
    return out


def describe(summary: dict[str, list[Line]], groups: int = 4) -> str:
    lines = []
    for group, rows in list(summary.items())[:groups]:
        total = sum(r.ms_per_page for r in rows)
        lines.append(f"    {group}: {total:.2f} ms per page on its {len(rows)} busiest lines")
        lines += [f"      {r.ms_per_page:7.3f}  {r.frame}" for r in rows]
    return "\n".join(lines)
