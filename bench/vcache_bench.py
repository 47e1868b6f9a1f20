"""Plain decoding on llama.cpp with the bf16 V cache (the default: bit-identical rows alone or in a block)
against an f16 V cache (with and without streaming records) and llama-cpp-python's own generation (f16),
same prompts back to back, 1 thread;
prints total prefill ms and total ms per side. Usage: .venv/bin/python bench/vcache_bench.py"""
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decoder.models.loading import load_pair
from decoder.engines.registry import target_gguf
from decoder.engines.llamacpp import LlamaCppEngine
from decoder.bench import LlamaCppPeer
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from decoder.workloads import get_workload
pair = load_pair("smollm2-135m", "layers:0-3")
g = target_gguf("smollm2-135m")
decs = {v: SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(prompt_cache=False), engine=LlamaCppEngine(g, threads=1, v_cache=v))
        for v in ("bf16", "f16")}
# f16 with records as serve and the demo's serving stream them (the prompt's top-k too): what recording costs
decs["f16+records"] = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(topk_record=32, record_prompt=True, prompt_cache=False),
                                         engine=decs["f16"].engine, sink=lambda sample: None)
peer = LlamaCppPeer(str(g), threads=1)
P = SamplingParams()
ids = [p.token_ids(pair.tokenizer)[-256:] for p in get_workload("code", 6)]
for d in decs.values():
    d.generate(DecodeRequest(ids[0], P, 8, gamma=0, ignore_eos=True))
tot = {"bf16": [0, 0], "f16": [0, 0], "f16+records": [0, 0], "peer": 0}
for rnd in range(2):
    for i in ids:
        for v, d in decs.items():
            r = d.generate(DecodeRequest(i, P, 64, gamma=0, ignore_eos=True))
            tot[v][0] += r.counts.prefill_ms; tot[v][1] += r.latency_ms
        t = time.perf_counter(); peer.generate(i, P, 64, 0); tot["peer"] += (time.perf_counter() - t) * 1e3
print({k: [round(x) for x in v] if isinstance(v, list) else round(v) for k, v in tot.items()})
