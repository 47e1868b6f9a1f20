"""Proposers side by side on prompts never served: plain vs n-gram (gated, ungated, cold) vs the
draft, beside llama.cpp's own plain generation.

For each workload: the decoder first serves ``--serve`` of the workload's prompts with the gated
n-gram proposer at γ = ``--serve-gamma`` (0: plain decoding), as a server does once speculation
is on: every served request is indexed into the history, and every verification of a proposal
teaches the gate (``decoder.proposers.ngram.NgramGate``) which kinds of match pay on this engine. Then,
on ``--prompts`` other prompts of the workload that were never served, back to back per prompt
(paired):

- ``plain``: our loop at γ = 0;
- ``llamacpp_plain`` (``--engine llamacpp``): llama-cpp-python's own generation on the same GGUF;
- ``ngram`` at each γ: prompt lookup over the request and the served history, gated: γ is the
  most it proposes per step (each evaluation request decodes against copies of the served
  history and gate, so evaluation requests never see each other);
- ``ngram_ungated`` at each γ: the same, every matched token up to γ proposed
  (``DecoderConfig(ngram_gate=False)``);
- ``ngram_cold`` at each γ: gated, with an empty history and a fresh gate (the request's own
  tokens only);
- ``draft`` at each of ``--draft-gammas``: the derived draft (no adapter) for reference;
- ``eagle`` at each of ``--eagle-gammas`` (``--eagle-head F``): the feature-level head of
  ``decoder.eagle`` trained by ``bench/eagle_bench.py --save F``, on the target's hidden states;
- ``peer_gguf_plain`` (``--peer-gguf F``): llama.cpp's own plain generation on another file F,
  and every row's per-prompt speedup against it (``speedup_vs_peer_gguf_*``): e.g. a requantised
  target (``bench/verify_cost_bench.py --formats``) against the packaged file it came from.

Per row: tokens/s end to end, speedup vs plain (pooled and the median of per-prompt speedups),
α = E[Σ min(p, q)] (for the n-gram's one-hot q: E[p(x)]), τ, acceptance rate, coverage (share of
steps that had a proposal), c = draft ms per draft token / plain ms per step, Leviathan et al.'s
predicted speedup (1 - α^(γ+1)) / ((1 - α)(γc + 1)) beside the measured one, and for greedy the
share of requests token-identical to plain decoding. Sampled requests are unseeded, as most of a
server's are (``--seeded`` seeds them; the gate is then off, see ``DecoderConfig.ngram_gate``).
``step_cost_ms``: what a step of n verified
rows cost (median), the gate's cost model.

    .venv/bin/python bench/proposer_bench.py --out proposer_bench.json            # llama.cpp (the main job's engine)
    .venv/bin/python bench/proposer_bench.py --engine torch --out proposer_bench.json
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
from decoder.models.loading import load_pair  # noqa: E402
from decoder.proposers.ngram import NgramGate  # noqa: E402
from decoder.sampling import predicted_speedup  # noqa: E402
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder  # noqa: E402
from decoder.workloads import get_workload  # noqa: E402
from store.jsonsafe import nan_none  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="layers:0-3")
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--engine", default="llamacpp", choices=("llamacpp", "torch"), help="the target's engine")
    ap.add_argument("--serve", type=int, default=16, help="prompts served before the evaluation, per workload")
    ap.add_argument("--serve-gamma", type=int, default=8, help="γ the gated n-gram serves them at (0: plain)")
    ap.add_argument("--prompts", type=int, default=6, help="never-served evaluation prompts per workload")
    ap.add_argument("--gammas", default="1,3,8")
    ap.add_argument("--draft-gammas", default="1")
    ap.add_argument("--eagle-head", default=None,
                    help="a trained feature-level head (bench/eagle_bench.py --save): adds rows 'eagle' at --eagle-gammas")
    ap.add_argument("--eagle-gammas", default="1,2,3")
    ap.add_argument("--sampling", default="greedy,t1.0")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--peer-gguf", default=None,
                    help="a second GGUF whose llama.cpp plain generation runs beside every prompt (e.g. the packaged "
                         "Q4_1 file while --target is a requantised one): each row gets its speedup against it")
    ap.add_argument("--seeded", action="store_true", help="seed the sampled requests (the n-gram gate is then off)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("gammas", "draft_gammas", "eagle_gammas"):
        try:
            vals = [int(x) for x in getattr(a, name).split(",") if x.strip()]
        except ValueError:
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)!r}: a comma-separated list of integers")
        if any(g < 1 for g in vals):
            ap.error(f"--{name.replace('_', '-')}={getattr(a, name)}: each γ must be >= 1")
        setattr(a, name, vals)
    a.sampling = [s for s in a.sampling.split(",") if s]
    bad = [s for s in a.sampling if s not in SAMPLING]
    if bad:
        ap.error(f"--sampling {bad}: use some of {sorted(SAMPLING)}")
    if a.peer_gguf is not None:
        peer = Path(a.peer_gguf)
        if not peer.is_file():
            ap.error(f"--peer-gguf {a.peer_gguf!r}: not a file")
        with open(peer, "rb") as f:
            if f.read(4) != b"GGUF":
                ap.error(f"--peer-gguf {a.peer_gguf!r}: not a GGUF file (no GGUF magic)")
        if a.engine != "llamacpp":
            ap.error("--peer-gguf needs --engine llamacpp (llama.cpp runs the peer)")
    if a.eagle_head is not None:
        try:
            from safetensors import safe_open

            with safe_open(a.eagle_head, "pt") as f:
                f.metadata()
        except Exception as e:  # a missing file, or not safetensors
            ap.error(f"--eagle-head {a.eagle_head!r}: not a head file ({e}); bench/eagle_bench.py --save writes one")
    if a.prompts < 1 or a.serve < 0 or a.serve_gamma < 0:
        ap.error("--prompts must be >= 1, --serve and --serve-gamma >= 0")
    return a


def _run(dec, ids, params, n, gamma, proposer, workload, history, gate):
    dec.ngram_history = history.copy()
    dec.ngram_gate = gate.copy() if gate is not None else None
    return dec.generate(DecodeRequest(ids, params, n, gamma=gamma, ignore_eos=True, workload=workload,
                                      proposer=proposer if gamma else None))


def main(argv=None) -> dict:
    a = parse_args(argv)
    import sys

    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    if a.threads:
        torch.set_num_threads(a.threads)
    from decoder.bench import LlamaCppPeer
    from decoder.engines.registry import choose_engine, torch_threads_for
    from decoder.proposers.ngram import NgramHistory

    pair = load_pair(a.target, a.draft)
    tok = pair.tokenizer
    # llama.cpp on every core, as serve runs it; with a head, its hidden states too
    choice = choose_engine(a.engine, a.target, "cpu", a.draft, embeddings=bool(a.eagle_head))
    dec = SpeculativeDecoder(pair.target, pair.draft, tok, DecoderConfig(topk_record=0, prompt_cache=False), engine=choice.target,
                             draft_engine=choice.draft)
    if a.eagle_head:
        from decoder.eagle import load_head
        from trainer.distill import cpu_has_native_bf16

        dec.eagle_head = load_head(pair.target, a.eagle_head).serving_copy(
            torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    peer = (LlamaCppPeer(choice.target.path, choice.target.threads, n_ctx=choice.target.context_length)
            if choice.name == "llamacpp" else None)
    if a.peer_gguf:
        peer2 = LlamaCppPeer(str(a.peer_gguf), choice.target.threads, n_ctx=choice.target.context_length)
    else:
        peer2 = None
    served_history, served_gate = dec.ngram_history, dec.ngram_gate
    empty = NgramHistory(dec.config.ngram_max_n, dec.ngram_min_n, dec.config.ngram_history_tokens)
    rows, t_all = [], time.time()
    with torch_threads_for(dec.engine):  # as serve decodes on llama.cpp: torch at one thread
        for wl in a.workloads.split(","):
            rows += _workload(a, dec, tok, wl, served_history, served_gate, empty, peer, peer2)
    out = {"machine": machine_info(), "args": {k: v for k, v in vars(a).items()}, "seconds": round(time.time() - t_all, 1),
           "pair": {"target": pair.target_name, "draft": pair.draft_name}, "torch_threads": torch.get_num_threads(),
           "engine": dec.engine.describe(), "small_m_calibration": dec.small_m_calibration,
           "step_cost_ms": dec.step_cost.status(), "ngram_gate": served_gate.status(), "rows": rows}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return out


def _workload(a, dec, tok, wl, served_history, served_gate, empty, peer, peer2=None) -> list[dict]:
    """One workload: serve, then every method back to back per never-served prompt; its rows.
    ``peer2`` (``--peer-gguf``): llama.cpp's plain generation on another file, run beside each
    prompt; every row then carries its per-prompt speedup against it."""
    rows = []
    prompts = get_workload(wl, a.prompts + a.serve)
    evals, serve = prompts[: a.prompts], prompts[a.prompts:]
    dec.ngram_history, dec.ngram_gate = served_history, served_gate
    t0 = time.time()
    for p in serve:  # what a server saw before: indexed by the n-gram proposer, and taught its gate
        dec.generate(DecodeRequest(p.token_ids(tok)[-256:], SAMPLING["greedy"], a.max_new_tokens, gamma=a.serve_gamma,
                                   workload=wl, proposer="ngram" if a.serve_gamma else None))
    served_s = time.time() - t0
    methods = ([("plain", 0, None, served_history, served_gate)]
               + [("ngram", g, "ngram", served_history, served_gate) for g in a.gammas]
               + [("ngram_ungated", g, "ngram", served_history, None) for g in a.gammas]
               + [("ngram_cold", g, "ngram", empty, NgramGate()) for g in a.gammas]
               + [("draft", g, "draft", served_history, served_gate) for g in a.draft_gammas]
               + ([("eagle", g, "eagle", served_history, served_gate) for g in a.eagle_gammas]
                  if dec.eagle_head is not None else []))
    for sname in a.sampling:
        params = SAMPLING[sname]
        res: dict[tuple[str, int], list] = {(m, g): [] for m, g, *_ in methods}
        peer_runs: list[tuple[float, float, bool]] = []  # (tokens/s, our plain tokens/s, same tokens)
        peer2_tps: list[float] = []
        for i, p in enumerate(evals):
            ids = p.token_ids(tok)[-256:]
            # sampled requests unseeded, as most of a server's are: a seeded one runs without the gate (its γ
            # would follow step timings, so the seed would not reproduce the completion)
            pr = params if params.greedy or not a.seeded else type(params)(params.temperature, params.top_p,
                                                                           params.top_k, seed=1000 + i)
            for m, g, prop, hist, gate in methods:  # back to back per prompt: a slower host slows all alike
                res[(m, g)].append(_run(dec, ids, pr, a.max_new_tokens, g, prop, wl, hist, gate))
            if peer is not None:
                out, ms, n_out = peer.generate(ids, params, a.max_new_tokens, 1000 + i)
                mine = res[("plain", 0)][-1]
                peer_runs.append((n_out / ms * 1e3, mine.tokens_per_s, out == mine.output_ids[: len(out)]))
            if peer2 is not None:
                _, ms, n_out = peer2.generate(ids, params, a.max_new_tokens, 1000 + i)
                peer2_tps.append(n_out / ms * 1e3)
        plain = res[("plain", 0)]
        plain_ms_step = sum(r.counts.decode_ms for r in plain) / max(1, sum(r.counts.num_steps for r in plain))
        plain_tps = sum(len(r.output_ids) for r in plain) / sum(r.latency_ms for r in plain) * 1e3
        if peer_runs:
            per = [mine / theirs for theirs, mine, _ in peer_runs]
            rows.append({"workload": wl, "sampling": sname, "method": "llamacpp_plain", "gamma": 0,
                         "prompts": len(peer_runs), "tokens_per_s": round(statistics.mean(t for t, _, _ in peer_runs), 3),
                         "ours_plain_vs_llamacpp_per_prompt": [round(x, 3) for x in per],
                         "ours_plain_vs_llamacpp_median": round(statistics.median(per), 3),
                         **({"same_tokens_share": round(sum(s for *_, s in peer_runs) / len(peer_runs), 3)}
                            if params.greedy else {})})
        if peer2_tps:
            rows.append({"workload": wl, "sampling": sname, "method": "peer_gguf_plain", "gamma": 0,
                         "gguf": Path(a.peer_gguf).name, "prompts": len(peer2_tps),
                         "tokens_per_s": round(statistics.mean(peer2_tps), 3)})
        for (m, g), rs in res.items():
            rows.append(_row(wl, sname, m, g, rs, plain, plain_tps, plain_ms_step, params.greedy))
            if peer2_tps:
                per = [r.tokens_per_s / t for r, t in zip(rs, peer2_tps)]
                rows[-1]["speedup_vs_peer_gguf_median"] = round(statistics.median(per), 3)
                rows[-1]["speedup_vs_peer_gguf_per_prompt"] = [round(x, 3) for x in per]
            print(json.dumps({k: rows[-1][k] for k in ("workload", "sampling", "method", "gamma", "tokens_per_s",
                                                       "speedup_vs_plain", "speedup_median", "alpha", "tau", "coverage",
                                                       "c", "predicted_speedup")}), file=sys.stderr)
    rows.append({"workload": wl, "served_prompts": len(serve), "served_gamma": a.serve_gamma,
                 "served_seconds": round(served_s, 1), "history_tokens": served_history.tokens(wl)})
    return rows


def _row(wl, sname, m, g, rs, plain, plain_tps, plain_ms_step, greedy) -> dict:
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
    if greedy and m != "plain":
        same = [r.output_ids == q.output_ids for r, q in zip(rs, plain)]
        row["matches_plain_share"] = round(sum(same) / len(same), 3)
        row["first_diff_index"] = [next((j for j, (x, y) in enumerate(zip(r.output_ids, q.output_ids)) if x != y), None)
                                   for r, q in zip(rs, plain) if r.output_ids != q.output_ids]
    return row


if __name__ == "__main__":
    main()
