"""How fast could prompt lookup make the copy-heavy extract workload on this engine? Plain greedy
outputs (llama.cpp's own generation, 1 thread) of never-served extract prompts, then a replay: at
each step the n-gram proposal (latest earlier occurrence of the longest suffix, n = 4..1, in prompt
+ output so far), its accepted prefix against the real next tokens; speedup from the verify cost
table t(n)/t(1) measured on this host (bench/RESULTS.md, Q4_1 1 thread), for fixed γ and for an
oracle that proposes exactly the accepted prefix (the ceiling of any gate), and for a replay of
decoder.proposers.ngram.NgramGate's estimator (per match length: conditional acceptance per
position bucket, forgetting 0.97, uniform prior, the g with the most E(g)/t(g+1)), cold (one pass)
and warm (a second pass over the same outputs: optimistic). Decoding steps only: no prefill, no
per-step overhead. Usage: .venv/bin/python bench/extract_replay.py [prompts]"""
import json
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decoder.models.loading import load_pair
from decoder.engines.registry import target_gguf
from decoder.bench import LlamaCppPeer
from decoder.sampling import SamplingParams
from decoder.workloads import get_workload

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
T = 64
pair = load_pair("smollm2-135m", "layers:0-3")
tok = pair.tokenizer
peer = LlamaCppPeer(str(target_gguf("smollm2-135m")), threads=1)
ps = get_workload("extract", N)
COST = {1: 1.0, 2: 1.53, 3: 1.74, 4: 1.90, 5: 2.12, 6: 2.33, 7: 2.55, 8: 2.76}
for n in range(9, 18):
    COST[n] = 2.76 + (n - 8) * (2.76 - 1.90) / 4


def propose(ctx, g):
    for n in (4, 3, 2, 1):
        if len(ctx) <= n:
            continue
        suf = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i:i + n] == suf:
                return ctx[i + n:i + n + g]
    return []


res = {}
outs = []
for p in ps:
    ids = p.token_ids(tok)[-256:]
    out, ms, n_out = peer.generate(ids, SamplingParams(), T + 1, 0)
    outs.append((ids, out[:T]))
for g in (1, 2, 3, 4, 6, 8, 12, 16, "oracle"):
    steps = cost = 0.0
    emitted = 0
    for ids, out in outs:
        pos = 0
        while pos < len(out):
            ctx = ids + out[:pos]
            gg = 16 if g == "oracle" else g
            prop = propose(ctx, gg)
            acc = 0
            while acc < len(prop) and pos + acc < len(out) and prop[acc] == out[pos + acc]:
                acc += 1
            rows = (acc if g == "oracle" else len(prop)) + 1
            cost += COST[rows]
            pos += acc + 1
            emitted += acc + 1
    res[str(g)] = {"speedup_decode": round(emitted / cost, 3)}
MB = (1, 2, 3, 4, 8)



def pb(j):
    return 0 if j == 1 else 1 if j == 2 else 2 if j <= 4 else 3


def run(feature, passes=2, gmax=16):
    st = {}
    em = cost = 0.0
    for rep in range(passes):  # first pass warms the gate (as serving would), second is measured
        e_tot = c_tot = 0.0
        for ids, out in outs:
            pos, prev_full = 0, False
            while pos < len(out):
                ctx = ids + out[:pos]
                m = None
                for n in (4, 3, 2, 1):
                    if len(ctx) > n:
                        suf = ctx[-n:]
                        for i in range(len(ctx) - n - 1, -1, -1):
                            if ctx[i:i + n] == suf:
                                m = (n, ctx[i + n:i + n + gmax]); break
                    if m: break
                if not m or not m[1]:
                    c_tot += 1; e_tot += 1; pos += 1; prev_full = False; continue
                n, cont = m
                cls = (max(b for b in MB if b <= n),) + ((prev_full,) if feature else ())
                s = st.setdefault(cls, [[0.0] * 4, [0.0] * 4])
                a, pr = [], 0.5
                for b in range(4):
                    pr = (s[0][b] + 1) / (s[1][b] + 2) if s[1][b] > 0 else pr
                    a.append(pr)
                best_g, best = 0, 1.0 / COST[1]
                E, P = 1.0, 1.0
                for g in range(1, len(cont) + 1):
                    P *= a[pb(g)]; E += P
                    if E / COST[g + 1] > best:
                        best_g, best = g, E / COST[g + 1]
                g = max(best_g, 1) if sum(s[1]) < 3 else best_g
                if g == 0:
                    c_tot += 1; e_tot += 1; pos += 1; prev_full = False; continue
                prop = cont[:g]
                acc = 0
                while acc < g and pos + acc < len(out) and prop[acc] == out[pos + acc]:
                    acc += 1
                for b in range(4):
                    s[0][b] *= 0.97; s[1][b] *= 0.97
                for j in range(1, min(g, acc + 1) + 1):
                    s[1][pb(j)] += 1
                    if j <= acc:
                        s[0][pb(j)] += 1
                c_tot += COST[g + 1]; e_tot += acc + 1; pos += acc + 1
                prev_full = acc == g
        em, cost = e_tot, c_tot
    return round(em / cost, 3)


copied = sum(1 for ids, out in outs for k in range(len(out)) if out[k] in ids)
print(json.dumps({"prompts": len(outs), "tokens": T, "tokens_in_prompt_share": round(copied / (len(outs) * T), 3),
                  "by_gamma": res, "gate_cold": run(False, passes=1), "gate_warm": run(False), "example": tok.decode(outs[0][1])[:300]}, indent=1))
