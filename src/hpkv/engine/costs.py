"""Cost-aware loads: how much of a hit is worth loading, from rates measured in this engine.

A hit's time to first token is about the time to load its chunks plus the time to compute the rest
of the prompt; a chunk left out is computed instead. Loading chunk ``i`` saves ``tokens / prefill
rate`` and costs ``bytes / read rate of the tier it is read from``, so the best load is the prefix
of the hit whose summed savings are largest (a prefix: the engine can only skip the leading
tokens). Memory chunks cost nothing to speak of and are always loaded.

Every rate is learned from this engine's own work, per source, robust to outliers (the median of
the last few samples):

* **read rates** per source (``storage`` from the page cache, ``storage-device`` from the device,
  ``valkey``), from the promotions of real hits: bytes over the span from the first read's start
  to the last chunk's check;
* **prefill rate** (tokens per second), from the engine's steps that computed at least a chunk of
  tokens;
* **step floor** (seconds), what a step costs however few tokens it computes (on a GPU, reading the
  weights once): the median time of the small steps whose tokens, at the prefill rate, take at most
  half of it. A step of ``n`` tokens then takes ``max(floor, n / prefill rate)``, so the tail of a
  prompt (the last partial block vLLM's own cache leaves) saves nothing when it is loaded;
* **copy cost** of a load into the engine, from the copies' own time (CUDA events on a GPU): the
  line through the recent loads' (bytes, seconds), a fixed part (the launch, the staging, the
  partial-block copies) plus the bytes at a rate. A hit whose load would cost more than the compute
  it saves is recomputed whole.

Every estimate is kept per model and device in a small file beside the chunks and the pool
(:class:`RateMemo`), so a restarted engine decides its first hits with what the last one learned.

Until a source's reads are measured, a hit loads a few of its chunks from it (``probe_chunks``,
one per reading thread) and computes the rest: those reads measure it, and a source slower than
computing costs the one hit that measured it only those few chunks' reads, not a whole prompt's
(a 448 MiB prompt over a link at 0.8 GB/s took 3.5 times its prefill). The probe is skipped when
the source's writes already show it far too slow: every thread reading at the rate one writer got
would still lose to the prefill (a throttled link is as slow both ways; only remote tiers' writes
are told here). A read rate is forgotten after ``SAMPLE_TTL_S`` so that a source that was too
slow is tried again.

Thread-safety: observations come from the scheduler thread and the write-behind thread; every
method takes one small lock and never blocks on I/O, except :class:`RateMemo`'s file writes,
which the caller rate-limits.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from hpkv.engine.promotion import Promotion

log = logging.getLogger(__name__)

MEMORY = "memory"
# How many samples a rate keeps: the median of the last few rides out one slow or fast outlier.
SAMPLES = 16
# A read rate older than this is forgotten: a source judged too slow is read again (and measured).
SAMPLE_TTL_S = 300.0
# A load must be expected to take at most this share of the recompute it replaces: estimates are
# rough, and a near-tie is better recomputed than loaded a little slower.
LOAD_MARGIN = 0.9
# A prefill sample needs this many tokens in its step: small steps (decode) measure step overhead,
# not the rate at which a prompt is computed.
MIN_PREFILL_TOKENS = 256
# Where the write rate stands in for an unmeasured read rate, it counts this many readers at once.
WRITE_PRIOR_READERS = 8
# A small step is at the step floor when its tokens at the prefill rate take at most this share of it.
FLOOR_SHARE = 0.5


class Rate:
    """The median of the last SAMPLES samples of one rate (units per second), each kept for ``ttl``."""

    def __init__(self, ttl: float | None = None) -> None:
        self._ttl = ttl
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)  # (when, rate)

    def add(self, units: float, seconds: float, now: float | None = None) -> None:
        if units > 0 and seconds > 0:
            self._samples.append((time.monotonic() if now is None else now, units / seconds))

    def seed(self, rate: float) -> None:
        """One sample from before this process (see :class:`RateMemo`)."""
        if rate > 0:
            self._samples.append((time.monotonic(), rate))

    def value(self, now: float | None = None) -> float | None:
        """The median rate of the samples still current, or None when there is none."""
        if self._ttl is not None:
            cutoff = (time.monotonic() if now is None else now) - self._ttl
            while self._samples and self._samples[0][0] < cutoff:
                self._samples.popleft()
        if not self._samples:
            return None
        return statistics.median(r for _, r in self._samples)


@dataclass(frozen=True)
class Plan:
    """A cost decision: load the first ``load`` chunks of a hit of ``found``; the rest is computed.
    ``why`` says which rates decided it (empty when nothing was left out)."""

    load: int
    found: int
    why: str = ""

    @property
    def left(self) -> int:
        return self.found - self.load


class Samples:
    """The last SAMPLES observations of a pair (units, seconds)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)

    def add(self, units: float, seconds: float) -> None:
        if units >= 0 and seconds > 0:
            self._samples.append((units, seconds))

    def all(self) -> list[tuple[float, float]]:
        return list(self._samples)


