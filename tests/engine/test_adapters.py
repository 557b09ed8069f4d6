"""The adapters call the engine only through its interface (hpkv.engine.interface.Engine).

Read from the source: every attribute an adapter takes of its engine (``self.catalog.X``,
``eng.X``, ``self.engine.X``) must be a member of :class:`Engine` or of the interfaces beside it
that this adapter's engine needs (vLLM's scheduler: its steps and upkeep; the in-process path: its
copies), and of a lookup handle
(``lk.X``, ``st.lookup.X``) only what the caller gave it and ``pending_io``. What a call did comes
back in its result; an adapter that reads or diffs the engine's fields fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpkv.engine.interface import Engine, EngineSteps, InProcessCopies, Upkeep

SRC = Path(__file__).resolve().parents[2] / "src" / "hpkv"
# Per adapter: the names its engine goes by, and the interfaces beside Engine it may use.
ADAPTERS: dict[str, tuple[tuple[str, ...], tuple[type, ...]]] = {
    "integrations/vllm/scheduler.py": (("self.catalog", "self._catalog"), (EngineSteps, Upkeep)),
    "integrations/vllm/logs.py": (("self._catalog",), ()),
    "integrations/library/local.py": (("eng",), (InProcessCopies,)),
    "integrations/library/store.py": (("self.engine",), (Upkeep,)),
}
# KVStore hands a library user its tiers for inspection (KVStore.pool, .storage, .valkey) and
# the record key a chunk is stored under; nothing of it is on a data path.
INSPECTION = {"integrations/library/store.py": {"pools", "tier", "tier_names", "record_key", "check"}}
LOOKUP_HANDLES = ("lk", "st.lookup", "lookup")
LOOKUP_PUBLIC = {"lks", "tenant", "pending_io"}


def _members(*interfaces: type) -> set[str]:
    out: set[str] = set()
    for cls in (Engine, *interfaces):
        out |= {n for n in vars(cls) if not n.startswith("_")} | set(cls.__annotations__)
    return out


def _reaches(path: str, bases: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """(line, base, attribute) of every ``base.attribute`` in the adapter."""
    tree = ast.parse((SRC / path).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if base in bases:
                out.append((node.lineno, base, node.attr))
    return out


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_an_adapter_calls_only_the_engine_interface(path: str) -> None:
    bases, beside = ADAPTERS[path]
    allowed = _members(*beside) | INSPECTION.get(path, set())
    found = _reaches(path, bases)
    assert found, f"{path}: no engine calls found; is the engine still named {bases}?"
    past = [f"{path}:{line} {base}.{attr}" for line, base, attr in found if attr not in allowed]
    assert not past, "adapters reach past the engine interface:\n" + "\n".join(past)


@pytest.mark.parametrize("path", sorted(ADAPTERS))
def test_an_adapter_reads_no_field_of_the_engine_lookup(path: str) -> None:
    found = _reaches(path, LOOKUP_HANDLES)
    past = [f"{path}:{line} {base}.{attr}" for line, base, attr in found if attr not in LOOKUP_PUBLIC]
    assert not past, "adapters read the engine's lookup fields:\n" + "\n".join(past)


def test_the_catalog_is_an_engine() -> None:
    from hpkv.engine.catalog import Catalog

    for cls in (Engine, EngineSteps, InProcessCopies, Upkeep):
        assert issubclass(Catalog, cls), cls
    assert not getattr(Catalog, "__abstractmethods__", None)


def test_the_core_interface_is_the_data_path_alone() -> None:
    """What every adapter calls: keys and existence, the lookup and its load, the store pair,
    reset, stats and close; what only some engines need lives beside it."""
    assert sorted(Engine.__abstractmethods__) == [
        "arrivals", "begin_stores", "clear", "close", "finish_load", "finish_stores", "keys",
        "locate", "look_ahead", "lookup", "release", "start_deferred", "stats",
    ]  # fmt: skip
