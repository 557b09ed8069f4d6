"""The replicas' router: each user's turns alternate between the replicas, responses pass through whole."""

from __future__ import annotations

import http.client
import itertools
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hpkv.bench.router import Router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend(name: str) -> ThreadingHTTPServer:
    """A replica that streams its name and the prompt's length back in three pieces."""

    class H(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for part in (f"data: {name}\n\n", f"data: {len(body['prompt'])}\n\n", "data: [DONE]\n\n"):
                self.wfile.write(part.encode())
                self.wfile.flush()

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_each_users_turns_alternate_between_replicas() -> None:
    a, b = backend("a"), backend("b")
    router = Router(free_port(), [a.server_address[1], b.server_address[1]]).start()
    try:
        seen: dict[int, list[str]] = {}
        for turn in range(4):
            for user in range(3):
                prompt = [user] * 40 + [turn] * (5 + turn)  # the user's context, then a new question
                conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
                conn.request(
                    "POST",
                    "/v1/completions",
                    json.dumps({"prompt": prompt}),
                    {"Content-Type": "application/json"},
                )
                resp = conn.getresponse()
                text = resp.read().decode()
                conn.close()
                assert resp.status == 200 and text.endswith("data: [DONE]\n\n")
                assert f"data: {len(prompt)}\n\n" in text  # the whole body reached the replica
                seen.setdefault(user, []).append(text.split("\n")[0][len("data: ") :])
        for user, replicas in seen.items():
            assert all(x != y for x, y in itertools.pairwise(replicas)), (user, replicas)
        assert router.sent == [6, 6]
    finally:
        router.stop()
        a.shutdown()
        b.shutdown()
