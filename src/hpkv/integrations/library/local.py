"""The engine's load and store pairs run for a caller that holds the bytes in this process.

The library (:class:`hpkv.KVStore`) and SGLang's storage backend copy chunks between their own
tensors and hpkv's tiers in their own process, where vLLM's workers copy between the pool and the
GPU in theirs. Both go through the same :class:`~hpkv.engine.interface.Engine`: one lookup and
one drain of its arrivals (:meth:`Engine.lookup`, :meth:`Engine.arrivals`), one store
(:meth:`Engine.begin_stores` / :meth:`Engine.finish_stores`). What differs is only who copies.

Thread contract: both functions block until their copies are done; ``consume`` of a chunk that
had no memory slot runs on an I/O thread, the others on the caller's.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from hpkv.core import record
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.engine.interface import NO_ROOM, InProcessEngine, Miss, Pending, Refused
from hpkv.engine.lookup import GIVE_UP_S, Lookup

# consume(chunk_index, payload) reads a verified payload (uint8, canonical layout, this rank's);
# produce(chunk_index, payload) fills one. Neither may keep ``payload``.
Consume = Callable[[int, torch.Tensor], None]
Produce = Callable[[int, torch.Tensor], None]
# into(chunk_index): where that chunk's payload ends up, as writable pieces in payload order (or
# None), so that a read from a local file can land there at once instead of going through a buffer
# and ``consume``. What a failed read leaves there is garbage: only the returned prefix counts.
Into = Callable[[int], "list[memoryview] | None"]


def load(
    eng: InProcessEngine,
    lks: list[bytes],
    consume: Consume,
    tenant: str = SHARED,
    *,
    probe: bool = True,
    into: Into | None = None,
) -> int:
    """Hand each chunk's verified payload (the first served rank's) to ``consume``; return how many
    leading chunks succeeded.

    The lookup finds the hit (waiting for its own existence check) and streams it: chunks in
    memory are consumed from their pinned slots at once, the others as their promotions land
    (:meth:`Engine.arrivals`, as vLLM's adapter drains an async load). A chunk that reaches no
    slot (no memory tier, or none to spare) is read on an I/O thread into a private buffer and
    consumed there, or, with ``into``, read from its storage file straight to where it belongs
    when the page cache holds the file. Only the returned prefix counts; a chunk after a failed
    one may still have been consumed. ``probe=False``: see :meth:`Engine.lookup`."""
    if not lks:
        return 0
    lk = Lookup(list(lks), tenant)
    answer = eng.lookup(
        lk, wait_until=time.monotonic() + GIVE_UP_S, stream=lambda _below, _n: True, probe=probe
    )
    while isinstance(answer, Pending):  # only "room": others' work holds the slots for a while
        time.sleep(0.005)
        answer = eng.lookup(lk, stream=lambda _below, _n: True, probe=probe)
    done: dict[int, bool] = {}
    try:
        if isinstance(answer, Miss) or not answer.streaming:
            if not isinstance(answer, Miss):
                eng.finish_load(answer.slots)
            return 0
        keys = lks[: answer.chunks]
        private: list[Future[object]] = []
        got = eng.arrivals(lk, private=True)
        first = True
        while True:
            for i, slot in got.ready:
                if _from_slot(eng, slot, i, keys[i], consume, hit=i in got.resident):
                    done[i] = True
                else:  # its header failed: the slower tiers may still have it
                    got.unslotted.append(i)
            if first:
                # One task per I/O thread, not one per chunk: each hand-over between threads is a
                # round trip for the GIL, which a busy engine thread may hold for its whole switch
                # interval. Then the promotions the lookup deferred start reading.
                k = min(len(got.unslotted), eng.io_threads)
                private = [
                    eng.run_io(_private_many, eng, got.unslotted[j::k], keys, consume, tenant, into)
                    for j in range(k)
                ]
                eng.start_deferred()
                first = False
            else:
                private.extend(
                    eng.run_io(_private_many, eng, [i], keys, consume, tenant, into) for i in got.unslotted
                )
            if not got.waiting:
                break
            got = eng.arrivals(lk, private=True, wait_until=time.monotonic() + GIVE_UP_S)
        for f in private:
            done.update(f.result())  # type: ignore[call-overload]
    finally:
        eng.release(lk)
    k = 0
    while done.get(k):
        k += 1
    return k


def _from_slot(eng: InProcessEngine, slot: int, i: int, lk: bytes, consume: Consume, *, hit: bool) -> bool:
    """Consume the chunk in its pinned slot, its header checked, and release the slot. ``hit``: it
    was in memory when found (a memory hit); a promoted chunk is a hit of the tier it came from."""
    payload = eng.slot_payload(slot, lk)
    if payload is None:
        return False
    try:
        consume(i, payload)
    except BaseException:
        eng.finish_load([slot])
        raise
    eng.finish_load([slot], loaded=int(hit), nbytes=eng.payload_bytes * hit)
    return True


def _private_many(
    eng: InProcessEngine,
    which: list[int],
    keys: list[bytes],
    consume: Consume,
    tenant: str,
    into: Into | None,
) -> dict[int, bool]:
    """On an I/O thread: the chunks ``which`` that have no slot. Those whose storage files the page
    cache holds land where ``into`` says, the whole share in one native call; the others are read
    one by one into this thread's buffer and consumed from there."""
    pieces: dict[int, list[memoryview]] = {}
    if into is not None:
        pieces = {i: p for i in which if (p := into(i)) is not None}
    done: dict[int, bool] = {}
    if pieces:
        got = eng.read_direct([keys[i] for i in pieces], list(pieces.values()))
        done = {i: True for i, ok in zip(pieces, got, strict=True) if ok}
    for i in which:
        if i not in done:
            done[i] = _private(eng, keys[i], consume, i, tenant)
    return done


def _private(eng: InProcessEngine, lk: bytes, consume: Consume, i: int, tenant: str) -> bool:
    rec = eng.read_private(lk, tenant)
    if rec is None:
        return False
    consume(i, rec[record.HEADER_BYTES : record.HEADER_BYTES + eng.payload_bytes])
    return True


def store(eng: InProcessEngine, lks: list[bytes], produce: Produce, tenant: str = SHARED) -> int:
    """Store each chunk whose payload ``produce`` writes (the engine serves one rank); return how
    many leading chunks are now held (in memory, or queued for or held by a slower tier). Chunks
    already held are not rewritten; nothing here waits on a remote server."""
    held = 0
    for i, lk in enumerate(lks):
        target = eng.begin_stores([lk], tenant, private=True)[0]
        if target is NO_ROOM:
            break
        if isinstance(target, Refused):
            held += 1
            continue
        rec = eng.store_record(target)
        payload = torch.frombuffer(rec, dtype=torch.uint8)[record.HEADER_BYTES : len(rec)]
        payload = payload[: eng.payload_bytes]
        try:
            produce(i, payload)
        except BaseException:
            del rec, payload
            eng.finish_stores([(lk, target, False, tenant)])
            raise
        del payload  # a private buffer must have no exports left when the write-behind hands it on
        eng.seal(lk, rec)
        del rec
        if not eng.finish_stores([(lk, target, True, tenant)])[0] and isinstance(target, mmap.mmap):
            break  # the write-behind's queue was full: not held anywhere
        held += 1
    return held
