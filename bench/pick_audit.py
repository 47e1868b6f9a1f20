"""Does the goodput controller price its candidates at what they run? A calibration check of
issue 34's "the pick never loses".

One process builds the serving loop as ``daemonctl serve`` does (``bench/serve_overhead.py``'s
``build``: records to Redis under a throwaway key prefix, deleted at the end; no trainer). Per
workload it serves ``--serve`` requests of the workload's pool (prompts past the demo's
evaluation ones) at the controller's own choices, every request allowed to probe (as the demo's
re-measurement does), then reads the controller's decision: each candidate's tokens per ms
(``tokens_per_ms``: the draft per γ; ``tokens_per_ms_by_proposer``: the n-gram types per γ) over
plain decoding's, the *price*. Then, on ``--prompts`` never-served prompts (the demo's evaluation
prompts), back to back per prompt (paired), greedy, ``ignore_eos``, ``--max-tokens`` each, with
the n-gram history and gate as serving left them (a copy per run, as the demo's evaluation
does): plain decoding and each audited candidate (the pick, ``--ngram-gammas`` of every offered
n-gram type, ``--draft-gammas`` of the draft), each run's decoding time (``latency_ms`` -
``prefill_ms``: what the price is per decoding step) and its tokens: the *run*, its pooled
tokens per ms over plain's with a paired bootstrap interval over prompts
(``trainer.gate.paired_ratio_gain``). Every output is checked equal to plain's.

Prints one JSON object at the end (logs may come before it on stdout; ``--out`` holds the object
alone): per workload the decision's ``t_plain_ms``, ``overhead_ms``, the pick,
and per candidate ``priced`` / ``ran`` [low, high] / ``priced_over_ran``.

Usage: .venv/bin/python bench/pick_audit.py [--workloads prose,code,math,extract] [--serve 16]
       [--prompts 8] [--max-tokens 64] [--ngram-gammas 1,2,4,8] [--draft-gammas 1,2] [--out F]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


ROWS: dict[tuple[str, int], list[float]] = {}  # (served | eval, rows) -> draft + verify ms of each step


def rows_ms() -> dict[str, dict[int, list]]:
    """Median draft + verify ms and count of steps by verified rows, served and evaluated (then cleared)."""
    import statistics

    out: dict[str, dict[int, list]] = {}
    for (side, n), xs in sorted(ROWS.items()):
        out.setdefault(side, {})[n] = [round(statistics.median(xs), 3), len(xs)]
    ROWS.clear()
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def serve_phase(loop, service, workload: str, prompts, max_tokens: int) -> list[dict]:
    """Serve ``prompts`` (token id lists) of ``workload`` at the controller's choices; one row per
    request (its proposer, γ, tokens, why)."""
    rows = []
    for ids in prompts:
        b = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "workload": workload,
             "stream": True, "model": service.model}
        t0 = time.perf_counter()
        ticket = loop.submit(service.request_of(service.parse(b, "completion")), on_tokens=lambda ids: None)
        res = ticket.result(timeout=600)
        for st in res.steps:
            ROWS.setdefault(("served", st.proposed + 1), []).append(st.draft_ms + st.verify_ms)
        rows.append({"proposer": res.proposer, "tokens": len(res.output_ids), "ms": round((time.perf_counter() - t0) * 1e3, 1),
                     "proposed": sum(st.proposed for st in res.steps), "why": (ticket.decision or {}).get("why")})
    return rows


def candidates(decision: dict, ngram_gammas: list[int], draft_gammas: list[int]) -> dict[tuple[str, int], float | None]:
    """(proposer, γ) -> its price (tokens per ms over plain's as the controller rates it; None
    where unrated): the pick, the draft at ``draft_gammas``, each n-gram type at ``ngram_gammas``,
    each as the demo prices its pick (``daemon.demo._priced``)."""
    from daemon.demo import _priced

    keys = [("draft", g) for g in draft_gammas]
    keys += [(name, g) for name in (decision.get("tokens_per_ms_by_proposer") or {}) for g in ngram_gammas]
    if decision.get("gamma"):
        keys.append((decision.get("proposer") or "draft", int(decision["gamma"])))
    return {(p, g): _priced(decision, p, g) for p, g in keys}


def evaluate(decoder, workload: str, prompts, cands, max_tokens: int) -> dict[str, list[tuple[int, float]]]:
    """Plain and every candidate on every prompt, back to back per prompt: name -> [(tokens,
    decoding ms)] per prompt. Raises AssertionError where a greedy output differs from plain's."""
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    history = decoder.ngram_history.copy()
    gate = decoder.ngram_gate.copy() if decoder.ngram_gate is not None else None
    params = SamplingParams()
    runs = [("plain", None, 0)] + [(f"{p}@{g}", p, g) for p, g in cands]
    per: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in runs}
    parts = per.setdefault("_parts", {})  # name -> [(steps, step tokens, draft ms, verify ms, decode ms)] per prompt
    for i, ids in enumerate(prompts):
        if i == 0:  # warm-up, not counted
            decoder.ngram_history, decoder.ngram_gate = history.copy(), gate.copy() if gate is not None else None
            decoder.generate(DecodeRequest(ids, params, 4, gamma=0, ignore_eos=True, workload=workload))
        plain_ids = None
        for name, p, g in runs:
            decoder.ngram_history, decoder.ngram_gate = history.copy(), gate.copy() if gate is not None else None
            r = decoder.generate(DecodeRequest(ids, params, max_tokens, gamma=g, ignore_eos=True, workload=workload,
                                               proposer=p))
            c = r.counts
            for st in r.steps:
                ROWS.setdefault(("eval", st.proposed + 1), []).append(st.draft_ms + st.verify_ms)
            per[name].append((c.num_emitted_tokens, r.latency_ms - c.prefill_ms))
            parts.setdefault(name, []).append((c.num_steps, c.num_emitted_tokens - c.num_prefill_tokens, c.draft_ms,
                                               c.verify_ms, c.decode_ms))
            if plain_ids is None:
                plain_ids = list(r.output_ids)
            elif list(r.output_ids) != plain_ids:
                raise AssertionError(f"{workload} prompt {i}: {name}'s greedy output differs from plain decoding's")
    decoder.ngram_history, decoder.ngram_gate = history, gate
    return per


