"""The worker's side of vLLM's async load on CUDA: when it reports a request received.

A request loading asynchronously is not scheduled until every rank says its copies landed. In a step
that computes nothing, the worker waits for the last part's copies and says so in that step; in a
step that computes, it only asks the events, never holding the step for a load. Runs on the device
machine (`make test-gpu` there); elsewhere skipped with a reason naming the missing GPU.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from hpkv import HpkvConfig
from hpkv.core import record
from hpkv.core.keys import Namespace, record_key
from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.meta import ChunkLoad, HpkvMeta, LoadRequest
from hpkv.integrations.vllm.worker import HpkvWorker
from hpkv.tiers.memory.pool import agreed_pool_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: none found")

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CHUNK, BLOCK, BLOCKS = 64, 16, 64
SIZE = 32 << 20
SLOW_CYCLES = 600_000_000  # a copy stream busy for a few hundred milliseconds: a slow link


@pytest.fixture
def worker() -> Iterator[HpkvWorker]:
    shm = f"/dev/shm/hpkv-wasync-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    path = agreed_pool_path(shm, os.getpid(), "w0e00r0")
    assert path is not None
    cfg = HpkvConfig(mem_pool_size=SIZE, share_mem_file_path=shm, chunk_size=CHUNK)
    w = HpkvWorker(
        Namespace("wasync", LAYOUT, CHUNK), CHUNK, BLOCK, "FLASH_ATTN", start_pool=path, config=cfg
    )
    H, D = LAYOUT.num_kv_heads, LAYOUT.head_dim
    # FlashAttention's physical [blocks, block, heads, 2*D] per layer, in vLLM's logical order
    w.register_kv_caches(
        [
            torch.zeros(BLOCKS, BLOCK, H, 2 * D, dtype=LAYOUT.dtype, device="cuda").permute(0, 2, 1, 3)
            for _ in range(LAYOUT.num_layers)
        ]
    )
    assert w.pool is not None
    yield w
    w.shutdown()
    for name in os.listdir(shm):
        os.unlink(os.path.join(shm, name))
    os.rmdir(shm)


def sealed_chunk(w: HpkvWorker, slot: int, lk: bytes, seed: int) -> torch.Tensor:
    """A verified record of ``lk`` in pool slot ``slot``; returns its payload."""
    assert w.pool is not None
    off = slot * w.slot_bytes
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (w.payload_bytes,), dtype=torch.uint8, generator=g)
    w.pool.tensor[off + record.HEADER_BYTES : off + record.HEADER_BYTES + w.payload_bytes].copy_(payload)
    rec = w.pool.view[off : off + w.record_bytes]
    record.seal(rec, w.rank_digest, record_key(w.rank_digest, lk), w.payload_bytes)
    return payload


def part(op: int, chunks: list[ChunkLoad], *, last: bool) -> LoadRequest:
    return LoadRequest(
        op, f"req{op}", chunks, 4 * CHUNK, 2 * CHUNK, {"storage": 2}, asynchronous=True, last=last
    )


def chunk(slot: int, lk: bytes, first_block: int) -> ChunkLoad:
    per = CHUNK // BLOCK
    return ChunkLoad(slot, lk, list(range(first_block, first_block + per)), 0, CHUNK)


@pytest.mark.parametrize("computes", [False, True])
def test_an_async_load_is_reported_in_its_last_step_only_when_the_step_computes_nothing(
    worker: HpkvWorker, computes: bool
) -> None:
    w = worker
    assert w.pool is not None and w.mover is not None
    paths = [w._pool_path]
    payloads = [sealed_chunk(w, s, bytes([s]) * 16, seed=s) for s in (0, 1)]
    w.start_load(HpkvMeta(paths, SIZE, loads=[part(1, [chunk(0, bytes([0]) * 16, 0)], last=False)]))
    assert w.finished_loads() == set()  # more parts to come
    with torch.cuda.stream(w.mover.copy_stream):
        torch.cuda._sleep(SLOW_CYCLES)  # type: ignore[no-untyped-call]  # the last part's copy waits behind this
    w.start_load(
        HpkvMeta(paths, SIZE, loads=[part(1, [chunk(1, bytes([1]) * 16, 4)], last=True)], computes=computes)
    )
    first = w.finished_loads()
    if computes:
        assert first == set(), "a computing step waited for an async load's copies"
        torch.cuda.synchronize()
        assert w.finished_loads() == {"req1"}
    else:
        assert first == {"req1"}, "the last part's copies were not waited for in an idle step"
    assert w.finished_loads() == set()  # reported once
    assert w.take_results().results == {1: (1, 0)}
    got = torch.empty(w.payload_bytes, dtype=torch.uint8)
    assert w.paged is not None
    for n, blocks in enumerate(([0, 1, 2, 3], [4, 5, 6, 7])):
        w.paged.gather(got, blocks)
        torch.cuda.synchronize()
        assert torch.equal(got, payloads[n])
