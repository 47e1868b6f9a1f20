"""What ``models.format = "auto"`` measures and chooses on this host (decoder/models/formats.py). JSON out.

Per thread count: :func:`decoder.models.formats.measure_formats` on the packaged target (the
packaged file, F16, BF16, Q8_0: median ms of a plain step and of a verification of 2-8 rows, whether
the rows of a verification equal one-row steps, the derived draft's step), measured afresh (no
cache), and :func:`decoder.models.formats.choose_format`'s choice with the prior α
(``decoder.models.formats.prior_alphas``: each proposer's ``ProposerSpec.prior_alpha``) for the
n-gram proposer and the draft.

Usage: ``.venv/bin/python bench/served_format_bench.py [--threads 1,2] [--reps 5] [--target smollm2-135m]``
(run it alone on the cores). Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated llama.cpp thread counts")
    ap.add_argument("--reps", type=int, default=5, help="repeats per row count (median; one warm-up more)")
    ap.add_argument("--target", default="smollm2-135m", help="a built-in model name")
    ap.add_argument("--draft-layers", default="0-3", help="the derived draft's layers, whose step is c")
    a = ap.parse_args()
    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    from decoder.models.formats import choose_format, measure_formats
    from decoder.models.packaged import packaged_gguf

    src = packaged_gguf(a.target)
    out = []
    for th in (int(t) for t in a.threads.split(",")):
        with tempfile.TemporaryDirectory() as d:  # afresh: never the serving cache
            m = measure_formats(src, th, reps=a.reps, draft_layers=a.draft_layers or None, cache_dir=Path(d))
        c = choose_format(m)
        out.append({"threads": th, "seconds": m.seconds, "draft_ms": m.draft_ms, "key": m.key,
                    "choice": c.format, "reason": c.reason, "costs": c.costs})
    print(json.dumps({"target": a.target, "gguf": src.name, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
