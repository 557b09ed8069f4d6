"""What a memory hit's copies cost on the GPU, outside vLLM: the mover's load against a pinned copy.

One prompt of the 7B shape (32 chunks of 256 tokens, 28 layers, 4 KV heads x 128, bf16, blocks of
64 tokens, FlashAttention's layout) is loaded from pool slots into paged KV, timed with CUDA events:

* ``pinned 1x``: the whole prompt in one copy from ``pin_memory`` host memory (the bench's reference);
* ``pinned 32x``: the same bytes as 32 copies of one chunk each;
* ``shm 32x``: 32 chunk copies from a shared-memory pool file page-locked with cudaHostRegister
  (where hpkv's pool lives), straight into device memory, no scatter;
* ``mover gN``: :meth:`Mover.load` (staging in groups of N chunks, the last N in halves, then the
  scatter into blocks); ``mover g8 flat``: groups of 8 to the end;
* ``hit``: the load of a hit as vLLM asks for it (its last chunk ends one token short, in a
  partial block);
* ``tail``: a 63-token load (a partial block), what a GPU-hit row would load.

    python3 scripts/gpu/probe_copy.py [ROUNDS]    (with hpkv importable)
"""

from __future__ import annotations

import os
import statistics
import sys
import uuid

import torch

from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm import mover as mover_mod
from hpkv.integrations.vllm.mover import LoadItem, Mover
from hpkv.integrations.vllm.paged import PagedKV
from hpkv.tiers.memory.pool import PAGE, ShmPool

LAYERS, HEADS, DIM, BS, CHUNK, CHUNKS = 28, 4, 128, 64, 256, 32


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn`` on the current stream, by CUDA events."""
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16, num_kv=2)
    nbytes = layout.chunk_bytes(CHUNK)
    per = CHUNK // BS
    blocks = CHUNKS * per * 2 + 8
    caches = [
        torch.zeros(blocks, BS, HEADS, 2 * DIM, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
        for _ in range(LAYERS)
    ]
    paged = PagedKV(caches, BS, layout, "FLASH_ATTN")
    slot = -(-(nbytes + PAGE) // PAGE) * PAGE
    path = f"/dev/shm/hpkv-probe-{uuid.uuid4().hex[:8]}.shm"
    pool = ShmPool(path, slot * CHUNKS, prefault=False)
    total = nbytes * CHUNKS
    try:
        mv = Mover(paged)
        mv.attach_pool(pool.tensor)
        mv.warm_up(CHUNK)
        payloads = [pool.tensor[i * slot + PAGE : i * slot + PAGE + nbytes] for i in range(CHUNKS)]
        for p in payloads:
            p.fill_(3)
        perm = torch.randperm(blocks - 8).add(8).tolist()
        ids = [perm[i * per : (i + 1) * per] for i in range(CHUNKS)]
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(1)
        dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        out: dict[str, float] = {}

        def pinned1() -> None:
            dev.copy_(pinned, non_blocking=True)

        def pinned32() -> None:
            for i in range(CHUNKS):
                part = slice(i * nbytes, (i + 1) * nbytes)
                dev[part].copy_(pinned[part], non_blocking=True)

        def shm32() -> None:
            for i in range(CHUNKS):
                dev[i * nbytes : (i + 1) * nbytes].copy_(payloads[i], non_blocking=True)

        def mover_load(items: list[LoadItem]):  # type: ignore[no-untyped-def]
            def run() -> None:
                mv.load(items)
                mv.finish_loads()

            return run

        whole = [LoadItem(payloads[i], ids[i], 0, CHUNK) for i in range(CHUNKS)]
        tail = [LoadItem(payloads[CHUNKS - 1], ids[CHUNKS - 1], 192, 63)]
        hit = [*whole[:-1], LoadItem(payloads[CHUNKS - 1], ids[CHUNKS - 1], 0, CHUNK - 1)]
        cases = {"pinned 1x": pinned1, "pinned 32x": pinned32, "shm 32x": shm32}
        for _ in range(2):  # interleaved rounds
            for name, fn in cases.items():
                out.setdefault(name, 0.0)
                out[name] = timed(fn, rounds)
            for g in (2, 4, 8, 16, 32):
                mover_mod.GROUP_CHUNKS = g
                out[f"mover g{g}"] = timed(mover_load(whole), rounds)
            mover_mod.GROUP_CHUNKS = 8
            out["hit (8191 tokens)"] = timed(mover_load(hit), rounds)
            tapered = mover_mod._group_sizes
            mover_mod._group_sizes = lambda n, g: [min(g, n - i) for i in range(0, n, g)]
            out["mover g8 flat"] = timed(mover_load(whole), rounds)
            mover_mod._group_sizes = tapered
            out["tail 63 tokens"] = timed(mover_load(tail), rounds)
        ref = total / out["pinned 1x"]
        print(f"one prompt: {total / 2**20:.0f} MiB in {CHUNKS} chunks; pinned 1x {ref / 1e9:.2f} GB/s")
        for name, s in out.items():
            n = nbytes if name.startswith("tail") else total
            print(f"  {name:16} {s * 1e3:8.3f} ms  {n / s / 1e9:7.2f} GB/s  {n / s / ref:5.2f}x pinned")
        thp = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
        if os.path.exists(thp):
            with open(thp) as f:
                print("shmem THP:", f.read().strip())
    finally:
        pool.close()


if __name__ == "__main__":
    main()
