"""A TCP proxy on loopback whose link has a set bandwidth: a slow network between an engine and
its Valkey, made real on one machine (``hpkv bench ttft --valkey-link-mbps``, the tier-policy tests).

Each direction shares one token bucket over all connections (a link, not a per-connection cap),
so eight GLIDE workers reading at once still get the link's rate between them. The rate can be
changed while connections are open (:attr:`ThrottledProxy.bytes_per_s`; 0: unlimited). A
``reply_delay`` holds every piece of the server's replies back that long (a far server).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

# Bytes a pump moves per turn: small enough that the bucket's pacing is smooth at a few MB/s.
PIECE = 64 * 1024
# What an idle link may bank: a few milliseconds of its rate (a whole second banked let a 448 MiB
# burst through at memory speed).
BURST_S = 0.005


class _Bucket:
    """Tokens (bytes) refilled at ``rate`` per second, at most one second's worth banked."""

    def __init__(self, proxy: ThrottledProxy) -> None:
        self._proxy = proxy
        self._lock = threading.Lock()
        self._tokens = 0.0
        self._at = time.monotonic()

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may pass."""
        while True:
            rate = self._proxy.bytes_per_s
            if rate <= 0:
                return
            with self._lock:
                now = time.monotonic()
                self._tokens = min(max(rate * BURST_S, n), self._tokens + (now - self._at) * rate)
                self._at = now
                if self._tokens >= n:
                    self._tokens -= n
                    return
                wait = (n - self._tokens) / rate
            time.sleep(min(wait, 0.05))


class ThrottledProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (host, port) at ``bytes_per_s`` each way, each
    piece of a reply ``reply_delay`` seconds late."""

    def __init__(self, target: tuple[str, int], bytes_per_s: float = 0.0, reply_delay: float = 0.0) -> None:
        self.target = target
        self.bytes_per_s = bytes_per_s
        self.reply_delay = reply_delay
        self._up = _Bucket(self)
        self._down = _Bucket(self)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closing = False
        self._socks: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="hpkv-throttle", daemon=True)

    @property
    def url(self) -> str:
        return f"valkey://127.0.0.1:{self.port}"

    def start(self) -> ThrottledProxy:
        self._thread.start()
        return self

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._socks.update((client, server))
            for a, b, bucket, delay in ((client, server, self._up, 0.0), (server, client, self._down, None)):
                threading.Thread(target=self._pump, args=(a, b, bucket, delay), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, bucket: _Bucket, delay: float | None) -> None:
        """``delay``: None for the replies (``reply_delay``, read at each piece)."""
        try:
            while True:
                data = src.recv(PIECE)
                if not data:
                    break
                late = self.reply_delay if delay is None else delay
                if late:
                    time.sleep(late)
                bucket.take(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
