"""The bootstrap's scoring on this CPU: the torch target (what ``daemonctl demo`` and ``run``
score with) against llama.cpp's Q4_1 (``score_windows_engine``), alone, and torch at 1 and 2
threads beside a llama.cpp plain-decoding loop at 2 threads in another process (as the demo's
first phase serves while v0 bootstraps). Prints JSON: tokens scored per second per side.

Usage: .venv/bin/python bench/bootstrap_scoring_check.py [--tokens 768]
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP = r'''
import sys, time
sys.path.insert(0, sys.argv[1])
from decoder.engines.registry import choose_engine
eng = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, n_seq=4).target
n, t0 = 0, time.perf_counter()
while True:
    seq = eng.start()
    seq.forward(list(range(100, 300)), keep=1)
    for i in range(64):
        seq.forward([500 + i], keep=1)
        n += 1
    seq.release()
    print(round(n / (time.perf_counter() - t0), 2), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=768, help="code corpus tokens scored per side")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from daemon.bootstrap_data import TOPK, WINDOW_TOKENS
    from daemon.warm_start import scoring_engine
    from decoder.models.loading import load_pair
    from decoder.teacher import corpus_windows, score_windows, score_windows_engine
    from decoder.workloads import bootstrap_documents

    pair = load_pair("smollm2-135m", "layers:0-3")
    items = corpus_windows(pair.tokenizer, bootstrap_documents("code"), WINDOW_TOKENS, max_tokens=args.tokens)
    n = sum(len(x) for _, x in items)
    out: dict = {"tokens": n, "load_1min_start": os.getloadavg()[0]}

    def rate(fn) -> float:
        t = time.perf_counter()
        list(fn())
        return round(n / (time.perf_counter() - t), 1)

    torch.set_num_threads(2)
    list(score_windows(pair.target, items[:2], "code", None, k=TOPK))  # warm-up (allocator, kernels), not counted
    out["alone_torch_2_threads"] = rate(lambda: score_windows(pair.target, items, "code", None, k=TOPK))
    with scoring_engine("llamacpp", "smollm2-135m", "cpu", 2) as eng:
        out["alone_llamacpp_2_threads"] = rate(lambda: score_windows_engine(eng, items, "code", None, k=TOPK))
    torch.set_num_threads(1)
    out["alone_torch_1_thread"] = rate(lambda: score_windows(pair.target, items, "code", None, k=TOPK))
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(REPO)], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(25)  # the loop's models loaded and decoding
        for th in (1, 2):
            torch.set_num_threads(th)
            out[f"beside_loop_torch_{th}_thread{'s' if th > 1 else ''}"] = rate(
                lambda: score_windows(pair.target, items, "code", None, k=TOPK))
    finally:
        loop.kill()
        lines = loop.communicate()[0].split()
    out["loop_decode_tokens_per_s_last"] = float(lines[-1]) if lines else None
    out["load_1min_end"] = os.getloadavg()[0]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
