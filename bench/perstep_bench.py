"""The serving loop's Python per emitted token, in process, by part (issue 35: what runs between
two ``llama_decode`` calls).

One process builds the serving loop as ``daemonctl serve`` does (``bench/serve_overhead.py``'s
``build``: continuous batching up to ``serve.max_batch``, records to Redis under a throwaway key
prefix, deleted at the end) and, per configuration (clients C in ``--clients``, γ in ``--gammas``:
0 = plain decoding, else the n-gram proposer at that fixed γ), submits C requests at once straight
to the loop (no HTTP), ``--rounds`` times, greedy, ``ignore_eos``, ``--max-tokens`` each. The
members' steps and the driver's decodes are serialized (one baton, the driver fires only at a step
boundary), so per emitted token:

- ``wall_ms``: the rounds' wall time over their tokens;
- ``decode_ms``: time inside ``llama_decode`` (``llama_call`` wrapped);
- ``python_ms``: ``wall_ms - decode_ms``, the Python on the critical path;
- ``python_cpu_ms``: the wrapped parts' own thread CPU time (``parts_cpu``), ``decode`` left out:
  what preemption on a loaded host does not inflate, hand-offs not included;
- ``parts``: the exclusive time (nested wrapped calls subtracted) of named functions, per emitted
  token: the member's step (``step``: γ, bookkeeping, stats), acceptance test (``verify``),
  observers (``observe``: the records' top-k, logprobs), cut at EOS/stop/length (``truncate``),
  ``accept``, the streaming hook (``on_step``), the proposer (``propose``), the n-gram shadow
  (``shadow``), step costs (``step_cost``), the γ policy (``policy``: the controller's estimates),
  the loop around steps (``loop``: cache crops, rollback);
  the driver's ``fire`` and ``forward_batch`` (the engine's batch filling and logits copies);
  ``handoff``: what is left (thread hand-offs between member and driver, unwrapped code).

``--code DIR`` imports the project from DIR instead of this checkout (a git worktree of an older
commit), so old and new code run the same script; alternate processes to pair them in time.

Usage::

    .venv/bin/python bench/perstep_bench.py --clients 1,4 --gammas 0,3 --rounds 3 --max-tokens 64 --out x.json
    .venv/bin/python bench/perstep_bench.py --code /work/perstep_old ...   # the same, older code
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent

# part name -> (module, qualified attribute) of the functions timed; absent ones are skipped (older code)
PARTS = {
    "step": [("decoder.speculative", "SpeculativeDecoder._step"), ("decoder.speculative", "SpeculativeDecoder._first_step")],
    "verify": [("decoder.speculative", "SpeculativeDecoder._verify")],
    "observe": [("decoder.speculative", "SpeculativeDecoder._observe")],
    "truncate": [("decoder.speculative", "SpeculativeDecoder._truncate")],
    "accept": [("decoder.speculative", "SpeculativeDecoder._accept")],
    "propose": [("decoder.speculative", "SpeculativeDecoder._propose")],
    "shadow": [("decoder.proposers.ngram", "NgramShadow.idle_step"), ("decoder.proposers.ngram", "NgramShadow.proposing"),
               ("decoder.proposers.ngram", "NgramShadow.settle")],
    "step_cost": [("decoder.proposers.cost", "StepCost.add")],
    "policy": [("decoder.loop", "_ObservedGamma.update"), ("decoder.loop", "_ObservedGamma.gamma"),
               ("decoder.control", "ControlledGamma.update"), ("decoder.control", "ControlledGamma.gamma")],
    "on_step": [("decoder.loop", "ServingLoop._on_step")],
    "loop": [("decoder.speculative", "SpeculativeDecoder._generate_one")],
    "wait": [("decoder.batching", "StepScheduler.call")],  # a member waiting for its rows: not on its own path
    "fire": [("decoder.batching", "StepScheduler.fire")],
    "forward_batch": [("decoder.engines.llamacpp", "LlamaCppEngine.forward_batch")],
    "decode": [("decoder.engines.llamacpp", "llama_call")],
    "request_edges": [("decoder.speculative", "SpeculativeDecoder._begin"), ("decoder.speculative", "SpeculativeDecoder._prefill"),
                      ("decoder.speculative", "SpeculativeDecoder._finish")],
}
OFF_PATH = {"wait", "request_edges"}  # not per-token work on the critical path (waiting; a request's prefill and end)


class Spans:
    """Exclusive time per part, wall (perf_counter) and the thread's CPU (thread_time: what a
    loaded host's preemption does not inflate), per thread (a stack per thread: a wrapped call's
    time is taken out of the wrapped call it runs inside)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self._mu = threading.Lock()
        self.on = False

    def wrap(self, name: str, fn):
        spans = self

        def timed(*a, **kw):
            if not spans.on:
                return fn(*a, **kw)
            stack = getattr(spans._local, "stack", None)
            if stack is None:
                stack = spans._local.stack = []
            stack.append([0.0, 0.0])  # wall and CPU time of nested wrapped calls
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                inner = stack.pop()
                if stack:
                    stack[-1][0] += dt
                    stack[-1][1] += dc
                with spans._mu:
                    spans.total[name] += dt - inner[0]
                    spans.cpu[name] += dc - inner[1]
                    spans.calls[name] += 1

        timed.__wrapped__ = fn
        return timed

    def reset(self) -> None:
        with self._mu:
            self.total.clear()
            self.cpu.clear()
            self.calls.clear()


