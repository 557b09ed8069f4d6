"""``remote_url``: the Valkey tier's address as one URL (seed nodes, TLS, credentials, database)."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from hpkv.core.errors import HpkvConfigError

REMOTE_SCHEMES = ("valkey", "redis", "valkeys", "rediss")


@dataclass(frozen=True)
class RemoteURL:
    """A parsed ``remote_url``: seed nodes, TLS, and credentials or database given in the URL."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None
    password: str | None
    database: int | None


def parse_remote_url(url: str, where: str = "HPKV_REMOTE_URL") -> RemoteURL:
    """Parse ``valkey://[user:password@]host:port[,host:port...][/db]`` (also redis://;
    valkeys:// and rediss:// mean TLS). Raises :class:`HpkvConfigError` naming ``where``."""

    def bad(why: str) -> HpkvConfigError:
        shown = url
        if "@" in url:  # never echo a password
            scheme, _, rest = url.partition("://")
            shown = f"{scheme}://***@{rest.rpartition('@')[2]}"
        return HpkvConfigError(f"{where}={shown!r} {why}; use e.g. valkey://127.0.0.1:6379")

    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in REMOTE_SCHEMES:
        raise bad(f"must start with one of {', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, _, pw = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) or None
    nodes: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            raise bad("has an empty host")
        if part.count(":") > 1 and "]" not in part:
            raise bad(f"has a host {part!r} with more than one ':' (an IPv6 address goes in [brackets])")
        host, colon, port_text = part.rpartition(":") if ":" in part else (part, "", "")
        if not colon:
            host, port_text = part, "6379"
        host = host.strip("[]")
        if not host:
            raise bad("has an empty host")
        if not re.fullmatch(r"[0-9]{1,5}", port_text, re.ASCII):
            raise bad(f"has a bad port {port_text!r}")
        port = int(port_text)
        if not 0 < port < 65536:
            raise bad(f"has a port {port} outside 1..65535")
        nodes.append((host, port))
    database = None
    path = path.split("?")[0].strip("/")
    if path:
        if not re.fullmatch(r"[0-9]{1,7}", path, re.ASCII):
            raise bad(f"has a database {path!r} that is not a number from 0 to {1 << 20}")
        database = int(path)
        if database > 1 << 20:
            raise bad(f"has a database {database} above {1 << 20}")
    return RemoteURL(tuple(nodes), scheme.lower().endswith("s"), username, password, database)
