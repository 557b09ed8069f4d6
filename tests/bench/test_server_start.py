"""A vLLM that exits while starting: the error names its root cause, not only vLLM's last line.

vLLM's API server ends with "Engine core initialization failed. See root cause above", and the
traceback after the cause can be longer than the tail we print. A real vLLM cannot be made to fail on
demand with a known cause, so the interpreter is a script that writes such a log (in vLLM's line
format) and exits 1.
"""

from __future__ import annotations

import os
import stat

import pytest

from hpkv.bench.server import Server, ServerError

CAUSE = "ValueError: Free memory on device (10.2/139.8 GiB) on startup is less than desired"


def _failing_python(tmp_path, lines: list[str]) -> str:
    script = tmp_path / "python"
    body = "\n".join(f"echo '{line}'" for line in lines)
    script.write_text(f"#!/bin/sh\n{body}\nexit 1\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_a_failed_start_names_the_root_cause_of_that_start(tmp_path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("ValueError: from an earlier start, already handled\n")
    noise = [f'(APIServer pid=1)   File "x.py", line {i}, in f' for i in range(60)]
    python = _failing_python(
        tmp_path,
        [
            "(EngineCore pid=2) ERROR 12-02 22:18:09 [core.py:1510] EngineCore failed to start.",
            f"(EngineCore pid=2) ERROR 12-02 22:18:09 [core.py:1510] {CAUSE}",
            *noise,
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ],
    )
    server = Server(model="m", port=1, env=dict(os.environ), log_path=str(log), python=python)
    with pytest.raises(ServerError) as err:
        server.start(timeout=30)
    message = str(err.value)
    assert f"root cause: {CAUSE}" in message
    assert "earlier start" not in message
    assert "root cause: RuntimeError" not in message
    # The cause is not in the tail: without the root-cause line the message would not show it.
    assert CAUSE not in server.log_tail()


def test_a_stopped_run_keeps_each_systems_first_error(capsys: pytest.CaptureFixture[str]) -> None:
    from types import SimpleNamespace

    from hpkv.bench.server import stopped

    first, fresh = SimpleNamespace(error="vLLM exited with 1"), SimpleNamespace(error="")
    stopped([first, fresh], RuntimeError("Traceback ...\nOSError: [Errno 28] No space left on device"))
    assert first.error == "vLLM exited with 1"
    assert fresh.error == "OSError: [Errno 28] No space left on device"
    assert capsys.readouterr().out == "stopped: OSError: [Errno 28] No space left on device\n"
