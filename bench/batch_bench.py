"""Continuous batching against batch 1 on llama.cpp: aggregate output tokens/s with 1, 2 and 4
concurrent clients, paired on the same prompts; prints one JSON object.

Both sides are the serving loop ``daemonctl serve`` runs (``build_serving_loop``), in this
process, on the packaged pair (SmolLM2-135M Q4_1 and its 4-layer draft, both on llama.cpp):
``batch1`` is today's loop (one-sequence engines, ``max_batch = 1``), ``batched`` the same loop
with ``max_batch = --max-batch`` on engines holding that many sequences. Each client submits its
prompts one after another (``loop.generate``); a round runs every client count on both sides,
the side that goes first alternating per round, and every (side, clients) cell serves the same
prompts with the same settings. Per cell: output tokens, wall seconds, tokens/s; per client
count the ratio batched / batch1 per round; and whether every greedy output of the batched side
equals the batch-1 side's (it must: both are plain decoding's).

Usage::

    .venv/bin/python bench/batch_bench.py --requests 2 --max-tokens 32 --rounds 1   # a smoke run, minutes on 2 cores
    .venv/bin/python bench/batch_bench.py --proposer ngram --gamma 3                # speculation per request inside the batch
    .venv/bin/python bench/batch_bench.py --long-prompt 4000 --rounds 0             # a short request behind a long prompt

``--long-prompt N``: a request with an N-token prompt (4 output tokens), and 0.3 s later a
4-token request, on each of: ``batch1``; ``batched`` with no step token budget; and
``budget<B>`` for each B of ``--budgets`` (default: the shipped ``serve.step_token_budget``), the
batched loop with that budget (``LoopConfig.step_token_budget``). Per side, in seconds from each
request's submission: the short one's queue wait (until it started decoding), first token and
last token; the long one's first token and total; and whether the outputs equal batch 1's. At
batch 1 the short request waits for the whole prefill; batched, it joins at the next step
boundary, and each of its steps carries a 512-token prefill chunk without a budget, B tokens of
it with one. ``--rounds 0`` runs this part alone.

``--piece-cost N``: what the budget costs a long prompt in the worst case (short requests decoding
beside it for its whole prefill): the first N tokens of the long prompt prefilled alone on the
batched target engine in the decoder's 512-token chunks, and in pieces of each budget, alternated
over ``--piece-reps`` repetitions; seconds per run and the ratio to whole chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The history of the river valley begins with",
    "def parse_config(path):\n    \"\"\"Read a TOML file and",
    "Question: Tom has 3 boxes of 12 apples and eats 5. How many are left?\nAnswer:",
    "Write a short letter to a friend about a trip to the mountains.",
    "Explain how a bicycle works.",
    "List the planets of the solar system and one fact about each.",
    "class Stack:\n    def __init__(self):",
    "The three most important ideas in economics are",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,2,4", help="concurrent client counts")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--proposer", choices=["plain", "ngram", "draft"], default="plain",
                    help="plain: γ = 0 (the batching gain alone); else that proposer at --gamma")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    ap.add_argument("--long-prompt", type=int, default=0, help="also time a short request behind an N-token prompt (0: off)")
    ap.add_argument("--budgets", default=None,
                    help="step token budgets the --long-prompt part compares (comma-separated; default: the shipped one)")
    ap.add_argument("--piece-cost", type=int, default=0,
                    help="time an N-token prefill in 512-token chunks against --budgets pieces (0: off)")
    ap.add_argument("--piece-reps", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from decoder.batching import STEP_TOKEN_BUDGET

    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [STEP_TOKEN_BUDGET]

    from decoder.engines.registry import choose_engine, torch_threads_for
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.models.loading import load_pair
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    clients = [int(c) for c in args.clients.split(",")]
    assert max(clients) <= args.max_batch or True  # more clients than max_batch simply queue
    pair = load_pair("smollm2-135m", "layers:0-3")
    tok = pair.tokenizer
    sides = {}
    for side, n_seq in (("batch1", 1), ("batched", args.max_batch)):
        ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=args.threads, n_seq=n_seq)
        loop = build_serving_loop(pair.target, pair.draft, tok, engine=ch.target, draft_engine=ch.draft,
                                  config=LoopConfig(max_batch=n_seq, queue_size=256), proposers=("ngram", "draft"))
        sides[side] = (loop.start(), ch)
    gamma = 0 if args.proposer == "plain" else args.gamma
    proposer = None if args.proposer == "plain" else args.proposer

    def requests(c: int, n_clients: int):
        for i in range(args.requests):
            p = PROMPTS[(c * args.requests + i) % len(PROMPTS)]
            yield DecodeRequest(tok(p)["input_ids"], SamplingParams(), args.max_tokens, gamma=gamma,
                                proposer=proposer, ignore_eos=True, request_id=f"c{n_clients}-{c}-{i}")

    def cell(side: str, n_clients: int) -> dict:
        loop = sides[side][0]
        outs: dict[str, list[int]] = {}
        errors: list[str] = []

        def client(c: int) -> None:
            for r in requests(c, n_clients):
                try:
                    outs[r.request_id] = loop.generate(r, timeout=1800).output_ids
                except Exception as e:  # noqa: BLE001 - counted
                    errors.append(f"{type(e).__name__}: {e}")

        before = dict(loop.status()["batch"])
        t0 = time.perf_counter()
        ths = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.perf_counter() - t0
        after = loop.status()["batch"]
        ntok = sum(len(v) for v in outs.values())
        fused = {k: v - before.get("by_sequences", {}).get(k, 0) for k, v in after.get("by_sequences", {}).items()}
        return {"side": side, "clients": n_clients, "requests": len(outs), "failed": len(errors),
                "output_tokens": ntok, "wall_s": round(wall, 3), "tokens_per_s": round(ntok / wall, 2),
                "fused_forwards_by_sequences": {k: v for k, v in fused.items() if v}, "outputs": outs}

    rounds = []
    with torch_threads_for(sides["batch1"][1].target):
        for rnd in range(args.rounds):
            for n in clients:
                order = ["batch1", "batched"] if rnd % 2 == 0 else ["batched", "batch1"]
                rounds.append({s: cell(s, n) for s in order} | {"round": rnd, "clients": n})
    behind, piece_cost = {}, {}
    if args.long_prompt or args.piece_cost:
        from decoder.workloads import prose_prompts

        long_ids: list[int] = []
        for p in prose_prompts(64, chars=4000):
            long_ids += tok(p.text)["input_ids"]
            if len(long_ids) >= max(args.long_prompt, args.piece_cost):
                break
    if args.piece_cost:
        eng, ids = sides["batched"][1].target, long_ids[: args.piece_cost]
        runs: dict[str, list[float]] = {}
        with torch_threads_for(eng):
            for rep in range(args.piece_reps):
                for size in ([512] + budgets)[:: 1 if rep % 2 == 0 else -1]:
                    seq = eng.start()
                    t0 = time.perf_counter()
                    for i in range(0, len(ids), size):
                        seq.forward(ids[i: i + size], 1)
                    runs.setdefault(str(size), []).append(round(time.perf_counter() - t0, 3))
                    seq.release()
        piece_cost = {"prompt_tokens": len(ids), "seconds_by_piece": runs,
                      "ratio_to_512": {k: round(sum(v) / sum(runs["512"]), 3) for k, v in runs.items()}}
    if args.long_prompt:
        long_ids = long_ids[: args.long_prompt]
        with torch_threads_for(sides["batch1"][1].target):
            plan = [("batch1", sides["batch1"][0])]
            sides["batched"][0].close()  # the batched engines serve one loop per budget, one after another
            for b in [None] + budgets:
                plan.append(("batched" if b is None else f"budget{b}", lambda b=b: build_serving_loop(
                    pair.target, pair.draft, tok, engine=sides["batched"][1].target, draft_engine=sides["batched"][1].draft,
                    config=LoopConfig(max_batch=args.max_batch, queue_size=256, step_token_budget=b),
                    proposers=("ngram", "draft")).start()))
            outputs = {}
            for side, loop in plan:
                loop = loop if side == "batch1" else loop()
                t0 = time.perf_counter()
                lt = loop.submit(DecodeRequest(long_ids, SamplingParams(), 4, gamma=0, ignore_eos=True, request_id=f"long-{side}"))
                time.sleep(0.3)
                st = loop.submit(DecodeRequest(tok("hi")["input_ids"], SamplingParams(), 4, gamma=0, ignore_eos=True,
                                               request_id=f"short-{side}"))
                short = st.result(timeout=1800)
                long = lt.result(timeout=1800)
                rel = lambda t, x: round(x - t.submitted_at, 3) if x is not None else None  # noqa: E731
                batch = loop.status()["batch"]
                behind[side] = {
                    "long_prompt_tokens": len(long_ids), "short_tokens": len(short.output_ids),
                    "short_queue_s": rel(st, st.started_at), "short_first_token_s": rel(st, st.first_token_at),
                    "short_s": rel(st, st.finished_at), "long_first_token_s": rel(lt, lt.first_token_at),
                    "long_s": rel(lt, lt.finished_at), "long_prefill_s": round(long.counts.prefill_ms / 1e3, 3),
                    "budget_cut_pieces": batch.get("budget_cut_pieces"), "by_sequences": batch.get("by_sequences")}
                outputs[side] = (long.output_ids, short.output_ids)
                if side != "batch1":
                    loop.close()
            for side in behind:
                behind[side]["outputs_equal_batch1"] = outputs[side] == outputs["batch1"]
    out_cells, ratios, equal = [], {}, True
    for r in rounds:
        b1, bb = r["batch1"], r["batched"]
        equal &= b1.pop("outputs") == bb.pop("outputs")
        out_cells += [b1, bb]
        ratios.setdefault(str(r["clients"]), []).append(round(bb["tokens_per_s"] / b1["tokens_per_s"], 3))
    for loop, ch in sides.values():
        loop.close()  # again for the batched one after --long-prompt: a no-op then
        for e in (ch.target, ch.draft):
            if e is not None:
                e.close()
    print(json.dumps({
        "bench": "batch_bench", "host": platform.node(), "cpu_threads": args.threads, "proposer": args.proposer,
        "gamma": gamma, "max_batch": args.max_batch, "step_token_budget": STEP_TOKEN_BUDGET, "load_avg": os.getloadavg(), "requests_per_client": args.requests,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "cells": out_cells,
        "batched_over_batch1_by_clients": ratios, "greedy_outputs_equal": equal, "short_behind_long": behind,
        "piece_cost": piece_cost,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
