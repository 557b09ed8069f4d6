"""What the vLLM scheduler side (scheduler.py) keeps per request and per load or store op.

The request's lookup is the engine's (:class:`hpkv.engine.lookup.Lookup`, with its own phases);
what is vLLM's is how its hit is handed to vLLM, :class:`LoadPhase`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hpkv.core.keys import SHARED_TENANT
from hpkv.engine.lookup import IllegalTransition, Lookup
from hpkv.integrations.vllm.meta import ChunkLoad


class LoadPhase(enum.Enum):
    NONE = "none"  # no load answered to vLLM (or it ended)
    LEASED = "leased"  # a synchronous hit answered; its slots pinned until vLLM allocates blocks
    SCHEDULED = "scheduled"  # blocks allocated: the load goes out with the request's next step
    ASYNC = "async"  # an async hit answered; vLLM has not allocated blocks yet
    ASYNC_LOADING = "async-loading"  # parts go out as chunks arrive, until every rank reported
    ABANDONED = "abandoned"  # vLLM finished the request while its async load was in flight


ALLOWED: dict[LoadPhase, frozenset[LoadPhase]] = {
    LoadPhase.NONE: frozenset({LoadPhase.NONE, LoadPhase.LEASED, LoadPhase.ASYNC}),
    LoadPhase.LEASED: frozenset({LoadPhase.NONE, LoadPhase.SCHEDULED}),
    LoadPhase.SCHEDULED: frozenset({LoadPhase.NONE}),
    LoadPhase.ASYNC: frozenset({LoadPhase.ASYNC, LoadPhase.ASYNC_LOADING, LoadPhase.NONE}),
    LoadPhase.ASYNC_LOADING: frozenset({LoadPhase.NONE, LoadPhase.ABANDONED}),
    LoadPhase.ABANDONED: frozenset({LoadPhase.NONE}),
}


@dataclass
class ReqState:
    lookup: Lookup  # no keys when hpkv does not touch the request (see identity.py)
    prompt_len: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    next_store: int = 0
    load: LoadPhase = LoadPhase.NONE
    lease: list[int] = field(default_factory=list)  # pinned slots of chunks [lease_first, ...)
    lease_first: int = 0
    load_start: int = 0
    load_tokens: int = 0
    async_hit: int = 0  # an async hit's end in tokens, once answered
    async_op: int = 0  # the async load's op, from allocation until every rank reported it
    logged: bool = False  # the lookup's log line was written
    # What the engine's answers said (the lookup's fields are the engine's):
    asked: bool = False  # the engine was asked about the request
    hit_first: int = 0  # the chunk the hit counts from
    hit_tiers: dict[str, int] = field(default_factory=dict)  # chunks of the hit per tier
    since: float = 0.0  # when its tier I/O began
    left_out: frozenset[bytes] = frozenset()  # chunks of the hit left to recompute (cost)

    @property
    def lks(self) -> list[bytes]:
        return self.lookup.lks

    @property
    def tenant(self) -> str:
        return self.lookup.tenant

    def to(self, phase: LoadPhase) -> None:
        if phase not in ALLOWED[self.load]:
            raise IllegalTransition(f"a request's load cannot go from {self.load.value} to {phase.value}")
        self.load = phase

    def chunk_blocks(self, j: int, per_chunk: int) -> list[int]:
        """Chunk ``j``'s blocks, group after group (see kvgroups.py)."""
        return [b for ids in self.block_ids for b in ids[j * per_chunk : (j + 1) * per_chunk]]

    def leased_chunks(self, chunk: int, block: int) -> list[ChunkLoad]:
        """A synchronous load's chunks: each leased slot's share of the tokens to load, and its blocks."""
        per_chunk, end = chunk // block, self.load_start + self.load_tokens
        out = []
        for n, slot in enumerate(self.lease):
            j = self.lease_first + n
            lo, hi = max(j * chunk, self.load_start), min((j + 1) * chunk, end)
            if hi > lo:
                blocks = self.chunk_blocks(j, per_chunk)
                out.append(ChunkLoad(slot, self.lks[j], blocks, lo - j * chunk, hi - lo))
        return out


@dataclass
class Op:
    kind: str  # "load" | "store"
    slots: list[int]
    lk: bytes = b""
    remaining: int = 0
    failed: bool = False
    tokens: int = 0
    tenant: str = SHARED_TENANT
    req_id: str = ""
    since: float = field(default_factory=time.monotonic)
