"""Dependencies point one way (docs/architecture.md): daemon -> {trainer, decoder} -> store, and
inside daemon/ the report builders, metrics and API never import the Daemon or the CLI."""

import subprocess
import sys

import pytest


def _loaded(modules: str, prefixes: tuple[str, ...]) -> list[str]:
    code = (f"import sys, {modules}; "
            f"print(sorted({{m.split('.')[0] + '.' + m.split('.')[1] if '.' in m else m for m in sys.modules "
            f"if m.startswith({prefixes!r})}}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return eval(r.stdout)  # a printed list of str


@pytest.mark.parametrize("modules, forbidden", [
    ("daemon.reports, daemon.metrics, daemon.api, daemon.errors", ("daemon.app", "daemon.cli", "daemon.demo")),
    ("store.buffer, store.registry, store.history, store.jsonsafe", ("torch", "decoder", "trainer", "daemon")),
    ("trainer.service, trainer.bootstrap, trainer.publish, trainer.head", ("decoder", "daemon")),
    ("decoder.control, decoder.tracking, decoder.rollback, decoder.bench, decoder.adapters, decoder.eagle", ("trainer", "daemon")),
])
def test_imports_run_one_way(modules, forbidden):
    assert _loaded(modules, forbidden) == []


# ---- read from the source: every import, function-local and TYPE_CHECKING ones included ----------
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
PACKAGES = ("store", "decoder", "trainer", "daemon")
# who may import whom: daemon -> {decoder, trainer} -> store; decoder and trainer apart
ALLOWED = {"store": {"store"}, "decoder": {"decoder", "store"}, "trainer": {"trainer", "store"},
           "daemon": {"daemon", "decoder", "trainer", "store"}}


def _modules() -> dict[str, "__import__('pathlib').Path"]:
    mods = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _imports(mods) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (a ``from pkg import mod``
    of a submodule counts as importing that submodule)."""
    import ast

    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        out: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
        edges[name] = out
    return edges


def test_no_import_circle_among_the_projects_modules():
    """No module reaches itself through imports, counting imports inside functions and under
    TYPE_CHECKING: each circle would make the modules one unit that can only be read together."""
    edges = _imports(_modules())
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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
                circles.append(sorted(comp))

    import sys

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert circles == [], circles


def test_layers_import_one_way_in_the_source():
    """daemon -> {decoder, trainer} -> store, read from every import in the source (function-local
    ones too): store imports no other package, decoder and trainer never import each other."""
    bad = sorted(f"{m} -> {t}" for m, ts in _imports(_modules()).items() for t in ts
                 if t.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert bad == []



MAX_FUNCTION_LINES = 80  # issue 33: no function over 80 lines in decoder/, trainer/, store/, daemon/


def _long_functions(files, root) -> list[str]:
    """``path:line name (n lines)`` of every function (methods and nested ones too) longer than
    MAX_FUNCTION_LINES, counted from its ``def`` line to its last line, docstring included."""
    import ast

    long = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return long


def test_the_length_check_counts_def_to_last_line_and_nested_functions(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("def fits():\n" + "".join(f"    x{i} = {i}\n" for i in range(79)))  # 1 + 79 = 80 lines
    long = tmp_path / "long.py"
    long.write_text("class C:\n    def outer(self):\n        async def inner():\n"
                    + "".join(f"            x{i} = {i}\n" for i in range(80))  # inner: 1 + 80 = 81 lines
                    + "        return inner\n")  # outer: 1 + 81 + 1 = 83 lines
    assert _long_functions([ok, long], tmp_path) == ["long.py:2 outer (83 lines)", "long.py:3 inner (81 lines)"]


def test_no_function_over_80_lines_in_the_packages():
    files = [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50  # the packages were found
    assert _long_functions(files, ROOT) == []
