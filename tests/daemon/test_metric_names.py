"""serve's live metrics and the daemon's metrics never share a name: one Prometheus scraping both
would otherwise get two series of one name that disagree (serve counts its own process's requests
by adapter version; the daemon sums the acceptance history's buckets, which expire)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _names(path: Path, prefixes: dict[str, str]) -> set[str]:
    """The metric family names a module declares as ``<PREFIX> + "name"``."""
    text = path.read_text()
    out = set()
    for var, prefix in prefixes.items():
        out |= {prefix + m for m in re.findall(rf'\b{var} \+ "([a-z_]+)"', text)}
    return out


def test_serve_and_daemon_metric_names_are_disjoint():
    serve = _names(ROOT / "daemon" / "serve.py", {"P": "draftd:"})
    daemon = _names(ROOT / "daemon" / "metrics.py", {"P": "draftd:", "H": "draftd:history_"})
    assert "draftd:spec_decode_num_drafts" in serve and "draftd:history_spec_decode_num_drafts" in daemon
    assert len(serve) >= 10 and len(daemon) >= 15
    assert serve & daemon == set()
