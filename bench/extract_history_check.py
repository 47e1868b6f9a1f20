"""Usage: .venv/bin/python bench/extract_history_check.py. Extract: the n-gram proposer at γ=4 on the 8 evaluation prompts, with the workload's history
(filled by serving the next 40 extract prompts first, as the demo's phase does) against without;
plain and llama.cpp's plain beside; interleaved per prompt; outputs checked equal to plain."""
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
dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(prompt_cache=False), engine=eng)
peer = LlamaCppPeer(str(g), threads=1)
P = SamplingParams()
allp = [p.token_ids(pair.tokenizer)[-256:] for p in get_workload("extract", 48)]
ev, fill = allp[:8], allp[8:48]
for i in fill:  # the phase's traffic: fills the history and teaches the gate
    dec.generate(DecodeRequest(i, P, 32, gamma=4, proposer="ngram", workload="extract"))
print("history tokens", dec.ngram_history.status(), flush=True)
tot = {"plain": 0.0, "peer": 0.0, "hist": 0.0, "nohist": 0.0}; ok = n = 0
hist0, gate0 = dec.ngram_history.copy(), dec.ngram_gate.copy() if dec.ngram_gate is not None else None
for i in ev:
    base = dec.generate(DecodeRequest(i, P, 64, gamma=0, ignore_eos=True, workload="extract"))
    tot["plain"] += base.latency_ms
    t = time.perf_counter(); peer.generate(i, P, 64, 0); tot["peer"] += (time.perf_counter() - t) * 1e3
    for name, h in (("hist", True), ("nohist", False)):
        dec.ngram_history, dec.ngram_gate = hist0.copy(), (gate0.copy() if gate0 is not None else None)
        r = dec.generate(DecodeRequest(i, P, 64, gamma=4, proposer="ngram", ignore_eos=True, workload="extract", ngram_history=h))
        tot[name] += r.latency_ms; n += 1; ok += list(r.output_ids) == list(base.output_ids)
print(json.dumps({k: round(v) for k, v in tot.items()}), "x llama.cpp:", {k: round(tot["peer"] / v, 3) for k, v in tot.items()}, f"equal {ok}/{n}")
