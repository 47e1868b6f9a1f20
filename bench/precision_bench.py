"""Training-side cost at fp32 and under bf16 autocast, side by side, on the real pair.

    python bench/precision_bench.py                 # SmolLM2-135M target, layers 0-3 draft, 2 threads

For each precision (``trainer.distill.DistillConfig.precision``) this measures on the same
teacher-forced prose windows (128 tokens, ``decoder.teacher``):

- teacher scoring: the target's forward over the windows (positions/s), and how far the bf16
  distributions are from the fp32 ones (mean |p_bf16 - p_fp32| over the top-k, top-1 agreement);
- a training step of the draft's LoRA adapter (forward KL, batch ``--batch-size``): median ms
  over ``--steps`` steps after one warm-up, from the same initial adapter;
- held-out alpha (fp32 evaluation, as the decoder serves the draft) after those steps.

Prints JSON: whether the CPU multiplies bf16 natively (``cpu_has_native_bf16``), one row per
precision, and the bf16/fp32 ratios. On a CPU without native bf16, bf16 is typically slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", default="0-3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", type=int, default=64, help="training windows of 128 tokens scored and trained on")
    ap.add_argument("--heldout", type=int, default=24, help="held-out windows for alpha")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--lora-r", type=int, default=32)
    args = ap.parse_args()
    for name in ("windows", "heldout", "steps", "batch_size", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    torch.set_num_threads(args.threads)

    from decoder.models.loading import derive_draft, load_pair
    from decoder.teacher import corpus_windows, score_windows
    from decoder.workloads import documents, split_documents
    from store.schema import PairFingerprint
    from trainer.distill import BASE, DistillConfig, Distiller, cpu_has_native_bf16

    pair = load_pair(args.target, draft=f"layers:{args.layers}")
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    tr_docs, he_docs = split_documents(documents("prose"), 0.2)
    items = corpus_windows(pair.tokenizer, tr_docs, 128)[: args.windows]
    held_items = corpus_windows(pair.tokenizer, he_docs, 128)[: args.heldout]
    held = list(score_windows(pair.target, held_items, "prose", fp))  # fp32: the reference

    rows, scored = {}, {}
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        t0 = time.perf_counter()
        train = list(score_windows(pair.target, items, "prose", fp, autocast_dtype=dtype))
        score_s = time.perf_counter() - t0
        scored[precision] = train
        dist = Distiller(derive_draft(pair.target, args.layers),
                         DistillConfig(lr=args.lr, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                                       batch_size=args.batch_size, max_steps=1, max_epochs=10**6,
                                       max_seconds=1e9, precision=precision))
        torch.manual_seed(0)
        dist.start_from(BASE)
        dist.train_round(train)  # warm-up step
        ms = []
        for _ in range(args.steps):
            t1 = time.perf_counter()
            dist.train_round(train)
            ms.append((time.perf_counter() - t1) * 1e3)
        ev = dist.evaluate(held)
        rows[precision] = {
            "score_positions_per_s": round(sum(s.num_tokens for s in train) / score_s, 1),
            "step_ms_median": round(statistics.median(ms), 1),
            "steps": args.steps + 1,
            "heldout_alpha_after": round(ev.alpha, 4),
        }
        print(f"{precision}: {rows[precision]}", file=sys.stderr, flush=True)
    a, b = scored["fp32"], scored["bf16"]
    diffs, top1 = [], []
    for x, y in zip(a, b):
        both = x.topk_ids == y.topk_ids  # (N, k) same id in the same rank
        diffs.append(np.abs(x.topk_probs - y.topk_probs)[both].mean())
        top1.append((x.topk_ids[:, 0] == y.topk_ids[:, 0]).mean())
    out = {
        "cpu_native_bf16": cpu_has_native_bf16(),
        "threads": args.threads,
        "rows": rows,
        "bf16_vs_fp32": {
            "scoring_speedup": round(rows["bf16"]["score_positions_per_s"] / rows["fp32"]["score_positions_per_s"], 2),
            "step_speedup": round(rows["fp32"]["step_ms_median"] / rows["bf16"]["step_ms_median"], 2),
            "teacher_mean_abs_prob_diff": round(float(np.mean(diffs)), 5),
            "teacher_top1_agreement": round(float(np.mean(top1)), 4),
        },
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
