"""The engine's one interface: what an adapter (vLLM's scheduler, the in-process path under
:class:`hpkv.KVStore` and SGLang's backend) may call, and the typed results it gets back.

:class:`Engine` is the core every adapter uses: keys and existence, the lookup and its load, the
store pair, reset, stats and close. Beside it, each adapter takes the one interface its engine
needs: :class:`EngineSteps` (an engine with a step loop: vLLM), :class:`InProcessCopies` (a caller
that holds the bytes in this process: the library, SGLang) and :class:`Upkeep` (the pool files, the
write-behind's progress, flush and stop).

An adapter holds such an engine and :class:`~hpkv.engine.lookup.Lookup` handles. It reads of a
Lookup only what the caller gave it (``lks``, ``tenant``) and :meth:`Lookup.pending_io`; what a
call did is in its result (:class:`Asked` on every answer, :class:`Arrivals`), never in the
engine's fields. ``tests/engine/test_adapters.py`` fails when an adapter reaches past this.

Every call may be made from any thread and is lightweight unless it says it blocks: the lookup and
the store pairs never wait on I/O (a lookup waits for its own I/O only until its ``wait_until``).
"""

from __future__ import annotations

import abc
import enum
import mmap
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from hpkv.core.keys import SHARED_TENANT as SHARED
from hpkv.core.keys import Tokens
from hpkv.engine.costs import LoadCosts

MEMORY = "memory"  # the memory tier's name (in stats, Hit.tiers and clear)


class Why(enum.StrEnum):
    """Why a lookup is pending (ask again)."""

    LOCATING = "locating"  # what the tiers below memory hold, asked on an I/O thread
    ROOM = "room"  # pool slots other work holds for a while
    PROMOTIONS = "promotions"  # the hit's chunks below memory are being read into memory


class Refused(enum.Enum):
    """Why a store hands out no target."""

    HELD = "held"  # memory or a slower tier holds the chunk, or a store of it is in flight
    NO_ROOM = "no room"  # every slot pinned and no slower tier to write to instead (counted)


# A store's target: a reserved pool slot (every served rank's), or one rank's private record (no
# memory tier, or no slot to spare) that the write-behind writes to the slower tiers.
StoreTarget = int | mmap.mmap
Reserved = StoreTarget | Refused
HELD, NO_ROOM = Refused.HELD, Refused.NO_ROOM


@dataclass(frozen=True)
class Cut:
    """A hit found with more chunks than are worth loading: ``loaded`` of ``found`` chunks are
    loaded, ``left_out`` (their keys) are left to the engine to recompute; ``why``: the cost
    model's rates."""

    loaded: int
    found: int
    left_out: frozenset[bytes]
    why: str


@dataclass(frozen=True)
class Asked:
    """What one ask of :meth:`Engine.lookup` did besides its answer."""

    waited: int = 0  # waits for the lookup's own I/O (its ``wait_until``)
    waited_for_room: bool = False  # it began waiting for pool room
    found: bool = False  # the hit was found and cut in this ask (see ``cut``, ``used_ahead``)
    used_ahead: bool = False  # it used the check :meth:`Engine.look_ahead` made
    cut: Cut | None = None  # the hit was cut by cost (with ``found``)
    # Every promotion of a staged hit settled in this ask: their futures, and when its I/O began.
    promotions: tuple[Future[bool], ...] = ()
    since: float = 0.0


NOTHING = Asked()


@dataclass(frozen=True)
class Miss:
    """Nothing to load from the asked position on."""

    asked: Asked = NOTHING


@dataclass(frozen=True)
class Pending:
    """Tier I/O still runs; ask again."""

    why: Why
    asked: Asked = NOTHING


@dataclass(frozen=True)
class Hit:
    """``chunks`` chunks from chunk ``first`` on. ``slots``: their pinned memory slots (empty for a
    streamed hit, whose chunks come from :meth:`Engine.arrivals`); the caller releases them with
    :meth:`Engine.finish_load`. ``tiers``: chunks of the hit per tier that held them when found
    (after staging: per tier, those that arrived). ``since``: when its tier I/O began."""

    first: int
    chunks: int
    slots: list[int] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)
    streaming: bool = False
    since: float = 0.0
    asked: Asked = NOTHING


Answer = Hit | Pending | Miss


