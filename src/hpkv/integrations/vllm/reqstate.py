"""What the vLLM scheduler side (scheduler.py) keeps per request and per load or store op."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from hpkv.core.keys import SHARED_TENANT
from hpkv.integrations.vllm.arrival import ArrivalCheck
from hpkv.integrations.vllm.meta import ChunkLoad


@dataclass
class ReqState:
    lks: list[bytes]  # empty when hpkv does not touch the request (see identity.py)
    prompt_len: int
    tenant: str = SHARED_TENANT
    block_ids: list[int] = field(default_factory=list)
    next_store: int = 0
    lease: list[int] = field(default_factory=list)  # pinned slots of chunks [lease_first, ...)
    lease_first: int = 0
    load_start: int = 0
    load_tokens: int = 0
    pending_load: bool = False
    # The lookup, in the order it happens (never waiting: see get_num_new_matched_tokens):
    where: list[str | None] | None = None  # tier per chunk from looked_from on (None: no tier)
    looked_from: int = 0
    probe: Future[list[str | None]] | None = None  # the remote tiers' answer for the local gaps
    probe_at: list[int] = field(default_factory=list)
    arrival: ArrivalCheck | None = None  # the remote tiers asked when vLLM queued the request
    cut: int = -1  # chunks of the hit (from looked_from), once cut at the first gap
    waited_for_room: bool = False
    stage_started: bool = False
    staging: list[Future[bool]] = field(default_factory=list)
    staging_since: float = 0.0
    staged: bool = False
    tiers: dict[str, int] = field(default_factory=dict)
    protected: list[bytes] = field(default_factory=list)  # kept from eviction while staging
    # Where each chunk of the hit below memory is read from (engine/costs.py's sources), and the
    # promotions of the load, whose timings measure those sources once they are all in.
    sources: dict[bytes, str] = field(default_factory=dict)
    promotions: list[Future[bool]] = field(default_factory=list)
    left_out: set[bytes] = field(default_factory=set)  # chunks of the hit left to the engine (costs)
    # vLLM's async load (config.async_load: see HpkvScheduler._load_async): the hit's end in
    # tokens once answered; the chunks not yet sent to the workers (index, their promotion or None
    # for a chunk in memory); the load op from allocation until every rank reported it.
    async_hit: int = 0
    async_wait: list[tuple[int, Future[bool] | None]] = field(default_factory=list)
    async_op: int = 0
    finished: bool = False  # vLLM finished (aborted) the request while its async load was in flight

    def hit_end(self, chunk: int) -> int:
        """Where the hit the lookup cut ends, in tokens (the engine computes at least the last one)."""
        return min((self.looked_from + len(self.protected)) * chunk, self.prompt_len - 1)

    def leased_chunks(self, chunk: int, block: int) -> list[ChunkLoad]:
        """A synchronous load's chunks: each leased slot's share of the tokens to load, and its blocks."""
        per_chunk, end = chunk // block, self.load_start + self.load_tokens
        out = []
        for n, slot in enumerate(self.lease):
            j = self.lease_first + n
            lo, hi = max(j * chunk, self.load_start), min((j + 1) * chunk, end)
            if hi > lo:
                blocks = self.block_ids[j * per_chunk : (j + 1) * per_chunk]
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
