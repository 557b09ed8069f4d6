from __future__ import annotations

from pathlib import Path

import pytest

from hpkv import HpkvConfig, HpkvConfigError
from hpkv.core.units import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16G", 16 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", int(1.5 * (1 << 30))),
        ("4096", 4096),
        ("0", 0),
        ("2k", 2048),
        ("3 TiB", 3 << 40),
        ("7b", 7),
        (1024, 1024),
    ],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text) == expected


def test_defaults() -> None:
    c = HpkvConfig()
    assert c.mem_pool_size == 4 << 30
    assert c.share_mem_file_path == "/dev/shm/hpkv"
    assert c.storage_path is None
    assert c.storage_size == 64 << 30
    assert c.chunk_size == 256


def test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPKV_KV_MEM_POOL_SIZE", "16G")
    monkeypatch.setenv("HPKV_SHARE_MEM_FILE_PATH", "/mnt/hpkv")
    monkeypatch.setenv("HPKV_KV_STORAGE_PATH", "~/storage")
    monkeypatch.setenv("HPKV_CHUNK_SIZE", "128")
    c = HpkvConfig.from_env()
    assert c.mem_pool_size == 16 << 30
    assert c.share_mem_file_path == "/mnt/hpkv"
    assert c.storage_path == "~/storage"
    # The seed quotes "~/storage", so the shell leaves ~ alone; hpkv expands it.
    assert c.resolved_storage_path == str(Path.home() / "storage")
    assert c.chunk_size == 128


def test_precedence_kwargs_over_env_over_yaml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    y = tmp_path / "hpkv.yaml"
    y.write_text("chunk_size: 64\nkv_storage_size: 10G\nmax_local_cpu_size: 2\nsalt: from-yaml\n")
    monkeypatch.setenv("HPKV_CONFIG_FILE", str(y))
    monkeypatch.setenv("HPKV_CHUNK_SIZE", "32")
    c = HpkvConfig.from_env(salt="kw")
    assert c.chunk_size == 32  # env beats YAML
    assert c.storage_size == 10 << 30  # YAML beats default
    assert c.mem_pool_size == 2 << 30  # LMCache's max_local_cpu_size is GB
    assert c.salt == "kw"  # keyword beats all


def test_lmcache_names(tmp_path: Path) -> None:
    y = tmp_path / "lm.yaml"
    y.write_text(
        "chunk_size: 256\nlocal_cpu: false\nlocal_disk: 'file:///tmp/lmc/'\nmax_local_disk_size: 5\n"
    )
    c = HpkvConfig.from_yaml(str(y))
    assert c.mem_pool_size == 0
    assert c.storage_path == "/tmp/lmc/"
    assert c.storage_size == 5 << 30