@dataclass
class Arrivals:
    """One look at a streamed hit: the chunks (index in the hit, pinned slot) that reached memory
    since the last look (``resident``: those of them that were in memory when found), the indexes
    of those that never will (a failed promotion, I/O given up, the request gone; every chunk after
    the first failure fails too), with ``private``, the indexes of chunks that reach no slot for a
    caller to read itself (:meth:`Engine.read_private`), and how many are still read."""

    ready: list[tuple[int, int]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    unslotted: list[int] = field(default_factory=list)
    resident: set[int] = field(default_factory=set)
    waiting: int = 0


class Engine(abc.ABC):
    """What is cached where, and every move between tiers (see :mod:`hpkv.engine.catalog`)."""

    chunk_size: int  # tokens per chunk
    payload_bytes: int  # one rank's bytes of one chunk's KV
    costs: LoadCosts  # what loads cost against recomputing (measured; see hpkv.engine.costs)

    # -- keys and existence ---------------------------------------------------------

    @abc.abstractmethod
    def keys(
        self,
        tokens: Tokens,
        limit: int | None = None,
        seed: bytes | None = None,
        extras: list[bytes | None] | None = None,
    ) -> list[bytes]:
        """Keys of the full chunks of ``tokens`` (``seed``/``extras``: a request's identity beyond its
        tokens, see :mod:`hpkv.core.keys`)."""

    @abc.abstractmethod
    def locate(self, lks: Iterable[bytes], tenant: str = SHARED, *, remote: bool = True) -> list[str | None]:
        """Per key the fastest tier that holds it; None from the first key no tier holds onwards.
        Nothing is protected, promoted or counted. ``remote=False``: memory and the local tiers'
        indexes only, and no cut at a gap. Blocks for the remote tiers' answer."""

    # -- the lookup and the load --------------------------------------------------------

    @abc.abstractmethod
    def look_ahead(self, lk: Any) -> None:
        """The request was queued: ask now, off the caller's thread, what its first lookup will need
        to know. Never blocks."""

    @abc.abstractmethod
    def lookup(
        self,
        lk: Any,
        first: int = 0,
        *,
        wait_until: float | None = None,
        defer: bool = False,
        stream: Callable[[int, int], bool] | None = None,
        probe: bool = True,
    ) -> Answer:
        """The hit of ``lk`` from chunk ``first`` on: :class:`Hit` (its slots pinned for the caller),
        :class:`Pending` (ask again) or :class:`Miss`; each with what the ask did (:class:`Asked`).
        ``wait_until`` (``time.monotonic``): wait for the lookup's own I/O until then. ``defer``:
        promotions read only from :meth:`start_deferred` on. ``stream(below, chunks)``: whether to
        answer a hit of ``chunks`` chunks, ``below`` of them below memory, as a streamed Hit.
        ``probe=False``: the caller has just checked existence itself."""

    @abc.abstractmethod
    def arrivals(
        self,
        lk: Any,
        *,
        give_up: bool = False,
        gone: bool = False,
        private: bool = False,
        wait_until: float | None = None,
    ) -> Arrivals:
        """A streamed hit's chunks that reached memory since the last call, each pinned for the
        caller, and those that never will (``give_up``: stop waiting; ``gone``: hand nothing out).
        ``private``: the caller reads a chunk that reaches no slot itself (see :class:`Arrivals`).
        ``wait_until``: wait until then for a first arrival when none is in (default: never wait)."""

    @abc.abstractmethod
    def finish_load(self, slots: Iterable[int], *, loaded: int = 0, nbytes: int = 0) -> None:
        """The caller is done with pinned ``slots``; ``loaded`` chunks of ``nbytes`` (every rank's)
        were copied out of them (counted as memory hits)."""

    @abc.abstractmethod
    def release(self, lk: Any) -> None:
        """End ``lk`` in any phase: its protection goes and nothing it awaits is handed out."""

    @abc.abstractmethod
    def start_deferred(self) -> int:
        """Start the promotions that lookups with ``defer`` staged; how many."""

    # -- stores -------------------------------------------------------------------------

    @abc.abstractmethod
    def begin_stores(
        self,
        lks: Sequence[bytes],
        tenant: str = SHARED,
        *,
        rewrite: Container[bytes] = (),
        private: bool = False,
    ) -> list[Reserved]:
        """Where to put each new chunk: a reserved slot (the caller fills and seals every served
        rank's record in it, then :meth:`finish_stores`), with ``private`` and no slot to spare a
        private record of the first served rank, or why not (:class:`Refused`). ``rewrite``: keys
        to store even where a slower tier holds them. Never blocks."""

    @abc.abstractmethod
    def finish_stores(self, done: Sequence[tuple[bytes, StoreTarget, bool, str]]) -> list[bool]:
        """Each ``(lk, target, ok, tenant)`` that :meth:`begin_stores` handed out is filled and
        sealed (``ok``) or given up: per store, whether the chunk is now held (visible in memory, or
        queued for the slower tiers). Never blocks."""

    # -- housekeeping ----------------------------------------------------------------------

    @abc.abstractmethod
    def clear(self, tiers: tuple[str, ...] | None = None) -> None:
        """Forget the chunks of the named tiers; default: memory and the local tiers (a remote one
        only when named: it is shared)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier counters (see :meth:`hpkv.engine.catalog.Catalog.stats`)."""

    @abc.abstractmethod
    def close(self, limit: float | None = None) -> None:
        """Write what is queued (for at most ``limit`` seconds), stop, close every tier. Idempotent."""


class EngineSteps(abc.ABC):
    """How an engine with a step loop (vLLM's scheduler) tells hpkv when it computes, so that the
    write-behind and the promotions stay out of its steps."""

    @abc.abstractmethod
    def step_scheduled(self, computes: bool) -> None:
        """The engine scheduled a step, computing or not (the write-behind waits for idle time)."""

    @abc.abstractmethod
    def step_done(self, computed: bool | None = None) -> None:
        """A scheduled step's output is back."""

    @property
    @abc.abstractmethod
    def engine_busy_now(self) -> bool:
        """Whether the engine computes a step now, as announced."""


class InProcessCopies(abc.ABC):
    """For a caller that holds the bytes in this process (the library, SGLang): the records behind
    the slots :meth:`Engine.lookup` and :meth:`Engine.begin_stores` hand out."""

    @abc.abstractmethod
    def slot_payload(self, slot: int, lk: bytes) -> torch.Tensor | None:
        """The first served rank's payload of ``lk`` in pinned ``slot``, its header checked (a slot
        holds only verified records or the engine's own KV), or None (the chunk is dropped and the
        slot released)."""

    @abc.abstractmethod
    def store_record(self, target: StoreTarget) -> memoryview:
        """The first served rank's record in a store's target, to fill (its payload after
        ``record.HEADER_BYTES``) and seal (:meth:`seal`)."""

    @abc.abstractmethod
    def seal(self, lk: bytes, rec: memoryview) -> None:
        """Write the header of the first served rank's record of ``lk`` whose payload is filled."""

    @abc.abstractmethod
    def read_private(self, lk: bytes, tenant: str = SHARED) -> torch.Tensor | None:
        """The first served rank's verified record of ``lk`` read from the slower tiers into this
        thread's buffer (valid until its next call), or None. Blocks for the read."""

    @abc.abstractmethod
    def read_direct(self, lks: list[bytes], pieces: list[list[memoryview]]) -> list[bool | None]:
        """The first served rank's payload of each of ``lks`` from a local file straight into its
        ``pieces``, the batch in one native call: per chunk True (verified), False (it failed its
        check), None (not tried). Blocks for the reads."""

    @abc.abstractmethod
    def run_io(self, fn: Callable[..., object], *args: object) -> Future[object]:
        """Run ``fn`` on one of the engine's ``io_threads`` I/O threads."""

    io_threads: int


class Upkeep(abc.ABC):
    """What an engine's process does around the data path: the pool files its workers map, the
    write-behind's progress, a flush and a stop."""

    @property
    @abc.abstractmethod
    def pool_paths(self) -> list[str]:
        """Per served rank, the memory pool's file."""

    @abc.abstractmethod
    def unlink_pool_files(self) -> None:
        """Every process that needs the pool files has mapped them: remove their names."""

    @abc.abstractmethod
    def write_behind(self) -> dict[str, int]:
        """The write-behind's progress: written, delay_max_ms, delay_last_ms, pending."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Wait for every queued write-behind and every promotion. Blocks."""

    @abc.abstractmethod
    def stopping(self) -> None:
        """The engine is stopping: the write-behind writes at once from now on."""


class InProcessEngine(Engine, InProcessCopies, abc.ABC):
    """The engine as the library and SGLang's backend use it (:mod:`hpkv.integrations.library`)."""


class SteppedEngine(Engine, EngineSteps, Upkeep, abc.ABC):
    """The engine as vLLM's scheduler uses it (:mod:`hpkv.integrations.vllm.scheduler`)."""
