from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpkv import KVLayout
from hpkv.core.keys import Namespace, chunk_keys, record_key

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


def ns(**kw: object) -> bytes:
    args: dict[str, object] = {"model_id": "m", "layout": LAYOUT, "chunk_size": 4, "rank": 0, "world_size": 1}
    args.update(kw)
    return Namespace(**args).digest  # type: ignore[arg-type]


def test_keys_are_128_bit_and_only_for_full_chunks() -> None:
    keys = chunk_keys(ns(), list(range(10)), 4)
    assert len(keys) == 2
    assert all(len(k) == 16 for k in keys)


def test_list_tensor_and_array_give_the_same_keys() -> None:
    toks = [5, 9, 1, 150000, 7, 7, 7, 3]
    a = chunk_keys(ns(), toks, 4)
    assert chunk_keys(ns(), torch.tensor(toks, dtype=torch.int32), 4) == a
    assert chunk_keys(ns(), np.array(toks, dtype=np.int64), 4) == a


def test_prefix_property() -> None:
    """Key i depends on every token before the end of chunk i and on nothing after."""
    a = chunk_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    b = chunk_keys(ns(), [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4)
    c = chunk_keys(ns(), [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c, strict=True))  # a change in chunk 0 changes every key


def test_namespace_separates_model_layout_rank_salt_chunk() -> None:
    toks = list(range(8))
    base = chunk_keys(ns(), toks, 4)
    other_layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)
    for variant in (
        ns(model_id="m2"),
        ns(layout=other_layout),
        ns(rank=1, world_size=2),
        ns(world_size=2),
        ns(salt="tenant"),
        ns(chunk_size=8),
    ):
        assert not set(chunk_keys(variant, toks, 4)) & set(base)


def test_keys_are_stable_across_fresh_processes() -> None:
    """No hash(), no per-process seed: two interpreters with different PYTHONHASHSEED agree."""
    code = (
        "import torch; from hpkv import KVLayout; from hpkv.core.keys import Namespace, chunk_keys;"
        "l=KVLayout(4,2,64,torch.bfloat16); n=Namespace('m',l,4,1,2,'s').digest;"
        "print(','.join(k.hex() for k in chunk_keys(n, list(range(100)), 4)))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    expected = ",".join(
        k.hex() for k in chunk_keys(Namespace("m", LAYOUT, 4, 1, 2, "s").digest, list(range(100)), 4)
    )
    assert outs == {expected}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=64), st.integers(1, 16))
def test_keys_deterministic_and_prefix_consistent(toks: list[int], chunk: int) -> None:
    keys = chunk_keys(ns(), toks, chunk)
    assert len(keys) == len(toks) // chunk
    assert chunk_keys(ns(), toks, chunk) == keys
    # Keys of a prefix are a prefix of the keys.
    cut = (len(toks) // 2 // chunk) * chunk
    assert chunk_keys(ns(), toks[:cut], chunk) == keys[: cut // chunk]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=8, max_size=8), st.integers(0, 7), st.integers(1, 1000))
def test_any_token_change_changes_its_chunk_key(toks: list[int], pos: int, delta: int) -> None:
    other = list(toks)
    other[pos] = (other[pos] + delta) % 2**31
    a, b = chunk_keys(ns(), toks, 4), chunk_keys(ns(), other, 4)
    first_changed = pos // 4
    assert a[:first_changed] == b[:first_changed]
    assert all(x != y for x, y in zip(a[first_changed:], b[first_changed:], strict=True))


def test_logical_keys_are_shared_by_ranks_record_keys_are_not() -> None:
    toks = list(range(8))
    r0 = Namespace("m", LAYOUT, 4, 0, 2)
    r1 = r0.for_rank(1)
    assert r0.logical_digest == r1.logical_digest and r0.digest != r1.digest
    logical = chunk_keys(r0.logical_digest, toks, 4)
    k0 = [record_key(r0.digest, lk) for lk in logical]
    k1 = [record_key(r1.digest, lk) for lk in logical]
    assert not set(k0) & set(k1) and not set(k0) & set(logical)
