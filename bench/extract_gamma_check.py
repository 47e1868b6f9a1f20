"""Usage: .venv/bin/python bench/extract_gamma_check.py [γ ...] (default 2 4 6 8). Extract prompts (the demo's 8 evaluation ones), n-gram proposer at several γ vs plain, bf16 V, 1 thread,
interleaved per prompt, ms per request; every output checked equal to plain."""
import sys, time, json
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import torch
torch.set_num_threads(1)
from decoder.models.loading import load_pair
from decoder.engines.registry import target_gguf
from decoder.engines.llamacpp import LlamaCppEngine
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from decoder.workloads import get_workload
from decoder.bench import LlamaCppPeer
pair = load_pair("smollm2-135m", "layers:0-3")
g = target_gguf("smollm2-135m")
eng = LlamaCppEngine(g, threads=1)
print("v_cache", eng.v_cache, flush=True)
dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(prompt_cache=False), engine=eng)
peer = LlamaCppPeer(str(g), threads=1)
P = SamplingParams()
ids = [p.token_ids(pair.tokenizer)[-256:] for p in get_workload("extract", 8)]
gammas = [int(x) for x in sys.argv[1:]] or [2, 4, 6, 8]
dec.generate(DecodeRequest(ids[0], P, 8, gamma=0))
tot = {"plain": 0.0, "peer": 0.0, **{f"ngram{gm}": 0.0 for gm in gammas}}
ok = 0; n = 0
for rnd in range(2):
    for i in ids:
        base = dec.generate(DecodeRequest(i, P, 64, gamma=0, workload="x", ngram_history=False))
        tot["plain"] += base.latency_ms
        t = time.perf_counter(); peer.generate(i, P, 64, 0); tot["peer"] += (time.perf_counter() - t) * 1e3
        for gm in gammas:
            r = dec.generate(DecodeRequest(i, P, 64, gamma=gm, proposer="ngram", workload="x", ngram_history=False))
            tot[f"ngram{gm}"] += r.latency_ms
            n += 1; ok += list(r.output_ids) == list(base.output_ids)
print(json.dumps({k: round(v) for k, v in tot.items()}), "vs peer:", {k: round(tot["peer"] / v, 3) for k, v in tot.items()}, f"equal {ok}/{n}")
