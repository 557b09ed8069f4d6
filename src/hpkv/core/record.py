"""Chunk records: a 64-byte header and the payload, in one buffer.

Header (little-endian)::

    magic      4s   b"HPKV"
    version    H    RECORD_VERSION
    header_len H    64
    namespace  16s  the layout fingerprint (Namespace.digest)
    key        16s  the chunk key
    length     Q    payload bytes
    checksum   Q    xxh3_64 of the payload
    (zero padding to 64 bytes)

A record is accepted only if every field matches what the reader expects;
anything else is a miss. The payload starts 64 bytes in, so a record placed at
a page-aligned address keeps its payload aligned for any dtype.
"""

from __future__ import annotations

import struct
from enum import Enum

import xxhash

MAGIC = b"HPKV"
RECORD_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHH16s16sQQ")
assert _HEADER.size <= HEADER_BYTES


class Verdict(Enum):
    OK = "ok"
    SHORT = "short"  # fewer bytes than a record of this layout
    BAD_HEADER = "bad_header"  # magic, version or header length wrong
    WRONG_NAMESPACE = "wrong_namespace"  # another model, layout, rank or salt
    WRONG_KEY = "wrong_key"  # a record of another chunk
    WRONG_LENGTH = "wrong_length"
    BAD_CHECKSUM = "bad_checksum"


def record_bytes(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def checksum(payload: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(buf: memoryview, namespace: bytes, key: bytes, payload_len: int, digest: int) -> None:
    """Fill ``buf[:64]``; call after the payload is in place and ``digest`` computed over it."""
    _HEADER.pack_into(buf, 0, MAGIC, RECORD_VERSION, HEADER_BYTES, namespace, key, payload_len, digest)
    buf[_HEADER.size : HEADER_BYTES] = bytes(HEADER_BYTES - _HEADER.size)


def seal(buf: memoryview, namespace: bytes, key: bytes, payload_len: int) -> None:
    """Checksum the payload already at ``buf[64:64+payload_len]`` and write the header."""
    digest = checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_len])
    write_header(buf, namespace, key, payload_len, digest)


def verify(
    buf: memoryview, n: int, namespace: bytes, key: bytes, payload_len: int, *, check_payload: bool = True
) -> Verdict:
    """Check the record in ``buf[:n]`` (``n`` = bytes actually read).

    ``check_payload=False`` skips the checksum (the memory tier's own slots,
    which no other process writes); everything else is always checked.
    """
    if n < HEADER_BYTES:
        return Verdict.SHORT
    magic, version, hlen, ns, k, length, digest = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != RECORD_VERSION or hlen != HEADER_BYTES:
        return Verdict.BAD_HEADER
    if ns != namespace:
        return Verdict.WRONG_NAMESPACE
    if k != key:
        return Verdict.WRONG_KEY
    if length != payload_len:
        return Verdict.WRONG_LENGTH
    if n < HEADER_BYTES + payload_len:
        return Verdict.SHORT
    if n > HEADER_BYTES + payload_len:
        return Verdict.WRONG_LENGTH
    if check_payload and checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_len]) != digest:
        return Verdict.BAD_CHECKSUM
    return Verdict.OK
