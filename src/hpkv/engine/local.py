"""The engine's load and store pairs run for a caller that holds the bytes in this process.

The library (:class:`hpkv.KVStore`) and SGLang's storage backend copy chunks between their own
tensors and hpkv's tiers in their own process, where vLLM's workers copy between the pool and the
GPU in theirs. Both go through the same :class:`~hpkv.engine.catalog.Catalog` interface: one
lookup (:meth:`Catalog.lookup`), one store (:meth:`Catalog.begin_store` /
:meth:`Catalog.finish_store`). What differs is only who copies.

Thread contract: both functions block until their copies are done; ``consume`` of a chunk that
had no memory slot runs on an I/O thread, the others on the caller's.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from hpkv.core import record
from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.engine.catalog import GIVE_UP_S, NO_ROOM, Catalog
from hpkv.engine.lookup import Lookup, Miss, Pending

# consume(chunk_index, payload) reads a verified payload (uint8, canonical layout, this rank's);
# produce(chunk_index, payload) fills one. Neither may keep ``payload``.
Consume = Callable[[int, torch.Tensor], None]
Produce = Callable[[int, torch.Tensor], None]
# into(chunk_index): where that chunk's payload ends up, as writable pieces in payload order (or
# None), so that a read from a local file can land there at once instead of going through a buffer
# and ``consume``. What a failed read leaves there is garbage: only the returned prefix counts.
Into = Callable[[int], "list[memoryview] | None"]


def load(
    cat: Catalog,
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
    memory are consumed from their pinned slots at once, the others as their promotions land.
    A chunk that found no slot (no memory tier, or none to spare) is read on an I/O thread into a
    private buffer and consumed there, or, with ``into``, read from its storage file straight to
    where it belongs when the page cache holds the file. Only the returned prefix counts; a chunk
    after a failed one may still have been consumed. ``probe=False``: see :meth:`Catalog.lookup`."""
    if not lks:
        return 0
    lk = Lookup(list(lks), tenant)
    answer = cat.lookup(
        lk, wait_until=time.monotonic() + GIVE_UP_S, stream=lambda _below, _n: True, probe=probe
    )
    while isinstance(answer, Pending):  # only "room": others' work holds the slots for a while
        time.sleep(0.005)
        answer = cat.lookup(lk, stream=lambda _below, _n: True, probe=probe)
    done: dict[int, bool] = {}
    try:
        if isinstance(answer, Miss) or not answer.streaming:
            if not isinstance(answer, Miss):
                cat.finish_load(answer.slots)
            return 0
        keys = lks[: answer.chunks]
        private: dict[int, Future[object]] = {}
        promoting: dict[Future[bool], int] = {}
        unslotted: list[int] = []
        for i, fut in lk.awaited:
            if fut is not None:
                promoting[fut] = i
            elif cat.pools and _from_memory(cat, i, keys[i], consume):
                done[i] = True
            else:  # no memory tier, or its header failed: the slower tiers may still have it
                unslotted.append(i)
        lk.awaited = []
        # One task per I/O thread, not one per chunk: each hand-over between threads is a round
        # trip for the GIL, which a busy engine thread may hold for its whole switch interval.
        k = min(len(unslotted), cat.io_threads)
        batches = [
            cat.run_io(_private_many, cat, unslotted[j::k], keys, consume, tenant, into) for j in range(k)
        ]
        cat.start_deferred()
        while promoting:
            landed, _ = wait(list(promoting), return_when=FIRST_COMPLETED)
            for fut in landed:
                i = promoting.pop(fut)
                if fut.result() and _from_memory(cat, i, keys[i], consume, hit=False):
                    done[i] = True
                else:  # no slot, or it failed: read privately (the slower tiers say why)
                    private[i] = cat.run_io(_private, cat, i, keys[i], consume, tenant, into)
        for i, f in private.items():
            done[i] = bool(f.result())
        for b in batches:
            done.update(b.result())  # type: ignore[call-overload]
    finally:
        cat.release(lk)
    k = 0
    while done.get(k):
        k += 1
    return k


def _from_memory(cat: Catalog, i: int, lk: bytes, consume: Consume, *, hit: bool = True) -> bool:
    """The chunk from its memory slot, pinned for the copy: its header checked (not its checksum:
    slots are written only by this engine, from verified records or the engine's own KV).
    ``hit=False``: it was just promoted, a hit of the tier it came from, not of memory."""
    slots = cat.memory.pin([lk])
    if not slots:
        return False
    off = slots[0] * cat.slot_bytes
    try:
        rec = cat.pools[0].view[off : off + cat.record_bytes]
        verdict = record.verify(
            rec, cat.record_bytes, cat.rank_digests[0], cat.record_key(0, lk), cat.payload_bytes,
            check_payload=False,
        )  # fmt: skip
        if verdict is not record.Verdict.OK:
            cat.memory.drop(lk)
            cat.finish_load(slots)
            return False
        p = off + record.HEADER_BYTES
        consume(i, cat.pools[0].tensor[p : p + cat.payload_bytes])
    except BaseException:
        cat.finish_load(slots)
        raise
    cat.finish_load(slots, loaded=int(hit), nbytes=cat.payload_bytes * hit)
    return True


def _private_many(
    cat: Catalog, which: list[int], keys: list[bytes], consume: Consume, tenant: str, into: Into | None
) -> dict[int, bool]:
    return {i: _private(cat, i, keys[i], consume, tenant, into) for i in which}


def _private(cat: Catalog, i: int, lk: bytes, consume: Consume, tenant: str, into: Into | None) -> bool:
    pieces = into(i) if into is not None else None
    if pieces is not None and cat.read_direct(lk, pieces):
        return True
    rec = cat.read_private(lk, tenant)
    if rec is None:
        return False
    consume(i, rec[record.HEADER_BYTES : record.HEADER_BYTES + cat.payload_bytes])
    return True


def store(cat: Catalog, lks: list[bytes], produce: Produce, tenant: str = SHARED) -> int:
    """Store each chunk whose payload ``produce`` writes (the catalog serves one rank); return how
    many leading chunks are now held (in memory, or queued for or held by a slower tier). Chunks
    already held are not rewritten; nothing here waits on a remote server."""
    if len(cat.ranks) != 1:
        raise ValueError("store() fills one rank's payloads; this catalog serves several ranks")
    held = 0
    for i, lk in enumerate(lks):
        target = cat.begin_store(lk, tenant, private=True)
        if target == NO_ROOM:
            break
        if isinstance(target, str):
            held += 1
            continue
        if isinstance(target, mmap.mmap):
            rec = memoryview(target)
            payload = torch.frombuffer(target, dtype=torch.uint8)[record.HEADER_BYTES :]
        else:
            off = target * cat.slot_bytes
            rec = cat.pools[0].view[off : off + cat.record_bytes]
            payload = cat.pools[0].tensor[off + record.HEADER_BYTES : off + cat.record_bytes]
        try:
            produce(i, payload)
        except BaseException:
            del rec, payload
            cat.finish_store(lk, target, False, tenant)
            raise
        del payload  # a private buffer must have no exports left when the cascade hands it on
        record.seal(rec, cat.rank_digests[0], cat.record_key(0, lk), cat.payload_bytes)
        del rec
        if not cat.finish_store(lk, target, True, tenant) and isinstance(target, mmap.mmap):
            break  # the cascade's queue was full: not held anywhere
        held += 1
    return held
