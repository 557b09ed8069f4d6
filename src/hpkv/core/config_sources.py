"""Where settings come from besides the environment: the YAML file named by ``HPKV_CONFIG_FILE``,
LMCache's names for the same settings, and the keys of LMCache's Valkey connector that hpkv accepts
(see :meth:`hpkv.core.config.HpkvConfig.load`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import yaml

from hpkv.core.errors import HpkvConfigError
from hpkv.core.paths import NotARegularFile, read_regular_file
from hpkv.core.units import parse_bool
from hpkv.core.values import shown, unknown_message

CONFIG_FILE_ENV = "HPKV_CONFIG_FILE"

# YAML / extra_config names that mean the same as a field (LMCache and the
# lower-cased variable names). Values are (field, converter from their unit).
_GIB = 1024**3


def _gb(v: object) -> object:
    """LMCache sizes are floats in GB; accept our own size strings too."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return int(float(v) * _GIB)
    return v


def _local_disk(v: object) -> object:
    """LMCache writes ``local_disk: "file:///path/"``."""
    if isinstance(v, str) and v.startswith("file://"):
        return v[len("file://") :]
    return v


_ALIASES: dict[str, tuple[str, Callable[[object], object]]] = {
    "kv_mem_pool_size": ("mem_pool_size", lambda v: v),
    "kv_storage_path": ("storage_path", lambda v: v),
    "kv_storage_size": ("storage_size", lambda v: v),
    "max_local_cpu_size": ("mem_pool_size", _gb),
    "local_disk": ("storage_path", _local_disk),
    "max_local_disk_size": ("storage_size", _gb),
}


YAML_MAX_BYTES = 1 << 20


def read_yaml(path: str) -> dict[str, Any]:
    """The settings file: a regular file (a FIFO would block the start for ever) of at most
    YAML_MAX_BYTES of UTF-8, read with the safe loader and without anchors or aliases (a few
    lines of aliases expand to gigabytes; a settings file never needs them)."""

    def bad(why: str) -> HpkvConfigError:
        return HpkvConfigError(
            f"{CONFIG_FILE_ENV}={shown(path)} {why}; point it at a YAML file, e.g. /etc/hpkv.yaml"
        )

    try:
        raw = read_regular_file(path, YAML_MAX_BYTES)
    except NotARegularFile:
        raise bad("is not a regular file") from None
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})") from None
    except ValueError:
        raise bad(f"is larger than {YAML_MAX_BYTES} bytes") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("is not UTF-8 text") from None
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise bad("uses YAML aliases (*name), which hpkv does not accept")
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise HpkvConfigError(f"{CONFIG_FILE_ENV}={shown(path)} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HpkvConfigError(
            f"{CONFIG_FILE_ENV}={path!r} must hold a mapping of settings, e.g. 'chunk_size: 256'"
        )
    return data


def merge(
    values: dict[str, Any],
    origins: dict[str, str],
    data: dict[str, Any],
    names: set[str],
    describe: Callable[[str], str],
) -> None:
    """Put each setting of ``data`` (a YAML mapping or keyword arguments) into ``values`` under its
    field among ``names``, and where it came from into ``origins``."""
    for key, raw in data.items():
        key_l = str(key).lower()
        if key_l == "extra_config" and isinstance(raw, dict):
            # LMCache's YAML nests the remote tier's settings under extra_config.
            merge(values, origins, raw, names, lambda k: describe(f"extra_config.{k}"))
            continue
        if key_l in _SEED_KEYS:
            _check_seed_key(key_l, raw, describe(str(key)))
            continue
        if key_l in names:
            target, value = key_l, raw
        elif key_l in _ALIASES:
            target, conv = _ALIASES[key_l]
            value = conv(raw)
        elif key_l == "local_cpu":
            # LMCache's switch for its CPU tier; false means no memory pool.
            try:
                on = parse_bool(raw)
            except ValueError:
                raise HpkvConfigError(
                    f"{describe(str(key))} = {raw!r} is not a boolean; use e.g. true"
                ) from None
            if not on:
                values["mem_pool_size"] = 0
                origins["mem_pool_size"] = describe(str(key))
            continue
        else:
            raise HpkvConfigError(unknown_message(describe(str(key)), sorted(names | set(_ALIASES)), "key"))
        values[target] = value
        origins[target] = describe(str(key))


# Keys of LMCache's Valkey connector that hpkv accepts for compatibility. hpkv
# stores one fixed-length record per chunk with its metadata in the record's
# header, so per-chunk metadata keys and partial chunks cannot be honoured.
_SEED_KEYS = {
    "save_chunk_meta",
    "save_unfull_chunk",
    "remote_serde",
    "blocking_timeout_secs",
    "pre_caching_hash_algorithm",
}


def _check_seed_key(key: str, raw: object, where: str) -> None:
    if key in ("save_chunk_meta", "save_unfull_chunk"):
        try:
            on = parse_bool(raw)
        except ValueError:
            raise HpkvConfigError(f"{where}={raw!r} is not a boolean; use e.g. false") from None
        if on:
            raise HpkvConfigError(
                f"{where}={raw!r} is not supported: hpkv stores one fixed-length record per full chunk "
                "(one GET per chunk), with no separate chunk metadata and no partial chunks; use false"
            )
    elif key == "remote_serde" and str(raw).strip().lower() != "naive":
        raise HpkvConfigError(f"{where}={raw!r} is not supported: records are stored raw; use naive")