@pytest.mark.parametrize(
    ("var", "value", "example"),
    [
        ("HPKV_KV_MEM_POOL_SIZE", "16X", "16G"),
        ("HPKV_KV_MEM_POOL_SIZE", "-1", "16G"),
        ("HPKV_KV_STORAGE_SIZE", "lots", "64G"),
        ("HPKV_CHUNK_SIZE", "0", "256"),
        ("HPKV_CHUNK_SIZE", "abc", "256"),
        ("HPKV_STORAGE_IO_THREADS", "-3", "4"),
        ("HPKV_STORAGE_O_DIRECT", "maybe", "true"),
        ("HPKV_STORAGE_DIRECT_WRITES", "sometimes", "true"),
        ("HPKV_WRITE_BEHIND", "later", "paced"),
        ("HPKV_SHARE_MEM_FILE_PATH", "", "/dev/shm/hpkv"),
        ("HPKV_REMOTE_URL", "http://cache:6379", "valkey://127.0.0.1:6379"),
        ("HPKV_REMOTE_URL", "valkey://cache:0", "valkey://127.0.0.1:6379"),
        ("HPKV_REMOTE_URL", "valkey://cache:port", "valkey://127.0.0.1:6379"),
        ("HPKV_REMOTE_URL", "valkey://a:1,,b:2", "valkey://127.0.0.1:6379"),
        ("HPKV_REMOTE_URL", "valkey://cache:6379/zero", "valkey://127.0.0.1:6379"),
        ("HPKV_VALKEY_NUM_WORKERS", "0", "8"),
        ("HPKV_VALKEY_NUM_WORKERS", "eight", "8"),
        ("HPKV_VALKEY_MODE", "sharded", "cluster"),
        ("HPKV_VALKEY_TLS_ENABLE", "sometimes", "true"),
        ("HPKV_VALKEY_DATABASE", "-1", "0"),
        ("HPKV_VALKEY_DATABASE", "first", "0"),
        ("HPKV_VALKEY_ENABLE_TTL", "2", "true"),
        ("HPKV_VALKEY_TTL_SEC", "0", "86400"),
        ("HPKV_VALKEY_TTL_SEC", "1.5", "86400"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "0", "5.0"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "soon", "5.0"),
        ("HPKV_VALKEY_REQUEST_TIMEOUT", "nan", "5.0"),
        ("HPKV_VALKEY_CONNECTION_TIMEOUT", "-2", "10.0"),
        ("HPKV_LAYERWISE_LOAD", "sometimes", "true"),
        ("HPKV_ASYNC_LOAD", "sometimes", "auto"),
    ],
)
def test_bad_env_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, example: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(HpkvConfigError) as e:
        HpkvConfig.from_env()
    msg = str(e.value)
    assert var in msg and repr(value) in msg and example in msg


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", "auto"), ("1", "true"), ("on", "true"), ("No", "false"), (False, "false")],
)
def test_async_load_takes_auto_or_a_yes_or_no(value: object, expected: str) -> None:
    """``HPKV_ASYNC_LOAD`` was a boolean before "auto": the yes/no spellings still work."""
    assert HpkvConfig(async_load=value).async_load == expected
    assert HpkvConfig().async_load == "auto"


def test_unknown_variable_is_rejected_with_suggestion(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPKV_KV_MEM_POOL_SZE", "1G")
    with pytest.raises(HpkvConfigError, match="did you mean HPKV_KV_MEM_POOL_SIZE"):
        HpkvConfig.from_env()


def test_unknown_yaml_key_is_rejected(tmp_path: Path) -> None:
    y = tmp_path / "bad.yaml"
    y.write_text("chunk_sise: 256\n")
    with pytest.raises(HpkvConfigError, match=r"chunk_sise.*did you mean chunk_size"):
        HpkvConfig.from_yaml(str(y))


def test_bad_yaml_value_names_key_and_file(tmp_path: Path) -> None:
    y = tmp_path / "bad.yaml"
    y.write_text("kv_mem_pool_size: 12Q\n")
    with pytest.raises(HpkvConfigError) as e:
        HpkvConfig.from_yaml(str(y))
    assert "kv_mem_pool_size" in str(e.value) and str(y) in str(e.value) and "'12Q'" in str(e.value)


def test_unreadable_or_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(HpkvConfigError, match="HPKV_CONFIG_FILE"):
        HpkvConfig.from_yaml(str(tmp_path / "missing.yaml"))
    y = tmp_path / "list.yaml"
    y.write_text("- a\n- b\n")
    with pytest.raises(HpkvConfigError, match="mapping"):
        HpkvConfig.from_yaml(str(y))


def test_keyword_errors_name_the_keyword() -> None:
    with pytest.raises(HpkvConfigError, match=r"mem_pool_size='16X'.*16G"):
        HpkvConfig(mem_pool_size="16X")
    with pytest.raises(HpkvConfigError, match="unknown key"):
        HpkvConfig.load({"no_such_setting": 1})


def test_config_is_frozen() -> None:
    c = HpkvConfig()
    with pytest.raises(AttributeError):
        c.chunk_size = 3  # type: ignore[misc]


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        HpkvConfig(chunk_size=-5)


def test_seed_valkey_yaml_with_extra_config(tmp_path: Path) -> None:
    """The seed's LMCache YAML, extra_config block included, configures the valkey tier."""
    y = tmp_path / "valkey.yaml"
    y.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 5.0\n"
        "remote_url: valkey://cluster-endpoint:6379\nremote_serde: naive\nblocking_timeout_secs: 120\n"
        "pre_caching_hash_algorithm: sha256_cbor_64bit\n"
        "extra_config:\n  valkey_num_workers: 32\n  valkey_mode: cluster\n  tls_enable: true\n"
        "  valkey_enable_ttl: true\n  valkey_ttl_sec: 3600\n  request_timeout: 2.5\n"
    )
    c = HpkvConfig.from_yaml(str(y))
    assert c.remote_url == "valkey://cluster-endpoint:6379"
    assert (c.valkey_num_workers, c.valkey_mode, c.tls_enable) == (32, "cluster", True)
    assert (c.valkey_enable_ttl, c.valkey_ttl_sec, c.request_timeout) == (True, 3600, 2.5)
    assert c.mem_pool_size == 5 << 30
    y.write_text("extra_config:\n  valkey_mode: shard\n")
    with pytest.raises(HpkvConfigError, match=r"extra_config.valkey_mode.*'shard'.*cluster"):
        HpkvConfig.from_yaml(str(y))


