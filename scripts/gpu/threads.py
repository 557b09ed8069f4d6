"""What each thread of a process did over a window, from /proc (no tracer needed): CPU time, minor
page faults, context switches, and how often it was seen running. Usage:
python3 threads.py PID SECONDS [INTERVAL_S]

Printed per thread name (threads of one name summed), busiest first: CPU ms (user+system), the share
of samples in state R, minor faults, voluntary and involuntary switches; then the process's allowed
CPUs and the machine's core count. For the question of why hpkv's staging runs at
~12 GB/s inside vLLM whatever its thread count, when it runs at 20 outside."""

from __future__ import annotations

import collections
import os
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int, tid: str) -> tuple[str, str, int, int] | None:
    """(name, state, cpu ticks, minor faults) of one thread, None if it is gone."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    # fields after the name: state(0) ... minflt(7) ... utime(11) stime(12)
    return name, rest[0], int(rest[11]) + int(rest[12]), int(rest[7])


def _switches(pid: int, tid: str) -> tuple[int, int]:
    vol = invol = 0
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
    except OSError:
        pass
    return vol, invol


def snapshot(pid: int) -> dict[str, tuple[str, int, int, int, int]]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        s = _stat(pid, tid)
        if s is None:
            continue
        vol, invol = _switches(pid, tid)
        out[tid] = (s[0], s[2], s[3], vol, invol)
    return out


def main() -> None:
    pid, seconds = int(sys.argv[1]), float(sys.argv[2])
    interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.002
    before = snapshot(pid)
    running: collections.Counter[str] = collections.Counter()
    names: dict[str, str] = {}
    samples = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples += 1
        for tid in os.listdir(f"/proc/{pid}/task"):
            s = _stat(pid, tid)
            if s is not None:
                names[tid] = s[0]
                if s[1] == "R":
                    running[tid] += 1
        time.sleep(interval)
    after = snapshot(pid)
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0, 0, 0])
    for tid, (name, cpu, flt, vol, invol) in after.items():
        b = before.get(tid, (name, 0, 0, 0, 0))
        r = rows[name]
        r[0] += 1
        r[1] += (cpu - b[1]) * 1e3 / TICK
        r[2] += flt - b[2]
        r[3] += vol - b[3]
        r[4] += invol - b[4]
        r[5] += running[tid]
    print(f"== pid {pid}, {seconds:.1f} s, {samples} samples of thread states")
    print(f"{'thread':<24} {'n':>3} {'cpu ms':>9} {'running':>8} {'minflt':>9} {'vol sw':>8} {'invol sw':>8}")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        if r[1] == 0 and r[5] == 0:
            continue
        print(
            f"{name:<24} {int(r[0]):>3} {r[1]:>9.0f} {r[5] / max(samples, 1):>8.1%} {int(r[2]):>9} "
            f"{int(r[3]):>8} {int(r[4]):>8}"
        )
    with open(f"/proc/{pid}/status") as f:
        allowed = [line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list")]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    where = allowed[0] if allowed else "?"
    print(f"allowed CPUs {where}; this machine has {os.cpu_count()} cores; load average {load}")


if __name__ == "__main__":
    main()
