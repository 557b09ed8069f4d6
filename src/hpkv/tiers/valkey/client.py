"""Settings of the remote tier and how one GLIDE client is made from them.

Only this module imports ``glide_sync`` (lazily), so hpkv runs without it
until a remote URL is configured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hpkv.core.config import HpkvConfig
from hpkv.core.errors import HpkvConfigError
from hpkv.core.paths import read_regular_file
from hpkv.core.remote_url import parse_remote_url

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "the valkey tier (remote_url / HPKV_REMOTE_URL) requires the glide_sync module. "
    "Install: pip install 'valkey-glide-sync>=2.3.0' (note: the plain valkey-glide package is async-only)"
)


def glide() -> Any:
    """The ``glide_sync`` module, or a configuration error that says how to install it."""
    global _logger_set
    try:
        import glide_sync
    except ImportError:
        raise HpkvConfigError(INSTALL_HINT) from None
    if not _logger_set:
        # GLIDE's core logs every timeout and reconnect attempt at WARN to stdout; hpkv reports
        # the tier's health itself (one rate-limited line), so keep GLIDE to errors.
        _logger_set = True
        try:
            glide_sync.Logger.set_logger_config(glide_sync.LogLevel.ERROR)
        except Exception:
            log.debug("hpkv: could not set GLIDE's log level", exc_info=True)
    return glide_sync


_logger_set = False


@dataclass(frozen=True)
class ValkeySettings:
    """Everything needed to open clients to one remote tier (standalone server or cluster)."""

    nodes: tuple[tuple[str, int], ...]
    cluster: bool = False
    tls: bool = False
    ca_cert_pem: bytes | None = field(default=None, repr=False)
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    database: int | None = None
    ttl_sec: int | None = None  # None: keys never expire
    request_timeout: float = 5.0
    connection_timeout: float = 10.0
    num_workers: int = 8
    auth_where: str = "valkey_password"  # how to name the credentials in an error

    @classmethod
    def from_config(cls, config: HpkvConfig) -> ValkeySettings | None:
        """The remote tier's settings, or None when no ``remote_url`` is set.

        Values in the URL (user, password, database, TLS scheme) apply unless the
        matching key is set. Raises :class:`HpkvConfigError` for an unreadable CA file.
        """
        if config.remote_url is None:
            return None
        url = parse_remote_url(config.remote_url, config.where("remote_url"))
        cluster = config.valkey_mode == "cluster"
        database = config.valkey_database if config.valkey_database is not None else url.database
        if cluster and database is not None:
            log.warning(
                "hpkv: %s=%s is ignored in cluster mode (a cluster has only database 0)",
                config.where("valkey_database"),
                database,
            )
            database = None
        pem = None
        if config.tls_ca_cert is not None:
            try:
                pem = read_regular_file(config.tls_ca_cert, 1 << 20)  # a FIFO there must not hang the start
            except (OSError, ValueError) as e:
                why = e.strerror if isinstance(e, OSError) else str(e)
                raise HpkvConfigError(
                    f"{config.where('tls_ca_cert')}={config.tls_ca_cert!r} cannot be read ({why}); "
                    "use the PEM file of your CA, e.g. /etc/ssl/private-ca.pem"
                ) from None
            if b"-----BEGIN CERTIFICATE-----" not in pem:
                raise HpkvConfigError(
                    f"{config.where('tls_ca_cert')}={config.tls_ca_cert!r} holds no PEM certificate; "
                    "use the PEM file of your CA, e.g. /etc/ssl/private-ca.pem"
                )
        return cls(
            nodes=url.nodes,
            cluster=cluster,
            tls=config.tls_enable or url.tls or pem is not None,
            ca_cert_pem=pem,
            username=config.valkey_username or url.username,
            password=config.valkey_password or url.password,
            database=database,
            ttl_sec=config.valkey_ttl_sec if config.valkey_enable_ttl else None,
            request_timeout=config.request_timeout,
            connection_timeout=config.connection_timeout,
            num_workers=config.valkey_num_workers,
            auth_where=(
                f"{config.where('valkey_username')} / {config.where('valkey_password')}"
                if config.valkey_password
                else config.where("remote_url")
            ),
        )

    def describe(self) -> str:
        scheme = "valkeys" if self.tls else "valkey"
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts} ({'cluster' if self.cluster else 'standalone'})"


def connect(s: ValkeySettings) -> Any:
    """A new GLIDE sync client (``GlideClient`` or ``GlideClusterClient``). Blocks up to
    ``connection_timeout``; raises GLIDE's errors when the server cannot be reached."""
    g = glide()
    addresses = [g.NodeAddress(h, p) for h, p in s.nodes]
    creds = g.ServerCredentials(password=s.password, username=s.username) if s.password else None
    tls_config = g.TlsAdvancedConfiguration(root_pem_cacerts=s.ca_cert_pem) if s.ca_cert_pem else None
    common: dict[str, Any] = {
        "use_tls": s.tls,
        "credentials": creds,
        "request_timeout": max(1, int(s.request_timeout * 1000)),
        "client_name": "hpkv",
    }
    conn_ms = max(1, int(s.connection_timeout * 1000))
    if s.cluster:
        adv = g.AdvancedGlideClusterClientConfiguration(connection_timeout=conn_ms, tls_config=tls_config)
        return g.GlideClusterClient.create(
            g.GlideClusterClientConfiguration(addresses, advanced_config=adv, **common)
        )
    adv = g.AdvancedGlideClientConfiguration(connection_timeout=conn_ms, tls_config=tls_config)
    return g.GlideClient.create(
        g.GlideClientConfiguration(addresses, database_id=s.database, advanced_config=adv, **common)
    )