@pytest.mark.parametrize("key", ["save_chunk_meta", "save_unfull_chunk"])
def test_seed_rejects_chunk_meta_and_unfull_chunks(key: str) -> None:
    HpkvConfig.load({key: False}, env={})
    with pytest.raises(ValueError, match=f"{key}.*use false"):
        HpkvConfig.load({key: True}, env={})


def test_remote_serde_only_naive() -> None:
    HpkvConfig.load({"remote_serde": "naive"}, env={})
    with pytest.raises(HpkvConfigError, match=r"remote_serde.*'cbor'.*naive"):
        HpkvConfig.load({"remote_serde": "cbor"}, env={})


def test_remote_url_forms_and_no_password_echo() -> None:
    from hpkv.core.remote_url import parse_remote_url

    u = parse_remote_url("rediss://alice:p%40ss@h1:7000,h2:7001/3")
    assert u.nodes == (("h1", 7000), ("h2", 7001)) and u.tls
    assert (u.username, u.password, u.database) == ("alice", "p@ss", 3)
    assert parse_remote_url("valkey://cache").nodes == (("cache", 6379),)
    with pytest.raises(HpkvConfigError) as e:
        HpkvConfig.load({"remote_url": "valkey://alice:topsecret@h:99999"}, env={})
    assert "topsecret" not in str(e.value) and "99999" in str(e.value)
    assert "topsecret" not in repr(HpkvConfig.load({"remote_url": "valkey://a:topsecret@h:1"}, env={}))


def test_the_readme_gives_every_setting_one_line() -> None:
    """README's settings table is the settings table: one row per setting in declaration order, its
    help and its default as the setting declares them, each a single line."""
    import pathlib
    import re

    from hpkv.core.config import settings

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = re.findall(r"^\| `(HPKV_\w+)` \| (.*) \| (.*) \|$", readme, re.M)
    want = [(spec.env, spec.help, spec.shown) for _, spec in settings()]
    assert rows == want
    assert all(len(what) < 160 for _, what, _ in rows)


def test_a_pool_idle_timeout_of_0_keeps_the_pool_until_it_is_stopped() -> None:
    """README: `0`: until `hpkv pool stop`; a negative value is refused by name."""
    assert HpkvConfig.load({}, env={"HPKV_POOL_IDLE_TIMEOUT": "0"}).pool_idle_timeout == 0
    with pytest.raises(HpkvConfigError, match=r"HPKV_POOL_IDLE_TIMEOUT='-1' must be a number of at least 0"):
        HpkvConfig.load({}, env={"HPKV_POOL_IDLE_TIMEOUT": "-1"})
    with pytest.raises(HpkvConfigError, match=r"HPKV_VALKEY_REQUEST_TIMEOUT='0' must be a number above 0"):
        HpkvConfig.load({}, env={"HPKV_VALKEY_REQUEST_TIMEOUT": "0"})
