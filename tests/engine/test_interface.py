"""The engine's one interface, driven as each integration drives it, against one real engine.

A real pool and a real storage directory; the vLLM scheduler's sequence (lookup until it stops
being pending, then the hit's pinned slots handed to the copies and released; a store reserved,
filled, sealed and finished) and the in-process sequence the library and SGLang use
(integrations/library/local.py) go through the same methods. Also: a reset during a pending
lookup, an abort while loading, and the state machines refusing an illegal transition.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import wait
from typing import Any

import pytest

from hpkv.core import record
from hpkv.core.config import HpkvConfig
from hpkv.core.keys import Namespace
from hpkv.engine.catalog import Catalog
from hpkv.engine.interface import HELD, MEMORY, Answer, Hit, Miss, Pending, Why
from hpkv.engine.lookup import IllegalTransition, Lookup, Phase
from hpkv.integrations.library import local
from hpkv.integrations.vllm.reqstate import LoadPhase, ReqState
from hpkv.tiers.base import STORAGE
from tests.conftest import CHUNK, SMALL


@pytest.fixture(params=["engine", "shared"])
def cat(request: pytest.FixtureRequest, shm_dir: str, storage_dir: str) -> Iterator[Catalog]:
    """The same sequences on an engine's own pool and on the host pool engines share."""
    cfg = HpkvConfig(
        mem_pool_size="4M",
        share_mem_file_path=shm_dir,
        storage_path=storage_dir,
        chunk_size=CHUNK,
        memory_pool=request.param,
    )
    c = Catalog(cfg, Namespace("iface", SMALL, CHUNK))
    yield c
    c.close()


def store_as_workers(cat: Catalog, lks: list[bytes]) -> list[bytes]:
    """vLLM's store sequence: begin_store, the workers fill and seal the slot, finish_store."""
    payloads = []
    for lk in lks:
        slot = cat.begin_store(lk)
        assert isinstance(slot, int)
        payload = os.urandom(cat.payload_bytes)
        off = slot * cat.slot_bytes
        view = cat.pools[0].view[off : off + cat.record_bytes]
        view[record.HEADER_BYTES :] = payload
        record.seal(view, cat.rank_digests[0], cat.record_key(0, lk), cat.payload_bytes)
        assert cat.finish_store(lk, slot, True)
        payloads.append(payload)
    cat.flush()
    return payloads


def slot_bytes(cat: Catalog, slot: int) -> bytes:
    off = slot * cat.slot_bytes + record.HEADER_BYTES
    return bytes(cat.pools[0].view[off : off + cat.payload_bytes])


def ask(cat: Catalog, lk: Lookup, **kw: Any) -> Answer:
    """The first answer once the lookup's probe (what the tiers below memory hold and where each
    read comes from, asked on an I/O thread) is in."""
    answer = cat.lookup(lk, **kw)
    if lk.phase is Phase.LOCATING:
        assert lk.probe is not None
        lk.probe.result(timeout=10)
        answer = cat.lookup(lk, **kw)
    return answer


def ask_until_answered(cat: Catalog, lk: Lookup, first: int = 0) -> Hit | Miss:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = cat.lookup(lk, first, defer=True)
        cat.start_deferred()  # the end of vLLM's scheduling pass
        if not isinstance(answer, Pending):
            return answer
        time.sleep(0.005)
    raise AssertionError("the lookup stayed pending")


