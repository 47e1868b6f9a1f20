"""FR-Spec on llama.cpp: the derived draft with its full 49152-row LM head against restricted-
vocabulary draft GGUFs (``decoder.models.gguf_export.restricted_draft_gguf``: V' head rows, inputs
fed as embeddings), side by side in one run.

Three measurements, each paired:

1. Step cost c: per round, every engine in a shuffled order decodes ``--steps`` one-token steps
   after the same ``--prefix``-token prompt; c = the draft's median step ms / the target's plain
   median step ms of the same round. Reported: the median over rounds and a 95 % bootstrap
   interval (over rounds) of c, per draft.
2. Greedy α on never-served prompts (the first ``decoder.workloads.EVAL_RESERVED_PROMPTS`` of each
   workload): the target's greedy continuation (``--new`` tokens), then each draft's argmax at
   every position of it in one forward; α = the share of positions where they agree (greedy
   acceptance per token). The full draft is scored both with its full head (``full``) and masked
   to V' (FR-Spec today), which the restricted file must equal. Paired per prompt.
3. Tokens/s: plain decoding and the draft proposer at each γ in ``--gammas``, full head (masked to
   the same V', today's path) and restricted, back to back per prompt (``--tps-prompts`` per
   workload); greedy outputs checked equal to plain.

    .venv/bin/python bench/frdraft_bench.py --out frdraft.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _boot_ci(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    a = np.asarray(xs, dtype=np.float64)
    meds = [float(np.median(a[rng.integers(0, len(a), len(a))])) for _ in range(n)]
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def _mean_ci(xs: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    a = np.asarray(xs, dtype=np.float64)
    means = [float(a[rng.integers(0, len(a), len(a))].mean()) for _ in range(n)]
    return float(a.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def step_ms(engine, prefix: list[int], steps: int) -> float:
    s = engine.start()
    logits = s.forward(prefix, 1)
    x = int(logits[-1].argmax())
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        x = int(s.forward([x], 1)[0].argmax())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocabs", default="4096,8192,16384")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per engine (the demo's default: 1)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per α prompt")
    ap.add_argument("--alpha-prompts", type=int, default=16)
    ap.add_argument("--tps-prompts", type=int, default=3)
    ap.add_argument("--tps-new", type=int, default=48)
    ap.add_argument("--gammas", default="1,2,3")
    ap.add_argument("--tps-vocab", type=int, default=8192)
    ap.add_argument("--adapter", default=None,
                    help="a peft LoRA directory of the draft (e.g. a cached v0 bootstrap's adapter/): set on every "
                         "draft engine for the α and tokens/s parts (the step cost is measured without it)")
    ap.add_argument("--skip-tps", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)
    from decoder.bench import machine_info
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.engines.registry import torch_threads_for
    from decoder.models.gguf_export import derived_draft_gguf, restricted_draft_gguf
    from decoder.models.loading import load_pair
    from decoder.models.packaged import packaged_gguf
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.vocab import frequent_token_ids
    from decoder.workloads import EVAL_RESERVED_PROMPTS, get_workload

    out: dict = {"machine": machine_info(), "args": vars(a), "loadavg_start": os.getloadavg()}
    pair = load_pair("smollm2-135m", "layers:0-3")
    tok = pair.tokenizer
    src = packaged_gguf("smollm2-135m")
    full_path = derived_draft_gguf(src, [0, 1, 2, 3])
    vocabs = [int(v) for v in a.vocabs.split(",") if v]
    ids = {v: frequent_token_ids(tok, v) for v in vocabs}
    kw = dict(n_ctx=1024, threads=a.threads)
    target = LlamaCppEngine(src, **kw)
    engines = {"full": LlamaCppEngine(full_path, **kw)}
    for v in vocabs:
        engines[f"v{v}"] = LlamaCppEngine(restricted_draft_gguf(full_path, ids[v]), **kw)
    prompts = {w: get_workload(w, EVAL_RESERVED_PROMPTS)[: a.alpha_prompts] for w in a.workloads.split(",")}
    prefix = [t for p in prompts["prose"] for t in p.token_ids(tok)][: a.prefix]

    # 1. step cost, paired per round
    rng = random.Random(0)
    per: dict[str, list[float]] = {k: [] for k in ["target", *engines]}
    c: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(a.rounds):
        order = ["target", *engines]
        rng.shuffle(order)
        ms = {k: step_ms(target if k == "target" else engines[k], prefix, a.steps) for k in order}
        for k, v in ms.items():
            per[k].append(v)
        for k in engines:
            c[k].append(ms[k] / ms["target"])
    out["step_ms_median"] = {k: round(statistics.median(v), 3) for k, v in per.items()}
    out["c"] = {k: {"median": round(statistics.median(v), 4), "ci95": [round(x, 4) for x in _boot_ci(v)]}
                for k, v in c.items()}
    out["loadavg_after_cost"] = os.getloadavg()
    print(json.dumps({"c": out["c"], "step_ms": out["step_ms_median"], "load": out["loadavg_after_cost"]}),
          file=sys.stderr)

    if a.adapter:  # the same adapter on every draft file (converted against each: lora_gguf_cached)
        import tempfile

        from decoder.models.gguf_export import lora_gguf_cached

        lora_dir = Path(tempfile.mkdtemp(prefix="frdraft-lora-"))
        for k, e in engines.items():
            e.load_lora("a", lora_gguf_cached(Path(a.adapter), lora_dir, e.path))
            e.set_lora("a")
        out["adapter"] = a.adapter

    # 2. greedy α on never-served prompts
    alpha: dict[str, dict[str, list[float]]] = {}
    for w, ps in prompts.items():
        rows: dict[str, list[float]] = {}
        for p in ps:
            x = p.token_ids(tok)[-256:]
            cont, s = [], target.start()
            lg = s.forward(x, 1)[0]
            for _ in range(a.new):
                nxt = int(lg.argmax())
                cont.append(nxt)
                lg = s.forward([nxt], 1)[0]
            seq = x + cont[:-1]
            want = torch.tensor(cont)
            fl = engines["full"].start().forward(seq, len(cont))
            rows.setdefault("full", []).append(float((fl.argmax(-1) == want).float().mean()))
            for v in vocabs:
                masked = torch.full_like(fl, float("-inf"))
                masked[:, ids[v]] = fl[:, ids[v]]
                rows.setdefault(f"masked_v{v}", []).append(float((masked.argmax(-1) == want).float().mean()))
                rl = engines[f"v{v}"].start().forward(seq, len(cont))
                rows.setdefault(f"v{v}", []).append(float((rl.argmax(-1) == want).float().mean()))
                rows.setdefault(f"v{v}_ceiling", []).append(float(torch.isin(want, ids[v]).float().mean()))
        alpha[w] = rows
    out["alpha"] = {w: {k: [round(x, 4) for x in _mean_ci(v)] for k, v in rows.items()} for w, rows in alpha.items()}
    out["alpha_diff_vs_full"] = {
        w: {f"v{v}": [round(x, 4) for x in _mean_ci([b - f for b, f in zip(rows[f"v{v}"], rows["full"])])]
            for v in vocabs} for w, rows in alpha.items()}
    out["loadavg_after_alpha"] = os.getloadavg()
    print(json.dumps({"alpha": out["alpha"], "load": out["loadavg_after_alpha"]}), file=sys.stderr)

    if a.skip_tps:
        text = json.dumps(out, indent=1, default=str)
        if a.out:
            Path(a.out).write_text(text)
        print(text)
        return out

    # 3. tokens/s: plain, full draft masked to V' (today's path), restricted V'
    v = a.tps_vocab
    gammas = [int(g) for g in a.gammas.split(",") if g]
    cfg = DecoderConfig(topk_record=0, draft_vocab=ids[v], ngram_gate=False, prompt_cache=False)
    decs = {"full_masked": SpeculativeDecoder(pair.target, pair.draft, tok, cfg, engine=target,
                                              draft_engine=engines["full"]),
            f"v{v}": SpeculativeDecoder(pair.target, pair.draft, tok, cfg, engine=target,
                                        draft_engine=engines[f"v{v}"])}
    tps: dict[str, list[float]] = {}
    same: dict[str, int] = {}
    with torch_threads_for(target):
        for w, ps in prompts.items():
            for p in ps[: a.tps_prompts]:
                x = p.token_ids(tok)[-256:]
                runs = [("plain", "full_masked", 0)] + [(f"{k}_g{g}", k, g) for g in gammas for k in decs]
                rng.shuffle(runs)
                res = {}
                for name, k, g in runs:
                    r = decs[k].generate(DecodeRequest(x, max_new_tokens=a.tps_new, gamma=g, ignore_eos=True,
                                                       proposer="draft" if g else None))
                    res[name] = r
                    tps.setdefault(name, []).append(len(r.output_ids) / (r.latency_ms / 1e3))
                for name, r in res.items():
                    same[name] = same.get(name, 0) + (r.output_ids == res["plain"].output_ids)
    base = tps["plain"]
    out["tokens_per_s"] = {k: round(statistics.mean(v_), 2) for k, v_ in tps.items()}
    out["speedup_vs_plain"] = {k: [round(x, 3) for x in _mean_ci([t / b for t, b in zip(v_, base)])]
                               for k, v_ in tps.items() if k != "plain"}
    out["greedy_equal_plain"] = same
    out["n_tps_requests"] = len(base)
    out["loadavg_end"] = os.getloadavg()
    text = json.dumps(out, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return out


if __name__ == "__main__":
    main()
