"""What a verification costs on the llama.cpp engine, and what that does to the n-gram proposer. JSON out.

1. ``verify_cost``: one ``llama_decode`` of n = 1..9 tokens with logits at all n (a verification of
   γ = n - 1) after 100 cached tokens, median ms over ``--reps``, and its ratio to n = 1, per thread
   count; ``prefill_ms``: the 100 tokens as one prompt (median of 3). On a weight-bandwidth-bound engine the ratio stays near 1; on a compute-bound one it grows
   with n. Where the llama.cpp build has the AMX path (a CPU with AMX), measured twice, each in a
   process of its own: with llama.cpp's extra (AMX) weight buffers and without
   (``DRAFTD_LLAMA_EXTRA_BUFTS``; ``decoder.engines.llamacpp_lib.llama_extra_buffers``); each on the main thread
   and on a thread of its own (where the serving loop decodes).
2. ``formats`` (``--formats Q4_0,BF16,...``): the same measurement (2 threads, main thread) on the
   packaged GGUF requantised by llama.cpp itself (``decoder.models.gguf_export.requantised_gguf``, written once under
   ``$DRAFTD_CACHE_DIR/requant``): which weight formats make a verification cheap on this CPU. A
   requantised file is a different model (Q4_0 of the Q4_1 weights loses more; BF16 rounds them), so
   this says where speculation can pay, not what to serve (``fidelity_to_packaged``: mean KL from the
   packaged file's next-token distributions, top-1 agreement, TV, over 768 teacher-forced
   positions of the three workloads, up to 256 each); ``break_even_a1`` is the first-token
   acceptance above which γ = 1 beats plain decoding of the same file (t(2) / t(1) - 1), and
   ``ms_vs_packaged`` a step of n rows against a plain step of the packaged file; ``Q4_1S`` is the
   packaged Q4_1 weights split into Q4_0 blocks and an offset adapter (``decoder.models.gguf_export.
   q4_1_split_gguf``: the same weights, Q4_0's batched kernels); ``--threads 1,2`` measures each
   file at each thread count. Every row has ``ceiling_at_alpha_1``: the speedup over plain decoding
   of the same file at each γ if every proposal were accepted at no cost (:func:`ceiling`).
3. ``beside`` (``--beside alone,thread,process``): the measurement at 1 thread, on a thread of
   its own (as the demo's decoder runs beside the trainer, 200 tokens cached), alone, with a
   training load in the same process (``thread``: the derived draft's torch copy, forward and
   backward on a 4 x 128 batch and an Adam step, in a loop, at 1 torch thread) or in a process of
   its own (``process``); whether the trainer's Python work beside the decoder (the GIL) makes a
   verification's rows dearer, as the demo's step costs beside the trainer suggested.
4. ``ngram_min_n``: greedy speculation with the n-gram proposer (history empty: the request's own
   context only) at ``ngram_min_n`` 1, 2, 3 and γ 1..3, against our plain decoding on the same engine,
   paired per prompt, on never-served prompts of prose, code and math; every output checked equal to
   plain.

Usage: ``.venv/bin/python bench/verify_cost_bench.py [--prompts 3] [--max-new-tokens 64] [--formats Q4_0,BF16]
[--beside alone,thread,process]``
(run it alone on the cores). Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def verify_cost(gguf, threads: int, reps: int, worker: bool = False, cached: int = 100, n_ctx: int = 1024) -> dict:
    """Median ms per n on the main thread, or (``worker``) on a thread of its own, as the serving
    loop decodes, after ``cached`` tokens in a context of ``n_ctx``."""
    if worker:
        import threading

        box: dict = {}
        t = threading.Thread(target=lambda: box.update(r=verify_cost(gguf, threads, reps, cached=cached, n_ctx=n_ctx)))
        t.start()
        t.join()
        return dict(box["r"], thread="worker")
    from decoder.engines.amx_rows import time_rows
    from decoder.engines.llamacpp import LlamaCppEngine

    eng = LlamaCppEngine(gguf, n_ctx=n_ctx, threads=threads)
    seq = eng.start()
    seq.forward([100 + i % 1000 for i in range(cached)], 1)
    ms = time_rows(seq, cached, (*range(1, 10), 12, 16), reps)
    prompt = [100 + i % 1000 for i in range(cached)]
    prefill = []
    for _ in range(3):  # the cached tokens as one prompt (what a request's first step costs before any decode)
        seq.truncate(0)
        t0 = time.perf_counter()
        seq.forward(prompt, 1)
        prefill.append((time.perf_counter() - t0) * 1e3)
    extra = eng.extra_bufts
    base = statistics.median(ms[1])
    ratio = {n: statistics.median(v) / base for n, v in ms.items()}
    offset = eng.offset_lora.name if eng.offset_lora else None
    eng.close()
    return {"threads": threads, "thread": "main", "extra_buffer_types": extra, "cached": cached, "n_ctx": n_ctx,
            "offset_lora": offset,
            "prefill_ms": round(statistics.median(prefill), 2),
            "ms": {n: round(statistics.median(v), 3) for n, v in ms.items()},
            "ratio": {n: round(r, 3) for n, r in ratio.items()}, **ceiling(ratio)}


def ceiling(ratio: dict[int, float]) -> dict:
    """The most any proposer can buy on this engine: the speedup over plain decoding of the same
    file at γ = n - 1 if every proposed token were accepted and proposing cost nothing, (γ + 1) /
    (t(γ + 1) / t(1)) (Leviathan et al. 2023, Theorem 3.8's speedup with α = 1 and c = 0, the cost
    of a verification of γ + 1 rows measured instead of assumed to be one step). Below 1.3 at
    every γ, no proposer reaches a 1.3x target here. ``best_ceiling``: the best γ up to the
    controller's ``gamma_max`` (8)."""
    from decoder.proposers.cost import speculation_ceiling

    every = speculation_ceiling(ratio, max(ratio) - 1)
    best = speculation_ceiling(ratio, GAMMA_MAX)  # what the controller can pick
    return {"ceiling_at_alpha_1": every["by_gamma"], "best_ceiling": {"gamma": best["gamma"], "speedup": best["speedup"]}}


