"""The host pool: engines in separate processes share one memory tier, it outlives them, and a
process killed with SIGKILL at any moment leaves nothing held and nothing half-written visible.

Every engine here is a real process with its own KVStore (or Catalog) over a real pool directory
in /dev/shm, and the pool is the real pool process they start."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hpkv import HpkvConfig, KVStore
from hpkv.tiers.memory.hostslots import pool_status, stop_pool
from hpkv.tiers.memory.wire import SOCKET
from tests.conftest import CHUNK, SMALL, bits_equal, random_kv, random_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A child engine: a KVStore over the pool directory; what it does is its first argument.
CHILD = textwrap.dedent(
    """
    import os, random, sys, time
    from hpkv import HpkvConfig, KVStore
    from hpkv.engine.interface import Hit
    from hpkv.engine.lookup import Lookup
    from tests.conftest import CHUNK, SMALL, bits_equal, random_kv, random_tokens

    shm, what = sys.argv[1], sys.argv[2]
    model, salt = os.environ.get("T_MODEL", "tiny"), os.environ.get("T_SALT", "")
    cfg = HpkvConfig(mem_pool_size=os.environ.get("T_POOL", "8M"), share_mem_file_path=shm,
                     chunk_size=CHUNK, salt=salt, pool_idle_timeout=float(os.environ.get("T_IDLE", "60")))
    s = KVStore(cfg, SMALL, model_id=model)
    cat = s.engine

    def prompt(seed):
        return random_tokens(4 * CHUNK, seed=seed), random_kv(SMALL, 4 * CHUNK, seed=seed)

    if what == "put":
        toks, kv = prompt(int(sys.argv[3]))
        print("stored", s.put(toks, kv), flush=True)
    elif what == "get":
        toks, kv = prompt(int(sys.argv[3]))
        where = s.locate(toks)
        ok = bits_equal(s.get(toks), kv)
        hits = s.stats()["memory"]["hits"]
        print("where", ",".join(str(w) for w in where), "equal", ok, "hits", hits, flush=True)
    elif what == "hold":  # pin a hit's slots, as a load does, and wait to be killed
        toks, _ = prompt(int(sys.argv[3]))
        hit = cat.lookup(Lookup(cat.keys(toks)))
        assert isinstance(hit, Hit) and hit.chunks == 4, hit
        print("held", len(hit.slots), flush=True)
        time.sleep(600)
    elif what == "reserve":  # reserve a slot for a new chunk, write half of it, and wait to be killed
        toks, _ = prompt(int(sys.argv[3]))
        lk = cat.keys(toks)[0]
        slot = cat.begin_store(lk)
        assert isinstance(slot, int), slot
        off = slot * cat.slot_bytes
        cat.pools[0].view[off : off + cat.slot_bytes // 2] = os.urandom(cat.slot_bytes // 2)
        print("reserved", slot, flush=True)
        time.sleep(600)
    elif what == "stress":  # random stores and loads of shared prompts until the deadline
        rng = random.Random(os.getpid())
        until = time.monotonic() + float(sys.argv[3])
        prompts = [prompt(i) for i in range(12)]
        n = loads = wrong = 0
        while time.monotonic() < until:
            toks, kv = prompts[rng.randrange(len(prompts))]
            if rng.random() < 0.5:
                s.put(toks, kv)
            else:
                got = s.lookup(toks)
                if got:
                    out = s.get(toks[:got])
                    loads += 1
                    wrong += not bits_equal(out, kv[:, :, : out.shape[2]])
            n += 1
            if n % 20 == 0:
                print("ops", n, "loads", loads, "wrong", wrong, flush=True)
        print("ops", n, "loads", loads, "wrong", wrong, flush=True)
        sys.exit(1 if wrong else 0)
    s.close()
    """
)


@pytest.fixture
def pool_dir(shm_dir: str) -> Iterator[str]:
    yield shm_dir
    stop_pool(shm_dir)


def child(shm: str, *args: Any, **env: str) -> subprocess.Popen[str]:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.path.join(ROOT, "src"))
    e.update({f"T_{k.upper()}": v for k, v in env.items()})
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, shm, *map(str, args)],
        cwd=ROOT,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(shm: str, *args: Any, **env: str) -> str:
    p = child(shm, *args, **env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1]


def wait_line(p: subprocess.Popen[str], word: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line.startswith(word):
        p.kill()
        raise AssertionError(f"child said {line!r}: {p.stderr.read()[-3000:] if p.stderr else ''}")
    return line


def group(shm: str) -> dict[str, Any]:
    st = pool_status(shm)
    assert st is not None, "no pool answers"
    (g,) = st["groups"].values()
    return dict(g)


def let_go(shm: str) -> dict[str, Any]:
    """The model's pool once it has noticed a killed engine's connection close (nothing pinned)."""
    deadline = time.monotonic() + 10
    while group(shm)["pinned"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return group(shm)


def test_a_chunk_one_engine_stored_is_a_memory_hit_for_another_and_after_both_exit(pool_dir: str) -> None:
    assert run(pool_dir, "put", 1) == "stored 64"
    # Another process, started after the first exited: memory, bit-exact, counted on it.
    assert run(pool_dir, "get", 1) == "where memory,memory,memory,memory equal True hits 4"
    st = pool_status(pool_dir)
    assert st is not None and st["engines"] == []  # nobody connected now, the chunks are still there
    assert group(pool_dir)["chunks"] == 4


def test_another_model_or_tenant_shares_nothing(pool_dir: str) -> None:
    run(pool_dir, "put", 2)
    assert run(pool_dir, "get", 2, salt="tenant-b").startswith("where None,None,None,None equal False")
    assert run(pool_dir, "get", 2, model="other").startswith("where None,None,None,None equal False")
    assert run(pool_dir, "get", 2) == "where memory,memory,memory,memory equal True hits 4"


def test_an_engine_killed_while_loading_leaves_no_pin(pool_dir: str) -> None:
    run(pool_dir, "put", 3)
    holder = child(pool_dir, "hold", 3)
    wait_line(holder, "held 4")
    assert group(pool_dir)["pinned"] == 4
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    g = let_go(pool_dir)
    assert g["pinned"] == 0 and g["protected"] == 0 and g["chunks"] == 4
    assert run(pool_dir, "get", 3) == "where memory,memory,memory,memory equal True hits 4"


def test_an_engine_killed_mid_store_leaves_nothing_visible_and_no_slot_held(pool_dir: str) -> None:
    writer = child(pool_dir, "reserve", 4)
    wait_line(writer, "reserved")
    assert group(pool_dir)["pinned"] == 1
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    g = let_go(pool_dir)
    assert g["pinned"] == 0 and g["chunks"] == 0  # the half-written chunk never became visible
    assert run(pool_dir, "get", 4).startswith("where None,None,None,None equal False")
    # The slot is reusable: a full store of the same prompt and its bytes back.
    run(pool_dir, "put", 4)
    assert run(pool_dir, "get", 4) == "where memory,memory,memory,memory equal True hits 4"


def test_four_engines_with_random_kills_never_read_a_wrong_byte(pool_dir: str) -> None:
    """Four processes storing and loading the same prompts in a pool too small for them (constant
    eviction), one killed at random every second and replaced: every load is bit-exact, and once
    they are gone nothing is pinned and the pool holds no more chunks than it has slots."""
    small = str(24 * 8192)  # 24 slots for 12 prompts of 4 chunks
    rng = random.Random(7)
    procs = [child(pool_dir, "stress", 8, pool=small) for _ in range(4)]
    killed = 0
    until = time.monotonic() + 20
    while time.monotonic() < until:
        time.sleep(1.0)
        i = rng.randrange(len(procs))
        if procs[i].poll() is None:
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait()
            killed += 1
        procs[i] = child(pool_dir, "stress", 4, pool=small)
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode in (0, -signal.SIGKILL), err[-3000:]
        outs.append(out)
    ops = [line for out in outs for line in out.splitlines() if line.startswith("ops")]
    assert ops and all(line.endswith("wrong 0") for line in ops), ops
    assert sum(int(line.split()[1]) for line in ops) > 50  # real work was done, not just starts
    assert sum(int(line.split()[3]) for line in ops) > 20  # and loads of what others stored
    assert killed >= 5
    g = group(pool_dir)
    assert g["pinned"] == 0 and g["protected"] == 0 and 0 < g["chunks"] <= g["slots"] == 24


def test_the_pool_stops_after_its_idle_timeout_and_takes_its_files(pool_dir: str) -> None:
    run(pool_dir, "put", 5, idle="1")
    deadline = time.monotonic() + 15
    while os.path.exists(os.path.join(pool_dir, SOCKET)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool_status(pool_dir) is None
    assert not [f for f in os.listdir(pool_dir) if f.endswith(".shm")]
    # The next engine starts a new, empty pool.
    assert run(pool_dir, "get", 5).startswith("where None,None,None,None")


def test_the_pool_stops_when_its_directory_is_removed(pool_dir: str) -> None:
    import shutil

    run(pool_dir, "put", 6)
    with open(os.path.join(pool_dir, "hpkv-pool.pid")) as f:
        pid = int(f.read())
    shutil.rmtree(pool_dir)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError("the pool outlived its directory")


def test_one_process_sees_the_host_pool_through_kvstore(pool_dir: str) -> None:
    """In-process: two stores of one model share the pool; an engine-mode store does not."""
    cfg = HpkvConfig(mem_pool_size="8M", share_mem_file_path=pool_dir, chunk_size=CHUNK)
    toks, kv = random_tokens(2 * CHUNK, seed=9), random_kv(SMALL, 2 * CHUNK, seed=9)
    with KVStore(cfg, SMALL, model_id="tiny") as a, KVStore(cfg, SMALL, model_id="tiny") as b:
        a.put(toks, kv)
        assert b.locate(toks) == ["memory", "memory"] and bits_equal(b.get(toks), kv)
    own = HpkvConfig(mem_pool_size="8M", share_mem_file_path=pool_dir, chunk_size=CHUNK, memory_pool="engine")
    with KVStore(own, SMALL, model_id="tiny") as c:
        assert c.locate(toks) == [None, None]
