"""The host pool's wire: where its socket and files are named, and how a message is framed.

Both ends import this module: the pool (:mod:`hpkv.tiers.memory.hostpool`) and an engine's client
(:mod:`hpkv.tiers.memory.hostslots`). A message is a 4-byte big-endian length, then that many bytes
of a JSON object: no code-executing format, and a peer that sends more than MAX_MESSAGE bytes is a
broken client, not a batch.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

SOCKET = "hpkv-pool.sock"  # in the pool directory
PIDFILE = "hpkv-pool.pid"
LOGFILE = "hpkv-pool.log"
HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection."""
    head = _read_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    if n > MAX_MESSAGE:
        raise ValueError(f"message of {n} bytes")
    body = _read_exact(sock, n)
    if body is None:
        return None
    return decode(body)


def decode(body: bytes) -> dict[str, Any]:
    """A message's JSON object; ValueError for anything else."""
    out = json.loads(body)
    if not isinstance(out, dict):
        raise ValueError("a message must be a JSON object")
    return out


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return bytes(buf)