GAMMA_MAX = 8  # decoder.control.ControllerConfig.gamma_max

FORMATS = ("Q4_0", "IQ4_NL", "Q8_0", "BF16", "F16")


FIDELITY_TOKENS = 256  # per workload: the text whose next-token distributions each format is compared on


def fidelity_logits(gguf, out) -> None:
    """Teacher-forced logits (positions, V) of ``gguf`` over the first ``FIDELITY_TOKENS`` tokens of
    each workload's first two prompts (prose, code, math), saved to ``out`` (.npy)."""
    import llama_cpp
    import numpy as np

    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.workloads import get_workload

    vocab = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    eng = LlamaCppEngine(gguf, n_ctx=1024, threads=2)
    rows = []
    for wl in ("prose", "code", "math"):
        text = "\n\n".join(p.text for p in get_workload(wl, 2))
        ids = vocab.tokenize(text.encode(), add_bos=False)[:FIDELITY_TOKENS]
        seq = eng.start()
        rows.append(np.asarray(seq.forward(ids, len(ids)), dtype=np.float32))
    eng.close()
    np.save(out, np.concatenate(rows))


def fidelity(ref, other) -> dict:
    """How far a requantised file's next-token distributions are from the packaged file's, over
    the same teacher-forced positions: mean KL(p_packaged || p_format) in nats, the share of
    positions whose argmax agrees, and mean total variation (1 - Σ min(p, q): one minus the α a
    one-step proposal from the packaged file would get against it)."""
    import numpy as np

    def logp(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    lp, lq = logp(np.load(ref).astype(np.float64)), logp(np.load(other).astype(np.float64))
    p, q = np.exp(lp), np.exp(lq)
    return {"positions": int(lp.shape[0]), "kl_nats": round(float((p * (lp - lq)).sum(axis=1).mean()), 5),
            "top1_agree": round(float((lp.argmax(1) == lq.argmax(1)).mean()), 4),
            "tv": round(float(1 - np.minimum(p, q).sum(axis=1).mean()), 5)}


def formats_cost(gguf, formats: list[str], reps: int, cached: int = 100, n_ctx: int = 1024,
                 threads: tuple[int, ...] = (2,)) -> list[dict]:
    """verify_cost at each of ``threads`` for the packaged file and each requantised one, each in a process of
    its own, with the first-token acceptance a γ = 1 proposal needs to pay on each, the prefill of
    the cached tokens, and each format's :func:`fidelity` to the packaged file."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="draftd-formats-"))
    try:
        rows = _formats_rows(gguf, formats, reps, cached, n_ctx, tmp, threads)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    base = {r["threads"]: r["ms"]["1"] for r in rows if r["format"] == "packaged" and "ms" in r}
    for row in rows:
        if base.get(row.get("threads")) and "ms" in row:
            row["ms_vs_packaged"] = {n: round(v / base[row["threads"]], 3) for n, v in row["ms"].items()}
    return rows


def _formats_rows(gguf, formats, reps, cached, n_ctx, tmp, threads=(2,)) -> list[dict]:
    """One row per format; a format llama.cpp cannot write or a child that fails is an error row
    (the other formats' measurements are kept)."""
    from decoder.models.gguf_export import SPLIT_FORMAT, q4_1_split_gguf, requantised_gguf

    rows = []
    for fmt in ["packaged", *dict.fromkeys(f.upper() for f in formats)]:
        try:
            path = (gguf if fmt == "packaged" else q4_1_split_gguf(gguf) if fmt == SPLIT_FORMAT
                    else requantised_gguf(gguf, fmt))
        except (ValueError, RuntimeError, OSError) as e:
            rows.append({"format": fmt, "error": str(e)})
            continue
        for i, th in enumerate(threads):
            logits = ["--logits-out", str(tmp / f"{fmt}.npy")] if i == 0 else []
            r = subprocess.run([sys.executable, __file__, "--verify-only", "--reps", str(reps), "--gguf", str(path),
                                "--cached", str(cached), "--n-ctx", str(n_ctx), "--threads", str(th), *logits],
                               capture_output=True, text=True)
            if r.returncode != 0:
                rows.append({"format": fmt, "threads": th, "error": f"exit {r.returncode}", "stderr": r.stderr[-500:]})
                continue
            row = dict(json.loads(r.stdout)[0], format=fmt, gguf=path.name, bytes=path.stat().st_size)
            if fmt != "packaged" and (tmp / "packaged.npy").exists() and (tmp / f"{fmt}.npy").exists():
                row["fidelity_to_packaged"] = fidelity(tmp / "packaged.npy", tmp / f"{fmt}.npy")
            row["break_even_a1"] = round(row["ratio"]["2"] - 1, 3)
            rows.append(row)
    return rows


def ngram_min_n(pair, engine, prompts: int, max_new: int) -> list[dict]:
    from decoder.engines.registry import torch_threads_for
    from decoder.speculative import DecoderConfig, SpeculativeDecoder

    decs = {k: SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(topk_record=0, ngram_min_n=k, prompt_cache=False),
                                  engine=engine) for k in (1, 2, 3)}
    with torch_threads_for(engine):  # as serve and generate decode on llama.cpp
        return _ngram_rows(decs, pair, prompts, max_new)


def _ngram_rows(decs, pair, prompts: int, max_new: int) -> list[dict]:
    from decoder.metrics import AcceptanceCounts
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, FixedGamma
    from decoder.workloads import get_workload

    rows = []
    for wl in ("prose", "code", "math"):
        tot: dict = {}
        for p in get_workload(wl, prompts):
            ids = p.token_ids(pair.tokenizer)
            plain = decs[1].generate(DecodeRequest(ids, SamplingParams(), max_new, gamma=0, ignore_eos=True), FixedGamma(0))
            tot.setdefault("plain", [AcceptanceCounts(), 0.0, True])
            tot["plain"][0].merge(plain.counts)
            tot["plain"][1] += plain.latency_ms
            for k, dec in decs.items():
                for g in (1, 2, 3):
                    dec.ngram_history.clear()
                    r = dec.generate(DecodeRequest(ids, SamplingParams(), max_new, gamma=g, ignore_eos=True,
                                                   proposer="ngram"), FixedGamma(g))
                    t = tot.setdefault((k, g), [AcceptanceCounts(), 0.0, True])
                    t[0].merge(r.counts)
                    t[1] += r.latency_ms
                    t[2] &= r.output_ids == plain.output_ids
        pc, pms, _ = tot["plain"]
        plain_tps = pc.num_emitted_tokens / pms
        for (k, g), (c, ms, same) in ((key, v) for key, v in tot.items() if key != "plain"):
            rows.append({"workload": wl, "ngram_min_n": k, "gamma": g,
                         "speedup_vs_plain": round(c.num_emitted_tokens / ms / plain_tps, 3),
                         "accepted_per_proposed": round(c.acceptance_rate, 3), "tau": round(c.mean_accepted_length, 3),
                         "proposed_per_step": round(c.num_draft_tokens / c.num_steps, 3), "matches_plain": same})
    return rows


def _training_load(stop, ready, pair=None) -> None:
    """A trainer's work until ``stop``: the derived draft's torch copy (its own copy, every
    parameter trained), forward and backward on a 4 x 128 batch and an Adam step, at 1 torch thread."""
    import copy

    import torch

    torch.set_num_threads(1)
    if pair is None:
        from daemon.logging import configure
        from decoder.models.loading import load_pair

        configure("auto", "warning", stream=sys.stderr)
        pair = load_pair("smollm2-135m", "layers:0-3")
    model = copy.deepcopy(pair.draft).train()
    params = list(model.parameters())
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=1e-6)
    ids = torch.randint(0, 40000, (4, 128), generator=torch.Generator().manual_seed(0))
    ready.set()
    while not stop.is_set():
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()