class LoadCosts:
    def __init__(
        self, chunk_tokens: int, chunk_bytes: int, *, enabled: bool = True, probe_chunks: int = 4
    ) -> None:
        """``chunk_tokens`` tokens per chunk; ``chunk_bytes``: the bytes a load of one chunk reads
        (every rank's shard). ``enabled=False`` (``HPKV_COST_AWARE_LOADS=false``): measure, never cut.
        ``probe_chunks``: how many chunks of a hit an unmeasured source gives (the engine's reading
        threads, so the probe measures them all at work)."""
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.enabled = enabled
        self.probe_chunks = max(1, probe_chunks)
        self._lock = threading.Lock()
        self._reads: dict[str, Rate] = {}
        self._writes: dict[str, Rate] = {}
        self._prefill = Rate()
        self._small_steps = Samples()  # (tokens, seconds) of steps below MIN_PREFILL_TOKENS
        self._copies = Samples()  # (bytes, seconds) of loads into the engine, one rank's
        self._copy_kept: tuple[float, float] | None = None  # (rate, fixed) from before this process

    # -- observations -------------------------------------------------------------------

    def read(self, source: str, nbytes: int, seconds: float) -> None:
        """``nbytes`` (every rank's) came from ``source`` in ``seconds``, reads started to last check."""
        with self._lock:
            self._reads.setdefault(source, Rate(SAMPLE_TTL_S)).add(nbytes, seconds)

    def promoted(self, promotions: Iterable[Future[bool]], sources: Mapping[bytes, str]) -> None:
        """A load's promotions are in: per source (``sources``: chunk key -> source) one read sample,
        its chunks' bytes over the span from its first read's start to its last chunk's check.
        Promotions that failed, or are not :class:`Promotion` s, are left out."""
        spans: dict[str, list[float]] = {}  # source -> [chunks, first began, last settled]
        for f in promotions:
            if not isinstance(f, Promotion) or not f.done() or not f.settled or not f.result():
                continue
            src = sources.get(f.lk)
            if src is None:
                continue
            got = spans.setdefault(src, [0, f.began, f.settled])
            got[0] += 1
            got[1], got[2] = min(got[1], f.began), max(got[2], f.settled)
        for src, (n, began, settled) in spans.items():
            self.read(src, int(n) * self.chunk_bytes, settled - began)

    def wrote(self, tier: str, nbytes: int, seconds: float) -> None:
        """One writer put ``nbytes`` into ``tier`` in ``seconds`` (the write-behind's timing)."""
        with self._lock:
            self._writes.setdefault(tier, Rate(SAMPLE_TTL_S)).add(nbytes, seconds)

    def computed(self, tokens: int, seconds: float) -> None:
        """The engine computed a step of ``tokens`` tokens in ``seconds``."""
        with self._lock:
            if tokens >= MIN_PREFILL_TOKENS:
                self._prefill.add(tokens, seconds)
            elif tokens > 0:
                self._small_steps.add(tokens, seconds)

    def copied(self, nbytes: int, seconds: float) -> None:
        """A load copied ``nbytes`` (one rank's) into the engine in ``seconds`` (the copies' own time)."""
        with self._lock:
            self._copies.add(nbytes, seconds)

    # -- estimates ----------------------------------------------------------------------

    def prefill_rate(self) -> float | None:
        with self._lock:
            return self._prefill.value()

    def step_floor(self) -> float | None:
        """Seconds a step takes however few tokens it computes, or None until measured (see the
        module's docstring)."""
        with self._lock:
            rate = self._prefill.value()
            small = self._small_steps.all()
        if rate is None:
            return None
        floor = [s for n, s in small if n / rate <= FLOOR_SHARE * s]
        return statistics.median(floor) if floor else None

    def step_seconds(self, tokens: int) -> float | None:
        """What a step of ``tokens`` tokens costs the engine, or None until the prefill rate is known."""
        rate = self.prefill_rate()
        if rate is None:
            return None
        return max(self.step_floor() or 0.0, tokens / rate)

    def copy_cost(self, nbytes: int) -> float | None:
        """Seconds a load of ``nbytes`` (one rank's) into the engine takes: a fixed part plus the
        bytes at the best rate seen; None until a load was measured."""
        got = self._copy_model()
        if got is None:
            return None
        rate, fixed = got
        return fixed + nbytes / rate

    def _copy_model(self) -> tuple[float, float] | None:
        """(rate in bytes/s, fixed seconds) of a load into the engine, or None until measured."""
        with self._lock:
            copies, kept = self._copies.all(), self._copy_kept
        copies = [(b, s) for b, s in copies if b > 0]
        if not copies:
            return kept
        if len({b for b, _ in copies}) > 1:  # loads of several sizes: the line through them
            slope, fixed = statistics.linear_regression([b for b, _ in copies], [s for _, s in copies])
            if slope > 0:
                return 1 / slope, max(0.0, fixed)
        return max(b / s for b, s in copies), 0.0  # one size: its time, all of it per byte

    def worth_loading(self, tokens: int, rest: int, nbytes: int) -> bool:
        """Whether loading ``tokens`` tokens (``nbytes`` of chunks, one rank's, to copy) beats
        computing them, when the engine computes ``rest`` more tokens of the prompt either way.
        True when cost-aware loading is off or the prefill rate is not known yet."""
        if not self.enabled:
            return True
        with_them, without = self.step_seconds(rest + tokens), self.step_seconds(rest)
        if with_them is None or without is None:
            return True
        saved = with_them - without
        return saved > 0 and (self.copy_cost(nbytes) or 0.0) <= LOAD_MARGIN * saved

    def read_rate(self, source: str) -> float | None:
        """The measured read rate of ``source`` (bytes/s), else what its writes bound it to when they
        show it far too slow to matter, else None (unknown: worth trying)."""
        with self._lock:
            r = self._reads.get(source)
            got = r.value() if r is not None else None
            if got is not None:
                return got
            w = self._writes.get(source)
            written = w.value() if w is not None else None
        return written * WRITE_PRIOR_READERS if written is not None else None

    def export(self) -> dict[str, float]:
        """The current estimates by name (``prefill``, ``read:<source>``, ``write:<tier>``), for
        :class:`RateMemo`: only what was measured, never a write standing in for a read."""
        out: dict[str, float] = {}
        with self._lock:
            p = self._prefill.value()
            if p is not None:
                out["prefill"] = p
        floor = self.step_floor()
        if floor is not None:
            out["floor"] = floor
        copy = self._copy_model()
        if copy is not None:
            # A kept estimate must be positive (RateMemo drops the others): a fixed part of 0 is 1 ns.
            out["copy"], out["copy_fixed"] = copy[0], max(1e-9, copy[1])
        with self._lock:
            for kind, rates in (("read", self._reads), ("write", self._writes)):
                for name, r in rates.items():
                    v = r.value()
                    if v is not None:
                        out[f"{kind}:{name}"] = v
        return out

    def seed(self, kept: dict[str, float]) -> None:
        """One sample per estimate from before this process (:meth:`export`'s names); each expires
        as a measured one would."""
        with self._lock:
            for name, v in kept.items():
                kind, _, what = name.partition(":")
                if kind == "prefill":
                    self._prefill.seed(v)
                elif kind in ("read", "write") and what:
                    rates = self._reads if kind == "read" else self._writes
                    rates.setdefault(what, Rate(SAMPLE_TTL_S)).seed(v)
                elif kind == "floor":
                    self._small_steps.add(0, v)  # no tokens: at the floor whatever the rate
            if kept.get("copy", 0) > 0 and kept.get("copy_fixed", 0) > 0:
                self._copy_kept = (kept["copy"], kept["copy_fixed"])

    def snapshot(self) -> dict[str, float]:
        """The current estimates, for stats: ``prefill_tokens_per_s``, ``step_floor_ms``,
        ``copy_bytes_per_s``, ``copy_fixed_ms`` and ``<source>_read_bytes_per_s``."""
        out: dict[str, float] = {}
        p = self.prefill_rate()
        if p is not None:
            out["prefill_tokens_per_s"] = round(p, 1)
        floor = self.step_floor()
        if floor is not None:
            out["step_floor_ms"] = round(floor * 1e3, 3)
        copy = self._copy_model()
        if copy is not None:
            out["copy_bytes_per_s"], out["copy_fixed_ms"] = round(copy[0]), round(copy[1] * 1e3, 3)
        with self._lock:
            sources = list(self._reads)
        for s in sources:
            r = self.read_rate(s)
            if r is not None:
                out[f"{s}_read_bytes_per_s"] = round(r)
        return out

    # -- the decision -------------------------------------------------------------------

    def plan(self, sources: Sequence[str]) -> Plan:
        """How many leading chunks of a hit to load, ``sources[i]`` being where chunk ``i`` would be
        read from (``memory`` or a source the reads were observed under). Loads everything when the
        prefill rate is not known yet, or cost-aware loading is off; at most ``probe_chunks`` from a
        source not measured yet."""
        n = len(sources)
        prefill = self.prefill_rate()
        if not self.enabled or prefill is None or n == 0:
            return Plan(n, n)
        recompute = self.chunk_tokens / prefill  # seconds one chunk costs the engine
        rates: dict[str, float | None] = {}
        probing: dict[str, int] = {}  # chunks planned from each unmeasured source
        best, best_at, total = 0.0, 0, 0.0
        for i, src in enumerate(sources):
            if src == MEMORY:
                cost = 0.0
            else:
                if src not in rates:
                    rates[src] = self.read_rate(src)
                rate = rates[src]
                if rate is None:
                    if probing.get(src, 0) == self.probe_chunks:
                        break  # enough to measure it: the rest waits for the measurement
                    probing[src] = probing.get(src, 0) + 1
                cost = 0.0 if rate is None else self.chunk_bytes / rate / LOAD_MARGIN
            total += recompute - cost
            if total >= best:
                best, best_at = total, i + 1
        if best_at == n:
            return Plan(n, n)
        why = [
            f"{s} {r / 1e9:.2f} GB/s" for s, r in rates.items() if r is not None and s in sources[best_at:]
        ]
        why += [
            f"{s} not measured yet, {k} chunks read to measure it"
            for s, k in probing.items()
            if s in sources[best_at:]
        ]
        return Plan(best_at, n, f"{', '.join(why)}, prefill {prefill / 1e3:.1f}k tokens/s")


