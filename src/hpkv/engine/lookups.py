"""The lookup's steps: from where each chunk of a request's prompt is to a hit pinned in memory.

:class:`Lookups` drives a :class:`~hpkv.engine.lookup.Lookup` through its phases for the catalog
(:meth:`hpkv.engine.catalog.Catalog.lookup` and its streamed hit's :meth:`~Lookups.arrivals`):
memory and the local tiers are asked from their indexes, the remote tiers once per lookup on an
I/O thread (:class:`~hpkv.engine.locator.Locator`), the hit is cut at the first gap and where
loading stops paying (:mod:`hpkv.engine.costs`), and its chunks below memory are promoted
(:mod:`hpkv.engine.promotion`), protected from eviction until pinned.

Thread contract: as :class:`~hpkv.engine.lookup.Lookup`'s: one thread drives a lookup at a time;
its futures settle on the I/O threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import Any

from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.engine.costs import LoadCosts
from hpkv.engine.interface import MEMORY, Answer, Arrivals, Asked, Cut, Hit, Miss, Pending, Why
from hpkv.engine.locator import Locator
from hpkv.engine.lookup import GIVE_UP_S, Ahead, Located, Lookup, Phase
from hpkv.engine.promotion import Promoter
from hpkv.tiers.memory.bookkeeping import Slots

# How long a hit waits for pool slots that others hold before it is promoted as far as room goes
# (two waiting requests could each hold, protected, resident chunks the other needs room for).
ROOM_WAIT_S = 2.0

Probe = Callable[..., "Future[Located]"]


class Lookups:
    def __init__(
        self,
        memory: Slots,
        where: Locator,
        promoter: Promoter,
        costs: LoadCosts,
        tier_names: Sequence[str],
        *,
        pooled: bool,
        probe: Probe,
    ) -> None:
        """``tier_names``: the tiers below memory, fastest first; ``pooled``: whether memory has
        pools (promotions land there); ``probe``: the catalog's existence check off this thread
        (:meth:`Locator.probe`, through the catalog so that one place sees every check)."""
        self.memory = memory
        self._where = where
        self._promoter = promoter
        self.costs = costs
        self._tier_names = list(tier_names)
        self._pooled = pooled
        self._probe = probe
        self._num_slots = memory.num_slots

    def _sources_needed(self) -> bool:
        """Whether a lookup needs to know where each read below memory comes from: for the cost plan
        (a prefill rate to weigh it against) or to measure the promotions into memory by source."""
        return self._pooled or (self.costs.enabled and self.costs.prefill_rate() is not None)

    def locate(self, lks: Iterable[bytes], tenant: str = SHARED, *, remote: bool = True) -> list[str | None]:
        """Per key the fastest tier that holds it; None from the first key no tier holds onwards.
        The first steps of :meth:`lookup` (the remote tiers asked once, for the keys the local ones
        lack), waited for, with nothing protected, promoted or counted: an existence check.
        ``remote=False``: :meth:`locate_local` (no cut at a gap)."""
        if not remote:
            return self._where.locate_local(lks, tenant)
        lk = Lookup(list(lks), tenant)
        self._find(lk, 0, probe=True, sources=False)
        if lk.probe is not None:
            for i, name in zip(lk.probe_at, lk.probe.result()[0], strict=True):
                lk.where[i] = name
        out = lk.where
        if None in out:
            cut = out.index(None)
            out[cut:] = [None] * (len(out) - cut)
        return out

    def look_ahead(self, lk: Lookup) -> None:
        """The request was queued: ask now, on an I/O thread, what its first :meth:`lookup` would
        ask there (the remote tiers about the chunks the others lack, where each read below memory
        would come from), so that the lookup finds the answer in. Never blocks."""
        if not self._tier_names or lk.phase is not Phase.NEW or lk.ahead is not None or not lk.lks:
            return
        where = self._where.locate_local(lk.lks, lk.tenant)
        gaps = [i for i, w in enumerate(where) if w is None] if self._where.has_remote else []
        held = []
        if self._sources_needed():
            held = [(k, w) for k, w in zip(lk.lks, where, strict=True) if w in self._where.local_names()]
        if gaps or held:
            answer = self._probe([lk.lks[i] for i in gaps], held, lk.tenant, remote=bool(gaps))
            lk.ahead = Ahead(answer, gaps)

    def lookup(
        self,
        lk: Lookup,
        first: int = 0,
        *,
        wait_until: float | None = None,
        defer: bool = False,
        stream: Callable[[int, int], bool] | None = None,
        probe: bool = True,
    ) -> Answer:
        """The hit of ``lk`` from chunk ``first`` on: a :class:`Hit` (its slots pinned for the caller),
        :class:`Pending` (tier I/O runs: ask again) or :class:`Miss`.

        The first ask finds each chunk's fastest tier (remote tiers: one batched check on an I/O
        thread, or the one :meth:`look_ahead` made), cuts the hit at the first gap and where
        loading would be slower than recomputing, and protects its chunks from eviction. Its chunks
        below memory are then promoted (unless pool slots are short: it waits for them up to
        ROOM_WAIT_S). Once every promotion settled (or GIVE_UP_S passed) the answer is a Hit of
        what is in memory from ``first`` on, pinned anew on every ask.

        ``wait_until`` (``time.monotonic``): wait for the lookup's own I/O until then (default:
        never wait). ``defer``: promotions read only from :meth:`start_deferred` on (vLLM: after the
        scheduling pass, whose other lookups the reading threads would slow down). ``stream(below,
        chunks)``: whether to answer a hit of ``chunks`` chunks, ``below`` of them below memory,
        as a streamed Hit (its chunks from :meth:`arrivals`). ``probe=False``: the caller has just
        checked existence itself (SGLang's ``batch_exists``), so the chunks no local tier holds are
        read from the remote tiers without asking first (a read that misses costs what the check
        would have)."""
        waits, room = lk.waits, lk.waited_for_room
        found = promotions = False

        def asked() -> Asked:
            if not (lk.waits - waits or lk.waited_for_room > room or found or promotions):
                return Asked()
            cut = None
            if found and lk.left_out:
                cut = Cut(lk.chunks, lk.found, frozenset(lk.left_out), lk.why_left)
            return Asked(
                waited=lk.waits - waits,
                waited_for_room=lk.waited_for_room and not room,
                found=found,
                used_ahead=found and lk.ahead_used,
                cut=cut,
                promotions=tuple(lk.promotions) if promotions else (),
                since=lk.since,
            )

        if lk.phase is Phase.NEW:
            self._find(lk, first, probe)
            self.memory.counters.add("misses", sum(w != MEMORY for w in lk.where))
            if lk.probe is not None:
                lk.since = time.monotonic()
                lk.to(Phase.LOCATING)
            else:
                self._cut(lk)
                found = True
        if lk.phase is Phase.LOCATING:
            assert lk.probe is not None
            self._wait([lk.probe], lk, wait_until)
            if not lk.probe.done() and not self._gave_up(lk, GIVE_UP_S):
                return Pending(Why.LOCATING, asked())
            names, sources = lk.probe.result() if lk.probe.done() else ([None] * len(lk.probe_at), {})
            for i, name in zip(lk.probe_at, names, strict=True):
                lk.where[i] = name
            lk.sources.update(sources)
            lk.probe = None
            self._cut(lk)
            found = True
        if lk.phase is Phase.FOUND:
            need = [k for k, w in zip(lk.protected, lk.where, strict=False) if w != MEMORY]
            if self._short_of_room(len(need)) and not self._gave_up(lk, ROOM_WAIT_S):
                # Promotions that found no slot would cut the hit short, and under load the engine
                # would recompute the rest behind the backlog holding the slots.
                lk.waited_for_room = True
                return Pending(Why.ROOM, asked())
            if not lk.protected:
                lk.to(Phase.READY)
            elif stream is not None and stream(len(need), len(lk.protected)):
                self._guard(lk)  # its chunks are pinned as each is handed out, steps later
                self._stream(lk)
            else:
                lk.staging = self._promoter.stage(need, lk.tenant, defer=defer)
                lk.promotions = list(lk.staging)
                lk.to(Phase.STAGING)
        if lk.phase is Phase.STREAMING:
            return Hit(
                lk.first,
                len(lk.protected),
                tiers=dict(lk.tiers),
                streaming=True,
                since=lk.since,
                asked=asked(),
            )
        if lk.phase is Phase.STAGING:
            self._wait(lk.staging, lk, wait_until)
            if not all(f.done() for f in lk.staging) and not self._gave_up(lk, GIVE_UP_S):
                return Pending(Why.PROMOTIONS, asked())
            self._staged(lk)
            promotions = bool(lk.promotions)
        slots = self.memory.pin(lk.lks[first:])
        self._unprotect(lk)  # pinned now, what of it is in memory
        if not slots:
            return Miss(asked())
        return Hit(first, len(slots), slots, dict(lk.tiers), since=lk.since, asked=asked())

    def _find(self, lk: Lookup, first: int, probe: bool, *, sources: bool = True) -> None:
        """Where each chunk from ``first`` is, from what memory and the tiers know without a system
        call (the memory tier asked once for all); what needs more is asked on an I/O thread in
        ``lk.probe``: the chunks that were not found (a file another process wrote, the remote
        tiers: the check made ahead if it is fresh and covers them), and where each read below
        memory would come from (``sources``, when :meth:`_sources_needed`). ``probe=False``: the
        remote tier is assumed to hold the gaps (a read that misses costs what the check would).
        Without a remote tier and nothing to ask of the found chunks, a gap is a miss at once and
        the local tiers are asked in the background for the next lookup."""
        lk.first = first
        lk.where = self._where.locate_local(lk.lks[first:], lk.tenant)
        keys = lk.lks[first:]
        gaps = [i for i, w in enumerate(lk.where) if w is None]
        ahead, lk.ahead = lk.ahead, None  # used once
        if gaps and self._where.has_remote and not probe:
            remote = self._where.remote_tiers()[0][0]
            for i in gaps:
                lk.where[i] = remote
            gaps = []
        held = []
        if sources and self._sources_needed():
            held = [(keys[i], w) for i, w in enumerate(lk.where) if w in self._where.local_names()]
        ask_remote = bool(gaps) and self._where.has_remote
        if not held and not ask_remote:
            if gaps and self._where.local_tiers():
                missing = [keys[i] for i in gaps]
                self._promoter.submit(lambda: self._where.in_slow_many(missing, lk.tenant, remote=False))
            return
        lk.probe_at = gaps
        lk.probe = None
        if ahead is not None and (ask_remote or not gaps):
            lk.probe = ahead.answer_for([first + i for i in gaps], [k for k, _ in held])
        lk.ahead_used = lk.probe is not None
        if lk.probe is None:
            lk.probe = self._probe([keys[i] for i in gaps], held, lk.tenant, remote=ask_remote)

    def _cut(self, lk: Lookup) -> None:
        """The hit ends at the first gap, then where loading stops paying (see LoadCosts.plan); its
        chunks are kept from eviction until they are pinned."""
        found = lk.where.index(None) if None in lk.where else len(lk.where)
        lk.found = found
        keys = lk.lks[lk.first : lk.first + found]
        where = lk.where[:found]
        n = found
        if found and any(w != MEMORY for w in where):
            # Where each read comes from was asked off this thread (_find's probe); a tier's name
            # where it was not asked.
            known = lk.sources
            sources = [
                MEMORY if w == MEMORY else known.get(k, w or "") for k, w in zip(keys, where, strict=True)
            ]
            lk.sources = {k: s for k, s in zip(keys, sources, strict=True) if s != MEMORY}
            plan = self.costs.plan(sources)
            n = plan.load
            if plan.left:
                lk.left_out = set(keys[n:])
                lk.why_left = plan.why
        lk.tiers = {t: where[:n].count(t) for t in [MEMORY, *self._tier_names] if t in where[:n]}
        lk.protected, lk.chunks = keys[:n], n
        if any(w != MEMORY for w in where[:n]):  # a hit all in memory is pinned in this same call
            self._guard(lk)
        if not lk.since:
            lk.since = time.monotonic()
        lk.to(Phase.FOUND)

    def _short_of_room(self, need: int) -> bool:
        """Whether promoting ``need`` chunks now would find slots missing that other work holds for
        a while (other requests' leases and promotions, the write-behind's queue), so that asking
        again shortly beats a shorter hit. Never for more than half the pool: the write-behind may
        pin half, so more can never be counted on (such a hit is promoted as far as room goes)."""
        return 0 < need <= self._num_slots // 2 and self.memory.room() < need

    def _stream(self, lk: Lookup) -> None:
        # Each chunk's read is deferred to the end of the scheduling pass (see lookup's ``defer``).
        resident = self.memory.contains_many(lk.protected)
        for i, k in enumerate(lk.protected):
            futs = [] if resident[i] else self._promoter.stage([k], lk.tenant, defer=True)
            lk.awaited.append((i, futs[0] if futs else None))
        lk.staging = [f for _, f in lk.awaited if f is not None]
        lk.promotions = list(lk.staging)
        lk.to(Phase.STREAMING)

    def _staged(self, lk: Lookup) -> None:
        """Every promotion of the hit settled: count per tier what arrived (a failed promotion
        shortens the hit) and measure the reads."""
        resident = self.memory.contains_many(lk.protected)
        for name in self._tier_names:
            if name in lk.tiers:
                lk.tiers[name] = sum(r for r, w in zip(resident, lk.where, strict=False) if w == name)
        self.costs.promoted(lk.promotions, lk.sources)
        lk.staging = []
        lk.to(Phase.READY)

    def _wait(self, futs: Sequence[Future[Any]], lk: Lookup, until: float | None) -> None:
        if until is None:
            return
        pending = [f for f in futs if not f.done()]
        left = until - time.monotonic()
        if pending and left > 0:
            lk.waits += 1
            wait(pending, timeout=left, return_when=ALL_COMPLETED)

    @staticmethod
    def _gave_up(lk: Lookup, limit: float) -> bool:
        return bool(lk.since) and time.monotonic() - lk.since > limit

    def arrivals(
        self,
        lk: Lookup,
        *,
        give_up: bool = False,
        gone: bool = False,
        private: bool = False,
        wait_until: float | None = None,
    ) -> Arrivals:
        """A streamed hit's chunks that reached memory since the last call, each pinned for the
        caller (released by :meth:`finish_load`), and those that never will: a failed promotion,
        tier I/O given up (``give_up``, or GIVE_UP_S passed), the request gone (``gone``: nothing is
        handed out any more). After the first failure every later chunk fails too (the engine
        recomputes from the first failed chunk anyway). ``private``: a chunk that reaches no slot
        (no memory tier, no slot to spare, a failed promotion) is ``unslotted`` instead, for the
        caller to read itself, and fails nothing after it. Once nothing is awaited the reads are
        measured and the lookup is READY. ``wait_until``: when nothing has arrived, wait until then
        for a first arrival."""
        pending = [f for _, f in lk.awaited if f is not None and not f.done()]
        if wait_until is not None and pending and len(pending) == len(lk.awaited) and not give_up:
            left = wait_until - time.monotonic()
            if left > 0:
                wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        give_up = give_up or self._gave_up(lk, GIVE_UP_S)
        out = Arrivals()
        waiting: list[tuple[int, Future[bool] | None]] = []
        failing = False
        for i, fut in lk.awaited:
            arrived = fut is None or fut.done()
            if not failing and not arrived and not give_up:
                waiting.append((i, fut))
                continue
            ok = not failing and not gone and arrived and (fut is None or fut.result())
            slots = self.memory.pin([lk.protected[i]]) if ok else []
            if slots:
                out.ready.append((i, slots[0]))
                if fut is None:
                    out.resident.add(i)
            elif private and not gone:
                out.unslotted.append(i)
            else:
                failing = True
                out.failed.append(i)
        lk.awaited = waiting
        lk.staging = [f for _, f in waiting if f is not None]
        out.waiting = len(waiting)
        if not waiting and lk.phase is Phase.STREAMING:
            self.costs.promoted(lk.promotions, lk.sources)
            self._unprotect(lk)
            lk.to(Phase.READY)
        return out

    def release(self, lk: Lookup) -> None:
        """End ``lk`` in any phase: its protection goes and nothing it awaits is handed out. A
        promotion still running completes into memory for a later hit. A released lookup may still
        be asked: it answers with what is in memory."""
        self._unprotect(lk)
        lk.awaited, lk.staging = [], []
        if lk.phase is not Phase.DONE:
            lk.to(Phase.DONE)

    def _guard(self, lk: Lookup) -> None:
        """Keep the hit's chunks from eviction until they are pinned (one question to the memory
        tier; a hit pinned in the call that found it needs none)."""
        if lk.protected and not lk.guarded:
            self.memory.protect(lk.protected)
            lk.guarded = True

    def _unprotect(self, lk: Lookup) -> None:
        if lk.protected and lk.guarded:
            self.memory.unprotect(lk.protected)
        lk.protected, lk.guarded = [], False
