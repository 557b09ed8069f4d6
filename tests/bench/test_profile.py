"""The bench's py-spy summary: thread groups, idle lines left out, time per page; finding SGLang's
scheduler process among a server's processes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from hpkv.bench.profile import describe, summarize
from hpkv.bench.sglang_server import SGLangServer

RAW = """\
thread (11): hpkv-io_0;Thread._bootstrap (threading.py:1002);_private (local.py:1);read_cached (io.py:204) 300
thread (12): hpkv-io_1;Thread._bootstrap (threading.py:1002);_private (local.py:1);read_cached (io.py:204) 100
thread (12): hpkv-io_1;Thread._bootstrap (threading.py:1002);check (tier.py:254) 50
thread (12): hpkv-io_1;Thread._bootstrap (threading.py:1002);_worker (thread.py:89) 900
thread (10): MainThread;event_loop (scheduler.py:900);recv_requests (scheduler.py:1200) 700
thread (13): hpkv-cascade;Thread._bootstrap (threading.py:1002);wait (threading.py:331) 500
not a sample line
"""


def test_summarize_groups_threads_and_leaves_out_waiting_for_work() -> None:
    got = summarize(RAW, rate=1000, pages=10)
    assert list(got) == ["MainThread", "hpkv-io"]  # the cascade only waited: no lines left
    io = {line.frame: line.ms_per_page for line in got["hpkv-io"]}
    assert io == {"read_cached (io.py:204)": pytest.approx(40.0), "check (tier.py:254)": pytest.approx(5.0)}
    assert got["MainThread"][0].ms_per_page == pytest.approx(70.0)
    text = describe(got)
    assert "hpkv-io: 45.00 ms per page" in text and "read_cached (io.py:204)" in text


def test_find_process_by_its_title_within_the_group() -> None:
    proc = subprocess.Popen(["bash", "-c", "exec -a sglang::scheduler_TP0 sleep 30"], start_new_session=True)
    try:
        server = SGLangServer("model", 0, {}, os.devnull, proc=proc)
        deadline = time.monotonic() + 5
        pid = None
        while pid is None and time.monotonic() < deadline:
            pid = server.process("sglang::scheduler")
            time.sleep(0.05)
        assert pid == proc.pid
        assert server.process("sglang::detokenizer") is None
    finally:
        proc.kill()
        proc.wait()