def test_a_memory_hit_then_a_storage_hit_through_the_schedulers_sequence(cat: Catalog) -> None:
    lks = cat.keys(list(range(4 * CHUNK)))
    payloads = store_as_workers(cat, lks)
    lk = Lookup(lks)
    hit = cat.lookup(lk)
    assert isinstance(hit, Hit) and hit.chunks == 4 and hit.tiers == {MEMORY: 4} and lk.phase is Phase.READY
    assert [slot_bytes(cat, s) for s in hit.slots] == payloads
    cat.finish_load(hit.slots, loaded=4, nbytes=4 * cat.payload_bytes)
    assert cat.stats()[MEMORY]["pinned_slots"] == 0 and cat.stats()[MEMORY]["hits"] == 4

    cat.clear((MEMORY,))  # storage alone holds them now
    lk = Lookup(lks)
    first = cat.lookup(lk, defer=True)
    # Where each read would come from (a look into the page cache per file) is asked on an I/O
    # thread, never on the caller's: the first answer is "ask again" (unless that thread answered
    # before the lookup looked, when the hit is already being staged).
    assert isinstance(first, Pending)
    second = first
    if first.why is Why.LOCATING:
        assert lk.phase is Phase.LOCATING and lk.probe is not None
        lk.probe.result()
        second = cat.lookup(lk, defer=True)
    deadline = time.monotonic() + 10
    while isinstance(second, Pending) and second.why is Why.ROOM and time.monotonic() < deadline:
        time.sleep(0.01)  # the host pool frees the cleared slots in its own time
        second = cat.lookup(lk, defer=True)
    assert isinstance(second, Pending) and lk.phase is Phase.STAGING  # promotions, reads deferred
    assert lk.sources == {k: STORAGE for k in lks}  # from the page cache, as the I/O thread saw
    hit = ask_until_answered(cat, lk)
    assert isinstance(hit, Hit) and hit.tiers == {STORAGE: 4}
    assert [slot_bytes(cat, s) for s in hit.slots] == payloads
    cat.finish_load(hit.slots)
    cat.release(lk)
    assert lk.phase is Phase.DONE and cat.memory.protected() == 0
    cat.check()


def test_a_streamed_hit_hands_out_each_chunk_once_it_is_in_memory(cat: Catalog) -> None:
    lks = cat.keys(list(range(3 * CHUNK)))
    payloads = store_as_workers(cat, lks)
    cat.clear((MEMORY,))
    lk = Lookup(lks)
    hit = ask(cat, lk, stream=lambda below, n: below > 0)
    assert isinstance(hit, Hit) and hit.streaming and hit.chunks == 3 and lk.phase is Phase.STREAMING
    cat.start_deferred()
    got: dict[int, bytes] = {}
    deadline = time.monotonic() + 10
    while lk.phase is Phase.STREAMING and time.monotonic() < deadline:
        wait(lk.staging, timeout=1)
        arrived = cat.arrivals(lk)
        for i, slot in arrived.ready:
            got[i] = slot_bytes(cat, slot)
            cat.finish_load([slot], loaded=1)
        assert not arrived.failed
    assert got == dict(enumerate(payloads)) and lk.phase is Phase.READY
    assert cat.stats()[MEMORY]["pinned_slots"] == 0 and cat.memory.protected() == 0


def test_the_in_process_sequence_reads_what_the_workers_stored_and_stores_once(cat: Catalog) -> None:
    lks = cat.keys(list(range(3 * CHUNK)))
    payloads = store_as_workers(cat, lks)
    cat.clear((MEMORY,))
    got: dict[int, bytes] = {}
    assert local.load(cat, lks, lambda i, p: got.__setitem__(i, p.numpy().tobytes())) == 3
    assert got == dict(enumerate(payloads))
    assert cat.locate_local(lks) == [MEMORY] * 3  # promoted on the way
    # The same chunks again through the in-process store: held, nothing rewritten.
    writes = cat.stats()[MEMORY]["writes"]
    assert local.store(cat, lks, lambda i, p: p.zero_()) == 3
    assert cat.stats()[MEMORY]["writes"] == writes
    assert cat.begin_store(lks[0]) == HELD
    cat.check()


def test_a_miss_is_a_miss_and_holds_nothing(cat: Catalog) -> None:
    lk = Lookup(cat.keys(list(range(50_000, 50_000 + 2 * CHUNK))))
    assert isinstance(cat.lookup(lk), Miss)
    assert cat.memory.protected() == 0 and cat.stats()[MEMORY]["pinned_slots"] == 0
    assert local.load(cat, lk.lks, lambda i, p: None) == 0


