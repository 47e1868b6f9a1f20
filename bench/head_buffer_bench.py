"""A feature-level head distilled from served traffic alone: decoder -> Redis buffer -> head. JSON out.

1. ``serve``: per workload, ``--serve`` prompts (after the first ``--skip``, which are never
   served: ``bench/proposer_bench.py --prompts N`` evaluates the first N <= ``--skip`` of each
   workload, so a head saved here is measured there on prompts it never saw) decoded by the serving engine (llama.cpp on the
   packaged GGUF, hidden-state extraction on; plain decoding, so the records are the target's
   own greedy text and the head's training does not depend on any proposer) with
   ``DecoderConfig(record_hidden=True, record_prompt=True)``: every record (prefill and decode)
   goes through ``store.buffer.SampleWriter`` into the real Redis buffer. Reported: records,
   positions, bytes per record (with hidden states, and the same records without), serving
   seconds.
2. ``record_cost``: the price of recording hidden states on the serving engine: ``--cost-prompts``
   never-served prompts per workload decoded back to back with and without ``record_hidden``
   (both streaming records to a sink; which runs first alternates per prompt), paired per
   prompt: tokens/s and their ratio.
3. ``curve``: the trainer side reads every record back through ``store.buffer.SampleReader`` (a
   consumer group, as ``trainer.service`` does), cuts them into windows (``trainer.head.record_items``)
   and distils a fresh head (``decoder.eagle.EagleHead.from_target``: the target's last layer,
   8192-token FR-Spec head) with ``trainer.head.HeadDistiller`` for ``--minutes`` of training
   (or ``--max-steps``), with no target forward. Every ``--round-steps``: teacher-forced α at
   depths 1..3 on the records of held-out prompts (``trainer.service.split_key``, 10 %: no held-out
   prompt is trained on), with CPU minutes spent.
4. ``--from-head F`` starts from a saved head (the demo's cached v0) instead of a fresh one, and
   ``--compare-lora R`` trains, from the same start on the same windows for the same time, LoRA
   of rank R on the head's linear layers with the base frozen: the two ways to adapt a head,
   side by side (``curve`` and ``lora.curve``: α per training second and CPU minute).
5. ``--save F``: the head (``decoder.eagle.save_head``), for ``bench/proposer_bench.py --eagle-head F``
   (decoded speed beside plain decoding and llama.cpp on never-served prompts).

Usage: ``.venv/bin/python bench/head_buffer_bench.py [--serve 40] [--minutes 4] [--save head.safetensors]``
(run it alone on the cores; it uses the Redis on ``--url`` under a unique key prefix, deleted at
the end). Results: README "The feature-level head (EAGLE)".
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--serve", type=int, default=40, help="prompts served per workload (recorded into the buffer)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--skip", type=int, default=16, help="first prompts of each workload never served (proposer_bench evaluates them)")
    ap.add_argument("--cost-prompts", type=int, default=3, help="never-served prompts per workload for record_cost (<= --skip)")
    ap.add_argument("--minutes", type=float, default=4.0, help="training time (ignored with --max-steps)")
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--round-steps", type=int, default=100)
    ap.add_argument("--window", type=int, default=64, help="rows per training window")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr", type=float, default=0.1)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None)
    ap.add_argument("--from-head", default=None,
                    help="start from this head file (e.g. the cached v0: ~/.cache/draftd/models/bootstrap-head/<key>/"
                         "head.safetensors) instead of a fresh one: adaptation to served traffic")
    ap.add_argument("--compare-lora", type=int, default=0, metavar="R",
                    help="also train LoRA of rank R on the head's linear layers (the base head frozen) from the same "
                         "start for the same --minutes, and report both curves side by side (issue 20 item 2)")
    ap.add_argument("--lora-lr", type=float, default=5e-3)
    a = ap.parse_args(argv)
    if a.skip < 0 or not 0 <= a.cost_prompts <= a.skip:
        ap.error(f"--skip {a.skip} must be >= 0 and --cost-prompts {a.cost_prompts} in 0..--skip")
    if a.serve < 2 or a.max_new_tokens < 3 or a.window < 3 or a.batch < 1 or a.unroll < 1:
        ap.error(f"--serve {a.serve} (>= 2), --max-new-tokens {a.max_new_tokens} (>= 3), --cost-prompts "
                 f"{a.cost_prompts}, --window {a.window} (>= 3), --batch {a.batch} and --unroll {a.unroll} (>= 1)")
    if not (a.minutes > 0 and a.lr > 0 and 0 <= a.min_lr <= 1 and a.max_steps >= 0 and a.round_steps >= 1):
        ap.error(f"--minutes {a.minutes} and --lr {a.lr} must be > 0, --min-lr {a.min_lr} in [0, 1], "
                 f"--max-steps {a.max_steps} >= 0, --round-steps {a.round_steps} >= 1")
    if a.save and not Path(a.save).resolve().parent.is_dir():
        ap.error(f"--save {a.save!r}: its directory does not exist")
    if a.from_head and not Path(a.from_head).is_file():
        ap.error(f"--from-head {a.from_head!r} does not exist (the demo with --heads caches a v0 head under "
                 f"~/.cache/draftd/models/bootstrap-head/)")
    if a.compare_lora < 0 or not a.lora_lr > 0:
        ap.error(f"--compare-lora {a.compare_lora} must be >= 0 and --lora-lr {a.lora_lr} > 0")
    return a


LORA_MODULES = ["fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_head(head, r: int):
    """``head`` with LoRA of rank ``r`` (alpha 2r) injected into fc and every linear layer of its
    decoder layer (peft's ``inject_adapter_in_model``); only the LoRA weights train."""
    from peft import LoraConfig, inject_adapter_in_model

    head = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=LORA_MODULES),
                                   head)
    for n, p in head.named_parameters():
        p.requires_grad_("lora_" in n)
    return head


