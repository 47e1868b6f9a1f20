"""What a fused step of B sequences x r verified rows costs on the llama.cpp engine, and the goodput
controller's γ per batch size from it (issue 35 item 2). JSON out.

1. ``fused_ms``: one :meth:`~decoder.engines.llamacpp.LlamaCppEngine.forward_batch` of B sequences
   (B in ``--batches``), each appending r rows with logits at all r (a verification of γ = r - 1
   per sequence; ``--rows``), after ``--cached`` tokens cached per sequence, on one engine holding
   ``max(batches)`` sequences (``n_seq``, as serve builds it); median ms over ``--reps``, the
   cells interleaved within each rep (alternating direction) so a burst of load from other
   processes hits all alike; each cell summarised twice, ``median`` and ``p10`` (the 10th
   percentile: on a core shared with other jobs, the nearest to the cell's own cost).
   ``alone_ms``: one sequence of n rows on the same engine for n up to B x r (the batch-1 curve
   StepCost reads the fused model off). ``ratio_to_plain``: t_B(r) / t_1(1); ``per_request_row``:
   what each further row of every sequence costs, (t_B(r) - t_B(1)) / (B (r - 1)) / t_1(1);
   ``model_ms``: :meth:`decoder.proposers.cost.StepCost.fused_ms` with the batch-1 curve only
   (t(B x r), no fused readings), to show how far the model is from the measurement.
2. ``decisions``: a :class:`decoder.control.GoodputController` (γ_max = max rows) whose key has
   the measured batch-1 costs as its verify ms (γ = 0..max rows), proposals free (draft ms 0: the n-gram proposer's case, the
   cheapest) and α in ``--alphas``, with the decoder's StepCost fed the measured table at batch 1
   and fused: its decision per batch size (``decision(key)["by_batch"]``: γ, rates per request,
   the step cost factor ρ_B(r) = t_B(r) / t(r)), once from the measured fused table
   (``measured``) and once from the model alone (``model``). ``break_even_alpha``: per B and γ,
   the α above which γ free proposals per request beat plain decoding in a batch of B,
   E(α, γ) = t_B(γ + 1) / t_B(1).

Usage: ``.venv/bin/python bench/fused_cost_bench.py [--reps 30] [--threads 2]`` (seconds on 2
cores). Results: bench/RESULTS.md, the continuous batching section.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(gguf, batches, rows, reps, threads, cached):
    from decoder.engines.llamacpp import LlamaCppEngine

    nmax = max(batches)
    eng = LlamaCppEngine(gguf, n_ctx=1024, threads=threads, n_seq=nmax)
    seqs = [eng.start() for _ in range(nmax)]
    eng.forward_batch([(s, [100 + (i * 7 + j) % 1000 for j in range(cached)], 1) for i, s in enumerate(seqs)])
    alone_n = sorted({b * r for b in batches for r in rows} | set(range(1, max(rows) + 2)))
    cells = [("fused", b, r) for b in batches for r in rows] + [("alone", 1, n) for n in alone_n]
    ms = {c: [] for c in cells}
    for rep in range(reps + 2):  # two warm-up reps
        order = cells if rep % 2 == 0 else cells[::-1]
        for kind, b, r in order:
            items = [(seqs[i], [5 + (i + j) % 500 for j in range(r)], r) for i in range(b)]
            t0 = time.perf_counter()
            eng.forward_batch(items)
            dt = (time.perf_counter() - t0) * 1e3
            for s, _, _ in items:
                s.truncate(cached)
            if rep >= 2:
                ms[(kind, b, r)].append(dt)
    eng.close()
    # two summaries of each cell: the median, and the 10th percentile (on a core shared with
    # other jobs a reading is the cell's own cost plus whatever preempted it; the low quantile
    # is the nearest to the cell alone)
    out = {}
    for name, f in (("median", statistics.median), ("p10", lambda v: sorted(v)[len(v) // 10])):
        m = {c: f(v) for c, v in ms.items()}
        out[name] = ({(b, r): m[("fused", b, r)] for b in batches for r in rows},
                     {n: m[("alone", 1, n)] for n in alone_n})
    return out


def decisions(fused, alone, batches, rows, alphas, use_fused: bool):
    from decoder.control import DRAFT, ControllerConfig, GoodputController
    from decoder.metrics import StepStats
    from decoder.proposers.cost import StepCost

    key = ("bench", "greedy")
    out = {}
    for a in alphas:
        cost = StepCost(clock=lambda: 0.0)  # one frozen instant: every reading paired with its plain steps
        for n, t in alone.items():
            cost.add(n, t)
        if use_fused:
            for (b, r), t in fused.items():
                if b > 1:
                    cost.add(r, t, batch=b)
        gmax = max(rows)  # γ up to the rows measured per sequence (its verify ms: alone[γ + 1], measured to max + 1)
        ctl = GoodputController(ControllerConfig(min_steps=1, batch_sizes=tuple(batches), gamma_max=gmax, gamma_init=1),
                                step_cost=cost)
        for g in range(0, gmax + 1):
            ctl.observe(key, StepStats(g, 0, 1, -1 if g == 0 else 0, a * g, 0.0, alone[g + 1]))
        by = ctl.decision(key)["by_batch"]
        out[str(a)] = {b: {"gamma": d["gamma"], "tokens_per_ms_per_request": d["tokens_per_ms"],
                           "plain_tokens_per_ms_per_request": d["plain_tokens_per_ms"],
                           "step_cost_factor": d["step_cost_factor"], "why": d["why"]} for b, d in by.items()}
        assert all(d["proposer"] in (None, DRAFT) for d in by.values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cached", type=int, default=100, help="tokens cached per sequence before the timed rows")
    ap.add_argument("--alphas", default="0.4,0.5,0.6,0.8,0.9")
    ap.add_argument("--from-json", default=None,
                    help="recompute the decisions from this script's earlier JSON output (no measuring)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    from decoder.models.packaged import packaged_gguf
    from decoder.proposers.cost import StepCost

    batches = [int(x) for x in a.batches.split(",")]
    rows = [int(x) for x in a.rows.split(",")]
    alphas = [float(x) for x in a.alphas.split(",")]
    gguf = packaged_gguf("smollm2-135m") if not a.from_json else None
    t0 = time.time()
    load_before = _load()
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        summaries = {}
        for name in ("median", "p10"):
            x = res[name]
            summaries[name] = ({tuple(int(v) for v in k.split("x")): t for k, t in x["fused_ms"].items()},
                               {int(n): t for n, t in x["alone_ms"].items()})
        batches = sorted({b for b, _ in summaries["median"][0]})
        rows = sorted({r for _, r in summaries["median"][0]})
    else:
        summaries = measure(gguf, batches, rows, a.reps, a.threads, a.cached)
        res = {"host": {"machine": platform.machine(), "processor": _cpu(), "threads": a.threads,
                        "load_avg_before": load_before},
               "gguf": Path(gguf).name, "cached": a.cached, "reps": a.reps}
    for name, (fused, alone) in summaries.items():
        model = StepCost(clock=lambda: 0.0)
        for n, t in alone.items():
            model.add(n, t)
        t11 = fused[(1, 1)]
        t_b1 = {b: fused[(b, 1)] for b in batches}
        res_break = {b: {r - 1: _break_even(fused[(b, r)] / t_b1[b], r - 1) for r in rows if r > 1} for b in batches}
        res[name] = {
            "break_even_alpha": res_break,
            "fused_ms": {f"{b}x{r}": round(t, 3) for (b, r), t in fused.items()},
            "ratio_to_plain": {f"{b}x{r}": round(t / t11, 3) for (b, r), t in fused.items()},
            "per_request_row": {f"{b}x{r}": round((t - fused[(b, 1)]) / (b * (r - 1)) / t11, 3)
                                for (b, r), t in fused.items() if r > 1},
            "alone_ms": {n: round(t, 3) for n, t in alone.items()},
            "model_ms": {f"{b}x{r}": round(model.fused_ms(b, r), 3) for (b, r) in fused},
            "decisions": {"measured": decisions(fused, alone, batches, rows, alphas, True),
                          "model": decisions(fused, alone, batches, rows, alphas, False)},
        }
    if not a.from_json:
        res.update(seconds=round(time.time() - t0, 1), load_avg_after=_load())
    print(json.dumps(res, indent=1))
    return 0


def _break_even(ratio: float, g: int) -> float | None:
    """The α at which γ = ``g`` free proposals per request pay at a step ``ratio`` x a plain one:
    E(α, g) = (1 - α^(g+1)) / (1 - α) = ratio (Leviathan et al. 2023, eq. 1), by bisection; None
    above g + 1 (no α pays)."""
    if ratio >= g + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = sum(mid ** k for k in range(g + 1))
        lo, hi = (mid, hi) if e < ratio else (lo, mid)
    return round(hi, 3)


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _load():
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
