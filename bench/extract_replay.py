"""How fast could prompt lookup make a workload on this engine, and which gate features would buy
more? A replay, not a timed run.

Plain greedy outputs of never-served prompts (llama.cpp, 1 thread, ``logits_all``: the target's
top-1 probability at every output position is kept), then at each step the n-gram proposal and its
accepted prefix against the real next tokens, priced with the verification cost t(n)/t(1) of the
packaged Q4_1 at one thread (``--cost``: the AMX Xeon's table in bench/RESULTS.md, "The served format,
chosen by measurement", by default; a line between and beyond the measured counts). Speedup =
tokens emitted / summed step costs, decoding steps only (no prefill, no per-step overhead: an upper
bound on the end-to-end figure). Policies:

- fixed γ (the latest earlier occurrence of the longest suffix, n = 4..1);
- ``oracle``: proposes exactly the accepted prefix of that match (the ceiling of any gate on it);
- the gate: a replay of :class:`decoder.proposers.ngram.NgramGate`'s estimator (per kind of match:
  conditional acceptance per position bucket, forgetting 0.97, uniform prior, the g with the most
  E(g) / t(g + 1)), cold (one pass) and warm (a second pass over the same outputs: optimistic),
  with variants: which occurrence is proposed (``latest``, ``longest`` backward match, ``majority``
  next token), the longest n (4 or 8), and ``conf``: the target's top-1 probability at the last
  emitted token as an extra feature of the kind of match (buckets 0.5 / 0.8 / 0.95).

Per-prompt speedups of each variant are paired against the shipped gate (``latest``, n <= 4, no
feature), with a 95 % bootstrap interval of the mean difference.

Usage: .venv/bin/python bench/extract_replay.py [--prompts 24] [--workload extract]
"""
import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decoder.engines.registry import target_gguf  # noqa: E402
from decoder.models.loading import load_pair  # noqa: E402
from decoder.workloads import get_workload  # noqa: E402

T = 64
MATCH_BUCKETS = (1, 2, 3, 4, 6, 9, 17)
# t(n)/t(1) at n = 1..8 rows, packaged Q4_1, 1 thread, the AMX Xeon (bench/RESULTS.md)
AMX_1T = (1.0, 1.53, 1.74, 1.90, 2.12, 2.33, 2.55, 2.76)


def cost_table(points) -> dict[int, float]:
    c = {n + 1: v for n, v in enumerate(points)}
    slope = (points[-1] - points[-2])
    for n in range(len(points) + 1, 40):
        c[n] = points[-1] + (n - len(points)) * slope
    return c


def decode(prompts, tok, threads: int = 1):
    """(prompt ids, 64 greedy output ids, the target's top-1 probability at each output position)."""
    import llama_cpp
    import numpy as np
    llm = llama_cpp.Llama(str(target_gguf("smollm2-135m")), n_ctx=1024, n_threads=threads,
                          logits_all=True, verbose=False)
    outs = []
    for p in prompts:
        ids = p.token_ids(tok)[-256:]
        llm.reset()
        llm.eval(ids)
        out, conf = [], []
        for _ in range(T):
            lg = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            pr = np.exp(lg - lg.max())
            t = int(lg.argmax())
            out.append(t)
            conf.append(float(pr.max() / pr.sum()))
            llm.eval([t])
        outs.append((ids, out, conf))
    return outs


def _back(ctx, i_end: int) -> int:
    m, L = 0, len(ctx)
    while m < 32 and m < i_end and ctx[i_end - 1 - m] == ctx[L - 1 - m]:
        m += 1
    return m


def match(ctx, gmax: int, pick: str = "latest", max_n: int = 4):
    """(backward match length, up to gmax continuation tokens) of the longest suffix n-gram's chosen
    earlier occurrence, or None."""
    L = len(ctx)
    for n in range(max_n, 0, -1):
        if L <= n:
            continue
        suf = ctx[-n:]
        occ = [i for i in range(L - n - 1, -1, -1) if ctx[i:i + n] == suf]  # latest first
        if not occ:
            continue
        if pick == "longest":
            i = max(occ, key=lambda i: (_back(ctx, i + n), i))
        elif pick == "majority":
            top = Counter(ctx[i + n] for i in occ).most_common(1)[0][0]
            i = next(i for i in occ if ctx[i + n] == top)
        else:
            i = occ[0]
        return _back(ctx, i + n), ctx[i + n:i + n + gmax]
    return None


def _accepted(prop, out, pos) -> int:
    k = 0
    while k < len(prop) and pos + k < len(out) and prop[k] == out[pos + k]:
        k += 1
    return k


