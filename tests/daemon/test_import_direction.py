"""The house's layering, read from the source: no import circle among the project's modules
(function-local and type-only imports included), and imports point one way, daemon -> {decoder,
trainer} -> store, with decoder and trainer apart (trainer.head and the decoder's heads meet in
daemon/, not in each other)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("store", "decoder", "trainer", "daemon")
LAYER = {"store": 0, "decoder": 1, "trainer": 1, "daemon": 2}


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its file."""
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            mods[".".join(parts)] = f
    g: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for n in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            g[m] |= {x for x in names if x in mods and x != m}
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_projects_modules():
    assert _cycles(_graph()) == []


def test_imports_point_from_daemon_to_decoder_and_trainer_to_store():
    wrong = []
    for m, deps in _graph().items():
        a = m.split(".")[0]
        for d in deps:
            b = d.split(".")[0]
            if a != b and (LAYER[b] > LAYER[a] or LAYER[a] == LAYER[b]):
                wrong.append(f"{m} -> {d}")
    assert wrong == []
