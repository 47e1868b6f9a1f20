"""LM-head and verification-step cost against rows M on CPU: F.linear vs W @ h^T.

    python bench/head_bench.py                # SmolLM2-135M head (49152 x 576), 1 and 2 threads

Verification runs gamma + 1 rows through the target; plain decoding runs 1. On CPU, F.linear
(x W^T, what nn.Linear calls) with a few rows can cost about twice one row for a large head, and
that ratio is the "c_verify" in every speedup estimate. For each thread count and M in 1..8
this prints the head time both ways and the whole target step (decoder + head) as the decoder
runs it: transformers' path, with ``decoder.speculative.small_m_head``, and with that head plus
every layer switched to ``decoder.fastpath.SmallMLinear`` (what ``SpeculativeDecoder`` does on
CPU); at M = 1 also the step with one row padded to a 2-column GEMM (``pad_one_row``). Then,
per thread count, one draft step (``--draft-layers`` of the target, 128 tokens of context) as
the decoder can serve it: float32 with ``F.linear``, float32 with the padded row, and the bf16
serving copy (``decoder.draft_weights.ServingDraft``), with c = draft step / plain target step;
JSON on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def timed(fn, reps: int) -> float:
    fn()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,3,4,5,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--draft-layers", default="0-3", help="the derived draft timed per step ('' = skip)")
    args = ap.parse_args()
    from transformers import DynamicCache

    from decoder.fastpath import small_m_linear
    from decoder.models.loading import load_model
    from decoder.speculative import small_m_head

    model, _ = load_model(args.target)
    switched = copy.deepcopy(model)
    small_m_linear(switched)
    padded = copy.deepcopy(model)
    small_m_linear(padded, pad_one_row=True)
    w = model.get_output_embeddings().weight.detach()
    head = small_m_head(model)
    ctx = torch.randint(0, w.shape[0], (1, 128))
    out = {"target": args.target, "head_shape": list(w.shape), "rows": {}}
    with torch.inference_mode():
        for th in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(th)
            for m in (int(r) for r in args.rows.split(",")):
                h = torch.randn(m, w.shape[1])
                x = torch.randint(0, w.shape[0], (1, m))

                def step(fast: bool, model=model):
                    cache = DynamicCache(config=model.config)
                    model.get_decoder()(input_ids=ctx, cache=cache, use_cache=True)

                    def run():
                        if fast:
                            hs = model.get_decoder()(input_ids=x, cache=cache, use_cache=True).last_hidden_state[0]
                            head(hs)
                        else:
                            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=m)
                        cache.crop(-m)
                    return run

                row = out["rows"][f"threads={th} M={m}"] = {
                    "head_F.linear_ms": timed(lambda: F.linear(h, w), args.reps),
                    "head_W@hT_ms": timed(lambda: (w @ h.T).T, args.reps),
                    "step_logits_to_keep_ms": timed(step(False), args.reps),
                    "step_small_m_head_ms": timed(step(True), args.reps),
                    "step_small_m_linear_ms": timed(step(True, switched), args.reps),
                }
                if m == 1:
                    row["step_padded_one_row_ms"] = timed(step(False, padded), args.reps)
                print(f"threads={th} M={m}: {row}", file=sys.stderr, flush=True)
            if args.draft_layers:
                out.setdefault("draft", {})[f"threads={th}"] = d = draft_steps(model, args.draft_layers, ctx, args.reps)
                print(f"threads={th} draft: {d}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


def draft_steps(target, layers: str, ctx: torch.Tensor, reps: int) -> dict:
    """One draft step (1 row, logits_to_keep=1) each way the decoder can serve the draft, and
    c against the target's plain step taken the same way (F.linear or the padded row)."""
    from transformers import DynamicCache

    from decoder.fastpath import small_m_linear
    from decoder.models.loading import derive_draft
    from decoder.draft_weights import ServingDraft

    def one(model):
        cache = DynamicCache(config=model.config)
        model(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1)
        x = ctx[:, -1:]

        def run():
            model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
            cache.crop(-1)
        return timed(run, reps)

    fp32 = derive_draft(target, layers)
    pad_target = copy.deepcopy(target)
    small_m_linear(pad_target, pad_one_row=True)
    pad_draft = derive_draft(pad_target, layers)
    out = {"target_fp32_ms": one(target), "target_padded_ms": one(pad_target),
           "draft_fp32_ms": one(fp32), "draft_fp32_padded_ms": one(pad_draft),
           "draft_bf16_ms": one(ServingDraft(fp32, torch.bfloat16).module)}
    out["c_fp32"] = round(out["draft_fp32_ms"] / out["target_fp32_ms"], 3)
    out["c_fp32_padded"] = round(out["draft_fp32_padded_ms"] / out["target_padded_ms"], 3)
    out["c_bf16_vs_padded_target"] = round(out["draft_bf16_ms"] / out["target_padded_ms"], 3)
    return out


if __name__ == "__main__":
    main()
