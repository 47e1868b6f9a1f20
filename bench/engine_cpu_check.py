"""CPU time (the calling thread's own clock, so a shared host's other jobs do not count) of the
llama.cpp engine's forwards at serve's shape: the packaged SmolLM2-135M Q4_1, one thread, an engine
holding 4 sequences (``n_seq`` 4, ``n_ctx`` 8192 each, flash attention), per V cache type:

- the prefill of a P-token prompt per sequence, with logits at every row (``serve.record_prompt``)
  and at the last row only (llama-server's prefill);
- S steps of 1 sequence x 1 row, and of 4 sequences x 1 row in one ``forward_batch``.

Prints one JSON object (CPU ms; per row too). A quick check for bench/RESULTS.md, not a timed test::

    .venv/bin/python bench/engine_cpu_check.py --prompt 94 --steps 48
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=94, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=48, help="decode steps per shape")
    ap.add_argument("--v-cache", default="bf16,f16", help="V cache types, in order")
    a = ap.parse_args()
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.packaged import packaged_gguf

    P, S = a.prompt, a.steps
    prompt = [(i * 7919) % 40000 + 100 for i in range(P)]  # fixed ids: the work does not depend on them
    out: dict = {"prompt_tokens": P, "steps": S, "threads": 1, "loadavg_1m_start": round(os.getloadavg()[0], 2), "cells": []}
    for v in a.v_cache.split(","):
        eng = LlamaCppEngine(packaged_gguf("smollm2-135m"), n_ctx=8192, threads=1, v_cache=v, n_seq=4)
        try:
            for keep_all in (True, False):
                seqs = [eng.start() for _ in range(4)]
                t = time.thread_time()
                for s in seqs:
                    eng.forward_batch([(s, prompt, P if keep_all else 1)])
                pre = (time.thread_time() - t) * 1e3 / 4
                t = time.thread_time()
                for k in range(S):
                    eng.forward_batch([(seqs[0], [prompt[0] + k], 1)])
                one = (time.thread_time() - t) * 1e3 / S
                t = time.thread_time()
                for k in range(S):
                    eng.forward_batch([(s, [prompt[j] + k], 1) for j, s in enumerate(seqs)])
                four = (time.thread_time() - t) * 1e3 / S
                for s in seqs:
                    s.release()
                out["cells"].append({"v_cache": v, "prompt_logits": "every row" if keep_all else "last row",
                                     "prefill_cpu_ms": round(pre, 1), "prefill_cpu_ms_per_row": round(pre / P, 2),
                                     "step_1x1_cpu_ms": round(one, 2), "step_4x1_cpu_ms": round(four, 2),
                                     "step_4x1_cpu_ms_per_row": round(four / 4, 2)})
        finally:
            eng.close()
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