class RateMemo:
    """The estimates of :class:`LoadCosts` per model and device (``key``), in one small JSON file in
    each of ``dirs`` (the storage directory, which survives a reboot, and the pool's, which survives
    the storage directory being emptied). A file that cannot be read or written costs only that:
    the rates are then learned again."""

    NAME = ".hpkv-rates.json"
    # Kept again when an estimate moved by more than this share, at most every MIN_INTERVAL_S.
    MOVED = 0.1
    MIN_INTERVAL_S = 10.0

    def __init__(self, dirs: Sequence[str | None], key: str) -> None:
        self.paths = [os.path.join(d, self.NAME) for d in dirs if d]
        self.key = key
        self._saved: dict[str, float] = {}
        self._last_write = 0.0

    def load(self) -> dict[str, float]:
        for path in self.paths:
            got = self._read(path).get(self.key)
            if isinstance(got, dict):
                kept = {
                    k: float(v)
                    for k, v in got.items()
                    if isinstance(k, str) and isinstance(v, (int, float)) and v > 0
                }
                if kept:
                    self._saved = dict(kept)
                    return kept
        return {}

    @staticmethod
    def _read(path: str) -> dict[str, object]:
        try:
            with open(path) as f:
                table = json.load(f)
        except (OSError, ValueError):
            return {}
        return table if isinstance(table, dict) else {}

    def save(self, rates: dict[str, float], *, force: bool = False) -> None:
        """Keep ``rates`` when one is new (at once: vLLM may kill the engine at any moment), or when one
        moved by more than MOVED since last kept (at most every MIN_INTERVAL_S), or when ``force``."""
        if not self.paths or not rates:
            return
        now = time.monotonic()
        new = any(k not in self._saved for k in rates)
        moved = any(
            abs(v - self._saved.get(k, 0.0)) > self.MOVED * self._saved.get(k, 0.0) for k, v in rates.items()
        )
        if not (force or new or (moved and now - self._last_write >= self.MIN_INTERVAL_S)):
            return
        self._last_write = now
        self._saved = dict(rates)
        for path in self.paths:
            table = self._read(path)
            table[self.key] = {k: float(f"{v:.6g}") for k, v in rates.items()}  # seconds stay > 0
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(table, f)
                os.replace(tmp, path)  # a reader sees the old table or the new, never half
            except OSError as e:
                log.debug("hpkv: rates not kept in %s: %s", path, e)
