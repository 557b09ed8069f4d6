from __future__ import annotations

import pytest
import torch

from hpkv import HpkvConfig, HpkvConfigError, KVLayout
from hpkv.core.keys import Namespace


def test_chunk_size_must_be_a_multiple_of_the_engine_block_size(tmp_path: object) -> None:
    from hpkv.integrations.vllm.scheduler import HpkvScheduler

    ns = Namespace("m", KVLayout(2, 2, 16, torch.bfloat16), 100)
    cfg = HpkvConfig.load({"chunk_size": 100, "mem_pool_size": 0}, env={}, source="kv_connector_extra_config")
    with pytest.raises(
        HpkvConfigError,
        match=r"chunk_size \(kv_connector_extra_config\)=100 is not a multiple "
        r"of the engine's --block-size 64; use e.g. 64",
    ):
        HpkvScheduler(cfg, ns, 64, load=True, store=True)


def test_write_behind_is_paced_unless_told() -> None:
    """HPKV_WRITE_BEHIND: "paced" (the default) prefers the engine's idle time (bounded);
    "immediate" writes at once; other values are refused with the values that work."""
    from hpkv.integrations.vllm.connector import defer_writes

    for setting, want in [("paced", True), ("immediate", False)]:
        assert defer_writes(setting) is want, setting
    assert HpkvConfig.load({}, env={"HPKV_WRITE_BEHIND": "Paced"}).write_behind == "paced"
    assert HpkvConfig.load({}, env={}).write_behind == "paced"
    with pytest.raises(HpkvConfigError, match="HPKV_WRITE_BEHIND='idle'"):
        HpkvConfig.load({}, env={"HPKV_WRITE_BEHIND": "idle"})


def test_cost_aware_loads_are_on_by_default_and_can_be_turned_off() -> None:
    assert HpkvConfig.load({}, env={}).cost_aware_loads is True
    assert HpkvConfig.load({}, env={"HPKV_COST_AWARE_LOADS": "false"}).cost_aware_loads is False


def test_a_stop_signal_starts_the_last_writes_on_a_thread_and_still_reaches_vllms_handler() -> None:
    """The handler interrupts the main thread anywhere, possibly inside a lock the write-behind needs:
    the callback runs on a thread of its own; the handler vLLM installed before runs as before."""
    import os
    import signal
    import threading

    from hpkv.integrations.vllm.connector import _on_stop_signals

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    vllms: list[int] = []
    ran = threading.Event()
    where: list[str] = []
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: vllms.append(signum))
        lock = threading.Lock()

        def callback() -> None:
            with lock:  # held by the main thread when the signal arrives: must not deadlock
                where.append(threading.current_thread().name)
                ran.set()

        _on_stop_signals(callback)
        with lock:
            os.kill(os.getpid(), signal.SIGTERM)
            assert not ran.wait(0.2)  # the callback waits for the lock, the main thread goes on
        assert ran.wait(5)
        assert where == ["hpkv-stopping"] and vllms == [signal.SIGTERM]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
