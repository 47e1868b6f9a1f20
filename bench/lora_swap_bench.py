"""LoRA hot-swap on the llama.cpp draft: conversion, load and swap-pause costs, in one run. JSON out.

What a version costs on the llama.cpp engine (decoder/engines/, decoder/models/gguf_export.py):

- ``convert_ms``: peft adapter -> GGUF LoRA (``lora_to_gguf``; the first call per base also parses
  the base's metadata), and a cached call (``lora_gguf_cached`` hit: the adapter's sha256);
- ``load_ms``: ``llama_adapter_lora_init`` on the draft's model;
- ``pause_ms``: ``llama_set_adapters_lora`` at a request boundary (what the AdapterManager's
  between-request hook holds the decoder's lock for), over ``--swaps`` alternating swaps;
- ``first_forward_ms`` vs ``steady_forward_ms``: the draft's first one-token forward after a swap
  against one without a swap (llama.cpp may rebuild its graph when the adapter set changes).

Usage: ``.venv/bin/python bench/lora_swap_bench.py [--swaps 200] [--rank 16]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "p99": pct(xs, 0.99), "max": round(max(xs), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--swaps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()

    import torch

    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.gguf_export import derived_draft_gguf, lora_gguf_cached, lora_to_gguf
    from decoder.models.loading import derive_draft, load_model
    from decoder.models.packaged import packaged_gguf
    from trainer.distill import DistillConfig, Distiller

    target, tok = load_model("smollm2-135m")
    base = derived_draft_gguf(packaged_gguf("smollm2-135m"), [0, 1, 2, 3])
    eng = LlamaCppEngine(base, n_ctx=512, threads=a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="lora-swap-"))
    convert, cached, load = [], [], []
    for v in (1, 2):  # two versions: the trainer's own LoRA layout, random non-zero B
        torch.manual_seed(v)
        dist = Distiller(derive_draft(target, "0-3"), DistillConfig(lora_r=a.rank, lora_alpha=2 * a.rank))
        with torch.no_grad():
            for name, p in dist.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        adir = dist.save(tmp / f"v{v}")
        t0 = time.perf_counter()
        lora_to_gguf(adir, tmp / f"v{v}.gguf", base)
        convert.append((time.perf_counter() - t0) * 1e3)
        lora_gguf_cached(adir, tmp / "cache", base)
        t0 = time.perf_counter()
        path = lora_gguf_cached(adir, tmp / "cache", base)
        cached.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        eng.load_lora(f"v{v}", path)
        load.append((time.perf_counter() - t0) * 1e3)
    ids = tok("The capital of France is")["input_ids"]
    seq = eng.start()
    seq.forward(ids, 1)
    pause, first, steady = [], [], []
    keys = ["v1", "v2", None]
    for i in range(a.swaps):
        t0 = time.perf_counter()
        eng.set_lora(keys[i % 3])
        pause.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        seq.forward([ids[-1]], 1)
        first.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        seq.forward([ids[-1]], 1)
        steady.append((time.perf_counter() - t0) * 1e3)
        seq.truncate(len(ids))
    print(json.dumps({
        "draft_gguf": base.name, "rank": a.rank, "threads": eng.threads,
        "convert_ms": [round(x, 1) for x in convert], "cached_convert_ms": [round(x, 2) for x in cached],
        "load_ms": [round(x, 2) for x in load],
        "pause_ms": summary(pause), "first_forward_ms": summary(first), "steady_forward_ms": summary(steady),
    }, indent=1))


if __name__ == "__main__":
    main()