def beside_trainer(gguf, modes: list[str], reps: int, cached: int = 200) -> list[dict]:
    """:func:`verify_cost` at 1 thread on a worker thread, per mode: ``alone``, a training load
    (:func:`_training_load`) on a thread of this process (``thread``), or in a process of its own
    (``process``)."""
    import multiprocessing as mp
    import threading

    from decoder.models.loading import load_pair

    pair = load_pair("smollm2-135m", "layers:0-3")
    rows = []
    for mode in modes:
        spawn = mp.get_context("spawn")
        stop, ready = (spawn.Event(), spawn.Event()) if mode == "process" else (threading.Event(), threading.Event())
        worker = None
        if mode == "process":
            worker = spawn.Process(target=_training_load, args=(stop, ready))
        elif mode == "thread":
            worker = threading.Thread(target=_training_load, args=(stop, ready, pair), daemon=True)
        if worker is not None:
            worker.start()
            if not ready.wait(600):
                raise RuntimeError(f"--beside {mode}: the training load did not start")
            time.sleep(2)  # past its first steps' allocations
        try:
            rows.append(dict(verify_cost(gguf, 1, reps, worker=True, cached=cached), beside=mode))
        finally:
            stop.set()
            if worker is not None:
                worker.join(60)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--formats", default="", help=f"comma-separated llama.cpp weight formats to requantise to "
                                                     f"and measure, e.g. {','.join(FORMATS)} (then only that)")
    ap.add_argument("--cached", type=int, default=100, help="--formats: tokens in the cache before each measured decode")
    ap.add_argument("--n-ctx", type=int, default=1024, help="--formats: the context size (serve's is the model's, 8192)")
    ap.add_argument("--threads", default="2", help="--formats: comma-separated thread counts to measure each file at "
                                                   "(the demo's decoder runs on 1 beside the trainer)")
    ap.add_argument("--beside", default="", help="comma-separated alone,thread,process: a verification's cost at 1 "
                                                 "thread beside a training load in this process or in its own (then only that)")
    ap.add_argument("--verify-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--logits-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON

    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.loading import load_pair
    from decoder.models.packaged import packaged_gguf

    gguf = packaged_gguf("smollm2-135m")
    if a.verify_only and a.gguf:  # the child of a --formats run: one file, 2 threads, main thread
        res = verify_cost(Path(a.gguf), int(a.threads), a.reps, cached=a.cached, n_ctx=a.n_ctx)
        if a.logits_out:
            fidelity_logits(Path(a.gguf), a.logits_out)
        print(json.dumps([res]))
        return
    if a.verify_only:  # the child of a run that measures both buffer settings
        print(json.dumps([verify_cost(gguf, t, a.reps, w) for t in (1, 2) for w in (False, True)]))
        return
    if a.beside:
        modes = [m.strip() for m in a.beside.split(",") if m.strip()]
        bad = [m for m in modes if m not in ("alone", "thread", "process")]
        if bad or not modes:
            ap.error(f"--beside {a.beside!r}: comma-separated alone, thread, process")
        print(json.dumps({"gguf": gguf.name, "beside": beside_trainer(gguf, modes, a.reps)}, indent=1))
        return
    if ((a.cached, a.n_ctx) != (100, 1024) or a.threads != "2") and not a.formats:
        ap.error("--cached, --n-ctx and --threads apply to --formats only (the default run measures after 100 cached "
                 "tokens, at 1 and 2 threads)")
    if a.formats:
        fmts = [f.strip() for f in a.formats.split(",") if f.strip()]
        from decoder.models.gguf_export import weight_formats

        from decoder.models.gguf_export import SPLIT_FORMAT

        known = [*weight_formats(), SPLIT_FORMAT]
        for f in fmts:  # refuse a bad name before any quantising
            if f.upper() not in known:
                ap.error(f"--formats: {f!r} is not a llama.cpp weight format; use some of {', '.join(known)} "
                         f"({SPLIT_FORMAT}: the Q4_1 weights split into Q4_0 blocks and an offset adapter)")
        try:
            threads = tuple(int(t) for t in a.threads.split(","))
        except ValueError:
            ap.error(f"--threads {a.threads!r}: comma-separated positive integers, e.g. 1,2")
        if not threads or min(threads) < 1:
            ap.error(f"--threads {a.threads!r}: comma-separated positive integers, e.g. 1,2")
        if not 1 <= a.cached < a.n_ctx - 16:
            ap.error(f"--cached {a.cached} must lie in 1..n_ctx - 17 (--n-ctx {a.n_ctx})")
        print(json.dumps({"gguf": gguf.name, "cached": a.cached, "n_ctx": a.n_ctx,
                          "formats": formats_cost(gguf, fmts, a.reps, a.cached, a.n_ctx, threads)}, indent=1))
        return
    from decoder.engines.llamacpp_lib import bindings

    info = bindings().llama_print_system_info().decode(errors="replace")
    settings = ("1", "0") if "AMX_INT8 = 1" in info else (None,)
    out = {"gguf": gguf.name, "llama_system_info": info.strip(), "verify_cost": []}
    for env in settings:
        child_env = dict(os.environ, **({"DRAFTD_LLAMA_EXTRA_BUFTS": env} if env else {}))
        r = subprocess.run([sys.executable, __file__, "--verify-only", "--reps", str(a.reps)], env=child_env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            out["verify_cost"].append({"extra_buffer_types": env == "1", "error": f"exit {r.returncode}",
                                       "stderr": r.stderr[-500:]})
            continue
        out["verify_cost"] += json.loads(r.stdout)
    pair = load_pair("smollm2-135m", "layers:0-3")
    engine = LlamaCppEngine(gguf, threads=2)
    out["ngram_min_n"] = ngram_min_n(pair, engine, a.prompts, a.max_new_tokens)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
