"""What a bench's servers take from the caller's environment: hpkv's thread counts and direct I/O (so
the engine and the bench's raw references run with the same ones), never where tiers are or what is
stored (each bench sets those itself)."""

from __future__ import annotations

import pytest

from hpkv.bench import ttft_run
from hpkv.bench.server import TUNING_ENV, bench_env
from hpkv.core.config import _SPECS, HpkvConfig


def test_the_thread_counts_pass_and_the_rest_of_hpkv_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPKV_STORAGE_IO_THREADS", "8")
    monkeypatch.setenv("HPKV_VALKEY_NUM_WORKERS", "3")
    monkeypatch.setenv("HPKV_STORAGE_O_DIRECT", "false")
    monkeypatch.setenv("HPKV_REMOTE_URL", "valkey://10.0.0.1:6379")
    monkeypatch.setenv("HPKV_KV_STORAGE_PATH", "/somewhere/else")
    monkeypatch.setenv("HPKV_ASYNC_LOAD", "true")
    monkeypatch.setenv("PATH_FOR_THE_TEST", "kept")
    env = bench_env()
    assert {k: v for k, v in env.items() if k.startswith("HPKV_")} == {
        "HPKV_STORAGE_IO_THREADS": "8",
        "HPKV_VALKEY_NUM_WORKERS": "3",
        "HPKV_STORAGE_O_DIRECT": "false",
    }
    assert env["PATH_FOR_THE_TEST"] == "kept"
    # The storage reference reads with the engine's thread count, from the same variable.
    assert ttft_run._io_threads() == 8 == HpkvConfig.from_env().storage_io_threads


def test_every_passed_variable_is_a_setting() -> None:
    assert set(TUNING_ENV) <= {spec.env for spec in _SPECS.values()}
