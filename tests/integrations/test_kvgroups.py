"""Several KV cache groups (vLLM's hybrid KV cache manager): a chunk's payload holds the groups'
layers one group after the other, each copied with its own blocks; a window's null blocks are
never written, and a chunk is stored only while every group still holds it."""

from __future__ import annotations

import torch

from hpkv.core.layout import KVLayout
from hpkv.integrations.vllm.kvgroups import NULL_BLOCK, GroupedPagedKV, KVGroup, KVGroups
from hpkv.integrations.vllm.paged import PagedKV

H, D, BS, NB = 2, 8, 4, 24
GROUPS = KVGroups((KVGroup("full", 1), KVGroup("sliding", 2, window=6)))
LAYOUT = KVLayout(3, H, D, torch.float32)


def caches(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    make = (
        (lambda: torch.randn(NB, H, BS, 2 * D, generator=g))
        if fill
        else (lambda: torch.zeros(NB, H, BS, 2 * D))
    )
    return [make() for _ in range(3)]


def test_a_chunk_is_each_groups_layers_from_its_own_blocks() -> None:
    src = caches(fill=True)
    full, window = [3, 4], [9, 10]  # a chunk of two blocks in each group
    payload = torch.zeros(LAYOUT.chunk_bytes(2 * BS), dtype=torch.uint8)
    GroupedPagedKV(src, BS, LAYOUT, "CPU_ATTN", GROUPS).gather(payload, full + window)

    half = LAYOUT.chunk_bytes(2 * BS) // 3
    want_full = torch.zeros(half, dtype=torch.uint8)
    PagedKV(src[:1], BS, KVLayout(1, H, D, torch.float32), "CPU_ATTN").gather(want_full, full)
    want_window = torch.zeros(2 * half, dtype=torch.uint8)
    PagedKV(src[1:], BS, KVLayout(2, H, D, torch.float32), "CPU_ATTN").gather(want_window, window)
    assert torch.equal(payload, torch.cat([want_full, want_window]))

    # Loaded back where the window's first block is vLLM's null block: that block stays untouched.
    dst = caches(fill=False)
    dst[1][NULL_BLOCK].fill_(5.0)
    GroupedPagedKV(dst, BS, LAYOUT, "CPU_ATTN", GROUPS).scatter(payload, [7, 8, NULL_BLOCK, 12], 0, 2 * BS)
    assert torch.equal(dst[0][7], src[0][3]) and torch.equal(dst[0][8], src[0][4])
    assert torch.equal(dst[1][12], src[1][10]) and torch.equal(dst[2][12], src[2][10])
    assert bool((dst[1][NULL_BLOCK] == 5.0).all()) and not dst[2][NULL_BLOCK].any()


def test_the_batched_forms_agree_with_the_single_ones() -> None:
    src = caches(fill=True)
    kv = GroupedPagedKV(src, BS, LAYOUT, "CPU_ATTN", GROUPS)
    chunks = [[1, 2, 5, 6], [11, 12, 13, 14]]
    buf = torch.zeros(2, LAYOUT.chunk_bytes(2 * BS), dtype=torch.uint8)
    kv.gather_many(buf, chunks)
    for row, ids in zip(buf, chunks, strict=True):
        one = torch.zeros_like(row)
        kv.gather(one, ids)
        assert torch.equal(row, one)

    a, b = caches(fill=False), caches(fill=False)
    # A null block at the front of a window, and one after a real block: neither is written.
    specs = [([15, 16, NULL_BLOCK, 17], 0, 2 * BS - 1), ([18, 19, 20, NULL_BLOCK], 0, 2 * BS)]
    GroupedPagedKV(a, BS, LAYOUT, "CPU_ATTN", GROUPS).scatter_many(buf, specs)
    for row, (ids, first, count) in zip(buf, specs, strict=True):
        GroupedPagedKV(b, BS, LAYOUT, "CPU_ATTN", GROUPS).scatter(row, ids, first, count)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(t[NULL_BLOCK].any() for t in a)


def test_a_chunk_is_stored_only_while_every_group_holds_it() -> None:
    win = KVGroups((KVGroup("full", 1), KVGroup("sliding", 1, window=128)))
    assert win.kept_from(100) == 0  # the window still reaches the first token
    assert win.kept_from(1000) == 1000 - 128 + 1
    local = KVGroups((KVGroup("full", 1), KVGroup("chunked", 1, window=256)))
    assert local.kept_from(700) == 512
    assert KVGroups((KVGroup("full", 2),)).kept_from(10**6) == 0
    # A failed load's blocks: every group's real blocks for the tokens, null ones left out.
    assert win.token_blocks([3, 4, NULL_BLOCK, 9], 0, 2 * BS, BS) == [3, 4, 9]
    assert win.token_blocks([3, 4, 8, 9], BS, 2 * BS, BS) == [4, 9]
    assert win.describe() == "fullx1+sw128x1"
