"""The CUDA mover against raw copies measured in the same run (run on a machine with a GPU).

    python -m bench.gpu [--tokens 8192] [--repeat 10]

A 7B-shaped KV (28 layers, 4 KV heads x 128, bf16: 448 MiB per 8192 tokens) in a
shared-memory pool registered with CUDA, and vLLM-style paged GPU KV
(FlashAttention token-major blocks, one allocation per layer), block sizes 16 and 64:

* load  (pool -> paged GPU KV, the mover)  vs  raw pinned H2D of the same bytes (one copy)
* store (paged GPU KV -> pool, the mover)  vs  raw D2H of the same bytes into the pool
* layer-wise load: time until layer 0 is usable, and until all layers are
* pageable H2D (an unregistered buffer), to show what registration buys

Medians of ``--repeat``; ratios are what to read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import torch

from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.mover import LoadItem, Mover, StoreItem
from hpkv.integrations.vllm.paged import PagedKV
from hpkv.tiers.memory.pool import PAGE, ShmPool

LAYOUT = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
CHUNK = 256


def timed(fn: Callable[[], object], repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    n_chunks = a.tokens // CHUNK
    nbytes = LAYOUT.chunk_bytes(CHUNK)
    slot = -(-nbytes // PAGE) * PAGE
    total = n_chunks * nbytes
    path = f"/dev/shm/hpkv-bench-gpu-{uuid.uuid4().hex[:8]}.shm"
    pool = ShmPool(path, n_chunks * slot + (64 << 20))
    print(
        f"{torch.cuda.get_device_name()}: {n_chunks} chunks x {nbytes / 2**20:.1f} MiB = "
        f"{total / 2**20:.0f} MiB (28 layers, 4 KV heads x 128, bf16, {a.tokens} tokens); "
        f"medians of {a.repeat}"
    )
    try:
        for bs in (16, 64):
            _run(pool, dev, bs, n_chunks, nbytes, slot, total, a.repeat)
    finally:
        pool.close()
        if os.path.exists(path):
            os.unlink(path)
    return 0


def _run(
    pool: ShmPool, dev: torch.device, bs: int, n_chunks: int, nbytes: int, slot: int, total: int, repeat: int
) -> None:
    L = LAYOUT
    per = CHUNK // bs
    num_blocks = n_chunks * per * 2 + 8
    caches = [
        torch.randn(num_blocks, bs, L.num_kv_heads, 2 * L.head_dim, device=dev)
        .to(L.dtype)
        .permute(0, 2, 1, 3)
        for _ in range(L.num_layers)
    ]
    paged = PagedKV(caches, bs, L, "FLASH_ATTN")
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[i * per : (i + 1) * per] for i in range(n_chunks)]
    payloads = [pool.tensor[i * slot : i * slot + nbytes] for i in range(n_chunks)]
    region = pool.tensor[: n_chunks * slot]
    gpu_buf = torch.empty(n_chunks * slot, dtype=torch.uint8, device=dev)

    mover = Mover(paged)
    mover.attach_pool(pool.tensor)
    assert mover.pinned, "the pool could not be registered"
    raw_h2d = timed(lambda: gpu_buf.copy_(region, non_blocking=True), repeat)
    raw_d2h = timed(lambda: region.copy_(gpu_buf, non_blocking=True), repeat)
    loads = [LoadItem(p, t, 0, CHUNK) for p, t in zip(payloads, tables, strict=True)]
    stores = [StoreItem(p, t) for p, t in zip(payloads, tables, strict=True)]

    def load() -> None:
        mover.load(loads)
        mover.finish_loads()

    def store() -> None:
        mover.store(stores, lambda: None)
        mover.flush()

    t_load = timed(load, repeat)
    t_store = timed(store, repeat)
    kernel_path = paged.use_kernels
    paged.use_kernels = False  # the torch path (per layer and K/V indexing), for comparison
    t_load_torch = timed(load, repeat)
    t_store_torch = timed(store, repeat)
    paged.use_kernels = kernel_path
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    mover.load(loads)
    t_enqueue = time.perf_counter() - t0
    mover.finish_loads()
    # The device-local halves alone (no PCIe): gather into / scatter from a GPU staging buffer.
    staged = torch.empty(n_chunks, nbytes, dtype=torch.uint8, device=dev)
    t_gather = timed(lambda: paged.gather_many(staged, tables), repeat)
    specs = [(t, 0, CHUNK) for t in tables]
    t_scatter = timed(lambda: paged.scatter_many(staged, specs), repeat)
    mover.close()

    lw = Mover(paged, layerwise=True)
    lw.attach_pool(pool.tensor)
    firsts, alls = [], []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        seen: list[float] = []

        def poll(t0: float, seen: list[float] = seen) -> None:  # layer 0 done, while the rest is enqueued
            while not lw._layer_events:
                time.sleep(0)
            ev = lw._layer_events[0]
            while not ev.query():
                time.sleep(0)
            seen.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        poller = threading.Thread(target=poll, args=(t0,))
        poller.start()
        lw.load(loads)
        lw._pending_load.synchronize()
        alls.append(time.perf_counter() - t0)
        poller.join()
        lw.finish_loads()
        firsts.append(seen[0])
    lw.close()

    pageable = torch.empty(n_chunks * slot, dtype=torch.uint8)
    pageable.fill_(1)
    t_pageable = timed(lambda: gpu_buf.copy_(pageable, non_blocking=True), repeat)

    gb = total / 1e9
    raw = n_chunks * slot / 1e9  # the raw copies move the slot-padded region: compare rates
    h2d, d2h = raw / raw_h2d, raw / raw_d2h
    print(f"\nblock size {bs}:")
    print(f"  raw pinned H2D {h2d:6.1f} GB/s  raw D2H {d2h:6.1f} GB/s  pageable {raw / t_pageable:6.1f} GB/s")
    print(f"  device-local   gather {gb / t_gather:7.1f} GB/s   scatter {gb / t_scatter:7.1f} GB/s")
    lr, sr = gb / t_load, gb / t_store
    print(f"  mover load     {lr:6.1f} GB/s = {lr / h2d:4.2f}x raw H2D ({t_load * 1e3:.1f} ms)")
    print(f"  mover store    {sr:6.1f} GB/s = {sr / d2h:4.2f}x raw D2H ({t_store * 1e3:.1f} ms)")
    print(
        f"  ({'Triton kernels' if kernel_path else 'torch indexing (no Triton)'}; host enqueue of a load "
        f"{t_enqueue * 1e3:.1f} ms; with torch indexing instead: load {gb / t_load_torch / h2d:4.2f}x, "
        f"store {gb / t_store_torch / d2h:4.2f}x)"
    )
    print(
        f"  layer-wise load  layer 0 usable after {statistics.median(firsts[1:]) * 1e3:.2f} ms, "
        f"all {statistics.median(alls[1:]) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    raise SystemExit(main())
