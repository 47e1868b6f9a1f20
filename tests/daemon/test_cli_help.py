"""`daemonctl --help` says what the README says about the commands a new user reads first."""

from __future__ import annotations

import re

from conftest import REPO


def _help(*args: str) -> str:
    from typer.testing import CliRunner

    from daemon.cli import app

    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "300"}, terminal_width=300)
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", r.output)


def test_bootstrap_is_the_v0_adapter_in_help_and_readme_registered_as_the_next_version():
    """The README calls what `daemonctl bootstrap` trains v0; the help said 'Adapter v1'. The code
    registers it under the registry's next number (1 in an empty registry; 0 is the base draft):
    both now say both."""
    readme = next(ln for ln in (REPO / "README.md").read_text().splitlines() if "daemonctl bootstrap " in ln)
    top = _help()
    line = top[top.index(" bootstrap "):][:120]
    assert "v0" in line and "v1" not in line.split("(")[0], line
    assert "v0" in readme, readme
    for text in (_help("bootstrap"), readme):
        assert "v1 in an empty registry" in text and "version 0 is the base draft" in text, text
