"""Bootstrap bench: held-out alpha against training minutes, per loss and position weighting.

    python bench/train_bench.py --pair tiny                     # tiny random Llama pair, seconds
    python bench/train_bench.py --pair smollm2 --minutes 15     # real derived draft (decoder.models)

For each (loss, weighting) a fresh untrained draft is wrapped by ``trainer.distill.Distiller`` and
trained by ``trainer.bootstrap.bootstrap`` on the same target-generated samples; held-out alpha
(sum of min(p, q) over the stored top-k + tail, pooled over positions) and greedy agreement are
measured after every round on samples from prompts never trained on.

Samples:
- ``tiny``: ``tests/trainer/tiny_pair.py`` (a real randomly initialised target with peaked
  outputs, another random init as draft), rejections from greedy gamma = 4 with the untrained draft.
- ``smollm2``: ``decoder.models.load_pair`` (target + layer-derived draft) and
  ``decoder.speculative.SpeculativeDecoder`` at gamma = 4, greedy, with the untrained draft, over
  ``decoder.workloads`` prompts; its sink yields the VerifiedSamples (greedy speculative output
  equals the target's greedy output, and the rejection positions feed the OSD weightings).
  Generation costs target time (~15 tokens/s on 2 cores) and is reported separately.

bench/ may import decoder and trainer; trainer itself never imports decoder.
Writes a JSON with every curve to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.bootstrap import BootstrapConfig, bootstrap  # noqa: E402
from trainer.distill import DistillConfig, Distiller  # noqa: E402


def tiny_setup(args):
    sys.path.insert(0, str(REPO / "tests" / "trainer"))
    from tiny_pair import make_samples, tiny_draft, tiny_target

    target = tiny_target()
    d0 = tiny_draft()
    samples = []
    for i, w in enumerate(["prose", "code"]):
        samples += make_samples(target, args.prompts, w, seed=1 + i, draft=d0, new_tokens=args.new_tokens)
    return samples, tiny_draft, {"pair": "tiny", "generate_s": 0.0}


def smollm2_setup(args):
    from decoder.models import derive_draft, load_pair
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.workloads import get_workload
    from store.schema import PairFingerprint

    t0 = time.perf_counter()
    pair = load_pair(args.target, draft=f"layers:{args.layers}")
    load_s = time.perf_counter() - t0
    samples = []
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(topk_record=args.k),
                             sink=samples.append, pair_fingerprint=fp)
    t0 = time.perf_counter()
    for w in args.workloads.split(","):
        for p in get_workload(w, n=args.prompts):
            dec.generate(DecodeRequest(p.token_ids(pair.tokenizer), SamplingParams(temperature=0.0),
                                       max_new_tokens=args.new_tokens, gamma=4, ignore_eos=True, workload=w))
    gen_s = time.perf_counter() - t0

    def fresh_draft():
        return derive_draft(pair.target, args.layers)

    return samples, fresh_draft, {"pair": args.target, "layers": args.layers, "load_s": load_s, "generate_s": gen_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", default="0-7")
    ap.add_argument("--workloads", default="prose")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per workload")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--losses", default="forward_kl,reverse_kl,jsd,tv")
    ap.add_argument("--weightings", default="all,upweight_rejected,rejected")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--round-steps", type=int, default=50)
    ap.add_argument("--minutes", type=float, default=15.0, help="training budget per configuration")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_bench.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    samples, fresh_draft, info = (tiny_setup if args.pair == "tiny" else smollm2_setup)(args)
    print(f"{info}; {len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens", flush=True)
    rows = []
    for loss in args.losses.split(","):
        for weighting in args.weightings.split(","):
            cfg = DistillConfig(loss=loss, weighting=weighting, lr=args.lr, batch_size=args.batch_size, lora_r=args.lora_r,
                                lora_alpha=2 * args.lora_r)
            dist = Distiller(fresh_draft(), cfg)
            cpu0 = time.process_time()
            try:
                res = bootstrap(samples, dist, None, BootstrapConfig(max_steps=args.steps, round_steps=args.round_steps,
                                                                     max_seconds=60 * args.minutes, holdout_fraction=args.holdout))
            except Exception as e:  # noqa: BLE001 - one failing configuration is a row, not the end
                print(f"{loss:>10} {weighting:>17}: failed: {e}", flush=True)
                rows.append({"loss": loss, "weighting": weighting, "error": str(e)})
                continue
            cpu = time.process_time() - cpu0
            curve = " ".join(f"{p.steps}:{p.alpha:.3f}" for p in res.curve)
            print(f"{loss:>10} {weighting:>17}: alpha {res.base.alpha:.3f} -> {res.after.alpha:.3f}, greedy "
                  f"{res.base.greedy:.3f} -> {res.after.greedy:.3f}, {res.steps} steps in {res.train_seconds:.1f} s "
                  f"train wall ({cpu / 60:.2f} CPU min incl. eval) | {curve}", flush=True)
            rows.append({
                "loss": loss, "weighting": weighting, "steps": res.steps, "train_seconds": res.train_seconds,
                "cpu_seconds": cpu, "base": res.base.to_dict(), "after": res.after.to_dict(),
                "curve": [p.__dict__ for p in res.curve],
            })
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
