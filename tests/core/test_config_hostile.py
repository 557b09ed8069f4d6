"""Hostile and unlucky settings: each is an HpkvConfigError naming the variable, the value (shortened)
and a good example, never a traceback from deep inside, a hang or a silently wrong value."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from hpkv import HpkvConfig, HpkvConfigError


def load(**env: str) -> HpkvConfig:
    return HpkvConfig.load(env=env)


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("HPKV_KV_MEM_POOL_SIZE", "9" * 400, "is too large"),
        ("HPKV_KV_MEM_POOL_SIZE", "99999P", "is too large"),
        ("HPKV_KV_MEM_POOL_SIZE", "１６G", "is not a size"),  # full-width digits
        ("HPKV_KV_MEM_POOL_SIZE", "0.0000001", "rounds to 0 bytes"),
        ("HPKV_KV_MEM_POOL_SIZE", "0.5", "rounds to 0 bytes"),
        ("HPKV_CHUNK_SIZE", "２５６", "is not an integer"),
        ("HPKV_CHUNK_SIZE", "1" * 300, "is not an integer"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "inf", "is not a number"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "nan", "is not a number"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "1e999", "must be a number above"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "５", "is not a number"),
        ("HPKV_SALT", "tenant-\udc80", "lone surrogate"),
        ("HPKV_REMOTE_URL", "valkey://h:1:2", "more than one ':'"),
        ("HPKV_REMOTE_URL", "valkey://127.0.0.1:6379/-1", "database"),
        ("HPKV_REMOTE_URL", "valkey://127.0.0.1:６３７９", "bad port"),
        ("HPKV_REMOTE_URL", "valkey://127.0.0.1:6379/99999999", "database"),
    ],
)
def test_bad_values_name_the_variable_value_and_an_example(var: str, value: str, says: str) -> None:
    with pytest.raises(HpkvConfigError) as e:
        load(**{var: value})
    msg = str(e.value)
    assert msg.startswith(f"{var}=") and says in msg and "e.g." in msg, msg
    assert len(msg) < 300, "a long value is shortened in the message"
    msg.encode("utf-8")  # printable: a lone surrogate is escaped, never raised on


def test_zero_written_as_zero_turns_a_tier_off() -> None:
    assert load(HPKV_KV_MEM_POOL_SIZE="0").mem_pool_size == 0
    assert HpkvConfig(mem_pool_size=0).mem_pool_size == 0
    for bad in (float("inf"), float("nan"), 10.0**30):
        with pytest.raises(HpkvConfigError, match="mem_pool_size="):
            HpkvConfig(mem_pool_size=bad)


def _yaml_env(path: Path | str) -> dict[str, str]:
    return {"HPKV_CONFIG_FILE": str(path)}


def test_a_binary_settings_file(tmp_path: Path) -> None:
    f = tmp_path / "bin.yaml"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(HpkvConfigError, match=r"HPKV_CONFIG_FILE=.*not UTF-8 text.*e\.g\. /etc/hpkv\.yaml"):
        HpkvConfig.load(env=_yaml_env(f))


def test_a_fifo_as_the_settings_file_does_not_hang(tmp_path: Path) -> None:
    f = tmp_path / "fifo.yaml"
    os.mkfifo(f)
    out: list[BaseException] = []

    def run() -> None:
        try:
            HpkvConfig.load(env=_yaml_env(f))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "loading the settings blocked on a FIFO"
    assert isinstance(out[0], HpkvConfigError) and "is not a regular file" in str(out[0])


def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        cur = chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(HpkvConfigError, match="aliases"):
        HpkvConfig.load(env=_yaml_env(f))


def test_a_huge_settings_file(tmp_path: Path) -> None:
    f = tmp_path / "huge.yaml"
    f.write_text("# " + "x" * (2 << 20) + "\nchunk_size: 256\n")
    with pytest.raises(HpkvConfigError, match="larger than"):
        HpkvConfig.load(env=_yaml_env(f))


def test_relative_paths_are_made_absolute_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hpkv"):
        a = load(HPKV_KV_STORAGE_PATH="rel/store", HPKV_SHARE_MEM_FILE_PATH="../shm-rel")
        b = load(HPKV_KV_STORAGE_PATH="rel/store")
    assert a.storage_path == str(tmp_path / "rel" / "store") == b.storage_path
    assert a.share_mem_file_path == str(tmp_path.parent / "shm-rel")
    said = [r for r in caplog.records if "is relative" in r.getMessage()]
    assert len(said) == 2  # each path once, not at every load
