"""An operator's command answers fast: importing the CLI loads no model code."""

import subprocess
import sys


def test_import_daemon_cli_does_not_import_torch():
    code = "import sys, daemon.cli; print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]", f"import daemon.cli pulled in {r.stdout.strip()}"
