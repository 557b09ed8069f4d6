"""hpkv's configuration: one frozen, typed dataclass, parsed once.

Sources and precedence (highest first), see :meth:`HpkvConfig.load`:

1. keyword arguments (``HpkvConfig.load(mem_pool_size="1G")``, vLLM's
   ``kv_connector_extra_config``),
2. ``HPKV_*`` environment variables,
3. the YAML file named by ``HPKV_CONFIG_FILE`` (lower-case names; LMCache-style
   names accepted where they mean the same thing),
4. the defaults below.

``HpkvConfig(...)`` itself takes keyword arguments only and reads no
environment, so tests and library users get exactly what they pass.
Every value is validated in ``__post_init__``; every error names the
variable or key, the bad value and a good example.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from hpkv.core.errors import HpkvConfigError
from hpkv.core.units import parse_bool, parse_size

ENV_PREFIX = "HPKV_"
CONFIG_FILE_ENV = "HPKV_CONFIG_FILE"


@dataclass(frozen=True)
class _Spec:
    env: str  # the HPKV_* variable
    example: str  # a good value, quoted in every error
    kind: str  # "size" | "int" | "bool" | "path" | "str" | "optpath"
    minimum: int | None = None
    maximum: int | None = None


# Field name -> how it is read and checked. Keep in step with HpkvConfig's fields.
_SPECS: dict[str, _Spec] = {
    "mem_pool_size": _Spec("HPKV_KV_MEM_POOL_SIZE", "16G", "size"),
    "share_mem_file_path": _Spec("HPKV_SHARE_MEM_FILE_PATH", "/dev/shm/hpkv", "path"),
    "storage_path": _Spec("HPKV_KV_STORAGE_PATH", "~/storage", "optpath"),
    "storage_size": _Spec("HPKV_KV_STORAGE_SIZE", "64G", "size"),
    "chunk_size": _Spec("HPKV_CHUNK_SIZE", "256", "int", minimum=1, maximum=1 << 20),
    "salt": _Spec("HPKV_SALT", "tenant-a", "str"),
    "storage_io_threads": _Spec("HPKV_STORAGE_IO_THREADS", "4", "int", minimum=1, maximum=256),
    "storage_o_direct": _Spec("HPKV_STORAGE_O_DIRECT", "true", "bool"),
    "cascade_queue_chunks": _Spec("HPKV_CASCADE_QUEUE_CHUNKS", "256", "int", minimum=0, maximum=1 << 20),
}

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


@dataclass(frozen=True)
class HpkvConfig:
    """Validated settings for one hpkv store. Immutable; build a new one to change it."""

    # Bytes of the shared-memory pool (the memory tier); 0 disables the tier.
    mem_pool_size: int = 4 * _GIB
    # Directory that holds the pool's shared-memory file, or the file itself (ends in .shm).
    share_mem_file_path: str = "/dev/shm/hpkv"
    # Directory of the persistent storage tier; None disables the tier. A leading ~ is expanded.
    storage_path: str | None = None
    # Capacity of the storage tier in bytes; least recently used chunks are evicted beyond it.
    storage_size: int = 64 * _GIB
    # Tokens per chunk: the unit of keys, records and loads. A multiple of the engine block size.
    chunk_size: int = 256
    # Mixed into every key's namespace, so tenants sharing storage never read each other's chunks.
    salt: str = ""
    # Threads reading and writing storage chunk files in parallel.
    storage_io_threads: int = 4
    # Read chunk files with O_DIRECT where the filesystem allows (falls back to buffered reads).
    storage_o_direct: bool = True
    # Chunks that may wait to be written to storage; beyond it a cascade write is dropped and counted.
    cascade_queue_chunks: int = 256
    # Which source set each field, for messages ("HPKV_CHUNK_SIZE", "chunk_size in cfg.yaml", ...).
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        origins = dict(self.origins)
        for f in dataclasses.fields(self):
            if f.name == "origins":
                continue
            spec = _SPECS[f.name]
            raw = getattr(self, f.name)
            where = origins.get(f.name, f.name)
            value = _convert(f.name, spec, raw, where)
            object.__setattr__(self, f.name, value)
            if f.name not in origins and value != f.default:
                origins[f.name] = f.name  # passed as a keyword: name the keyword in later messages
        object.__setattr__(self, "origins", origins)

    # -- construction -----------------------------------------------------

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        source: str = "keyword argument",
    ) -> HpkvConfig:
        """Merge defaults < YAML (``HPKV_CONFIG_FILE``) < ``HPKV_*`` < ``overrides``.

        ``overrides`` may use field names, the lower-cased variable names or the
        LMCache names; unknown keys raise :class:`HpkvConfigError`. ``env``
        defaults to ``os.environ``; unknown ``HPKV_*`` variables are rejected
        with the closest valid name, since a typo would otherwise be silently
        ignored.
        """
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}

        yaml_path = env.get(CONFIG_FILE_ENV)
        if yaml_path:
            data = _read_yaml(yaml_path)
            _merge(values, origins, data, lambda k: f"{k} in {yaml_path} ({CONFIG_FILE_ENV})")

        known_env = {s.env: name for name, s in _SPECS.items()}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV:
                continue
            if var in _FOREIGN_ENV:
                continue
            if var not in known_env:
                raise HpkvConfigError(_unknown_message(var, [*known_env, CONFIG_FILE_ENV], "variable"))
            values[known_env[var]] = raw
            origins[known_env[var]] = var

        if overrides:
            _merge(values, origins, dict(overrides), lambda k: f"{k} ({source})")
        return cls(**values, origins=origins)

    @classmethod
    def from_env(cls, **overrides: Any) -> HpkvConfig:
        """The settings a user exported (``HPKV_*`` and ``HPKV_CONFIG_FILE``), plus ``overrides``."""
        return cls.load(overrides)

    @classmethod
    def from_yaml(cls, path: str, **overrides: Any) -> HpkvConfig:
        """Settings from one YAML file (no environment), plus ``overrides``."""
        return cls.load(overrides, env={CONFIG_FILE_ENV: path})

    # -- derived values ---------------------------------------------------

    @property
    def resolved_storage_path(self) -> str | None:
        """``storage_path`` with ``~`` expanded and made absolute (the seed quotes ``"~/storage"``)."""
        if self.storage_path is None:
            return None
        return os.path.abspath(os.path.expanduser(self.storage_path))

    def where(self, name: str) -> str:
        """How to name field ``name`` to the user: the variable or key that set it."""
        return self.origins.get(name, _SPECS[name].env)

    def example(self, name: str) -> str:
        return _SPECS[name].example

    @staticmethod
    def env_names() -> dict[str, str]:
        """Field name -> ``HPKV_*`` variable, for docs and the CLI."""
        return {name: s.env for name, s in _SPECS.items()}


# Variables with the HPKV_ prefix that belong to other parts of hpkv (the CLI,
# the test suite) and are not store settings.
_FOREIGN_ENV = {"HPKV_TEST_KEEP", "HPKV_LOG_LEVEL"}


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise HpkvConfigError(
            f"{CONFIG_FILE_ENV}={path!r} cannot be read ({e.strerror}); "
            "point it at a YAML file, e.g. /etc/hpkv.yaml"
        ) from None
    except yaml.YAMLError as e:
        raise HpkvConfigError(f"{CONFIG_FILE_ENV}={path!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HpkvConfigError(
            f"{CONFIG_FILE_ENV}={path!r} must hold a mapping of settings, e.g. 'chunk_size: 256'"
        )
    return data


def _merge(
    values: dict[str, Any],
    origins: dict[str, str],
    data: dict[str, Any],
    describe: Callable[[str], str],
) -> None:
    names = {f.name for f in dataclasses.fields(HpkvConfig)} - {"origins"}
    for key, raw in data.items():
        key_l = str(key).lower()
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
            raise HpkvConfigError(_unknown_message(describe(str(key)), sorted(names | set(_ALIASES)), "key"))
        values[target] = value
        origins[target] = describe(str(key))


def _unknown_message(what: str, valid: list[str], noun: str) -> str:
    name = what.split(" ")[0]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown {noun} {what}; {hint}valid: {', '.join(sorted(valid))}"


def _convert(name: str, spec: _Spec, raw: Any, where: str) -> Any:
    def bad(why: str) -> HpkvConfigError:
        return HpkvConfigError(f"{where}={raw!r} {why}; use e.g. {spec.example}")

    if spec.kind == "size":
        try:
            return parse_size(raw)
        except ValueError:
            raise bad("is not a size") from None
    if spec.kind == "int":
        if isinstance(raw, bool):
            raise bad("is not an integer")
        try:
            value = int(str(raw).strip()) if not isinstance(raw, int) else raw
        except ValueError:
            raise bad("is not an integer") from None
        if spec.minimum is not None and value < spec.minimum:
            raise bad(f"is below the minimum {spec.minimum}")
        if spec.maximum is not None and value > spec.maximum:
            raise bad(f"is above the maximum {spec.maximum}")
        return value
    if spec.kind == "bool":
        try:
            return parse_bool(raw)
        except ValueError:
            raise bad("is not a boolean") from None
    if spec.kind in ("path", "optpath"):
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            if spec.kind == "optpath":
                return None
            raise bad("is empty")
        if not isinstance(raw, str | os.PathLike):
            raise bad("is not a path")
        text = os.fspath(raw)
        if "\0" in str(text):
            raise bad("contains a NUL byte")
        return str(text)
    if spec.kind == "str":
        if not isinstance(raw, str):
            raise bad("is not a string")
        return raw
    raise AssertionError(f"unknown kind {spec.kind} for {name}")  # pragma: no cover
