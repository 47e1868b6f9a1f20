"""Per-row cost of grammar-constrained rows (decoder/grammar.py) on the packaged SmolLM2 GGUF:
a full mask (one llama_sampler_apply over the 49,152-token vocabulary) against the partial masks
greedy (best 1) and top-k 40 rows use, at the positions of a schema-constrained greedy output
(structural positions and inside strings). Prints JSON: CPU ms per row (the least of 3; torch
on one thread), median and max over the positions, by mode.

    PYTHONPATH=. python bench/grammar_cost_bench.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from decoder.engines.llamacpp import LlamaCppEngine
from decoder.grammar import GrammarConstraint, GrammarVocab, schema_to_gbnf
from decoder.models.loading import load_pair
from decoder.models.packaged import packaged_gguf
from decoder.sampling import SamplingParams
from decoder.speculative import DecodeRequest, SpeculativeDecoder

REPEAT = 3
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "bio": {"type": "string"}}, "required": ["name", "age", "bio"]}


def main() -> None:
    torch.set_num_threads(1)  # as serve runs the decoder's torch work on llama.cpp (torch_threads_for)
    gguf = packaged_gguf("smollm2-135m")
    eng = LlamaCppEngine(gguf, n_ctx=512, threads=2)
    real = load_pair("smollm2-135m", "layers:0-3")
    vocab = GrammarVocab(gguf)
    g = GrammarConstraint(vocab, schema_to_gbnf(SCHEMA), width=eng.vocab_size)
    dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=eng)
    tok = real.tokenizer
    ids = tok(tok.apply_chat_template([{"role": "user", "content": "Describe Ann, 31, a painter from Rome, as JSON."}],
                                      tokenize=False, add_generation_prompt=True))["input_ids"]
    out = dec.generate(DecodeRequest(ids, SamplingParams(), 48, gamma=0, constraint=g)).output_ids
    seq = eng.start()
    logits = seq.forward(ids + out[:-1], len(out))
    seq.release()
    times: dict[str, list[float]] = {"full": [], "greedy": [], "top_k 40": []}
    s = g.start()
    for j, t in enumerate(out):
        row = logits[j: j + 1]
        for name, k in (("greedy", 1), ("top_k 40", 40), ("full", None)):
            best = float("inf")
            for _ in range(REPEAT):  # the least CPU time of a few (the host is shared)
                st = _replay(g, out[:j], dec.eos_ids)  # a state with nothing cached
                g._masks.clear()  # noqa: SLF001 - the cross-request cache would hide the apply
                t0 = time.process_time()
                g.constrain(row, st, [], dec.eos_ids, top_k=k)
                best = min(best, (time.process_time() - t0) * 1e3)
            times[name].append(best)
        s = g.advance(s, t, dec.eos_ids)
    print(json.dumps({"tokens": len(out), "text": tok.decode(out, skip_special_tokens=True),
                      "ms_per_row": {k: {"median": round(statistics.median(v), 2), "max": round(max(v), 2)}
                                     for k, v in times.items()}}, indent=1))


def _replay(g, prefix, eos):
    s = g.start()
    for t in prefix:
        s = g.advance(s, t, eos)
    return s


if __name__ == "__main__":
    main()
