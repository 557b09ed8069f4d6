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
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpkv.core.config_sources import CONFIG_FILE_ENV, merge, read_yaml
from hpkv.core.errors import HpkvConfigError
from hpkv.core.remote_url import parse_remote_url
from hpkv.core.values import Spec, convert, unknown_message

ENV_PREFIX = "HPKV_"


def _setting(
    default: Any,
    env: str,
    kind: str,
    example: str,
    help: str,
    shown: str,
    *,
    secret: bool = False,
    **check: Any,
) -> Any:
    """One setting: its default, variable, check and README line, declared once as a field."""
    spec = Spec(env, example, kind, help, shown, **check)
    return field(default=default, repr=not secret, metadata={"spec": spec})


_GIB = 1024**3


@dataclass(frozen=True)
class HpkvConfig:
    """Validated settings for one hpkv store. Immutable; build a new one to change it."""

    # Bytes of the shared-memory pool (the memory tier); 0 disables the tier.
    mem_pool_size: int = _setting(
        4 * _GIB,
        "HPKV_KV_MEM_POOL_SIZE",
        "size",
        "16G",
        "memory pool per TP rank (`16G`, `512MiB`); `0`: no memory tier",
        "`4G`",
    )
    # Directory that holds the pool's shared-memory file, or the file itself (ends in .shm).
    share_mem_file_path: str = _setting(
        "/dev/shm/hpkv",
        "HPKV_SHARE_MEM_FILE_PATH",
        "path",
        "/dev/shm/hpkv",
        "directory of the pool's shared-memory files",
        "`/dev/shm/hpkv`",
    )
    # "shared": one memory pool per host and pool directory, shared by every engine there and kept
    # across their restarts by a pool process of its own (tiers/memory/hostpool.py); "engine": each
    # engine its own pool, removed when it stops.
    memory_pool: str = _setting(
        "shared",
        "HPKV_MEMORY_POOL",
        "choice",
        "shared",
        "`shared`: one pool per host and directory, shared by its engines, kept across restarts; "
        "`engine`: each engine its own",
        "`shared`",
        choices=("shared", "engine"),
    )
    # Seconds the shared pool stays after its last engine disconnects (0: until `hpkv pool stop`).
    pool_idle_timeout: float = _setting(
        3600.0,
        "HPKV_POOL_IDLE_TIMEOUT",
        "float",
        "3600",
        "seconds the shared pool stays after its last engine leaves; `0`: until `hpkv pool stop`",
        "`3600`",
        minimum=0,
        maximum=1 << 31,
        minimum_ok=True,
    )
    # Directory of the persistent storage tier; None disables the tier. A leading ~ is expanded.
    storage_path: str | None = _setting(
        None,
        "HPKV_KV_STORAGE_PATH",
        "optpath",
        "~/storage",
        "storage directory; unset: no storage tier",
        "unset",
    )
    # Capacity of the storage tier in bytes; least recently used chunks are evicted beyond it.
    storage_size: int = _setting(
        64 * _GIB,
        "HPKV_KV_STORAGE_SIZE",
        "size",
        "64G",
        "storage capacity; least recently used chunks go beyond it",
        "`64G`",
    )
    # Tokens per chunk: the unit of keys, records and loads. A multiple of the engine block size.
    chunk_size: int = _setting(
        256,
        "HPKV_CHUNK_SIZE",
        "int",
        "256",
        "tokens per chunk, a multiple of the engine's block size",
        "`256`",
        minimum=1,
        maximum=1 << 20,
    )
    # Mixed into every key's namespace, so tenants sharing storage never read each other's chunks.
    salt: str = _setting(
        "",
        "HPKV_SALT",
        "str",
        "tenant-a",
        "mixed into every key: engines with different salts never share chunks",
        "empty",
    )
    # Threads reading and writing storage chunk files in parallel.
    storage_io_threads: int = _setting(
        4,
        "HPKV_STORAGE_IO_THREADS",
        "int",
        "4",
        "threads reading and writing storage in parallel",
        "`4`",
        minimum=1,
        maximum=256,
    )
    # SGLang: Python's GIL switch interval in SGLang's scheduler process, in microseconds, if it is
    # longer (0: leave it). SGLang's scheduler thread polls in a loop, holding the GIL until asked
    # to let go, which Python does only after this interval (5 ms by default); each of hpkv's reads
    # and writes takes the GIL back a few times per page, so at 5 ms a page waits milliseconds for
    # nothing.
    sglang_switch_interval_us: int = _setting(
        200,
        "HPKV_SGLANG_SWITCH_INTERVAL_US",
        "int",
        "200",
        "SGLang: lower Python's GIL switch interval to this, so a busy scheduler loop does not stall "
        "hpkv's page I/O; `0`: leave it",
        "`200`",
        minimum=0,
        maximum=100000,
    )
    # Read chunk files with O_DIRECT where the filesystem allows (falls back to buffered reads).
    storage_o_direct: bool = _setting(
        True,
        "HPKV_STORAGE_O_DIRECT",
        "bool",
        "true",
        "read chunk files with O_DIRECT where the filesystem allows",
        "`true`",
    )
    # Write chunk files with O_DIRECT (their last partial page buffered): no page-cache copy of what
    # the pool already holds, and a fraction of the CPU where the page cache's new pages are
    # expensive (VMs whose balloon hands freed memory back to the host).
    # Later reads of such a file come from the device, not the page cache.
    storage_direct_writes: bool = _setting(
        False,
        "HPKV_STORAGE_DIRECT_WRITES",
        "bool",
        "true",
        "write chunk files with O_DIRECT (no page-cache copy; later reads come from the device)",
        "`false`",
    )
    # Chunks that may wait to be written to storage; beyond it a cascade write is dropped and counted.
    cascade_queue_chunks: int = _setting(
        256,
        "HPKV_CASCADE_QUEUE_CHUNKS",
        "int",
        "256",
        "chunks queued for storage and Valkey; beyond it writes are skipped and counted",
        "`256`",
        minimum=0,
        maximum=1 << 20,
    )
    # vLLM: when the write-behind sends new chunks to storage and Valkey. "paced": in the engine's
    # idle time, but no chunk waits longer than about a second (engine/cascade.py); "immediate": as
    # soon as they are in memory.
    write_behind: str = _setting(
        "paced",
        "HPKV_WRITE_BEHIND",
        "choice",
        "immediate",
        "`paced`: writes to storage and Valkey in idle time, none later than ~1 s; `immediate`: at once",
        "`paced`",
        choices=("paced", "immediate"),
    )
    # vLLM: load only as much of a hit as is faster than recomputing it, by the tiers' measured read
    # rates and the engine's measured prefill rate (engine/costs.py); false: load every hit whole.
    cost_aware_loads: bool = _setting(
        True,
        "HPKV_COST_AWARE_LOADS",
        "bool",
        "false",
        "load only the part of a hit that is faster to read and copy than to recompute",
        "`true`",
    )
    # CUDA: load layer by layer, so the first layers' attention starts before the last layers arrive.
    layerwise_load: bool = _setting(
        False,
        "HPKV_LAYERWISE_LOAD",
        "bool",
        "true",
        "CUDA: load layer by layer, so attention starts before the last layer arrives",
        "`false`",
    )
    # vLLM: when a hit is loaded asynchronously (vLLM's async KV load: the request waits for its KV
    # unscheduled, its chunks go to the engine as soon as they are in memory, and no step waits for
    # the copies). "true": every hit that needs storage or Valkey. "false": none ("ask again" until
    # every chunk is in memory, then one load inside the request's first step). "auto": on a GPU,
    # every load of a chunk or more that needs storage or Valkey (its copies overlap its reads) or
    # that is found while the engine has other requests (no step serving them waits for its
    # copies); a memory hit of a request alone, a shorter load, and every request on the CPU build
    # (whose copies run inline either way), as "false".
    async_load: str = _setting(
        "auto",
        "HPKV_ASYNC_LOAD",
        "choice",
        "auto",
        "vLLM's asynchronous load: `auto` (on a GPU, slow or concurrent hits), `true`, `false`",
        "`auto`",
        choices=("auto", "true", "false"),
    )
    # vLLM: a directory where the engine's scheduler writes one JSON line per lookup, step and step
    # report it sees (integrations/vllm/steptrace.py), for finding where a request's time went.
    # None: no trace.
    step_trace: str | None = _setting(
        None,
        "HPKV_STEP_TRACE",
        "optpath",
        "/tmp/hpkv-steps",
        "directory for a JSON line per lookup and step, to see where a request's time went",
        "unset",
    )
    # Accept pool and storage directories that their group may write (a group of trusted engines).
    shared_group: bool = _setting(
        False,
        "HPKV_SHARED_GROUP",
        "bool",
        "true",
        "accept pool and storage directories writable by their group",
        "`false`",
    )
    # A secret shared by every engine of one cache: records carry a keyed MAC checked on every read
    # from storage or Valkey, so a record forged without the key is a miss. None: plain checksums.
    auth_key: str | None = _setting(
        None,
        "HPKV_AUTH_KEY",
        "optstr",
        "<32 random characters, e.g. from: openssl rand -hex 16>",
        "≥ 16 bytes: every record carries a keyed MAC instead of a checksum",
        "unset",
        secret=True,
    )
    # The remote (Valkey/Redis) tier: valkey://host:port[,host:port...] (valkeys:// = TLS); None disables it.
    remote_url: str | None = _setting(
        None,
        "HPKV_REMOTE_URL",
        "url",
        "valkey://127.0.0.1:6379",
        "Valkey: `valkey://host:port[,host:port…][/db]`, `valkeys://` for TLS, `user:pass@` allowed",
        "unset",
        secret=True,
    )
    # Threads talking to Valkey, each with its own client.
    valkey_num_workers: int = _setting(
        8,
        "HPKV_VALKEY_NUM_WORKERS",
        "int",
        "8",
        "Valkey client threads, each with its own connection",
        "`8`",
        minimum=1,
        maximum=256,
    )
    # "standalone" (one server, optional database) or "cluster" (topology discovered from the URL's nodes).
    valkey_mode: str = _setting(
        "standalone",
        "HPKV_VALKEY_MODE",
        "choice",
        "cluster",
        "`standalone` or `cluster`",
        "`standalone`",
        choices=("standalone", "cluster"),
    )
    # Connect with TLS (also implied by a valkeys:// or rediss:// URL).
    tls_enable: bool = _setting(
        False,
        "HPKV_VALKEY_TLS_ENABLE",
        "bool",
        "true",
        "connect with TLS",
        "`false`",
    )
    # PEM file of the CA that signed the server's certificate (private CAs, self-signed); None: system CAs.
    tls_ca_cert: str | None = _setting(
        None,
        "HPKV_VALKEY_TLS_CA_CERT",
        "optpath",
        "/etc/ssl/private-ca.pem",
        "PEM file of a private CA (implies TLS)",
        "system CAs",
    )
    # ACL user and password for the remote tier (None: default user / no AUTH).
    valkey_username: str | None = _setting(
        None,
        "HPKV_VALKEY_USERNAME",
        "optstr",
        "hpkv",
        "ACL user",
        "unset",
    )
    valkey_password: str | None = _setting(
        None,
        "HPKV_VALKEY_PASSWORD",
        "optstr",
        "s3cret",
        "its password",
        "unset",
        secret=True,
    )
    # Logical database of a standalone server (ignored, with a warning, in cluster mode).
    valkey_database: int | None = _setting(
        None,
        "HPKV_VALKEY_DATABASE",
        "optint",
        "0",
        "database number of a standalone server",
        "`0`",
        minimum=0,
        maximum=1 << 20,
    )
    # Give every chunk an expiry, so a volatile-* maxmemory-policy can reclaim it.
    valkey_enable_ttl: bool = _setting(
        False,
        "HPKV_VALKEY_ENABLE_TTL",
        "bool",
        "true",
        "give every chunk an expiry",
        "`false`",
    )
    # That expiry, in seconds.
    valkey_ttl_sec: int = _setting(
        86400,
        "HPKV_VALKEY_TTL_SEC",
        "int",
        "86400",
        "that expiry, in seconds",
        "`86400`",
        minimum=1,
        maximum=1 << 31,
    )
    # Seconds one Valkey request may take before it counts as a miss.
    request_timeout: float = _setting(
        5.0,
        "HPKV_VALKEY_REQUEST_TIMEOUT",
        "float",
        "5.0",
        "seconds a Valkey request may take before it is a miss",
        "`5.0`",
        minimum=0,
        maximum=3600,
    )
    # Seconds to wait for a connection to the remote tier.
    connection_timeout: float = _setting(
        10.0,
        "HPKV_VALKEY_CONNECTION_TIMEOUT",
        "float",
        "10.0",
        "seconds to wait for a connection",
        "`10.0`",
        minimum=0,
        maximum=3600,
    )
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
            value = convert(f.name, spec, raw, where)
            object.__setattr__(self, f.name, value)
            if f.name not in origins and value != f.default:
                origins[f.name] = f.name  # passed as a keyword: name the keyword in later messages
        object.__setattr__(self, "origins", origins)
        if self.remote_url is not None:
            parse_remote_url(self.remote_url, self.where("remote_url"))
        if self.auth_key is not None and len(self.auth_key.encode("utf-8")) < 16:
            raise HpkvConfigError(
                f"{self.where('auth_key')} is shorter than 16 bytes (not echoed); "
                "use e.g. 32 random characters: openssl rand -hex 16"
            )

    @property
    def auth_key_bytes(self) -> bytes | None:
        return None if self.auth_key is None else self.auth_key.encode("utf-8")

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
            data = read_yaml(yaml_path)
            merge(values, origins, data, _field_names(), lambda k: f"{k} in {yaml_path} ({CONFIG_FILE_ENV})")

        known_env = {s.env: name for name, s in _SPECS.items()}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var == CONFIG_FILE_ENV:
                continue
            if var in _FOREIGN_ENV:
                continue
            if var not in known_env:
                raise HpkvConfigError(unknown_message(var, [*known_env, CONFIG_FILE_ENV], "variable"))
            values[known_env[var]] = raw
            origins[known_env[var]] = var

        if overrides:
            merge(values, origins, dict(overrides), _field_names(), lambda k: f"{k} ({source})")
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

    def refuse(self, name: str, why: str, example: str) -> HpkvConfigError:
        """The error for field ``name``'s value, checked against something only known at start
        (the engine's block size, ...): the variable, the value, why, and a value that works."""
        return HpkvConfigError(f"{self.where(name)}={getattr(self, name)!r} {why}; use e.g. {example}")

    @staticmethod
    def env_names() -> dict[str, str]:
        """Field name -> ``HPKV_*`` variable, for docs and the CLI."""
        return {name: s.env for name, s in _SPECS.items()}


# Field name -> its setting: the table above, read once.
_SPECS: dict[str, Spec] = {
    f.name: f.metadata["spec"] for f in dataclasses.fields(HpkvConfig) if "spec" in f.metadata
}


def settings() -> list[tuple[str, Spec]]:
    """Every setting in declaration order: (field name, how it is read, checked and documented)."""
    return list(_SPECS.items())


# Variables with the HPKV_ prefix that belong to other parts of hpkv (the CLI,
# the test suite) and are not store settings.
_FOREIGN_ENV = {"HPKV_TEST_KEEP", "HPKV_LOG_LEVEL"}


def _field_names() -> set[str]:
    """The settings' field names (what a YAML key or keyword argument may name)."""
    return {f.name for f in dataclasses.fields(HpkvConfig)} - {"origins"}
