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


def background_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority to ``nice`` (Linux schedules threads one by one: only
    this thread, and threads it starts later, are affected), so that background tier work yields
    the CPU to the model's threads where they share cores (vLLM's CPU build). Never raises: where
    the platform refuses, the thread keeps its priority."""
    import contextlib
    import threading

    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def name_os_thread() -> None:
    """Give the calling thread its Python name at the OS level too (Linux keeps 15 bytes), so that
    ``top -H``, ``/proc/PID/task/*/comm`` and profilers tell hpkv's threads from the engine's
    (CPython leaves every thread with the process's name). Never raises."""
    import ctypes
    import threading

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
