"""``hpkv bench serve``'s timing path against a stub OpenAI server with known delays: what vLLM's client
measures and what hpkv computes from it (percentiles, throughput) must say back the delays the stub
was told to take. (The real server runs are tests/e2e/test_bench_serve.py.)"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from hpkv.bench.serve_run import run_load
from hpkv.bench.serve_stats import percentile, summarize
from hpkv.bench.workload import Turn

ITL_S = 0.03  # between two streamed tokens, every request


def _ttft_of(prompt: list[int]) -> float:
    """The stub's first-token delay for a prompt: its first token id in ms (so each is known)."""
    return prompt[0] / 1000


class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes: no chunked encoding
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with _Stub.lock:
            _Stub.in_flight += 1
            _Stub.most_in_flight = max(_Stub.most_in_flight, _Stub.in_flight)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(_ttft_of(body["prompt"]))
            n = body["max_tokens"]
            for i in range(n):
                if i:
                    time.sleep(ITL_S)
                self._event({"choices": [{"index": 0, "text": f" t{i}"}]})
            self._event(
                {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
            )
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            with _Stub.lock:
                _Stub.in_flight -= 1

    def _event(self, doc: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
        self.wfile.flush()


@dataclass
class _Server:
    port: int
    model: str = "stub"


@pytest.fixture
def stub() -> Iterator[_Server]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    _Stub.in_flight = _Stub.most_in_flight = 0
    try:
        yield _Server(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_ttft_itl_and_throughput_say_back_the_stubs_delays(stub: _Server) -> None:
    # Ten requests whose first tokens take 100, 120, ..., 280 ms; four tokens each, 30 ms apart.
    delays = [100 + 20 * i for i in range(10)]
    turns = [Turn(0, i, [d, 300, 301]) for i, d in enumerate(delays)]
    result = run_load(stub, None, turns, output_len=4, level={"concurrency": 1})
    m = summarize(result)
    assert m["completed"] == 10 and m["failed"] == 0
    # Each TTFT is its known delay plus loopback and client overhead: never less, typically a few ms,
    # and on a loaded box (CI: 2 cores) still below the three 30 ms gaps a TTFT that waited for the
    # whole answer would add. Each bound holds on a busy machine; together they pin what is measured.
    over = [got - want / 1e3 for got, want in zip(result["ttfts"], delays, strict=True)]
    assert all(o >= 0 for o in over), over
    assert all(o < 3 * ITL_S for o in over), over
    assert statistics.median(over) < 0.04, over
    # The percentiles interpolate the sorted TTFTs (p50: between the 5th and 6th, 180 and 200 ms).
    assert m["ttft_p50_ms"] == pytest.approx(percentile(result["ttfts"], 50) * 1e3)
    assert m["ttft_p99_ms"] == pytest.approx(percentile(result["ttfts"], 99) * 1e3)
    assert 190 <= m["ttft_p50_ms"] < 190 + 3 * ITL_S * 1e3
    # Three gaps per request, each the stub's 30 ms.
    assert len([g for row in result["itls"] for g in row]) == 30
    assert ITL_S * 1e3 <= m["itl_p50_ms"] < ITL_S * 1e3 + 20
    # One client at a time: the run lasts the sum of the requests, and req/s is its inverse.
    busy = sum(d / 1e3 + 3 * ITL_S for d in delays)
    assert busy <= m["duration_s"] < busy + 10 * 3 * ITL_S
    assert m["requests_per_s"] == pytest.approx(10 / m["duration_s"])
    assert m["output_tokens_per_s"] == pytest.approx(40 / m["duration_s"])
    assert _Stub.most_in_flight == 1
    # End to end: the first token plus the three gaps.
    assert 280 + 90 <= m["e2e_p99_ms"] < 280 + 90 + 3 * ITL_S * 1e3


def test_a_concurrency_level_keeps_that_many_requests_in_flight(stub: _Server) -> None:
    turns = [Turn(0, i, [200, 300]) for i in range(8)]
    result = run_load(stub, None, turns, output_len=2, level={"concurrency": 4})
    m = summarize(result)
    assert m["completed"] == 8
    assert _Stub.most_in_flight == 4
    # Two waves of four requests of 200 + 30 ms each: about 0.46 s, not 8 x 0.23 s.
    assert 0.46 <= m["duration_s"] < 0.46 + 0.3
    assert all(0.2 <= t < 0.2 + 3 * ITL_S for t in result["ttfts"])
