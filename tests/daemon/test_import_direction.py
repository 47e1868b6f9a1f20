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
    ("decoder.control, decoder.bench, decoder.adapters, decoder.eagle", ("trainer", "daemon")),
])
def test_imports_run_one_way(modules, forbidden):
    assert _loaded(modules, forbidden) == []
