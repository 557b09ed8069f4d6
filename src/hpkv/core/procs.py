"""Process helpers shared by the tiers and integrations."""

from __future__ import annotations

import os
import signal
import subprocess


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen[bytes] | None, timeout: float = 60.0) -> None:
    """End a child started with ``start_new_session=True`` and everything it started: SIGTERM to its
    process group, SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