def fixed(outs, cost, g) -> list[float]:
    """Per-prompt speedup of a fixed γ (``"oracle"``: exactly the accepted prefix)."""
    res = []
    for ids, out, _ in outs:
        pos, e, c = 0, 0.0, 0.0
        while pos < len(out):
            m = match(ids + out[:pos], 16 if g == "oracle" else g)
            prop = m[1] if m else []
            acc = _accepted(prop, out, pos)
            c += cost[(acc if g == "oracle" else len(prop)) + 1]
            e += acc + 1
            pos += acc + 1
        res.append(e / c)
    return res


def _pb(j: int) -> int:
    return 0 if j == 1 else 1 if j == 2 else 2 if j <= 4 else 3


def _gate_length(s, avail: int, cost) -> int:
    a, pr = [], 0.5
    for b in range(4):
        pr = (s[0][b] + 1) / (s[1][b] + 2) if s[1][b] > 0 else pr
        a.append(pr)
    best_g, best, e, run = 0, 1.0 / cost[1], 1.0, 1.0
    for g in range(1, avail + 1):
        run *= a[_pb(g)]
        e += run
        if e / cost[g + 1] > best:
            best_g, best = g, e / cost[g + 1]
    return max(best_g, 1) if s[2] < 3 else best_g


def gate(outs, cost, passes=1, pick="latest", max_n=4, conf_edges=()) -> list[float]:
    """Per-prompt speedup of the gate's estimator (the last pass's)."""
    st: dict = {}
    for _ in range(passes):
        res = []
        for ids, out, conf in outs:
            pos, e, c = 0, 0.0, 0.0
            while pos < len(out):
                m = match(ids + out[:pos], 16, pick, max_n)
                g = 0
                if m and m[1]:
                    cls = (max(b for b in MATCH_BUCKETS if b <= max(1, m[0])),)
                    if conf_edges:
                        cls += (sum(conf[pos - 1] >= x for x in conf_edges) if pos else -1,)
                    s = st.setdefault(cls, [[0.0] * 4, [0.0] * 4, 0])
                    g = _gate_length(s, len(m[1]), cost)
                if g == 0:
                    c, e, pos = c + 1, e + 1, pos + 1
                    continue
                acc = _accepted(m[1][:g], out, pos)
                for b in range(4):
                    s[0][b] *= 0.97
                    s[1][b] *= 0.97
                for j in range(1, min(g, acc + 1) + 1):
                    s[1][_pb(j)] += 1
                    s[0][_pb(j)] += j <= acc
                s[2] += 1
                c, e, pos = c + cost[g + 1], e + acc + 1, pos + acc + 1
            res.append(e / c)
    return res


def boot_ci(xs, reps=4000, seed=0):
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(xs) for _ in xs) / len(xs) for _ in range(reps))
    return round(means[int(0.025 * reps)], 4), round(means[int(0.975 * reps) - 1], 4)


def pooled(outs, per) -> float:
    """Tokens emitted over summed cost, pooled over prompts (every prompt emits T tokens)."""
    return round(len(outs) * T / sum(T / r for r in per), 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--workload", default="extract")
    ap.add_argument("--cost", default=",".join(map(str, AMX_1T)), help="t(n)/t(1) for n = 1, 2, ... rows")
    a = ap.parse_args()
    cost = cost_table([float(x) for x in a.cost.split(",")])
    tok = load_pair("smollm2-135m", "layers:0-3").tokenizer
    outs = decode(get_workload(a.workload, a.prompts), tok)
    copied = sum(1 for ids, out, _ in outs for t in out if t in ids)
    res = {"workload": a.workload, "prompts": len(outs), "tokens": T, "cost": a.cost,
           "tokens_in_prompt_share": round(copied / (len(outs) * T), 3),
           "by_gamma": {str(g): pooled(outs, fixed(outs, cost, g)) for g in (1, 2, 3, 4, 6, 8, 12, 16, "oracle")}}
    base = {p: gate(outs, cost, p) for p in (1, 2)}
    res["gate"] = {"cold": pooled(outs, base[1]), "warm": pooled(outs, base[2])}
    variants = {"longest": dict(pick="longest"), "majority": dict(pick="majority"), "max_n 8": dict(max_n=8),
                "conf 0.5/0.8/0.95": dict(conf_edges=(0.5, 0.8, 0.95)), "conf 0.9": dict(conf_edges=(0.9,))}
    res["variants"] = {}
    for name, kw in variants.items():
        for p, label in ((1, "cold"), (2, "warm")):
            per = gate(outs, cost, p, **kw)
            diff = [x - y for x, y in zip(per, base[p])]
            res["variants"][f"{name} {label}"] = {"speedup": pooled(outs, per),
                                                  "minus_gate_per_prompt": round(sum(diff) / len(diff), 4),
                                                  "ci95": boot_ci(diff)}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
