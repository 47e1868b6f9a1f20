"""How fast an EAGLE-style head (``decoder.eagle``) learns, against the derived draft's bootstrap.

    python bench/eagle_bench.py                                  # 12,000 tokens per workload, 5 minutes
    python bench/eagle_bench.py --corpus-tokens 40000 --minutes 10 --noise 0.05

The same corpora and document-level held-out split as the first start's bootstrap
(``daemon.warm_start.score_corpora``: each workload's bootstrap documents, whole documents held
out), scored by the torch target with its final hidden states kept (``decoder.eagle.score_features``),
then the head (fc + a copy of the target's last layer, the LM head cut to ``--draft-vocab``
frequent tokens) is trained with EAGLE-1's loss for ``--minutes``. Every ``--round-steps`` steps
it prints held-out teacher-forced α at proposal depth 1 .. 3 (depth d: the head's own features
for the last d - 1 steps), overall and per workload, with the training and CPU seconds so far.
``bench/bootstrap_bench.py`` gives the derived draft's curve on the same split. Finally the cost
of one head step (one row, a 256-position cache) against one target step on the served engine
(llama.cpp, the packaged file) and on the torch target: c of Leviathan et al. 2023, §3.4.
Prints JSON; run it alone on the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--corpus-tokens", type=int, default=12_000)
    ap.add_argument("--heldout-tokens", type=int, default=2_048)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--round-steps", type=int, default=50)
    ap.add_argument("--max-steps", type=int, default=None,
                    help="train this many steps instead (the learning-rate decay then follows steps, not minutes)")
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--feature-weight", type=float, default=1.0)
    ap.add_argument("--noise", type=float, default=0.0, help="uniform feature noise half-width (EAGLE §3.3)")
    ap.add_argument("--unroll", type=int, default=2, help="proposal depths trained per step (EAGLE-3's training-time test)")
    ap.add_argument("--min-lr", type=float, default=0.1, help="cosine decay over --minutes to this fraction of --lr")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="write the trained head here (safetensors; bench/proposer_bench.py --eagle-head)")
    args = ap.parse_args()
    for name in ("corpus_tokens", "heldout_tokens", "round_steps", "batch", "unroll"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.max_steps is not None and args.max_steps < 1:
        ap.error(f"--max-steps {args.max_steps}: must be >= 1 (or leave it out: train for --minutes)")
    if not args.minutes > 0 or not args.lr > 0 or not 0 <= args.min_lr <= 1:
        ap.error(f"--minutes {args.minutes} and --lr {args.lr} must be > 0, --min-lr {args.min_lr} in [0, 1]")
    if args.save and not Path(args.save).resolve().parent.is_dir():
        ap.error(f"--save {args.save!r}: its directory does not exist")

    import torch

    from daemon.bootstrap_data import TOPK, WINDOW_TOKENS
    from decoder.eagle import EagleHead, score_features
    from decoder.models.loading import load_model
    from decoder.teacher import corpus_windows
    from decoder.vocab import frequent_token_ids
    from decoder.workloads import bootstrap_documents, split_documents
    from trainer.distill import cpu_has_native_bf16
    from trainer.head import HeadDistiller, column_map, groups, head_batch, heldout_alpha, learning_curve

    from daemon.logging import configure

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    torch.manual_seed(args.seed)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    c_start = time.process_time()
    target, tok = load_model(args.target)
    target.eval()
    ac = torch.bfloat16 if cpu_has_native_bf16() else None
    vocab = frequent_token_ids(tok, args.draft_vocab) if args.draft_vocab else None
    col = column_map(vocab, target.get_output_embeddings().weight.shape[0])

    train, held, scoring = [], {}, {}
    for w in args.workloads.split(","):
        docs = bootstrap_documents(w)
        if not docs:
            log(f"{w}: no documents, skipped")
            continue
        tr, he = split_documents(docs, 0.1)
        t0, c0 = time.perf_counter(), time.process_time()
        tw = [x for _, x in corpus_windows(tok, tr, WINDOW_TOKENS, max_tokens=args.corpus_tokens)]
        hw = [x for _, x in corpus_windows(tok, he, WINDOW_TOKENS, max_tokens=args.heldout_tokens)]
        train += score_features(target, tw, TOPK, autocast_dtype=ac)
        held[w] = score_features(target, hw, TOPK, autocast_dtype=ac)
        scoring[w] = {"train_positions": sum(len(x) for x in tw), "heldout_positions": sum(len(x) for x in hw),
                      "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}
        log(f"{w}: scored {scoring[w]}")

    held_batches = {w: [head_batch(g, col) for g in groups(items)] for w, items in held.items()}

    head = EagleHead.from_target(target, vocab)
    cost = step_costs(head, target, args.target)
    log(f"cost: {cost}")
    # --minutes: the cosine runs over the steps the first minute's pace predicts (re-estimated as it goes)
    dist = HeadDistiller(head, train, col, lr=args.lr, batch=args.batch, unroll=args.unroll, noise=args.noise,
                         feature_weight=args.feature_weight, total_steps=args.max_steps or 10**9,
                         min_lr=args.min_lr, seed=args.seed, autocast=ac)

    curve = learning_curve(dist, held_batches, minutes=args.minutes, max_steps=args.max_steps,
                           round_steps=args.round_steps, cpu_start=c_start, log=log, final=False)
    steps = dist.steps
    # the same held-out windows scored by the served engine: the features the head proposes from
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.loading import packaged_target
    from decoder.eagle import score_features_engine

    gguf = packaged_target(args.target)
    engine_alpha = None
    if gguf is not None:
        eng = LlamaCppEngine(gguf, embeddings=True)
        engine_alpha = {}
        for w, items in held.items():
            sc = score_features_engine(eng, [it["ids"].tolist() for it in items], TOPK)
            engine_alpha[w] = [round(a, 4) for a in heldout_alpha(head, [head_batch(g, col) for g in groups(sc)], 3)]
        eng.close()
        log(f"held-out alpha on llama.cpp features: {engine_alpha}")
    if args.save:
        from decoder.eagle import save_head
        save_head(head, args.save, target, {"target": args.target, "steps": steps})
    print(json.dumps({"args": vars(args), "scoring": scoring, "trainable_params": sum(p.numel() for p in head.trainable()),
                      "curve": curve, "cost": cost,
                      "heldout_alpha_on_served_engine_features": engine_alpha}, indent=1))


def step_costs(head, target, target_ref: str, ctx: int = 256, reps: int = 30) -> dict:
    """Median ms of one head step (1 row after a ctx-row cache) and of one target step on
    llama.cpp (the served engine) and on torch, same context."""
    import torch

    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.loading import packaged_target

    head.eval()
    H = head.hidden_size
    out = {}
    with torch.inference_mode():
        _, _, cache = head(torch.randn(1, ctx, H), torch.randint(0, 1000, (1, ctx)))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            head(torch.randn(1, 1, H), torch.randint(0, 1000, (1, 1)), ctx, cache)
            ts.append((time.perf_counter() - t0) * 1e3)
        out["head_step_ms"] = round(statistics.median(ts), 3)
        ts = []
        from transformers import DynamicCache
        c = DynamicCache()
        target(input_ids=torch.randint(0, 1000, (1, ctx)), cache=c, use_cache=True)
        for _ in range(reps):
            t0 = time.perf_counter()
            target(input_ids=torch.randint(0, 1000, (1, 1)), cache=c, use_cache=True)
            c.crop(-1)
            ts.append((time.perf_counter() - t0) * 1e3)
        out["torch_target_step_ms"] = round(statistics.median(ts), 3)
    gguf = packaged_target(target_ref)
    if gguf is not None:
        eng = LlamaCppEngine(gguf, embeddings=True)
        seq = eng.start()
        seq.forward(list(range(100, 100 + ctx)), 1)
        ts = []
        for i in range(reps):
            t0 = time.perf_counter()
            seq.forward([500 + i], 1, hidden=True)
            ts.append((time.perf_counter() - t0) * 1e3)
            seq.truncate(ctx)
        out["llama_cpp_target_step_ms"] = round(statistics.median(ts), 3)
        out["c_vs_llama_cpp"] = round(out["head_step_ms"] / out["llama_cpp_target_step_ms"], 3)
    return out


if __name__ == "__main__":
    main()
