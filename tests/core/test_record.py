from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpkv import HpkvConfig, HpkvConfigError
from hpkv.core import record
from hpkv.core.record import HEADER_BYTES, Verdict

NS = bytes(range(16))
KEY = bytes(range(16, 32))


def make(payload: bytes, ns: bytes = NS, key: bytes = KEY) -> bytearray:
    buf = bytearray(HEADER_BYTES + len(payload))
    buf[HEADER_BYTES:] = payload
    record.seal(memoryview(buf), ns, key, len(payload))
    return buf


def test_round_trip() -> None:
    buf = make(b"x" * 1000)
    assert record.verify(memoryview(buf), len(buf), NS, KEY, 1000) is Verdict.OK


def test_every_field_is_checked() -> None:
    buf = make(b"payload-bytes" * 10)
    n = len(buf)
    p = n - HEADER_BYTES
    assert record.verify(memoryview(buf), n, bytes(16), KEY, p) is Verdict.WRONG_NAMESPACE
    assert record.verify(memoryview(buf), n, NS, bytes(16), p) is Verdict.WRONG_KEY
    assert record.verify(memoryview(buf), n, NS, KEY, p + 1) is Verdict.WRONG_LENGTH
    assert record.verify(memoryview(buf), n - 1, NS, KEY, p) is Verdict.SHORT
    assert record.verify(memoryview(buf), 10, NS, KEY, p) is Verdict.SHORT
    assert record.verify(memoryview(buf + b"\0"), n + 1, NS, KEY, p) is Verdict.WRONG_LENGTH
    bad = bytearray(buf)
    bad[0:4] = b"XXXX"
    assert record.verify(memoryview(bad), n, NS, KEY, p) is Verdict.BAD_HEADER
    bad = bytearray(buf)
    bad[-1] ^= 1
    assert record.verify(memoryview(bad), n, NS, KEY, p) is Verdict.BAD_CHECKSUM


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=2048), st.data())
def test_any_single_bit_flip_is_caught(payload: bytes, data: st.DataObject) -> None:
    buf = make(payload)
    pos = data.draw(st.integers(0, len(buf) - 1))
    bit = data.draw(st.integers(0, 7))
    if HEADER_BYTES - 8 <= pos < HEADER_BYTES:
        return  # zero padding after the fields: not covered by design
    buf[pos] ^= 1 << bit
    assert record.verify(memoryview(buf), len(buf), NS, KEY, len(payload)) is not Verdict.OK


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=0, max_size=4096))
def test_round_trip_any_payload(payload: bytes) -> None:
    buf = make(payload)
    assert record.verify(memoryview(buf), len(buf), NS, KEY, len(payload)) is Verdict.OK


def _sealed(payload: bytes, ns: bytes = b"N" * 16, key: bytes = b"K" * 16) -> bytearray:
    buf = bytearray(record.HEADER_BYTES + len(payload))
    buf[record.HEADER_BYTES :] = payload
    record.seal(memoryview(buf), ns, key, len(payload))
    return buf


def test_with_an_auth_key_only_records_macd_with_that_key_are_accepted() -> None:
    payload = bytes(range(256)) * 40
    plain = _sealed(payload)  # a valid record without a MAC: what a forger without the key can make
    record.set_auth_key(b"k" * 32)
    good = _sealed(payload)
    n = len(good)
    assert good[4:6] != plain[4:6]  # another record version
    assert record.verify(memoryview(good), n, b"N" * 16, b"K" * 16, len(payload)) is record.Verdict.OK
    assert (
        record.verify(memoryview(plain), n, b"N" * 16, b"K" * 16, len(payload)) is record.Verdict.BAD_HEADER
    )
    tampered = bytearray(good)
    tampered[-1] ^= 1
    assert (
        record.verify(memoryview(tampered), n, b"N" * 16, b"K" * 16, len(payload))
        is record.Verdict.BAD_CHECKSUM
    )
    with pytest.raises(HpkvConfigError, match="HPKV_AUTH_KEY differs"):
        record.set_auth_key(b"x" * 32)
    record.set_auth_key(None)
    record.set_auth_key(b"x" * 32)  # another key: the first one's records are forgeries now
    assert (
        record.verify(memoryview(good), n, b"N" * 16, b"K" * 16, len(payload)) is record.Verdict.BAD_CHECKSUM
    )
    record.set_auth_key(None)
    assert record.verify(memoryview(good), n, b"N" * 16, b"K" * 16, len(payload)) is record.Verdict.BAD_HEADER


def test_a_short_auth_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(HpkvConfigError, match="HPKV_AUTH_KEY is shorter than 16 bytes") as e:
        HpkvConfig.load(env={"HPKV_AUTH_KEY": "hunter2"})
    assert "hunter2" not in str(e.value)


def check_in_pieces(buf: bytes | bytearray, cuts: list[int], ns: bytes = NS, key: bytes = KEY) -> Verdict:
    """What a Checker says of ``buf`` read as its header, then the payload cut at ``cuts``."""
    c = record.Checker(ns, key, len(buf) - HEADER_BYTES)
    v = c.header(memoryview(buf)[:HEADER_BYTES])
    if v is not Verdict.OK:
        return v
    edges = [HEADER_BYTES, *sorted(HEADER_BYTES + x for x in cuts), len(buf)]
    for a, b in itertools.pairwise(edges):
        c.update(memoryview(buf)[a:b])
    return c.finish()


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=4096), st.data())
def test_a_record_checked_in_pieces_gets_verifys_verdict(payload: bytes, data: st.DataObject) -> None:
    buf = make(payload)
    cuts = data.draw(st.lists(st.integers(0, len(payload)), max_size=4))
    assert check_in_pieces(buf, cuts) is Verdict.OK
    pos = data.draw(st.integers(0, len(buf) - 1))
    if not HEADER_BYTES - 8 <= pos < HEADER_BYTES:
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        assert check_in_pieces(buf, cuts) is record.verify(memoryview(buf), len(buf), NS, KEY, len(payload))


def test_a_checker_refuses_another_key_or_namespace_and_a_short_payload() -> None:
    buf = make(b"z" * 500)
    assert check_in_pieces(buf, [100], key=bytes(16)) is Verdict.WRONG_KEY
    assert check_in_pieces(buf, [100], ns=bytes(16)) is Verdict.WRONG_NAMESPACE
    c = record.Checker(NS, KEY, 500)
    assert c.header(memoryview(buf)[:HEADER_BYTES]) is Verdict.OK
    c.update(memoryview(buf)[HEADER_BYTES:-1])
    assert c.finish() is Verdict.SHORT
    assert record.Checker(NS, KEY, 500).finish() is Verdict.BAD_HEADER  # no header seen: never OK


def test_a_checker_checks_the_mac_when_there_is_an_auth_key() -> None:
    record.set_auth_key(b"k" * 32)
    try:
        buf = make(b"m" * 3000)
        assert check_in_pieces(buf, [1000, 2000]) is Verdict.OK
        buf[HEADER_BYTES + 1500] ^= 1
        assert check_in_pieces(buf, [1000, 2000]) is Verdict.BAD_CHECKSUM
    finally:
        record.set_auth_key(None)
    assert check_in_pieces(make(b"m" * 3000), [10]) is Verdict.OK