def test_a_reset_while_a_lookup_is_pending_makes_nothing_in_flight_visible(
    cat: Catalog, monkeypatch: pytest.MonkeyPatch
) -> None:
    lks = cat.keys(list(range(2 * CHUNK)))
    store_as_workers(cat, lks)
    cat.clear((MEMORY,))
    lk = Lookup(lks)
    assert isinstance(ask(cat, lk, defer=True), Pending)  # slots reserved, reads not started
    cat.clear((MEMORY,))  # reset_external while the promotions are pending
    cat.start_deferred()
    wait(lk.staging, timeout=10)
    assert not any(f.result() for f in lk.promotions)  # reserved before the reset: never committed
    answer = cat.lookup(lk)
    assert isinstance(answer, Miss)  # nothing in memory after the reset
    cat.release(lk)
    assert cat.stats()[MEMORY]["pinned_slots"] == 0 and cat.memory.protected() == 0
    cat.check()


def test_an_abort_while_loading_releases_every_pin_and_protection(cat: Catalog) -> None:
    lks = cat.keys(list(range(3 * CHUNK)))
    store_as_workers(cat, lks)
    cat.clear((MEMORY,))
    lk = Lookup(lks)
    hit = ask(cat, lk, stream=lambda below, n: True)
    assert isinstance(hit, Hit) and hit.streaming
    cat.start_deferred()
    wait(lk.staging, timeout=10)
    gone = cat.arrivals(lk, gone=True)  # vLLM finished the request: nothing is handed out
    assert gone.ready == [] and gone.failed == [0, 1, 2] and lk.phase is Phase.READY
    cat.release(lk)
    assert cat.stats()[MEMORY]["pinned_slots"] == 0 and cat.memory.protected() == 0
    assert cat.locate_local(lks) == [MEMORY] * 3  # the promotions landed for a later hit
    cat.check()


def test_the_state_machines_refuse_an_illegal_transition() -> None:
    lk = Lookup([b"k" * 16])
    with pytest.raises(IllegalTransition, match="from new to ready"):
        lk.to(Phase.READY)
    lk.to(Phase.DONE)
    with pytest.raises(IllegalTransition):
        lk.to(Phase.STAGING)
    st = ReqState(Lookup([]), prompt_len=10)
    with pytest.raises(IllegalTransition, match="from none to scheduled"):
        st.to(LoadPhase.SCHEDULED)
    st.to(LoadPhase.ASYNC)
    with pytest.raises(IllegalTransition):
        st.to(LoadPhase.LEASED)


def test_every_integration_reaches_the_engine_through_its_interface_only() -> None:
    """The integrations call the Catalog's interface, never the memory tier's bookkeeping or the
    promoter directly (one lookup path, one store path)."""
    import pathlib

    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "hpkv" / "integrations"
    for path in src.rglob("*.py"):
        text = path.read_text()
        for private in (
            "catalog.memory.",
            "._promoter",
            "catalog.reserve(",
            "catalog.commit(",
            "catalog.pin(",
        ):
            assert private not in text, f"{path.name} reaches past the engine's interface: {private}"


def test_no_import_cycle_among_hpkv_modules() -> None:
    """Every hpkv module imports on its own, and no two import each other at module level."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "src"
    graph: dict[str, set[str]] = {}
    for path in (root / "hpkv").rglob("*.py"):
        mod = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:  # module level only: lazy imports are fine
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpkv"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("hpkv"))
        graph[mod] = deps
    seen: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        if seen.get(m) == 2:
            return
        assert seen.get(m) != 1, "import cycle: " + " -> ".join([*stack, m])
        seen[m] = 1
        for d in graph.get(m, ()):
            if d in graph:
                visit(d, [*stack, m])
        seen[m] = 2

    for m in graph:
        visit(m, [])
