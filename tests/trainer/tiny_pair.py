"""A tiny (target, draft) pair of real, randomly initialised Llama models and real
target-generated VerifiedSamples, for the trainer's tests (and ``bench/train_bench.py --pair tiny``).

The target's output projection is scaled up so its distributions are peaked like a trained
LM's (a random init is near uniform); the draft is a different random init, so it starts far
from the target and must learn the target's next-token function from the stored top-k.
Rejections are those a greedy decoder with the untrained draft would make (teacher-forced
draft argmax vs the emitted token), at gamma = 4.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from store.schema import PairFingerprint, VerifiedSample

VOCAB = 64
PAIR = PairFingerprint(target="tiny-target", draft="tiny-draft", tokenizer_hash="tiny-vocab-64")
# Prompt token ranges per workload, so workloads differ in their contexts.
WORKLOADS = {"prose": (0, 40), "code": (24, 64)}


def tiny_llama(seed: int, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def tiny_target() -> LlamaForCausalLM:
    m = tiny_llama(seed=1234, layers=2, hidden=48)
    with torch.no_grad():
        m.lm_head.weight.mul_(30.0)  # peaked distributions like a trained LM's, not ~uniform
    return m


def tiny_draft() -> LlamaForCausalLM:
    m = tiny_llama(seed=7)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # a real draft's logits have a real scale; LoRA leaves lm_head alone
    return m


@torch.no_grad()
def make_samples(
    target: LlamaForCausalLM,
    n: int,
    workload: str = "prose",
    seed: int = 0,
    prompt_len: int = 8,
    new_tokens: int = 24,
    k: int = 8,
    gamma: int = 4,
    draft: LlamaForCausalLM | None = None,
) -> list[VerifiedSample]:
    """``n`` samples the target generates (sampling at temperature 1) from random prompts.

    With ``draft`` given, proposal_lens / rejection_pos are those of greedy speculative decoding
    with that draft (gamma proposals per step); else every step is a plain step (gamma = 0).
    """
    g = torch.Generator().manual_seed(seed)
    lo, hi = WORKLOADS[workload]
    ids = torch.randint(lo, hi, (n, prompt_len), generator=g)
    top_ids, top_probs, tails = [], [], []
    for _ in range(new_tokens):
        probs = torch.softmax(target(input_ids=ids).logits[:, -1].float(), -1)  # (n, V)
        tp, ti = probs.topk(k, -1)
        top_ids.append(ti)
        top_probs.append(tp)
        tails.append((1.0 - tp.sum(-1)).clamp_min(0.0))
        nxt = torch.multinomial(probs, 1, generator=g)
        ids = torch.cat([ids, nxt], -1)
    top_ids_t = torch.stack(top_ids, 1)  # (n, N, k)
    top_probs_t = torch.stack(top_probs, 1)
    tails_t = torch.stack(tails, 1)  # (n, N)
    if draft is not None:
        d_arg = draft(input_ids=ids[:, :-1]).logits[:, prompt_len - 1 :].argmax(-1)  # (n, N)
    out = []
    for i in range(n):
        output = ids[i, prompt_len:].numpy()
        if draft is None:
            props, rejs = np.zeros(new_tokens, np.int16), np.full(new_tokens, -1, np.int16)
        else:
            ok = (d_arg[i] == ids[i, prompt_len:]).numpy()
            props_l, rejs_l, o = [], [], 0
            while o < new_tokens:
                g_s = min(gamma, new_tokens - o)
                acc = 0
                while acc < g_s and ok[o + acc]:
                    acc += 1
                props_l.append(g_s)
                rejs_l.append(acc if acc < g_s else -1)
                o += acc + 1
            props, rejs = np.array(props_l, np.int16), np.array(rejs_l, np.int16)
        out.append(
            VerifiedSample(
                request_id=f"{workload}-{seed}-{i}",
                workload=workload,
                adapter_version=0,
                pair=PAIR,
                prompt_ids=ids[i, :prompt_len].numpy(),
                output_ids=output,
                proposal_lens=props,
                rejection_pos=rejs,
                topk_ids=top_ids_t[i].numpy(),
                topk_probs=top_probs_t[i].numpy().astype(np.float16),
                tail_mass=tails_t[i].numpy(),
                record_id=f"{workload}-{seed}-{i}",
            )
        )
    return out
