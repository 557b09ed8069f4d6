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

Version 2 (when the process has an auth key, ``HPKV_AUTH_KEY``): the 16 bytes
from offset 48 hold a keyed BLAKE2b-128 over the first 48 header bytes and the
payload, instead of checksum + padding. xxh3 catches accidents; only the MAC
catches a record forged by someone who can write a shared tier (a Valkey
cluster, a shared directory) but does not know the key. A reader accepts only
the version of its own configuration, so records with and without a MAC never
mix.

A record is accepted only if every field matches what the reader expects;
anything else is a miss. The payload starts 64 bytes in, so a record placed at
a page-aligned address keeps its payload aligned for any dtype.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from enum import Enum
from typing import Any

import xxhash

from hpkv.core.errors import HpkvConfigError

MAGIC = b"HPKV"
RECORD_VERSION = 1
RECORD_VERSION_MAC = 2
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHH16s16sQQ")
_MAC_AT = 48  # MAC covers header[:48] (magic .. length) and the payload
assert _HEADER.size <= HEADER_BYTES

# One auth key per process: every tier of a process seals and checks records the same way.
_auth_key: bytes | None = None
_auth_lock = threading.Lock()


def set_auth_key(key: bytes | None) -> None:
    """Seal and accept only MAC'd records from now on (None: plain records). A process holds one
    key: setting a different one while one is set raises HpkvConfigError."""
    global _auth_key
    with _auth_lock:
        if key is not None and _auth_key is not None and key != _auth_key:
            raise HpkvConfigError(
                "HPKV_AUTH_KEY differs between two hpkv stores of one process; use one key per process"
            )
        _auth_key = key


def current_auth_key() -> bytes | None:
    """The key :func:`set_auth_key` set in this process (a helper process must check with it too)."""
    return _auth_key


def _mac(buf: memoryview, payload_len: int, key: bytes) -> bytes:
    h = hashlib.blake2b(buf[:_MAC_AT], digest_size=16, key=key, person=b"hpkv-record-mac")
    h.update(buf[HEADER_BYTES : HEADER_BYTES + payload_len])
    return h.digest()


class Verdict(Enum):
    OK = "ok"
    SHORT = "short"  # fewer bytes than a record of this layout
    BAD_HEADER = "bad_header"  # magic, version or header length wrong
    WRONG_NAMESPACE = "wrong_namespace"  # another model, layout, rank or salt
    WRONG_KEY = "wrong_key"  # a record of another chunk
    WRONG_LENGTH = "wrong_length"
    BAD_CHECKSUM = "bad_checksum"


# A verdict by its index (the native reader's statuses 0..6 are these, in this order).
VERDICTS = list(Verdict)


def record_bytes(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def checksum(payload: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(buf: memoryview, namespace: bytes, key: bytes, payload_len: int, digest: int) -> None:
    """Fill ``buf[:64]``; call after the payload is in place and ``digest`` computed over it."""
    _HEADER.pack_into(buf, 0, MAGIC, RECORD_VERSION, HEADER_BYTES, namespace, key, payload_len, digest)
    buf[_HEADER.size : HEADER_BYTES] = bytes(HEADER_BYTES - _HEADER.size)


def seal(buf: memoryview, namespace: bytes, key: bytes, payload_len: int) -> None:
    """Checksum (or, with an auth key, MAC) the payload already at ``buf[64:64+payload_len]``
    and write the header."""
    auth = _auth_key
    if auth is None:
        digest = checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_len])
        write_header(buf, namespace, key, payload_len, digest)
        return
    _HEADER.pack_into(buf, 0, MAGIC, RECORD_VERSION_MAC, HEADER_BYTES, namespace, key, payload_len, 0)
    buf[_MAC_AT:HEADER_BYTES] = _mac(buf, payload_len, auth)


