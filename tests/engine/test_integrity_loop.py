"""Many get() calls while a seeded adversary damages the slow tiers: never a wrong byte.

Memory pool (small, so chunks are evicted and promoted again), a real storage directory and a real
valkey-server. Between gets the adversary flips a byte, truncates, swaps two chunks' files or
values, unlinks, or writes a record of another chunk under a key. Every get() must return a prefix
of exactly what was put (a damaged chunk cuts the prefix there: a miss, then recompute).
"""

from __future__ import annotations

import os
import random
from typing import Any

from hpkv.bench.valkey import ValkeyServers
from tests.conftest import CHUNK, SMALL, StoreFactory, bits_equal, random_kv, random_tokens

PROMPTS = 12
CHUNKS = 6
GETS = 1500


def test_no_wrong_byte_under_random_damage(make_store: StoreFactory, valkey_server: ValkeyServers) -> None:
    rng = random.Random(20261201)
    store = make_store(
        model_id="integrity",
        mem_pool_size="64K",  # a few chunks: most gets promote from storage or valkey again
        remote_url=valkey_server.url,
        request_timeout=2.0,
        connection_timeout=2.0,
    )
    assert store.storage is not None and store.valkey is not None
    prompts = [random_tokens(CHUNKS * CHUNK, seed=100 + i) for i in range(PROMPTS)]
    kvs = [random_kv(SMALL, CHUNKS * CHUNK, seed=100 + i) for i in range(PROMPTS)]
    for toks, kv in zip(prompts, kvs, strict=True):
        store.put(toks, kv)
    store.flush()
    adm = valkey_server.admin()
    keys = [store.keys(t) for t in prompts]
    served = damaged = 0

    def damage() -> None:
        p, c = rng.randrange(PROMPTS), rng.randrange(CHUNKS)
        key = keys[p][c]
        path = store.storage.path(store.record_key(key))
        name = store.valkey.key_name(store.record_key(key))
        what = rng.choice(["flip", "truncate", "swap", "unlink", "foreign"])
        try:
            if what == "flip" and os.path.exists(path):
                with open(path, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(rng.randrange(size))
                    b = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                v = adm.command("GET", name)
                if v:
                    i = rng.randrange(len(v))
                    adm.command("SET", name, v[:i] + bytes([v[i] ^ 0x40]) + v[i + 1 :])
            elif what == "truncate" and os.path.exists(path):
                os.truncate(path, rng.randrange(os.path.getsize(path)))
                v = adm.command("GET", name)
                if v:
                    adm.command("SET", name, v[: rng.randrange(len(v))])
            elif what in ("swap", "foreign"):
                other = keys[rng.randrange(PROMPTS)][rng.randrange(CHUNKS)]
                if other != key:
                    o_path = store.storage.path(store.record_key(other))
                    if os.path.exists(o_path):
                        with open(o_path, "rb") as f:
                            data = f.read()
                        with open(path, "wb") as f:
                            f.write(data)
                    v = adm.command("GET", store.valkey.key_name(store.record_key(other)))
                    if v:
                        adm.command("SET", name, v)
            elif what == "unlink":
                if os.path.exists(path):
                    os.unlink(path)
                adm.command("DEL", name)
        except OSError:
            pass

    for n in range(GETS):
        if rng.random() < 0.3:
            damage()
            damaged += 1
        p = rng.randrange(PROMPTS)
        out = store.get(prompts[p])
        got = out.shape[2]
        assert got % CHUNK == 0
        assert bits_equal(out, kvs[p][:, :, :got]), f"wrong bytes at get {n} (prompt {p})"
        served += got
        if rng.random() < 0.1:  # put back what recompute would store again
            store.put(prompts[p], kvs[p])
    st: dict[str, Any] = store.stats()
    assert served > 0 and damaged > 0
    assert st["storage"]["corrupt"] + st["valkey"]["corrupt"] > 0, "the adversary never hit a read"
