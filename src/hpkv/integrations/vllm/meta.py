"""What the scheduler-side connector tells the workers each step, and what they answer.

Plain dataclasses of ints, bytes and lists: vLLM carries them between its own
processes; hpkv never reads them back from disk or the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkLoad:
    slot: int  # pool slot holding the chunk (same slot in every rank's pool)
    lk: bytes  # logical key; each rank derives its record key from it
    block_ids: list[int]  # engine blocks holding the chunk's tokens, in order, group after group
    first: int  # first token of the chunk to copy (a multiple of the block size)
    count: int  # tokens to copy


@dataclass
class LoadRequest:
    op_id: int
    req_id: str
    chunks: list[ChunkLoad]
    prompt_tokens: int
    requested_tokens: int
    tiers: dict[str, int]  # chunks by the tier they came from (before staging into memory)
    # vLLM's async load: the op arrives in parts, one per step, each with the chunks that reached
    # memory since the last; the worker reports the request received once the ``last`` part's
    # copies landed. ``failed_blocks``: blocks of chunks that will never come (a failed promotion),
    # reported to vLLM as load errors, so it recomputes from the first of them.
    asynchronous: bool = False
    last: bool = True
    failed_blocks: list[int] = field(default_factory=list)
    since: float = 0.0  # time.monotonic() of the lookup (same host): the async load's log line


@dataclass
class StoreChunk:
    op_id: int
    slot: int
    lk: bytes
    block_ids: list[int]


@dataclass
class HpkvMeta(KVConnectorMetadata):
    pool_paths: list[str]
    pool_size: int
    loads: list[LoadRequest] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)
    computes: bool = False  # the step has tokens to compute (echoed back in the workers' report)


@dataclass
class HpkvWorkerMeta(KVConnectorWorkerMetadata):
    """Per op id: (ranks that completed it, ranks that failed it); ``attached``: ranks that mapped
    their pool file since the last report (once every rank has, the scheduler unlinks the files);
    ``computed``: the step this report ends computed tokens. Every step sends one: vLLM hands an
    empty step's output to the connector only when a worker has something to say, and the
    scheduler counts the computing steps still out by their answers."""

    results: dict[int, tuple[int, int]] = field(default_factory=dict)
    attached: int = 0
    computed: bool = False
    # (bytes, seconds) of each rank's synchronous loads since the last report, the copies' own time:
    # what a load costs the engine (engine/costs.py).
    copies: list[tuple[int, float]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, HpkvWorkerMeta):
            return self
        merged = dict(self.results)
        for op, (ok, bad) in other.results.items():
            a, b = merged.get(op, (0, 0))
            merged[op] = (a + ok, b + bad)
        return HpkvWorkerMeta(
            merged,
            self.attached + other.attached,
            self.computed or other.computed,
            self.copies + other.copies,
        )