def ratio(plain: list[tuple[int, float]], other: list[tuple[int, float]]) -> dict:
    """Pooled tokens per ms of ``other`` over ``plain``, paired bootstrap interval over prompts, as
    the demo's evaluation computes it (``daemon.demo._speed_ratio``)."""
    from daemon.demo import _speed_ratio

    r = _speed_ratio({str(i): (a[0], a[1], b[0], b[1]) for i, (a, b) in enumerate(zip(plain, other))}, 0.95) or {}
    return {"ran": r.get("ratio"), "low": r.get("low"), "high": r.get("high")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="prose,code,math,extract")
    ap.add_argument("--serve", type=int, default=16, help="requests served per workload before the decision is read")
    ap.add_argument("--prompts", type=int, default=8, help="never-served prompts per workload, paired")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ngram-gammas", default="1,2,4,8")
    ap.add_argument("--draft-gammas", default="1,2")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    from daemon.demo import _PROMPT_TOKENS, DemoConfig, _prompts
    from daemon.settings import load_settings
    from serve_overhead import build, own_key_prefix

    own_key_prefix("audit")  # before the settings are read

    settings = load_settings()
    prefix = settings.store.key_prefix
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally below deletes the run's keys
    out: dict = {"serve": a.serve, "prompts": a.prompts, "max_tokens": a.max_tokens, "workloads": {}}
    loop = None
    try:
        client, pair, loop, service = build(settings, prefix)
        n_eval = DemoConfig.quick().eval_prompts
        tok = pair.tokenizer
        ctl = loop.controller
        ctl.config.unsure_probe_every = 1
        for w in [x for x in a.workloads.split(",") if x]:
            pool = [p.token_ids(tok)[-_PROMPT_TOKENS:] for p in _prompts(w, a.serve, skip=n_eval)]
            served = serve_phase(loop, service, w, pool, a.max_tokens)
            from decoder.sampling import SamplingParams
            d = ctl.decision((w, SamplingParams().bucket()))
            cands = candidates(d, _ints(a.ngram_gammas), _ints(a.draft_gammas))
            evals = [p.token_ids(tok)[-_PROMPT_TOKENS:] for p in _prompts(w, a.prompts)]
            per = evaluate(loop.decoder, w, evals, [k for k in cands], a.max_tokens)
            rows = {}
            for name, xs in per.pop("_parts").items():
                st, tk, dm, vm, de = (sum(x[i] for x in xs) for i in range(5))
                rows.setdefault("_eval", {})[name] = {"tokens_per_step": round(tk / max(1, st), 3),
                                                      "draft_ms_per_step": round(dm / max(1, st), 3),
                                                      "verify_ms_per_step": round(vm / max(1, st), 3),
                                                      "decode_ms_per_step": round(de / max(1, st), 3)}
            s = ctl._keys.get((w, SamplingParams().bucket()))
            for pname, m in (s.lengths.items() if s is not None else ()):
                rows.setdefault("_model", {})[pname] = {
                    "tokens": {g: round(e.value, 3) for g, e in m.tokens.items() if e.n},
                    "step_ms": {g: round(e.value, 3) for g, e in m.step_ms.items() if e.n},
                    "draft_ms": round(m.draft_ms.value, 3) if m.draft_ms.n else None,
                    "base_ms": round(m.base_ms.value, 3) if m.base_ms.n else None, "base_n": m.base_ms.n,
                    "plain_now": round(s.verify_ms[0].value, 3) if 0 in s.verify_ms else None,
                    "overhead_ms": round(s.overhead_ms.value, 3) if s.overhead_ms.n else None, "steps": m.steps}
            for (p, g), priced in cands.items():
                r = ratio(per["plain"], per[f"{p}@{g}"])
                r["priced"] = priced
                r["priced_over_ran"] = round(priced / r["ran"], 3) if priced and r["ran"] else None
                rows[f"{p}@{g}"] = r
            plain_tok = sum(n for n, _ in per["plain"])
            out["workloads"][w] = {
                "pick": {"proposer": d.get("proposer"), "gamma": d.get("gamma"), "why": d.get("why")},
                "t_plain_ms": d.get("t_plain_ms"), "overhead_ms": d.get("overhead_ms"),
                "t_verify_ms": d.get("t_verify_ms"), "t_draft_ms": d.get("t_draft_ms"), "alpha": d.get("alpha"),
                "eval_plain_ms_per_token": round(sum(ms for _, ms in per["plain"]) / max(1, plain_tok), 3),
                "step_cost_ms": loop.decoder.step_cost.status() if loop.decoder.step_cost is not None else None,
                "rows_ms": rows_ms(),
                "served": [{k: s[k] for k in ("proposer", "tokens", "ms", "proposed")} for s in served],
                "candidates": rows}
            print(json.dumps({w: out["workloads"][w]["candidates"], "t_plain_ms": d.get("t_plain_ms"),
                              "eval_plain": out["workloads"][w]["eval_plain_ms_per_token"],
                              "pick": out["workloads"][w]["pick"]}), file=sys.stderr, flush=True)
    finally:
        try:
            if loop is not None:
                loop.close()
        finally:
            from store.client import connect

            keys = connect(settings.redis.url or "redis://127.0.0.1:6379/0")
            for k in keys.scan_iter(match=prefix + "*", count=1000):
                keys.delete(k)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
