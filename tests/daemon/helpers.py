"""Real adapter directories and VerifiedSamples for the daemon tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from store.schema import PairFingerprint, VerifiedSample


def make_adapter_dir(path: Path, seed: int = 0) -> Path:
    """A real peft LoRA adapter (save_pretrained) of a tiny random Llama."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(str(path))
    return path


def make_sample(pair: PairFingerprint, workload: str, i: int, vocab: int, prompt_len: int = 8, n: int = 16, k: int = 8,
                seed: int = 0) -> VerifiedSample:
    """A well-formed sample: random prompt and output ids, a top-k that holds the emitted token."""
    g = np.random.default_rng(seed * 100_003 + i)
    out = g.integers(0, vocab, n)
    topk = np.stack([np.concatenate([[t], g.choice(vocab, k - 1, replace=False)]) for t in out])
    for row, t in zip(topk, out):  # keep ids distinct within a row
        dup = np.where(row[1:] == t)[0]
        row[1 + dup] = (t + 1 + np.arange(len(dup))) % vocab
    probs = g.dirichlet(np.ones(k), n) * 0.9
    return VerifiedSample(
        request_id=f"{workload}-{seed}-{i}", workload=workload, adapter_version=0, pair=pair,
        prompt_ids=g.integers(0, vocab, prompt_len), output_ids=out,
        proposal_lens=np.zeros(n, np.int16), rejection_pos=np.full(n, -1, np.int16),
        topk_ids=topk, topk_probs=probs.astype(np.float16), tail_mass=(1 - probs.sum(1)).astype(np.float32),
        record_id=f"{workload}-{seed}-{i}",
    )