def install(spans: Spans, with_parts: bool) -> list[str]:
    """Wrap the PARTS present in the imported code (only ``decode`` without ``with_parts``); the
    names wrapped."""
    import importlib

    done = []
    for name, targets in PARTS.items():
        if not with_parts and name != "decode":
            continue
        for mod_name, attr in targets:
            mod = importlib.import_module(mod_name)
            owner, leaf = mod, attr
            if "." in attr:
                cls, leaf = attr.split(".")
                owner = getattr(mod, cls, None)
            if owner is None or not hasattr(owner, leaf):
                continue
            setattr(owner, leaf, spans.wrap(name, getattr(owner, leaf)))
            done.append(f"{name}:{attr}")
    return done


def run_config(loop, prompts, clients: int, gamma: int, rounds: int, max_tokens: int, spans: Spans, start: int):
    """``rounds`` rounds of ``clients`` requests submitted at once; tokens, wall and spans."""
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest

    tokens, wall, outputs = 0, 0.0, []
    spans.reset()
    spans.on = True
    for r in range(rounds):
        batch = [prompts[(start + r * clients + c) % len(prompts)] for c in range(clients)]
        reqs = [DecodeRequest(ids, SamplingParams(), max_new_tokens=max_tokens, gamma=gamma, ignore_eos=True,
                              workload=w, proposer="ngram" if gamma else None) for w, ids in batch]
        t0 = time.perf_counter()
        tickets = [loop.submit(q, on_tokens=lambda ids: None) for q in reqs]
        res = [t.result(timeout=600) for t in tickets]
        wall += time.perf_counter() - t0
        tokens += sum(len(x.output_ids) for x in res)
        outputs.extend(x.output_ids for x in res)
    spans.on = False
    per = {k: 1e3 * v / tokens for k, v in spans.total.items()}
    path = {k: v for k, v in per.items() if k not in OFF_PATH}
    out = {"clients": clients, "gamma": gamma, "rounds": rounds, "tokens": tokens,
           "wall_ms": 1e3 * wall / tokens, "decode_ms": per.get("decode", 0.0)}
    out["python_ms"] = out["wall_ms"] - out["decode_ms"]
    if len(per) > 1:
        out["parts"] = {k: round(v, 4) for k, v in sorted(path.items(), key=lambda kv: -kv[1])}
        out["parts"]["handoff"] = round(out["wall_ms"] - sum(path.values()), 4)
        out["off_path_ms"] = {k: round(per[k], 4) for k in OFF_PATH if k in per}
        cpu = {k: 1e3 * v / tokens for k, v in spans.cpu.items() if k not in OFF_PATH and k != "decode"}
        out["python_cpu_ms"] = sum(cpu.values())  # the parts' own CPU on the critical path
        out["parts_cpu"] = {k: round(v, 4) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}
    out["output_hash"] = hash(tuple(tuple(o) for o in outputs)) & 0xFFFFFFFF
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4", help="requests decoded at once, comma-separated")
    ap.add_argument("--gammas", default="0,3", help="fixed γ per configuration (0: plain; else the n-gram proposer)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of `clients` requests per configuration")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-parts", action="store_true", help="time llama_decode only (no per-part wrappers)")
    ap.add_argument("--code", default=None, help="import the project from this directory (an older worktree)")
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    code = Path(a.code).resolve() if a.code else HERE.parent
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(code))
    os.environ.setdefault("DRAFTD_MODELS__FORMAT", "packaged")
    os.environ.setdefault("DRAFTD_MODELS__ENGINE_THREADS", "2")
    from daemon.settings import load_settings
    from serve_bench import peer_prompts
    from serve_overhead import build, own_key_prefix

    own_key_prefix("perstep")  # before the settings are read

    spans = Spans()
    wrapped = install(spans, not a.no_parts)
    settings = load_settings()
    prefix = settings.store.key_prefix
    client, pair, loop, _ = build(settings, prefix)
    workloads = [w for w in a.workloads.split(",") if w]
    prompts = peer_prompts(pair.tokenizer, workloads, 8)
    rows = []
    try:
        run_config(loop, prompts, 1, 0, 1, 8, spans, 0)  # warm-up: first-request allocations
        start = 1
        for c in [int(x) for x in a.clients.split(",")]:
            for g in [int(x) for x in a.gammas.split(",")]:
                r = run_config(loop, prompts, c, g, a.rounds, a.max_tokens, spans, start)
                r["load1"] = round(os.getloadavg()[0], 2)
                rows.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                start += a.rounds * c
    finally:
        loop.close()
        for k in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(k)
    head = os.popen(f"git -C {code} rev-parse --short HEAD 2>/dev/null").read().strip()
    out = {"code": str(code), "commit": head, "max_tokens": a.max_tokens, "wrapped": wrapped, "rows": rows}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