def main(argv=None) -> dict:
    a = parse_args(argv)
    import torch

    from daemon.logging import configure
    from decoder.bench import SAMPLING, machine_info
    from decoder.eagle import EagleHead
    from decoder.engines.registry import choose_engine, torch_threads_for
    from decoder.models.loading import load_pair
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.vocab import frequent_token_ids
    from decoder.workloads import get_workload
    from store.buffer import SampleReader, SampleWriter
    from store.client import connect
    from store.config import BufferConfig, StoreConfig
    from store.schema import PairFingerprint, encode
    from trainer.distill import cpu_has_native_bf16
    from trainer.head import HeadDistiller, column_map, groups, head_batch, learning_curve, record_items
    from trainer.service import split_key

    configure("auto", "warning", stream=sys.stderr)  # stdout carries only the JSON
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    c_start = time.process_time()
    torch.manual_seed(a.seed)
    pair = load_pair(a.target, "layers:0-3")
    tok = pair.tokenizer
    choice = choose_engine("auto", a.target, "cpu", "", embeddings=True)  # no draft: plain decoding serves
    fp = PairFingerprint(pair.target_name, "eagle-head", "bench")
    client = connect(a.url)
    prefix = f"bench:head:{uuid.uuid4().hex[:8]}:"
    cfg = StoreConfig(key_prefix=prefix, buffer=BufferConfig(max_bytes=None))
    out: dict = {"machine": machine_info(), "args": vars(a)}
    try:
        writer = SampleWriter(client, cfg)
        dec = SpeculativeDecoder(pair.target, pair.target, tok,
                                 DecoderConfig(record_hidden=True, record_prompt=True), sink=writer.submit,
                                 pair_fingerprint=fp, engine=choice.target)
        out["engine"] = dec.engine.describe()
        served, evals = {}, {}
        t0 = time.perf_counter()
        with torch_threads_for(dec.engine):
            for wl in a.workloads.split(","):
                prompts = get_workload(wl, a.skip + a.serve)
                served[wl], evals[wl] = prompts[a.skip:], prompts[: a.cost_prompts]
                if len(served[wl]) < a.serve:
                    log(f"{wl}: {len(prompts)} prompts in all, {len(served[wl])} served after the first {a.skip}")
                for p in served[wl]:
                    dec.generate(DecodeRequest(p.token_ids(tok)[-256:], SAMPLING["greedy"], a.max_new_tokens, gamma=0,
                                               workload=wl))
        serve_s = time.perf_counter() - t0
        assert writer.flush(120), "the buffer writer did not drain"
        wst = writer.close()
        reader = SampleReader(client, cfg, "head-trainer", "c1", expected_fingerprint=fp)
        records = []
        while True:
            got = reader.read(count=200)
            if not got:
                break
            records += [e.sample for e in got]
            reader.ack(got)
        with_h = [sum(len(k) + len(v) for k, v in encode(s).items()) for s in records]
        without = [sum(len(k) + len(v) for k, v in encode(_without_hidden(s)).items()) for s in records]
        out["serve"] = {"requests": sum(len(v) for v in served.values()), "records": len(records),
                        "written": wst.written, "dropped": wst.dropped,
                        "positions": sum(s.num_tokens for s in records), "seconds": round(serve_s, 1),
                        "bytes_per_record_with_hidden": round(statistics.mean(with_h)),
                        "bytes_per_record_without": round(statistics.mean(without)),
                        "bytes_per_position_with_hidden": round(sum(with_h) / sum(s.num_tokens for s in records), 1),
                        "bytes_per_position_without": round(sum(without) / sum(s.num_tokens for s in records), 1)}
        log(f"serve: {out['serve']}")

        # the price of recording hidden states where the decoder serves: paired per never-served prompt
        if a.cost_prompts:
            plain_dec = SpeculativeDecoder(pair.target, pair.target, tok, DecoderConfig(record_prompt=True),
                                           sink=lambda s: None, pair_fingerprint=fp, engine=choice.target)
            rec_dec = SpeculativeDecoder(pair.target, pair.target, tok,
                                         DecoderConfig(record_prompt=True, record_hidden=True),
                                         sink=lambda s: None, pair_fingerprint=fp, engine=choice.target)
            pairs = []
            with torch_threads_for(dec.engine):
                for wl, ps in evals.items():
                    for i, p in enumerate(ps):  # the order alternates per prompt: neither run is always first
                        ids = p.token_ids(tok)[-256:]
                        req = DecodeRequest(ids, SAMPLING["greedy"], a.max_new_tokens, gamma=0)
                        if i % 2:
                            r1, r0 = rec_dec.generate(req), plain_dec.generate(req)
                        else:
                            r0, r1 = plain_dec.generate(req), rec_dec.generate(req)
                        pairs.append((r0.tokens_per_s, r1.tokens_per_s, r0.output_ids == r1.output_ids))
            out["record_cost"] = {"prompts": len(pairs),
                                  "tokens_per_s_without": round(statistics.mean(x for x, _, _ in pairs), 2),
                                  "tokens_per_s_with_hidden": round(statistics.mean(y for _, y, _ in pairs), 2),
                                  "ratio_per_prompt": [round(y / x, 3) for x, y, _ in pairs],
                                  "ratio_median": round(statistics.median(y / x for x, y, _ in pairs), 3),
                                  "same_tokens": all(s for *_, s in pairs)}
            log(f"record_cost: {out['record_cost']}")

        # the trainer's side: records only
        held = [s for s in records if int(split_key(s)[:8], 16) % 10 == 0]
        train = [s for s in records if int(split_key(s)[:8], 16) % 10 != 0]
        vocab = frequent_token_ids(tok, a.draft_vocab) if a.draft_vocab else None
        col = column_map(vocab, pair.target.get_output_embeddings().weight.shape[0])
        items = record_items(train, a.window)
        held_batches = {}
        for wl in served:
            hb = [head_batch(g, col) for g in groups(record_items([s for s in held if s.workload == wl], a.window))]
            if hb:
                held_batches[wl] = hb
            else:
                log(f"{wl}: no held-out records (the 10 % prompt-hash split drew none of its {len(served[wl])} "
                    f"prompts): its alpha is not in the curve; serve more (--serve)")
        if not held_batches or not items:
            raise SystemExit(f"{len(held)} held-out and {len(train)} training records (the split hashes each prompt, 10 % "
                             f"held out): serve more prompts (--serve {a.serve})")
        ac = torch.bfloat16 if cpu_has_native_bf16() else None
        if a.from_head:
            from decoder.eagle import load_head

            base = load_head(pair.target, a.from_head)
            if (base.vocab_ids is None) != (vocab is None) or (vocab is not None and not torch.equal(base.vocab_ids, vocab)):
                vocab = base.vocab_ids  # the head's own vocabulary decides the columns
                col = column_map(vocab, pair.target.get_output_embeddings().weight.shape[0])
                held_batches = {wl: [head_batch(g, col) for g in groups(record_items([s for s in held if s.workload == wl],
                                                                                      a.window))]
                                for wl in held_batches}
            head = copy.deepcopy(base)
            out["from_head"] = a.from_head
        else:
            head = EagleHead.from_target(pair.target, vocab)
        start = copy.deepcopy(head) if a.compare_lora else None
        dist = HeadDistiller(head, items, col, lr=a.lr, batch=a.batch, unroll=a.unroll,
                             total_steps=a.max_steps or 10**9, min_lr=a.min_lr, seed=a.seed, autocast=ac)
        out["train_data"] = {"train_records": len(train), "heldout_records": len(held), "windows": len(items),
                             "train_positions": sum(len(it["ids"]) for it in items),
                             "heldout_positions": {wl: sum(b["tokens"].numel() for b in bs)
                                                   for wl, bs in held_batches.items()}}
        log(f"train data: {out['train_data']}")

        curve = learning_curve(dist, held_batches, minutes=a.minutes, max_steps=a.max_steps,
                               round_steps=a.round_steps, cpu_start=c_start, log=log)
        out["curve"] = curve
        out["trainable_params"] = sum(p.numel() for p in head.trainable())
        if a.compare_lora:  # the same start, data, steps' schedule and time, LoRA weights only
            lh = lora_head(start, a.compare_lora)
            ld = HeadDistiller(lh, items, col, lr=a.lora_lr, batch=a.batch, unroll=a.unroll,
                               total_steps=a.max_steps or 10**9, min_lr=a.min_lr, seed=a.seed, autocast=ac)
            log(f"LoRA r={a.compare_lora}: {sum(p.numel() for p in lh.trainable())} trainable parameters")
            out["lora"] = {"rank": a.compare_lora, "lr": a.lora_lr, "trainable_params": sum(p.numel() for p in lh.trainable()),
                           "curve": learning_curve(ld, held_batches, minutes=a.minutes, max_steps=a.max_steps,
                                                   round_steps=a.round_steps, cpu_start=c_start, log=log)}
        if a.save:
            from decoder.eagle import save_head

            save_head(head, a.save, pair.target, {"target": a.target, "steps": dist.steps, "source": "buffer"})
            out["saved"] = a.save
    finally:
        for k in client.scan_iter(match=f"{prefix}*".encode(), count=1000):
            client.delete(k)
        client.close()
    print(json.dumps(out, indent=1))
    return out


def _without_hidden(s):
    import dataclasses

    return dataclasses.replace(s, hidden=None)


if __name__ == "__main__":
    main()
