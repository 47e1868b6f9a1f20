"""How many CPU minutes of bootstrap buy how much held-out α: the table behind v0's budget.

    python bench/bootstrap_bench.py                              # the daemon's settings, 8 minutes of training
    python bench/bootstrap_bench.py --corpus-tokens 30000 --minutes 12 --draft-vocab 8192

Runs what the first start runs (``daemon.warm_start.train_v0``: the target teacher-scores each
workload's bootstrap documents, whole documents held out, on the torch copy of the target
(``--scorer engine``: on llama.cpp, where it is served), then the draft's LoRA is distilled),
with a held-out evaluation every ``--round-steps`` steps, and prints JSON: the scoring cost
(positions, wall and CPU seconds per workload) and the curve, one point per evaluation: steps,
training seconds, CPU minutes since the start (scoring + training + evaluations, all threads),
held-out α (teacher-forced, α = Σ min(p, q) over the stored top-k: Leviathan et al. 2023, §3.1)
overall and per workload, and the base draft's α beside it. The LoRA and loss settings are the
trainer's (``DRAFTD_TRAINER__*``, ``DRAFTD_MODELS__DRAFT_VOCAB``) unless overridden here.
Run it alone on the machine's cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--corpus-tokens", type=int, default=12_000, help="teacher-scored training tokens per workload")
    ap.add_argument("--heldout-tokens", type=int, default=2_048, help="teacher-scored held-out tokens per workload")
    ap.add_argument("--minutes", type=float, default=8.0, help="training minutes (wall clock)")
    ap.add_argument("--steps", type=int, default=100_000, help="optimiser steps at most")
    ap.add_argument("--round-steps", type=int, default=25, help="steps between held-out evaluations")
    ap.add_argument("--draft-vocab", type=int, default=None, help="FR-Spec head size (default: models.draft_vocab)")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--lora-r", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: all cores)")
    ap.add_argument("--scorer", choices=("engine", "torch"), default="torch",
                    help="torch: the dequantised torch copy scores the corpora (what the first start does); "
                         "engine: the served target on llama.cpp")
    args = ap.parse_args()
    for name in ("corpus_tokens", "heldout_tokens", "steps", "round_steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not args.minutes > 0:
        ap.error(f"--minutes {args.minutes}: must be > 0")

    import torch

    from daemon.settings import Settings, distill_config, draft_vocab_ids
    from daemon.warm_start import WarmStartConfig, scoring_engine, train_v0
    from decoder.models.loading import load_pair
    from store.schema import PairFingerprint
    from trainer.distill import Distiller, cpu_has_native_bf16

    from daemon.logging import configure

    configure("console", "warning", stream=sys.stderr)  # stdout is the JSON alone
    if args.threads:
        torch.set_num_threads(args.threads)
    s = Settings()
    if args.draft_vocab is not None:
        s.models.draft_vocab = args.draft_vocab
    dcfg = distill_config(s)
    dcfg = dataclasses.replace(dcfg, **{k: v for k, v in (("lr", args.lr), ("lora_r", args.lora_r)) if v is not None})
    cfg = WarmStartConfig(workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
                          corpus_tokens=args.corpus_tokens, heldout_tokens=args.heldout_tokens,
                          max_steps=args.steps, max_seconds=args.minutes * 60, round_steps=args.round_steps)
    c_start, t_start = time.process_time(), time.perf_counter()
    pair = load_pair(s.models.target, s.models.draft)
    load_cpu = time.process_time() - c_start
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    distiller = Distiller(pair.draft, dcfg, vocab=draft_vocab_ids(s, pair.tokenizer))
    c0 = time.process_time()
    curve = []

    def on_round(pt) -> None:
        row = dataclasses.asdict(pt)
        row["cpu_minutes_total"] = round((time.process_time() - c0) / 60, 3)  # scoring + training + evaluations
        curve.append(row)
        print(f"steps {pt.steps:5d}  train {pt.train_seconds:6.0f} s  CPU {row['cpu_minutes_total']:6.2f} min  "
              f"alpha {pt.alpha:.4f} {pt.per_workload}", file=sys.stderr, flush=True)

    m = s.models
    with scoring_engine("torch" if args.scorer == "torch" else m.engine, m.target, m.device, args.threads) as eng:
        res, stats = train_v0(pair, fp, distiller, cfg, s.trainer.precision, lambda msg: print(msg, file=sys.stderr, flush=True),
                              on_round=on_round, engine=eng)
    print(json.dumps({
        "bench": "bootstrap_bench",
        "target": s.models.target, "draft": s.models.draft, "draft_vocab": s.models.draft_vocab,
        "torch_threads": torch.get_num_threads(), "cpu_has_native_bf16": cpu_has_native_bf16(),
        "config": dataclasses.asdict(cfg), "distill": {k: v for k, v in dataclasses.asdict(dcfg).items()
                                                        if k in ("loss", "lora_r", "lora_alpha", "lr", "batch_size", "precision")},
        "model_load_cpu_seconds": round(load_cpu, 2),
        "scoring": stats,
        "samples_trained": res.samples_trained, "heldout_samples": res.heldout_samples,
        "base": {"alpha": res.base.alpha, "per_workload": {w: c.alpha for w, c in sorted(res.base.per_workload.items())}},
        "curve": curve,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