def _check_header(
    hdr: memoryview | bytes, namespace: bytes, key: bytes, payload_len: int, auth: bytes | None
) -> tuple[Verdict, int]:
    """Every header field against what the reader expects (the first failing one's verdict), and the
    checksum the header carries (a MAC'd record keeps its MAC after the fields instead)."""
    magic, version, hlen, ns, k, length, digest = _HEADER.unpack_from(hdr, 0)
    expected = RECORD_VERSION if auth is None else RECORD_VERSION_MAC
    if magic != MAGIC or version != expected or hlen != HEADER_BYTES:
        return Verdict.BAD_HEADER, 0
    if ns != namespace:
        return Verdict.WRONG_NAMESPACE, 0
    if k != key:
        return Verdict.WRONG_KEY, 0
    if length != payload_len:
        return Verdict.WRONG_LENGTH, 0
    return Verdict.OK, digest


def verify(
    buf: memoryview, n: int, namespace: bytes, key: bytes, payload_len: int, *, check_payload: bool = True
) -> Verdict:
    """Check the record in ``buf[:n]`` (``n`` = bytes actually read).

    ``check_payload=False`` skips the checksum (the memory tier's own slots,
    which no other process writes); everything else is always checked.
    """
    if n < HEADER_BYTES:
        return Verdict.SHORT
    auth = _auth_key
    verdict, digest = _check_header(buf, namespace, key, payload_len, auth)
    if verdict is not Verdict.OK:
        return verdict
    if n < HEADER_BYTES + payload_len:
        return Verdict.SHORT
    if n > HEADER_BYTES + payload_len:
        return Verdict.WRONG_LENGTH
    if not check_payload:
        return Verdict.OK
    if auth is not None:
        if not hmac.compare_digest(bytes(buf[_MAC_AT:HEADER_BYTES]), _mac(buf, payload_len, auth)):
            return Verdict.BAD_CHECKSUM
        return Verdict.OK
    if checksum(buf[HEADER_BYTES : HEADER_BYTES + payload_len]) != digest:
        return Verdict.BAD_CHECKSUM
    return Verdict.OK


class Checker:
    """:func:`verify` for a record read in pieces into memory that is not one buffer (the payload
    straight into an engine's pages): :meth:`header` first, then :meth:`update` with each piece of
    the payload in order, then :meth:`finish`. The payload's bytes are the caller's to discard
    unless :meth:`finish` says OK."""

    def __init__(self, namespace: bytes, key: bytes, payload_len: int) -> None:
        self.namespace, self.key, self.payload_len = namespace, key, payload_len
        self._auth = _auth_key
        self._seen = 0
        self._expected: int | bytes = 0
        self._hash: Any = None

    def header(self, hdr: memoryview | bytes) -> Verdict:
        """Check the 64 header bytes; on OK the payload's pieces may follow."""
        if len(hdr) < HEADER_BYTES:
            return Verdict.SHORT
        verdict, digest = _check_header(hdr, self.namespace, self.key, self.payload_len, self._auth)
        if verdict is not Verdict.OK:
            return verdict
        if self._auth is None:
            self._expected, self._hash = digest, xxhash.xxh3_64()
        else:
            self._expected = bytes(hdr[_MAC_AT:HEADER_BYTES])
            self._hash = hashlib.blake2b(
                bytes(hdr[:_MAC_AT]), digest_size=16, key=self._auth, person=b"hpkv-record-mac"
            )
        return Verdict.OK

    def update(self, piece: memoryview) -> None:
        self._hash.update(piece)
        self._seen += len(piece)

    def finish(self) -> Verdict:
        if self._hash is None:
            return Verdict.BAD_HEADER
        if self._seen != self.payload_len:
            return Verdict.SHORT if self._seen < self.payload_len else Verdict.WRONG_LENGTH
        if self._auth is None:
            ok = self._hash.intdigest() == self._expected
        else:
            ok = hmac.compare_digest(self._hash.digest(), self._expected)
        return Verdict.OK if ok else Verdict.BAD_CHECKSUM


def check_pieces(bufs: list[memoryview], namespace: bytes, key: bytes, payload_len: int) -> Verdict:
    """:func:`verify` of a whole record read into ``bufs``: one buffer holding the record, or the
    64 header bytes and then the payload's pieces in order."""
    if len(bufs) == 1:
        return verify(bufs[0], record_bytes(payload_len), namespace, key, payload_len)
    c = Checker(namespace, key, payload_len)
    verdict = c.header(bufs[0])
    if verdict is not Verdict.OK:
        return verdict
    for piece in bufs[1:]:
        c.update(piece)
    return c.finish()
