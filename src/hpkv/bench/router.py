"""A round-robin router in front of several engines, for ``hpkv bench serve --replicas N``.

Each user's turns alternate between the replicas, as a load balancer that knows nothing of the cache
spreads them: a user is recognised by the first tokens of the prompt (the multi-turn workload's
context), and its k-th request goes to replica (start + k) mod N, where start comes from the user.
Responses, streamed ones included, are passed through as they arrive.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

USER_PREFIX = 32  # prompt tokens that name a user


class Router:
    def __init__(self, port: int, backends: list[int]) -> None:
        self.port = port
        self.backends = list(backends)
        self.seen: dict[str, int] = {}
        self.sent = [0] * len(backends)
        self._lock = threading.Lock()
        router = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                router.forward(self, "GET", b"", 0)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                router.forward(self, "POST", body, router.pick(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hpkv-router", daemon=True)

    def start(self) -> Router:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def pick(self, body: bytes) -> int:
        """The replica for this request: the user's next one in turn."""
        try:
            prompt = json.loads(body).get("prompt")
        except ValueError:
            prompt = None
        user = json.dumps(prompt[:USER_PREFIX] if isinstance(prompt, list | str) else prompt)
        with self._lock:
            k = self.seen.get(user, 0)
            self.seen[user] = k + 1
            i = (zlib.crc32(user.encode()) + k) % len(self.backends)
            self.sent[i] += 1
        return i

    def forward(self, h: BaseHTTPRequestHandler, method: str, body: bytes, i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.backends[i], timeout=3600)
        try:
            headers = {"Content-Type": h.headers.get("Content-Type", "application/json")}
            if h.headers.get("X-Request-Id"):  # the bench's request ids name requests in the logs
                headers["X-Request-Id"] = h.headers["X-Request-Id"]
            conn.request(method, h.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                    h.send_header(k, v)
            h.send_header("Connection", "close")
            h.end_headers()
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                h.wfile.write(chunk)
                h.wfile.flush()
        except OSError as e:
            with contextlib.suppress(OSError):
                h.send_error(502, f"replica {i}: {e}")
        finally:
            conn.close()
