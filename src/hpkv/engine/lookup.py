"""The engine's lookup: one request's prompt chunks, what the engine found for them, and the answer.

An integration makes a :class:`Lookup` per request (its chunk keys and tenant) and asks
:meth:`hpkv.engine.catalog.Catalog.lookup` about it, as often as it likes; each answer is one of

* :class:`Miss`: no chunk from the asked position on is held anywhere (the engine computes);
* :class:`Pending`: tier I/O is still running (the remote tiers' existence check, promotions, or
  a wait for pool room); ask again, the engine never blocks the caller for it unless told to;
* :class:`Hit`: ``chunks`` chunks from ``first`` are in memory and pinned for the caller
  (``slots``), to be released by :meth:`Catalog.finish_load`; or, for a streamed hit
  (``streaming``), the chunks are handed out as each reaches memory by :meth:`Catalog.arrivals`.

The lookup's phases are :class:`Phase`; :meth:`Lookup.to` refuses a transition the engine does not
make, so a bug shows as an error, not as a pin that is never released. A lookup holds protection
(see :mod:`hpkv.tiers.memory.bookkeeping`) from FOUND until it is pinned or released; :meth:`Catalog.release`
ends it in any phase.

Thread contract: a Lookup is driven by one thread at a time (vLLM's scheduler thread; a library
caller's thread); the futures it holds settle on the engine's I/O threads.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hpkv.core.keys import SHARED_TENANT

# How long a lookup's tier I/O may take before it settles for what has arrived.
GIVE_UP_S = 30.0
# A remote existence check made ahead of the lookup (see Catalog.look_ahead) is used only if it is
# at most this old: another engine may have stored the chunks since.
AHEAD_FRESH_S = 2.0


class Phase(enum.Enum):
    NEW = "new"  # keys known; nothing asked yet
    LOCATING = "locating"  # memory and the tiers' indexes asked; the probe's answer is awaited
    FOUND = "found"  # the hit is cut and protected; its promotions have not started (room)
    STAGING = "staging"  # the hit's chunks below memory are being promoted
    STREAMING = "streaming"  # answered; chunks are handed out as each reaches memory
    READY = "ready"  # what arrived is in memory; each ask pins it afresh
    DONE = "done"  # released: nothing protected, nothing awaited


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.LOCATING, Phase.FOUND, Phase.DONE}),
    Phase.LOCATING: frozenset({Phase.FOUND, Phase.DONE}),
    Phase.FOUND: frozenset({Phase.STAGING, Phase.STREAMING, Phase.READY, Phase.DONE}),
    Phase.STAGING: frozenset({Phase.READY, Phase.DONE}),
    Phase.STREAMING: frozenset({Phase.READY, Phase.DONE}),
    Phase.READY: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A lookup was moved to a phase its current one cannot lead to (a bug in the caller or engine)."""


Names = list[str | None]  # per chunk asked: the tier below memory that holds it, or None
# A probe's answer: Names for the chunks asked, and where each read below memory would come from
# (chunk key -> source, see ``Tier.source``).
Located = tuple[Names, dict[bytes, str]]


@dataclass
class Ahead:
    """The probe made when the request was queued (see ``Catalog.look_ahead``): the remote tiers'
    existence check for the chunks at ``chunks`` (indexes into the prompt's chunks), and where
    each read of a chunk held below memory would come from."""

    answer: Future[Located]
    chunks: list[int]
    since: float = field(default_factory=time.monotonic)

    def answer_for(self, chunks: list[int], held: list[bytes]) -> Future[Located] | None:
        """The answer for the gaps ``chunks`` and the sources of ``held`` (chunk keys), if this
        check asked about all of them and is recent."""
        if time.monotonic() - self.since > AHEAD_FRESH_S:
            return None
        at = {c: j for j, c in enumerate(self.chunks)}
        if any(c not in at for c in chunks):  # a chunk left the local tiers since
            return None
        if held and not (self.answer.done() and set(held) <= self.answer.result()[1].keys()):
            return None  # a chunk reached a local tier since (or the answer is not in to tell)

        def pick(f: Future[Located]) -> Located:
            names, sources = f.result()
            return [names[at[c]] for c in chunks], sources

        out: Future[Located] = Future()
        if self.answer.done():
            out.set_result(pick(self.answer))
            return out

        def settle(f: Future[Located]) -> None:
            try:
                out.set_result(pick(f))
            except Exception:  # cancelled or failed: absent, as a failed check answers
                out.set_result(([None] * len(chunks), {}))

        self.answer.add_done_callback(settle)
        return out


@dataclass
class Lookup:
    """One request's lookup. Fields after ``tenant`` belong to the engine."""

    lks: list[bytes]
    tenant: str = SHARED_TENANT
    phase: Phase = Phase.NEW
    first: int = 0  # the chunk the lookup looked from
    where: list[str | None] = field(default_factory=list)  # per chunk from ``first``: its tier
    probe: Future[Located] | None = None  # the answer asked off the engine's thread (Catalog._find)
    probe_at: list[int] = field(default_factory=list)
    ahead: Ahead | None = None
    ahead_used: bool = False  # the first ask used the check made ahead
    protected: list[bytes] = field(default_factory=list)  # the hit's chunks, kept from eviction
    guarded: bool = False  # whether the memory tier was asked to protect them
    tiers: dict[str, int] = field(default_factory=dict)
    since: float = 0.0  # when tier I/O for it began (time.monotonic; 0.0: none)
    waited_for_room: bool = False
    waits: int = 0  # asks that waited for the lookup's own I/O (Catalog.lookup's wait_until)
    staging: list[Future[bool]] = field(default_factory=list)  # promotions still running
    promotions: list[Future[bool]] = field(default_factory=list)  # every promotion of the hit
    sources: dict[bytes, str] = field(default_factory=dict)  # where each chunk below memory is read
    found: int = 0  # chunks found before the cost cut
    chunks: int = 0  # chunks of the hit after the cut (kept once it is no longer protected)
    left_out: set[bytes] = field(default_factory=set)  # chunks of the hit left to recompute
    why_left: str = ""  # the cost model's reason (its rates)
    awaited: list[tuple[int, Future[bool] | None]] = field(default_factory=list)  # streamed chunks

    def to(self, phase: Phase) -> None:
        if phase not in ALLOWED[self.phase]:
            raise IllegalTransition(f"a lookup cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    def pending_io(self) -> list[Future[Any]]:
        """The futures of its tier I/O still running (for a caller that waits for any of them)."""
        out: list[Future[Any]] = []
        if self.probe is not None and not self.probe.done():
            out.append(self.probe)
        out.extend(f for f in self.staging if not f.done())
        return out
