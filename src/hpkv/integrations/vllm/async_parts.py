"""One step's part of an async load (vLLM's async KV load, ``HPKV_ASYNC_LOAD``).

The scheduler answers the hit at once and then, step by step, sends the workers each chunk once it is
in memory (at once for a chunk that already was; after its promotion for the others). This module
decides one step's part from the chunks still awaited; the scheduler (scheduler.py) keeps the request's
state and the load op.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hpkv.integrations.vllm.meta import ChunkLoad

if TYPE_CHECKING:
    from hpkv.engine.catalog import Catalog

# A chunk still awaited: its index in the hit (from the lookup's first chunk) and its promotion
# (None: it was in memory when the hit was answered).
Awaited = tuple[int, "Future[bool] | None"]


@dataclass
class Part:
    chunks: list[ChunkLoad] = field(default_factory=list)  # in memory now, pinned for the copy
    failed_blocks: list[int] = field(default_factory=list)  # blocks of chunks that will never come
    waiting: list[Awaited] = field(default_factory=list)  # still being read
    lost_tokens: int = 0  # tokens of the failed chunks (the op loads that many fewer)


def next_part(
    catalog: Catalog,
    awaited: list[Awaited],
    lks: list[bytes],
    first_chunk: int,
    block_ids: list[int],
    load: tuple[int, int],
    sizes: tuple[int, int],
    *,
    give_up: bool,
    finished: bool,
) -> Part:
    """The chunks of ``awaited`` that reached memory since the last part, pinned (the caller's op
    unpins them once every rank has copied), and the blocks of those that never will: a failed
    promotion, tier I/O given up (``give_up``), or a request vLLM finished (``finished``: nothing is
    sent any more). After the first failure every later chunk fails too: vLLM recomputes from the
    first failed block anyway. ``load``: the tokens [start, end) to load; ``sizes``: chunk and block
    size in tokens. Called on the scheduler's thread; never waits."""
    C, bs = sizes
    per_chunk = C // bs
    start, end = load
    part = Part()
    failing = False
    for i, fut in awaited:
        j = first_chunk + i
        lo, hi = max(j * C, start), min((j + 1) * C, end)
        blocks = block_ids[j * per_chunk : (j + 1) * per_chunk]
        arrived = fut is None or fut.done()
        if not failing and not arrived and not give_up:
            part.waiting.append((i, fut))
            continue
        # In memory (and kept there: protected) unless its promotion failed or was given up.
        ok = not failing and not finished and arrived and (fut is None or fut.result())
        slots = catalog.pin([lks[j]]) if ok else []
        if not slots or hi <= lo:
            catalog.unpin(slots)
            if not slots:
                failing = True
                part.failed_blocks.extend(blocks[(lo - j * C) // bs : -(-(hi - j * C) // bs)])
                part.lost_tokens += max(0, hi - lo)
            continue
        part.chunks.append(ChunkLoad(slots[0], lks[j], blocks, lo - j * C, hi - lo))
    return part
