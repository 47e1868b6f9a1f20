"""Decoder-side adaptation bench on the tiny pair: swap pauses under load, and γ control.

    python bench/adaptation_bench.py                 # ~1-2 min on 2 cores; prints JSON
    python bench/adaptation_bench.py --swaps 100 --requests 12

1. *Swap pause*: worker threads decode continuously while the main thread promotes adapter
   versions in a cycle (real peft adapters in a real AdapterRegistry on Redis, learnt over
   pub/sub); reports the pause distribution (time the swap hook holds the decoder's lock), the
   background preparation time, and failed requests (target: 0 over 100 swaps, p99 <= 50 ms).
2. *γ control*: the same requests decoded by plain decoding, fixed γ = 4, transformers'
   heuristic schedule (:class:`decoder.speculative.HeuristicGamma`, state kept across requests
   like transformers' assistant config) and the :class:`decoder.control.GoodputController`,
   interleaved request by request, in two phases: a useless draft (α ≈ 0.02) and the same draft
   after a LoRA adapter that makes it agree with the target (α = 1). Goodput = emitted tokens /
   decode ms, summed over the phase.

The pair (tests/decoder/adapt_helpers.py): a 3-layer tiny target whose layers 1-2 add zeros, a
1-layer draft copying its layer 0 and perturbed by a rank-2 noise that an adapter cancels.

3. *Recovery* (``--demo-report out/demo/report.json``): requests and seconds from each workload
   shift until greedy α is back within 90 % of its pre-shift level, and goodput vs plain per
   phase, read from a ``daemonctl demo`` run (the trainer producing adapters from served traffic
   on the real pair; ``decoder.shift.recovery_stats``). Without the option this part is skipped and
   says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import structlog
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "decoder"))

from adapt_helpers import RedisRegistry, exact_draft, fixing_lora, perturb, random_lora, shallow_target  # noqa: E402
from decoder.adapters import AdapterManager, summarize_ms  # noqa: E402
from decoder.control import ControllerConfig, GoodputController  # noqa: E402
from decoder.tracking import key_of  # noqa: E402
from decoder.speculative import DecodeRequest, FixedGamma, HeuristicGamma, SpeculativeDecoder  # noqa: E402
from tiny import char_tokenizer  # noqa: E402

PROMPTS = ["the cat sat on", "def f(x): return", "what is 3+4?", "hello there, how", "once upon a time"]


def swap_bench(dec, mgr, reg, versions, tok, n_swaps: int, workers: int) -> dict:
    stop = threading.Event()
    done, failed = [0], []

    def work(i: int):
        j = 0
        while not stop.is_set():
            try:
                dec.generate(DecodeRequest(tok(PROMPTS[(i + j) % len(PROMPTS)])["input_ids"], max_new_tokens=8,
                                           ignore_eos=True), FixedGamma(3))
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - counted, the bench goes on
                failed.append(repr(e))
            j += 1

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    start_swaps = len(mgr.swaps)
    t0 = time.perf_counter()
    k = 0
    while len(mgr.swaps) - start_swaps < n_swaps and time.perf_counter() - t0 < 600:
        v = versions[k % len(versions)]
        k += 1
        if reg.registry.active_version() == v:
            continue
        before = len(mgr.swaps)
        reg.registry.promote(v, "bench")
        deadline = time.perf_counter() + 10
        while len(mgr.swaps) == before and time.perf_counter() < deadline:
            time.sleep(0.002)
    stop.set()
    for t in threads:
        t.join(30)
    pauses = [s.pause_ms for s in list(mgr.swaps)[start_swaps:]]
    return {
        "swaps": len(pauses),
        "requests": done[0],
        "failed_requests": len(failed),
        "failures": failed[:3],
        "load_failures": mgr.status()["failures"],
        "pause_ms": summarize_ms(pauses),
        "prepare_ms": summarize_ms(list(mgr.prepare_ms)[-len(pauses):]),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def gamma_bench(dec, tok, ctl, heuristic, n_requests: int, max_new: int) -> dict:
    policies = {
        "plain": lambda key: FixedGamma(0),
        "fixed_4": lambda key: FixedGamma(4),
        "heuristic": lambda key: heuristic,
        "controller": ctl.policy_for,
    }
    tokens = {p: 0 for p in policies}
    ms = {p: 0.0 for p in policies}
    gammas = []
    for i in range(n_requests):
        req = DecodeRequest(tok(PROMPTS[i % len(PROMPTS)])["input_ids"], max_new_tokens=max_new, ignore_eos=True,
                            workload="prose")
        for name, make in policies.items():
            pol = make(key_of(req))
            r = dec.generate(req, pol)
            tokens[name] += r.counts.num_emitted_tokens
            ms[name] += r.counts.decode_ms
            if name == "controller":
                gammas.append(pol.decision["gamma"])
    out = {name: round(tokens[name] / ms[name], 4) for name in policies}
    d = ctl.decision(("prose", "greedy"))
    out |= {
        "speedup_vs_plain": {name: round(out[name] / out["plain"], 3) for name in policies},
        "controller_gammas": gammas,
        "controller_decision": {k: d[k] for k in ("gamma", "alpha", "t_draft_ms", "t_plain_ms", "why")},
        "heuristic_gamma_end": heuristic.value,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--swaps", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12, help="requests per phase of the γ comparison")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--demo-report", default=None, help="a daemonctl demo report.json: recovery and goodput per phase")
    args = ap.parse_args()
    torch.set_num_threads(1)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only

    tok = char_tokenizer()
    target = shallow_target()
    draft = exact_draft(target)
    noise = perturb(draft, scale=3.0)
    with tempfile.TemporaryDirectory() as tmp:
        reg = RedisRegistry(Path(tmp) / "artifacts", url=args.redis)
        try:
            fix = reg.register(fixing_lora(draft, noise, Path(tmp) / "fix"))
            versions = [fix,
                        reg.register(fixing_lora(draft, {n: x for n, x in noise.items() if "o_proj" in n}, Path(tmp) / "half")),
                        reg.register(random_lora(draft, Path(tmp) / "r1", scale=2.0, seed=1))]
            dec = SpeculativeDecoder(target, draft, tok)
            ctl = GoodputController(ControllerConfig(gamma_max=16, gamma_init=4, probe_every=10, min_steps=6),
                                    adapter_version=lambda: dec.adapter_version)
            heuristic = HeuristicGamma()
            with AdapterManager(dec, reg.registry, poll_interval_s=0.5) as mgr:
                phases = {"useless_draft": gamma_bench(dec, tok, ctl, heuristic, args.requests, args.max_new)}
                reg.registry.promote(fix, "bench: adapted")
                mgr.wait_prepared(fix, 30)
                phases["adapted_draft"] = gamma_bench(dec, tok, ctl, heuristic, args.requests, args.max_new)
                swap = swap_bench(dec, mgr, reg, versions, tok, args.swaps, args.workers)
        finally:
            reg.close()
    print(json.dumps({
        "pair": "tiny (3-layer target, 1-layer draft; tests/decoder/adapt_helpers.py)",
        "torch_threads": 1,
        "swap": swap,
        "gamma_control_tokens_per_ms": phases,
        "recovery": recovery_from_demo(args.demo_report),
    }, indent=2))


def recovery_from_demo(path: str | None) -> dict | str:
    if path is None:
        return "skipped: pass --demo-report out/demo/report.json (written by daemonctl demo)"
    from decoder.shift import recovery_stats

    rep = json.loads(Path(path).read_text())
    phases = [{"workload": r["workload"], "frozen_speedup_vs_plain": r["frozen"]["speedup_vs_plain"],
               "adapted_speedup_vs_plain": r["adapted"]["speedup_vs_plain"], "frozen_alpha": r["frozen"]["alpha"],
               "adapted_alpha": r["adapted"]["alpha"]} for r in rep["phases"]]
    return {"report": path, "run_id": rep.get("run_id"), "shifts": recovery_stats(rep["timeline"], rep["shifts"]),
            "phases": phases}


if __name__ == "__main__":
    main()
