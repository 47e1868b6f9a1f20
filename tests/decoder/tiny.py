"""Tiny real models and a real (character-level) tokenizer for the decoder's unit tests.

The target's LM head is scaled so its distributions are peaked like a trained LM's; drafts are
either derived from it (shared embeddings/head) or independently initialised.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?()[]+-*/=<>'\"_#@$%&")
SPECIALS = ["<unk>", "<eos>"]


def char_tokenizer(chars=CHARS, swap: bool = False) -> PreTrainedTokenizerFast:
    """One token per character; ids 0/1 are <unk>/<eos>. ``swap`` exchanges the ids of 'a' and 'b'
    (a different tokenizer of the same size)."""
    toks = SPECIALS + list(chars)
    vocab = {t: i for i, t in enumerate(toks)}
    if swap:
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


VOCAB = len(SPECIALS) + len(CHARS)  # 64


def tiny_llama(seed: int, layers: int = 4, hidden: int = 32, vocab: int = VOCAB, head_scale: float = 1.0):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(head_scale)
    m.requires_grad_(False)
    return m


def tiny_target():
    return tiny_llama(1234, layers=4, hidden=48, head_scale=20.0)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding by full recomputation (no KV cache): an independent reference."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if eos is not None and nxt == eos:
            break
    return out
