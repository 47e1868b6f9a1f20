"""Bootstrap bench: held-out alpha against training minutes, per loss and position weighting.

    python bench/train_bench.py --pair tiny                     # tiny random Llama pair, seconds
    python bench/train_bench.py --pair smollm2 --minutes 15     # real derived draft (decoder.models)
    python bench/train_bench.py --pair smollm2 --data decode    # ... on target-decoded samples only

For each (loss, weighting) a fresh untrained draft is wrapped by ``trainer.distill.Distiller`` and
trained by ``trainer.bootstrap.bootstrap`` on the same target-generated samples; held-out alpha
(sum of min(p, q) over the stored top-k + tail, pooled over positions) and greedy agreement are
measured after every round on samples from prompts never trained on.

Samples:
- ``tiny``: ``tests/trainer/tiny_pair.py`` (a real randomly initialised target with peaked
  outputs, another random init as draft), rejections from greedy gamma = 4 with the untrained draft.
- ``smollm2 --data corpus`` (default): training samples are teacher-forced windows of the
  workload's corpus (``decoder.workloads.documents``, split by document: 80 % train, 20 %
  held out; documents sharing text stay on one side), scored by one target forward pass per batch
  (``decoder.teacher``). The held-out documents are split again, the same way and about half and
  half by characters, into *selection* and *bench* documents.
  Held out for selection are (a) target-*decoded* samples on ``--prompts`` prompts cut from the
  selection documents (the decoder at gamma = 4, greedy, with the untrained draft: the on-policy
  text the draft meets when serving) and (b) teacher-forced windows of the selection documents.
  Alpha is reported on both after every round; the checkpoint with the best decoded alpha is
  kept, as the promotion gate keeps the best candidate. Then the decoder bench
  (``decoder.bench.run_bench``, every method back to back per prompt) runs on
  ``--bench-prompts`` prompts cut from the bench documents, which picked nothing, with the
  untrained and the picked (merged) draft: speculative goodput vs plain decoding, and the picked
  draft once more with its LM head restricted to ``--bench-draft-vocab`` frequent tokens
  (FR-Spec). ``--train-draft-vocab N`` trains that restricted head instead (``Distiller(vocab=...)``:
  the N most frequent tokens of the training documents; held-out alpha is then the FR-Spec draft's,
  q = 0 outside them) and benches the trained draft served with those ids. ``--gen-tokens N`` adds on-policy training data: the target's own continuations (greedy by default) of windows of
  the training documents (``decoder.teacher.continue_windows``), teacher-scored with them.
  ``--per-workload-steps N`` (with several ``--workloads``) then compares, from the trained
  shared adapter and at equal training steps, the shared adapter trained on for N steps per
  workload on the mixed data against one adapter per workload trained N steps on its own data
  (``ServiceConfig.per_workload``), by held-out alpha per workload.
- ``smollm2 --data decode``: ``decoder.models.loading.load_pair`` (target + layer-derived draft) and
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
import math
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
    from decoder.models.loading import derive_draft, load_pair
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


def doc_prompts(workload: str, docs: list[tuple[str, str]], n: int, chars: int = 400, stride: int = 1200) -> list:
    """Up to ``n`` prompts of about ``chars`` characters cut from ``docs`` at word boundaries:
    every document's opening first, then each long document's text at ``stride``, 2 x ``stride``, ...
    characters in, document by document in turn (so a few long documents don't take every prompt)."""
    from decoder.workloads import Prompt

    out, offset = [], 0
    while len(out) < n and any(len(t) >= offset + chars for _, t in docs):
        for _, t in docs:
            if len(out) < n and len(t) >= offset + chars:
                text = t[offset : offset + chars]
                if offset:
                    text = text.split(" ", 1)[-1]  # start at a word
                text = text.rsplit(" ", 1)[0]
                if text.strip():  # a cut with no word boundary inside can come out empty
                    out.append(Prompt(workload, text))
        offset += stride
    return out


def corpus_setup(args):
    """Teacher-forced training windows + decoded and teacher-forced held-out samples."""
    from decoder.models.loading import derive_draft, load_pair
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.teacher import continue_windows, corpus_windows, score_windows
    from decoder.workloads import documents, split_documents
    from store.schema import PairFingerprint
    from trainer.distill import autocast_dtype

    # Split and cut prompts for every workload before loading the model or scoring anything, so a
    # workload that would give no selection or bench prompts stops the run in seconds, by name.
    if args.prompts < 1 or (args.decode_bench and args.bench_prompts < 1):
        raise SystemExit(f"--prompts {args.prompts} / --bench-prompts {args.bench_prompts}: each must be >= 1 "
                         f"(--no-decode-bench skips the bench and its prompts)")
    plan = []
    for w in args.workloads.split(","):
        tr_docs, he_docs = split_documents(documents(w), 0.2)
        # the held-out documents split again, sharing no text: selection (the held-out alpha that
        # picks the checkpoint, as the promotion gate would) and bench (the decoder bench's
        # prompts, never used to pick anything)
        he_docs, bench_docs = split_documents(he_docs, 0.5)
        sel_p = doc_prompts(w, he_docs, args.prompts)
        bench_p = doc_prompts(w, bench_docs, args.bench_prompts) if args.decode_bench else []
        if not sel_p or (args.decode_bench and not bench_p):
            raise SystemExit(f"workload {w!r}: its held-out documents gave {len(sel_p)} selection and {len(bench_p)} "
                             f"bench prompts; each side needs a document of >= 400 characters (use a workload with "
                             f"more text, or --no-decode-bench to skip the bench)")
        plan.append((w, tr_docs, he_docs, sel_p, bench_p))

    t0 = time.perf_counter()
    pair = load_pair(args.target, draft=f"layers:{args.layers}")
    load_s = time.perf_counter() - t0
    vocab = None
    if args.train_draft_vocab:  # counted on training documents only: the held-out text picks nothing
        from decoder.vocab import frequent_token_ids

        try:  # the size is checked before any counting
            vocab = frequent_token_ids(pair.tokenizer, args.train_draft_vocab, [t for _, docs, *_ in plan for _, t in docs])
        except ValueError as e:
            raise SystemExit(f"--train-draft-vocab: {e}") from e
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    # training data is scored at --precision (bf16 where native: ~2x faster); held-out data in fp32
    ac = autocast_dtype(args.precision, "cpu")
    train, held, eval_prompts, bench_prompts = [], [], [], []
    gen_train_s, n_generated = 0.0, 0
    t0 = time.perf_counter()
    for w, tr_docs, he_docs, sel_p, bench_p in plan:
        items = corpus_windows(pair.tokenizer, tr_docs, args.window, max_tokens=args.corpus_tokens)
        train += list(score_windows(pair.target, items, w, fp, k=args.k, request_prefix="train", autocast_dtype=ac))
        if args.gen_tokens:  # on-policy: the target's own continuations of training-document windows
            t1 = time.perf_counter()
            starts = corpus_windows(pair.tokenizer, tr_docs, args.gen_prompt)
            want = max(1, args.gen_tokens // args.gen_new)
            starts = [starts[i * len(starts) // want] for i in range(min(want, len(starts)))]
            cont = continue_windows(pair.target, starts, args.gen_new, temperature=args.gen_temperature)
            gen_train_s += time.perf_counter() - t1
            train += list(score_windows(pair.target, cont, w, fp, k=args.k, request_prefix="generated", autocast_dtype=ac))
            n_generated += len(cont) * args.gen_new
        items = corpus_windows(pair.tokenizer, he_docs, args.window, max_tokens=args.heldout_tokens)
        held += list(score_windows(pair.target, items, w, fp, k=args.k, request_prefix="heldout"))
        eval_prompts += sel_p
        bench_prompts += bench_p
    teach_s = time.perf_counter() - t0
    decoded = []
    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(topk_record=args.k),
                             sink=decoded.append, pair_fingerprint=fp)
    t0 = time.perf_counter()
    for p in eval_prompts:
        dec.generate(DecodeRequest(p.token_ids(pair.tokenizer), SamplingParams(temperature=0.0),
                                   max_new_tokens=args.new_tokens, gamma=4, ignore_eos=True, workload=p.workload))
    gen_s = time.perf_counter() - t0

    def fresh_draft():
        return derive_draft(pair.target, args.layers)

    info = {"pair": args.target, "layers": args.layers, "data": "corpus", "load_s": load_s, "teacher_s": teach_s,
            "autocast": str(ac),
            "teacher_positions": sum(s.num_tokens for s in train + held), "generate_s": gen_s,
            "generated_train_tokens": n_generated, "generate_train_s": gen_train_s,
            "train_samples": len(train), "heldout_teacher_forced": len(held), "heldout_decoded": len(decoded),
            "selection_prompts": len(eval_prompts), "bench_prompts": len(bench_prompts)}
    return train, held, decoded, bench_prompts, pair, fresh_draft, vocab, info


def per_workload_compare(dist, cfg, train, held_dec, held_tf, n_steps: int) -> dict:
    """From the distiller's current (shared) adapter, at equal steps: the shared adapter trained
    on for ``n_steps`` x workloads on all of ``train``, vs one adapter per workload trained
    ``n_steps`` on that workload's samples only. Held-out alpha (decoded, teacher-forced) per
    workload for the start, both arms; the distiller is left at the start."""
    import dataclasses

    workloads = sorted({s.workload for s in train})

    def per_w(samples, w):
        return [s for s in samples if s.workload == w]

    def evaluate(ws):
        return {w: {"decoded": dist.evaluate(per_w(held_dec, w)).alpha, "teacher_forced": dist.evaluate(per_w(held_tf, w)).alpha}
                for w in ws}

    start = dist.training_context()
    out = {"steps_per_workload": n_steps, "start": evaluate(workloads)}
    t0 = time.perf_counter()
    dist.config = dataclasses.replace(cfg, max_steps=n_steps * len(workloads), max_seconds=1e9)
    res = dist.train_round(train)
    out["shared"] = evaluate(workloads) | {"steps": res.steps, "train_seconds": round(time.perf_counter() - t0, 1)}
    own = {"steps": 0, "train_seconds": 0.0}
    for w in workloads:
        dist.load_training_context(start)
        dist.config = dataclasses.replace(cfg, max_steps=n_steps, max_seconds=1e9)
        t0 = time.perf_counter()
        res = dist.train_round(per_w(train, w))
        own["train_seconds"] = round(own["train_seconds"] + time.perf_counter() - t0, 1)
        own["steps"] += res.steps
        own |= evaluate([w])
    out["per_workload"] = own
    dist.load_training_context(start)
    dist.config = cfg
    for w in workloads:
        print(f"per-workload vs shared, {w}: held-out decoded alpha {out['start'][w]['decoded']:.3f} -> shared "
              f"{out['shared'][w]['decoded']:.3f} / own {own[w]['decoded']:.3f}; teacher-forced "
              f"{out['start'][w]['teacher_forced']:.3f} -> {out['shared'][w]['teacher_forced']:.3f} / "
              f"{own[w]['teacher_forced']:.3f}", flush=True)
    return out


def corpus_main(args) -> None:
    import dataclasses

    from peft import PeftModel

    from decoder.bench import BenchConfig, run_bench
    from decoder.speculative import DecoderConfig, SpeculativeDecoder
    from trainer.distill import BASE

    train, held_tf, held_dec, bench_prompts, pair, fresh_draft, vocab, info = corpus_setup(args)
    print(f"{info}", flush=True)
    rows = []
    best = None
    for loss, weighting, temp in _configs(args):
        cfg = DistillConfig(loss=loss, weighting=weighting, lr=args.lr, batch_size=args.batch_size,
                            lora_r=args.lora_r, lora_alpha=2 * args.lora_r, max_steps=args.round_steps,
                            max_seconds=1e9, max_epochs=10**6, precision=args.precision, teacher_temperature=temp)
        loss = _label(loss, temp)
        dist = Distiller(fresh_draft(), cfg, vocab=vocab)
        base = {"decoded": dist.evaluate(held_dec, adapter=BASE), "teacher_forced": dist.evaluate(held_tf, adapter=BASE)}
        curve, steps, train_s = [], 0, 0.0
        pick = None  # (alpha_decoded, steps, adapter_state): the best held-out checkpoint so far
        cpu0 = time.process_time()
        while steps < args.steps and train_s < 60 * args.minutes:
            dist.config = dataclasses.replace(cfg, max_steps=min(args.round_steps, args.steps - steps),
                                              max_seconds=60 * args.minutes - train_s)
            if args.lr_decay == "cosine":  # per round, by the share of the budget (time or steps) spent
                done = max(train_s / (60 * args.minutes), steps / args.steps)
                dist.set_lr(args.lr_min + 0.5 * (args.lr - args.lr_min) * (1 + math.cos(math.pi * min(done, 1.0))))
            t0 = time.perf_counter()
            res = dist.train_round(train)
            train_s += time.perf_counter() - t0
            steps += res.steps
            if not res.finite or res.steps == 0:
                print(f"{loss} {weighting}: round failed: {res.reason}", flush=True)
                break
            ed, et = dist.evaluate(held_dec), dist.evaluate(held_tf)
            curve.append({"steps": steps, "train_seconds": round(train_s, 1), "lr": dist.config.lr, "alpha_decoded": ed.alpha,
                          "greedy_decoded": ed.greedy, "alpha_teacher_forced": et.alpha,
                          "greedy_teacher_forced": et.greedy, "loss": res.loss_last})
            if pick is None or ed.alpha > pick[0]:
                pick = (ed.alpha, steps, dist.adapter_state())
            print(f"{loss:>10} {weighting:>8} step {steps:4d} {train_s:6.0f} s: held-out decoded alpha "
                  f"{base['decoded'].alpha:.3f} -> {ed.alpha:.3f} (greedy {base['decoded'].greedy:.3f} -> "
                  f"{ed.greedy:.3f}); teacher-forced alpha {base['teacher_forced'].alpha:.3f} -> {et.alpha:.3f}",
                  flush=True)
        row = {"loss": loss, "weighting": weighting, "steps": steps, "train_seconds": train_s,
               "cpu_seconds": time.process_time() - cpu0,
               "base": {k: v.to_dict() for k, v in base.items()}, "curve": curve,
               "picked": None if pick is None else next(p for p in curve if p["steps"] == pick[1])}
        if args.per_workload_steps:
            row["per_workload"] = per_workload_compare(dist, cfg, train, held_dec, held_tf, args.per_workload_steps)
        rows.append(row)
        if pick is not None and (best is None or pick[0] > best[0]):
            best = (pick[0], loss, weighting, dist, pick)
    bench = None
    if best is not None and args.decode_bench:
        import tempfile

        _, loss, weighting, dist, pick = best
        # the checkpoint with the best held-out (selection) decoded alpha, as the promotion gate
        # keeps the best candidate, not whichever step training stopped at
        dist.load_adapter_state(pick[2])
        print(f"decoder bench: the ({loss}, {weighting}) adapter at step {pick[1]} (held-out decoded alpha "
              f"{pick[0]:.3f}), on {len(bench_prompts)} prompts from other held-out documents", flush=True)
        with tempfile.TemporaryDirectory() as d:
            path = dist.save(Path(d) / "adapter")
            trained = PeftModel.from_pretrained(fresh_draft(), str(path)).merge_and_unload().eval()
        bcfg = BenchConfig(gammas=tuple(int(g) for g in args.bench_gammas.split(",")), sampling=("greedy", "t1.0"),
                           max_new_tokens=args.new_tokens, hf=False)
        bench = {}
        name = f"trained ({loss}, {weighting}, step {pick[1]})"
        runs = [("untrained", pair.draft, None)] if args.bench_untrained else []
        if vocab is not None:  # the adapter fits the restricted head only: serve it so
            runs.append((f"{name} + FR-Spec {len(vocab)} (trained on it)", trained, vocab))
        else:
            runs.append((name, trained, None))
        if args.bench_draft_vocab and vocab is None:
            from decoder.vocab import frequent_token_ids

            dv = frequent_token_ids(pair.tokenizer, args.bench_draft_vocab)
            runs.append((f"{name} + FR-Spec {args.bench_draft_vocab}", trained, dv))
        for name, draft, dv in runs:
            print(f"decoder bench: {name} draft", flush=True)
            dec = SpeculativeDecoder(pair.target, draft, pair.tokenizer, DecoderConfig(draft_vocab=dv))
            res = run_bench(dec, bench_prompts, bcfg)
            bench[name] = res
            for r in res["rows"]:
                print(f"  {r['workload']:>6} {r['sampling']:>7} {r['method']:>6} γ={r['gamma']} "
                      f"tok/s {r['tokens_per_s']:.2f} x{r.get('speedup_vs_plain') or 1:.2f} "
                      f"α={r.get('alpha')} τ={r.get('tau')} per-prompt median x{r.get('speedup_per_prompt_median')}",
                      flush=True)
            for srow in res["summary"]:
                print(f"  summary: {srow}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "args": vars(args), "rows": rows, "decoder_bench": bench}, indent=1, default=str))
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    """The command line, checked before any model is loaded (argparse exits 2 on a bad value)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", default="0-3")
    ap.add_argument("--workloads", default="prose")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per workload")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--losses", default="forward_kl,reverse_kl,jsd,tv")
    ap.add_argument("--weightings", default="all,upweight_rejected,rejected")
    ap.add_argument("--teacher-temperatures", default="1",
                    help="temperatures the teacher is distilled at (DistillConfig.teacher_temperature; 0 = its top-1)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--round-steps", type=int, default=50)
    ap.add_argument("--minutes", type=float, default=15.0, help="training budget per configuration")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-decay", choices=["none", "cosine"], default="none",
                    help="--data corpus: cosine decay from --lr to --lr-min over the budget (--minutes or --steps, "
                         "whichever runs out first), set before each round")
    ap.add_argument("--lr-min", type=float, default=0.0, help="the cosine decay's floor")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave torch's default)")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="training (and, with --data corpus, training-data scoring) under bf16 autocast: auto = where "
                         "the CPU multiplies bf16 natively (trainer.distill.autocast_dtype)")
    ap.add_argument("--data", choices=["corpus", "decode"], default="corpus",
                    help="smollm2 training data: teacher-forced corpus windows, or target-decoded samples")
    ap.add_argument("--window", type=int, default=128, help="corpus window, tokens")
    ap.add_argument("--corpus-tokens", type=int, default=40_000, help="training corpus tokens per workload")
    ap.add_argument("--heldout-tokens", type=int, default=6_000, help="held-out teacher-forced tokens per workload")
    ap.add_argument("--gen-tokens", type=int, default=0,
                    help="on-policy training data: tokens the target generates per workload, continuing windows "
                         "spread over the training documents (decoder.teacher.continue_windows), then "
                         "teacher-scored with their prompt")
    ap.add_argument("--gen-prompt", type=int, default=32, help="prompt tokens per generated window")
    ap.add_argument("--gen-new", type=int, default=96, help="tokens generated per opening")
    ap.add_argument("--gen-temperature", type=float, default=0.0, help="0 = greedy continuations")
    ap.add_argument("--bench-draft-vocab", type=int, default=8192,
                    help="also bench the trained draft with its LM head restricted to N frequent tokens (FR-Spec; 0 = off; "
                         "with --train-draft-vocab the bench serves that vocabulary instead)")
    ap.add_argument("--train-draft-vocab", type=int, default=0,
                    help="train (and evaluate, and bench) the draft with its LM head restricted to the N most frequent "
                         "tokens of the training documents (FR-Spec; 0 = the full vocabulary)")
    ap.add_argument("--decode-bench", action=argparse.BooleanOptionalAction, default=True,
                    help="after training, decoder bench with the untrained and the best trained draft")
    ap.add_argument("--per-workload-steps", type=int, default=0,
                    help="after training, compare per-workload adapters with the shared one at N steps per workload "
                         "(several --workloads; 0 = off)")
    ap.add_argument("--bench-gammas", default="1,2,3")
    ap.add_argument("--bench-prompts", type=int, default=12,
                    help="decoder-bench prompts, cut from held-out documents other than the selection prompts' "
                         "(--prompts)")
    ap.add_argument("--bench-untrained", action=argparse.BooleanOptionalAction, default=True,
                    help="also bench the untrained draft")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "train_bench.json"))
    args = ap.parse_args()
    for name in ("gen_prompt", "gen_new"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.per_workload_steps < 0:
        ap.error(f"--per-workload-steps {args.per_workload_steps}: must be >= 0 (0 = off)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr {args.lr}: must be a finite number > 0")
    if args.lr_decay != "none" and not (args.pair == "smollm2" and args.data == "corpus"):
        ap.error(f"--lr-decay {args.lr_decay} needs --pair smollm2 --data corpus (the other paths train at a constant --lr)")
    if not (0 <= args.lr_min <= args.lr):
        ap.error(f"--lr-min {args.lr_min}: must be in 0..--lr ({args.lr})")
    if args.train_draft_vocab < 0:
        ap.error(f"--train-draft-vocab {args.train_draft_vocab}: must be >= 0 (0 = the full vocabulary)")
    if args.train_draft_vocab and not (args.pair == "smollm2" and args.data == "corpus"):
        ap.error("--train-draft-vocab needs --pair smollm2 --data corpus")
    if args.gen_tokens < 0:
        ap.error(f"--gen-tokens {args.gen_tokens}: must be >= 0 (0 = no generated training data)")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pair == "smollm2" and args.data == "corpus":
        return corpus_main(args)
    samples_main(args)


def _configs(args) -> list[tuple[str, str, float]]:
    """Every (loss, weighting, teacher temperature) the arguments ask for."""
    return [(loss, w, float(t)) for loss in args.losses.split(",") for w in args.weightings.split(",")
            for t in args.teacher_temperatures.split(",")]


def _label(loss: str, temperature: float) -> str:
    """The row's loss name: ``forward_kl`` at T = 1, ``forward_kl@T0.25`` otherwise."""
    return loss if temperature == 1.0 else f"{loss}@T{temperature:g}"


def samples_main(args) -> None:
    """--pair tiny, or --data decode: every loss x weighting bootstrapped on one sample set."""
    samples, fresh_draft, info = (tiny_setup if args.pair == "tiny" else smollm2_setup)(args)
    print(f"{info}; {len(samples)} samples, {sum(s.num_tokens for s in samples)} tokens", flush=True)
    rows = []
    for loss, weighting, temp in _configs(args):
        cfg = DistillConfig(loss=loss, weighting=weighting, lr=args.lr, batch_size=args.batch_size, lora_r=args.lora_r,
                            lora_alpha=2 * args.lora_r, precision=args.precision, teacher_temperature=temp)
        loss = _label(loss, temp)
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
