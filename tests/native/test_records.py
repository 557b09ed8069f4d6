"""The native reader (hpkv.native): a batch of records read and checked in one call, each record's
status as record.verify would judge it, whatever else lies at its path."""

from __future__ import annotations

import mmap
import os

import pytest

from hpkv import native
from hpkv.core import record

NS = b"n" * 16
PAYLOAD = 3 * 4096 + 777


def sealed(key: bytes) -> bytes:
    buf = memoryview(bytearray(record.record_bytes(PAYLOAD)))
    buf[record.HEADER_BYTES :] = os.urandom(PAYLOAD)
    record.seal(buf, NS, key, PAYLOAD)
    return bytes(buf)


def job(path: str, bufs: list[memoryview], key: bytes, mode: int = native.BUFFERED) -> native.Job:
    return native.Job(
        os.fsencode(path), bufs, record.record_bytes(PAYLOAD), NS, key, record.RECORD_VERSION, True, mode
    )


def buf() -> memoryview:
    return memoryview(mmap.mmap(-1, 4 * 4096 + 4096))


@pytest.mark.parametrize("threads", [1, 4])
def test_a_batch_gives_each_record_the_verdict_record_verify_would(tmp_path: object, threads: int) -> None:
    d = str(tmp_path)
    good = sealed(b"g" * 16)
    files = {
        "good": good,
        "flipped": good[:5000] + bytes([good[5000] ^ 1]) + good[5001:],
        "foreign": sealed(b"f" * 16),
        "short": good[:-10],
        "long": good + b"x",
        "header": b"XXXX" + good[4:],
    }
    for name, data in files.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
    os.symlink(os.path.join(d, "good"), os.path.join(d, "link"))
    os.mkfifo(os.path.join(d, "fifo"))
    os.mkdir(os.path.join(d, "dir"))
    names = [*files, "link", "fifo", "dir", "absent"]
    bufs = [buf() for _ in names]
    reads = native.read_records(
        [job(os.path.join(d, n), [b], b"g" * 16) for n, b in zip(names, bufs, strict=True)], threads
    )
    got = dict(zip(names, (r.status for r in reads), strict=True))
    v = record.VERDICTS.index
    assert got == {
        "good": v(record.Verdict.OK),
        "flipped": v(record.Verdict.BAD_CHECKSUM),
        "foreign": v(record.Verdict.WRONG_KEY),
        "short": v(record.Verdict.SHORT),
        "long": v(record.Verdict.WRONG_LENGTH),
        "header": v(record.Verdict.BAD_HEADER),
        "link": native.NOT_REGULAR,  # never followed
        "fifo": native.NOT_REGULAR,  # never blocks
        "dir": native.NOT_REGULAR,
        "absent": native.NOT_FOUND,
    }
    assert bytes(bufs[0][: len(good)]) == good
    # What the Python side would say of the same bytes.
    for name, b, r in zip(names[:6], bufs, reads, strict=False):
        if name not in ("long",):
            assert record.VERDICTS[r.status] is record.verify(b, r.nread, NS, b"g" * 16, PAYLOAD), name


def test_a_record_read_in_pieces_lands_in_them_and_is_checked_across_them(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "r")
    data = sealed(b"g" * 16)
    with open(path, "wb") as f:
        f.write(data)
    header = memoryview(bytearray(record.HEADER_BYTES))
    pieces = [memoryview(bytearray(n)) for n in (1000, 1, PAYLOAD - 1001)]
    for mode in (native.BUFFERED, native.CACHED_ONLY, native.DIRECT):
        (r,) = native.read_records([job(path, [header, *pieces], b"g" * 16, mode)])
        assert r.status == 0 and r.nread == len(data)
        assert bytes(header) + b"".join(bytes(p) for p in pieces) == data
    pieces[1][0] ^= 1  # the check is over what landed: a record whose bytes differ fails
    with open(path, "r+b") as f:
        f.seek(record.HEADER_BYTES + 1000)
        f.write(bytes([data[record.HEADER_BYTES + 1000] ^ 1]))
    (r,) = native.read_records([job(path, [header, *pieces], b"g" * 16)])
    assert record.VERDICTS[r.status] is record.Verdict.BAD_CHECKSUM


def test_bad_arguments_raise_and_read_nothing() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        native.read_records([native.Job(b"/x", [buf()], 100, b"short", b"k" * 16, 1, True, 0)])
    with pytest.raises(ValueError, match="64-byte header"):
        native.read_records([native.Job(b"/x", [memoryview(bytearray(8))], 100, NS, b"k" * 16, 1, True, 0)])
    with pytest.raises(BufferError):  # a read-only buffer is never written
        native.read_records([native.Job(b"/x", [b"read-only" * 8], 100, NS, b"k" * 16, 1, True, 0)])
