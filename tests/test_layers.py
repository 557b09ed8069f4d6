"""The package's layers point down only: core → tiers → engine → integrations → bench → cli.

A module may import its own layer and the layers below it, at the top of the file or inside a
function alike (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "hpkv"
LAYERS = ["core", "tiers", "engine", "integrations", "bench", "cli"]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: pathlib.Path) -> set[str]:
    """Every ``hpkv`` module ``name`` imports, wherever in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("hpkv"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([base] if base else []))
            if base.startswith("hpkv"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    known = modules()
    return {m for m in found if m in known}


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.mark.parametrize("name", sorted(n for n in modules() if layer(n) is not None))
def test_a_module_imports_only_its_layer_and_those_below(name: str) -> None:
    own = layer(name)
    assert own is not None
    up = sorted(m for m in imports(name, modules()[name]) if (layer(m) or 0) > own)
    assert not up, f"{name} ({LAYERS[own]}) imports from a layer above it: {up}"


def test_the_benches_import_each_other_without_a_cycle() -> None:
    """A bench module's imports (lazy ones too) never lead back to it: a cycle hidden by a
    function-level import is still one."""
    known = modules()
    bench = {n for n in known if n.startswith("hpkv.bench.")}
    graph = {n: {m for m in imports(n, known[n]) if m in bench and m != n} for n in bench}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                cycles.append(" -> ".join([*path, nxt]))
            elif nxt not in path and nxt > path[0]:  # each cycle once, from its smallest module
                visit(nxt, [*path, nxt])

    for start in sorted(bench):
        visit(start, [start])
    assert not cycles, "bench modules import each other in a cycle:\n" + "\n".join(cycles)
