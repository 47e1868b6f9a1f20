"""Proposers side by side on prompts never served: plain vs n-gram (cold and adapted) vs the draft.

For each workload: the decoder first serves ``--serve`` of the workload's prompts (plain
decoding, as a server would before speculation pays), which is all the n-gram proposer's
adaptation is: every served request is indexed. Then, on ``--prompts`` other prompts of the
workload that were never served, back to back per prompt (paired):

- ``plain``: our loop at γ = 0;
- ``ngram`` at each γ: prompt lookup over the request and the served history (each evaluation
  request decodes against a copy of it, so evaluation requests never see each other);
- ``ngram_cold`` at each γ: the same with an empty history (the request's own tokens only);
- ``draft`` at each of ``--draft-gammas``: the derived draft (no adapter) for reference.

Per row: tokens/s end to end, speedup vs plain (pooled and the median of per-prompt speedups),
α = E[Σ min(p, q)] (for the n-gram's one-hot q: E[p(x)]), τ, acceptance rate, coverage (share of
steps that had a proposal), c = draft ms per draft token / plain ms per step, Leviathan et al.'s
predicted speedup (1 - α^(γ+1)) / ((1 - α)(γc + 1)) beside the measured one, and for greedy the
share of requests token-identical to plain decoding.

    .venv/bin/python bench/proposer_bench.py --out proposer_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from decoder.bench import SAMPLING, machine_info  # noqa: E402
from decoder.metrics import AcceptanceCounts  # noqa: E402
from decoder.models import load_pair  # noqa: E402
from decoder.sampling import predicted_speedup  # noqa: E402
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder  # noqa: E402
from decoder.workloads import get_workload  # noqa: E402
from store.jsonsafe import nan_none  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="layers:0-3")
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--serve", type=int, default=16, help="prompts served (plain) before the evaluation, per workload")
    ap.add_argument("--prompts", type=int, default=6, help="never-served evaluation prompts per workload")
    ap.add_argument("--gammas", default="2,4,6")
    ap.add_argument("--draft-gammas", default="1")
    ap.add_argument("--sampling", default="greedy,t1.0")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("gammas", "draft_gammas"):
        vals = [int(x) for x in getattr(a, name).split(",") if x.strip()]
        if any(g < 1 for g in vals):
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: each γ must be >= 1")
        setattr(a, name, vals)
    a.sampling = [s for s in a.sampling.split(",") if s]
    bad = [s for s in a.sampling if s not in SAMPLING]
    if bad:
        ap.error(f"--sampling {bad}: use some of {sorted(SAMPLING)}")
    if a.prompts < 1 or a.serve < 0:
        ap.error("--prompts must be >= 1 and --serve >= 0")
    return a


def _run(dec, ids, params, n, gamma, proposer, workload, history):
    dec.ngram_history = history.copy()
    return dec.generate(DecodeRequest(ids, params, n, gamma=gamma, ignore_eos=True, workload=workload,
                                      proposer=proposer if gamma else None))


def main(argv=None) -> dict:
    a = parse_args(argv)
    import sys

    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    if a.threads:
        torch.set_num_threads(a.threads)
    pair = load_pair(a.target, a.draft)
    tok = pair.tokenizer
    dec = SpeculativeDecoder(pair.target, pair.draft, tok, DecoderConfig(topk_record=0))
    served_history = dec.ngram_history
    from decoder.proposers import NgramHistory

    empty = NgramHistory(dec.config.ngram_max_n, dec.ngram_min_n, dec.config.ngram_history_tokens)
    rows, t_all = [], time.time()
    for wl in a.workloads.split(","):
        prompts = get_workload(wl, a.prompts + a.serve)
        evals, serve = prompts[: a.prompts], prompts[a.prompts:]
        dec.ngram_history = served_history
        t0 = time.time()
        for p in serve:  # what a server saw before: indexed by the n-gram proposer
            dec.generate(DecodeRequest(p.token_ids(tok)[-256:], SAMPLING["greedy"], a.max_new_tokens, gamma=0,
                                       workload=wl))
        served_s = time.time() - t0
        methods = ([("plain", 0, None, served_history)]
                   + [("ngram", g, "ngram", served_history) for g in a.gammas]
                   + [("ngram_cold", g, "ngram", empty) for g in a.gammas]
                   + [("draft", g, "draft", served_history) for g in a.draft_gammas])
        for sname in a.sampling:
            params = SAMPLING[sname]
            res: dict[tuple[str, int], list] = {(m, g): [] for m, g, _, _ in methods}
            for i, p in enumerate(evals):
                ids = p.token_ids(tok)[-256:]
                for m, g, prop, hist in methods:  # back to back per prompt: a slower host slows all alike
                    pr = params if params.greedy else type(params)(params.temperature, params.top_p, params.top_k,
                                                                  seed=1000 + i)
                    res[(m, g)].append(_run(dec, ids, pr, a.max_new_tokens, g, prop, wl, hist))
            plain = res[("plain", 0)]
            plain_ms_step = sum(r.counts.decode_ms for r in plain) / max(1, sum(r.counts.num_steps for r in plain))
            plain_tps = sum(len(r.output_ids) for r in plain) / sum(r.latency_ms for r in plain) * 1e3
            for (m, g), rs in res.items():
                c = AcceptanceCounts()
                for r in rs:
                    c.merge(r.counts)
                tps = sum(len(r.output_ids) for r in rs) / sum(r.latency_ms for r in rs) * 1e3
                per = [r.tokens_per_s / q.tokens_per_s for r, q in zip(rs, plain)]
                cost = (c.draft_ms / c.num_draft_tokens / plain_ms_step) if c.num_draft_tokens else None
                alpha = c.alpha
                row = {
                    "workload": wl, "sampling": sname, "method": m, "gamma": g, "prompts": len(rs),
                    "tokens_per_s": round(tps, 3), "speedup_vs_plain": round(tps / plain_tps, 3),
                    "speedup_median": round(statistics.median(per), 3),
                    "speedup_per_prompt": [round(x, 3) for x in per],
                    "alpha": nan_none(alpha, 4), "tau": nan_none(c.mean_accepted_length, 3),
                    "acceptance_rate": nan_none(c.acceptance_rate, 4),
                    "proposed_tokens": c.num_draft_tokens, "accepted_tokens": c.num_accepted_tokens,
                    "coverage": nan_none(c.num_drafts / c.num_steps if c.num_steps else float("nan"), 3),
                    "draft_ms": round(c.draft_ms, 1), "verify_ms": round(c.verify_ms, 1),
                    "plain_ms_per_step": round(plain_ms_step, 2),
                    "c": None if cost is None else round(cost, 4),
                    "predicted_speedup": (round(predicted_speedup(alpha, g, cost), 3)
                                          if g and cost is not None and alpha == alpha else None),
                }
                if params.greedy and m != "plain":
                    same = [r.output_ids == q.output_ids for r, q in zip(rs, plain)]
                    row["matches_plain_share"] = round(sum(same) / len(same), 3)
                    row["first_diff_index"] = [next((j for j, (x, y) in enumerate(zip(r.output_ids, q.output_ids))
                                                     if x != y), None) for r, q in zip(rs, plain) if r.output_ids != q.output_ids]
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("workload", "sampling", "method", "gamma", "tokens_per_s",
                                                      "speedup_vs_plain", "speedup_median", "alpha", "tau", "coverage", "c",
                                                      "predicted_speedup")}), file=sys.stderr)
        rows.append({"workload": wl, "served_prompts": len(serve), "served_seconds": round(served_s, 1),
                     "history_tokens": served_history.tokens(wl)})
    out = {"machine": machine_info(), "args": {k: v for k, v in vars(a).items()}, "seconds": round(time.time() - t_all, 1),
           "pair": {"target": pair.target_name, "draft": pair.draft_name}, "torch_threads": torch.get_num_threads(),
           "small_m_calibration": dec.small_m_calibration, "rows": rows}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return out


if __name__ == "__main__":
    main()
