"""Wall time of ``daemonctl status``; prints one JSON object.

Runs ``daemonctl status --json`` as a subprocess ``--runs`` times (with no daemon running it
reports offline from Redis, which is the path an operator waits on when something is wrong) and
``python -X importtime -c "import daemon.cli"`` once, to say what the import costs and whether it
pulled in torch. The exit status of ``status`` is 1 while the daemon is down; that is expected.

Usage: ``.venv/bin/python bench/status_bench.py [--runs 5]``. Settings come from the environment
as for the daemon (``DRAFTD_*``); point ``DRAFTD_API__PORT`` at a free port to time the offline path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def daemonctl() -> list[str]:
    """The ``daemonctl`` beside this interpreter, else the one on PATH, else ``python -m daemon.cli``."""
    here = Path(sys.executable).with_name("daemonctl")
    if here.exists():
        return [str(here)]
    found = shutil.which("daemonctl")
    return [found] if found else [sys.executable, "-m", "daemon.cli"]


def import_cost() -> dict:
    """Cumulative import time of daemon.cli (µs, from -X importtime) and whether torch was imported."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import daemon.cli, sys; print('torch' in sys.modules)"],
                       capture_output=True, text=True, check=True)
    total_us = None
    for line in r.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2] == "daemon.cli":
            total_us = int(parts[1])
    return {"import_daemon_cli_ms": None if total_us is None else round(total_us / 1000, 1),
            "imports_torch": r.stdout.strip() == "True"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cmd = daemonctl() + ["status", "--json"]
    walls, rcs = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        walls.append(time.perf_counter() - t0)
        rcs.append(r.returncode)
    try:
        daemon_up = json.loads(r.stdout)["daemon"]["up"]
    except (ValueError, KeyError, TypeError):
        daemon_up = None
    print(json.dumps({
        "command": " ".join(cmd),
        "runs": args.runs,
        "wall_s_median": round(statistics.median(walls), 3),
        "wall_s_min": round(min(walls), 3),
        "wall_s_max": round(max(walls), 3),
        "exit_codes": sorted(set(rcs)),
        "daemon_up": daemon_up,
        **import_cost(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }, indent=2))


if __name__ == "__main__":
    main()
