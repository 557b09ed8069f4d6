"""A writer SIGKILLed in the middle of its stores: the storage tier's next start serves no partial
record (every hit is bit-exact), and what the kills left behind is reclaimed."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time
from typing import Any

from hpkv.core import record
from hpkv.tiers.disk import StorageTier

NS = b"k" * 16
PAYLOAD = 8 << 20  # big records: a kill lands inside a write more often than between two

WRITER = r"""
import os, sys
from hpkv.core import record
from hpkv.tiers.disk import StorageTier
root, ns, payload, start = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
t = StorageTier(root, 1 << 40, payload, ns)
buf = bytearray(record.record_bytes(payload))
i = start
while True:
    key = i.to_bytes(16, "big")
    buf[record.HEADER_BYTES:] = bytes([i % 251]) * payload
    record.seal(memoryview(buf), ns, key, payload)
    t.write(key, memoryview(buf))
    print(i, flush=True)
    i += 1
"""


def _writer(root: str, start: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, root, NS.decode(), str(PAYLOAD), str(start)],
        stdout=subprocess.PIPE,
        text=True,
    )


def _temp_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".tmp")]


def test_kills_mid_store_leave_no_partial_record_and_their_leftovers_are_reclaimed(tmp_path: Any) -> None:
    root = str(tmp_path / "storage")
    written: list[int] = []
    for round_ in range(6):
        p = _writer(root, 1000 * round_)
        assert p.stdout is not None
        written.append(int(p.stdout.readline()))  # at least one store finished
        time.sleep(0.05 + 0.04 * round_)  # then killed somewhere in a later one
        p.send_signal(signal.SIGKILL)
        p.wait()
        written += [int(x) for x in p.stdout.read().split()]
    left = _temp_files(root)
    print(f"{len(left)} temp files left by the kills, {len(written)} stores reported")
    # A temp file of a killed writer is removed by the next start once it is older than any write
    # in flight could be (an hour): age them.
    for path in left:
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    t = StorageTier(root, 1 << 40, PAYLOAD, NS)
    assert _temp_files(root) == []
    buf = memoryview(mmap.mmap(-1, -(-record.record_bytes(PAYLOAD) // 4096) * 4096))
    hits = 0
    for round_ in range(6):
        for i in range(1000 * round_, 1000 * round_ + 200):
            key = i.to_bytes(16, "big")
            if not t.contains(key):
                continue
            # Only whole records are visible (written to a temp name, renamed when complete).
            assert t.read_into(key, buf), i
            body = buf[record.HEADER_BYTES : record.HEADER_BYTES + PAYLOAD]
            assert body.tobytes() == bytes([i % 251]) * PAYLOAD, i
            hits += 1
    assert hits >= len(written) >= 6  # every store the writers reported finished reads back
    assert t.stats()["corrupt"] == 0
