"""A feature-level draft head over the target's hidden states (EAGLE-1).

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", §3: the
draft autoregresses on the target's second-to-top features, not on tokens. One step maps the
target's final hidden state f_t and the embedding of the token x_{t+1} sampled after it to a
predicted feature g_{t+1}, through ``fc([e(x_{t+1}) ; f_t])`` and one decoder layer; the
target's own LM head turns g_{t+1} into q(x_{t+2} | x_<=t+1). For γ > 1 it feeds its own g back
in place of the target's f (which exists only after verification); after each verification the
head's cache is refilled from the target's true features of the accepted tokens.

Here the layer is a copy of the target's last decoder layer (EAGLE-1 initialises its layer the
same way in its released code), the embedding is the target's (frozen) and the LM head is the
target's tied embedding cut to a frequent-token vocabulary (FR-Spec, Zhao et al. 2025:
``decoder.vocab.frequent_token_ids``), frozen. What trains is ``fc`` and the layer: 4.2M
parameters for SmolLM2-135M (576 hidden, 1536 MLP), against 134M in the target.

Training (the loss, the batches, teacher-forced α, distillation from buffered records) lives in
``trainer.head``: decoder/ and trainer/ never import each other. This module holds what serves:
the head, its proposer, the target's features for scoring (``score_features``) and the file format.

Shapes: B batch, T positions, H hidden size, V' the head's vocabulary. The features are the
target's final hidden states after its final norm, which is what both the transformers model
(``output_hidden_states[-1]``) and llama.cpp (``llama_get_embeddings_ith`` with pooling none)
return.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone().float())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


@dataclass
class KVCache:
    """The head's own attention cache: k, v of shape (B, n_kv_heads, T, head_dim)."""
    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])

    def crop(self, length: int) -> "KVCache":
        return KVCache(self.k[:, :, :length], self.v[:, :, :length])


class HeadLayer(nn.Module):
    """One Llama decoder layer (pre-norm attention with RoPE and grouped KV heads, then a SwiGLU
    MLP), copied from a transformers ``LlamaDecoderLayer`` and run with its own cache, so a
    refill of several rows after a cached prefix gets the right (bottom-right aligned) causal
    mask."""

    def __init__(self, layer: nn.Module, config):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.n_heads = int(config.num_attention_heads)
        self.n_kv = int(getattr(config, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.n_heads)
        eps = float(getattr(config, "rms_norm_eps", 1e-5))
        theta = float(getattr(config, "rope_theta", None)
                      or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.q_proj, self.k_proj = copy.deepcopy(a.q_proj), copy.deepcopy(a.k_proj)
        self.v_proj, self.o_proj = copy.deepcopy(a.v_proj), copy.deepcopy(a.o_proj)
        self.gate_proj, self.up_proj, self.down_proj = (copy.deepcopy(m.gate_proj), copy.deepcopy(m.up_proj),
                                                        copy.deepcopy(m.down_proj))
        self.input_norm = _RMSNorm(layer.input_layernorm.weight, eps)
        self.post_norm = _RMSNorm(layer.post_attention_layernorm.weight, eps)
        # float32 whatever the layer's dtype (a bf16 copy would put rotary angles off by ~0.4 %
        # of the position): a plain attribute, so Module.to(dtype) leaves it alone
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        for p in self.parameters():  # the target's copies arrive frozen (requires_grad=False): the head trains them
            p.data = p.data.float()
            p.requires_grad_(True)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos.float()[:, None] * self.inv_freq.to(pos.device)[None, :]  # (T, hd/2)
        emb = torch.cat([ang, ang], dim=-1)  # (T, hd)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        x1, x2 = x[..., : self.head_dim // 2], x[..., self.head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def forward(self, x: torch.Tensor, start: int, cache: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """x: (B, T, H) at positions start .. start + T - 1, after ``cache`` (length == start).
        Returns (B, T, H) and the cache extended by T positions."""
        B, T, _ = x.shape
        pos = torch.arange(start, start + T, device=x.device)
        h = self.input_norm(x)
        q = self.q_proj(h).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, pos), self._rope(k, pos)
        if cache is not None and cache.length:
            k = torch.cat([cache.k, k], dim=2)
            v = torch.cat([cache.v, v], dim=2)
        new_cache = KVCache(k, v)
        S = k.shape[2]
        # grouped KV heads without copying them (enable_gqa), and in float32: a bf16 serving copy's
        # attention over a few hundred keys ran 4x slower in bf16 than in float32 on one CPU thread
        qf, kf, vf = (t.float() for t in (q, k, v))
        mask = None if T == 1 else torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)  # row i sees keys 0 .. S - T + i
        att = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv).to(x.dtype)
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        h = self.post_norm(x)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x, new_cache


LLAMA_TYPES = ("llama",)  # model types whose decoder layer HeadLayer reproduces (SmolLM2 is one)


class EagleHead(nn.Module):
    """fc([e(x_{t+1}) ; f_t]) -> one decoder layer -> g_{t+1}; logits = g W_S^T over the head's
    vocabulary S (column j is token ``vocab_ids[j]``)."""

    def __init__(self, layer: HeadLayer, embed: torch.Tensor, lm_weight: torch.Tensor,
                 vocab_ids: torch.Tensor | None):
        super().__init__()
        H = embed.shape[1]
        self.hidden_size = H
        self.fc = nn.Linear(2 * H, H, bias=True)
        with torch.no_grad():  # start as "the feature passes through", the embedding as a small nudge
            self.fc.weight.zero_()
            self.fc.weight[:, H:].copy_(torch.eye(H))
            self.fc.weight[:, :H].normal_(0.0, 1.0 / math.sqrt(H))
            self.fc.bias.zero_()
        self.layer = layer
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_weight", lm_weight.detach().float().clone(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids.clone() if vocab_ids is not None else None, persistent=False)

    @classmethod
    def from_target(cls, target: nn.Module, vocab_ids: torch.Tensor | None = None, layer_index: int = -1) -> "EagleHead":
        """Build the head from a transformers causal LM (Llama family): a copy of decoder layer
        ``layer_index``, its input embedding, its LM head rows ``vocab_ids`` (None: all).

        Raises:
            ValueError: a target that is not a Llama-family model (the copied layer is Llama's: no
                q/k norms, no embedding scale, as Gemma 3 and Qwen3 have), or ``vocab_ids`` that
                are not a non-empty 1-D integer tensor of distinct ids inside the vocabulary.
        """
        mtype = getattr(target.config, "model_type", None)
        if mtype not in LLAMA_TYPES:
            raise ValueError(f"EagleHead.from_target: model_type {mtype!r} is not supported (the head's layer is a "
                             f"Llama decoder layer: {', '.join(LLAMA_TYPES)}); use a Llama-family target such as "
                             f"smollm2-135m")
        dec = target.get_decoder()
        emb = target.get_input_embeddings().weight
        lm = target.get_output_embeddings().weight
        if vocab_ids is not None:
            vocab_ids = torch.as_tensor(vocab_ids)
            if (vocab_ids.dim() != 1 or not vocab_ids.numel() or vocab_ids.dtype.is_floating_point
                    or vocab_ids.dtype == torch.bool):
                raise ValueError(f"vocab_ids: need a non-empty 1-D tensor of integer token ids, got shape "
                                 f"{tuple(vocab_ids.shape)} of {vocab_ids.dtype}; build one with "
                                 f"decoder.vocab.frequent_token_ids")
            vocab_ids = vocab_ids.long()
            if int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= lm.shape[0]:
                raise ValueError(f"vocab_ids span {int(vocab_ids.min())}..{int(vocab_ids.max())}; the target's "
                                 f"vocabulary is 0..{lm.shape[0] - 1}")
            if vocab_ids.unique().numel() != vocab_ids.numel():
                raise ValueError("vocab_ids: an id appears twice; each column of the head is one distinct token")
            lm = lm[vocab_ids]
        return cls(HeadLayer(dec.layers[layer_index], target.config), emb, lm, vocab_ids)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, feats: torch.Tensor, next_tokens: torch.Tensor, start: int = 0,
                cache: KVCache | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """One or more head steps.

        Args:
            feats: (B, T, H) features f (the target's, or the head's own g for a γ > 1 step).
            next_tokens: (B, T) int64: token x_{t+1} for the feature f_t in the same row.
            start: the head position of the first row (== cache length).
            cache: the head's cache, or None.
            last_only: logits of the last row only (a refill of a long prompt needs no others).

        Returns:
            logits (B, T, V') over the head's vocabulary ((B, 1, V') with ``last_only``), g (B, T, H),
            the extended cache.
        """
        e = F.embedding(next_tokens.to(self.embed.device), self.embed)
        x = self.fc(torch.cat([e, feats.to(device=e.device, dtype=e.dtype)], dim=-1))
        g, cache = self.layer(x, start, cache)
        # F.linear on 2-D rows, not ``@ lm_weight.T`` on (B, 1, H): the last row of a multi-row refill
        # is a strided view, and matmul turned it into a bmm that copied the whole (V', H) head on
        # every call (a 2-row bf16 refill took 10.6 ms against 2.3 for one row)
        if last_only:
            return F.linear(g[:, -1], self.lm_weight).unsqueeze(1), g, cache
        return F.linear(g, self.lm_weight), g, cache

    def serving_copy(self, dtype: torch.dtype = torch.bfloat16) -> "EagleHead":
        """A frozen copy in ``dtype`` for proposing (the trainer keeps the float32 original).
        One row through SmolLM2-135M's head in bf16 on an AVX512-BF16 CPU: bench/RESULTS.md."""
        cp = copy.deepcopy(self).to(dtype).eval()
        cp.requires_grad_(False)
        return cp

    def full_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(…, V') head logits -> (…, vocab_size) with -inf outside the head's vocabulary."""
        if self.vocab_ids is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        out[..., self.vocab_ids] = logits
        return out


@torch.inference_mode()
def score_features(target: nn.Module, windows: list[list[int]], k: int = 32, batch_size: int = 8,
                   autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """Teacher-force the target over token windows and keep, per window, what a head learns from:
    ``ids`` (L,) int64, ``feats`` (L, H) float16 final hidden states, and the target's
    next-token distribution at each position as top-k: ``topk_ids`` (L, k) int64, ``topk_probs``
    (L, k) float32, ``tail`` (L,) float32 (row j is p(. | ids[: j + 1]), temperature 1).
    Windows of equal length are batched (no padding)."""
    from decoder.sampling import topk_rows as _topk_rows

    device = next(target.parameters()).device
    by_len: dict[int, list[list[int]]] = {}
    for w in windows:
        if len(w) >= 3:
            by_len.setdefault(len(w), []).append(list(w))
    out = []
    for _, group in sorted(by_len.items()):
        for i in range(0, len(group), batch_size):
            x = torch.tensor(group[i : i + batch_size], device=device)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                o = target(input_ids=x, output_hidden_states=True)
            ti, tp, tail = _topk_rows(o.logits.float(), k)
            hs = o.hidden_states[-1].float()
            for b in range(x.shape[0]):
                out.append({"ids": x[b].cpu(), "feats": hs[b].half().cpu(), "topk_ids": ti[b].cpu(),
                            "topk_probs": tp[b].float().cpu(), "tail": tail[b].float().cpu()})
    return out


@torch.inference_mode()
def score_features_engine(engine, windows: list[list[int]], k: int = 32) -> list[dict]:
    """:func:`score_features` on a serving engine (``decoder.engine``; llama.cpp with
    ``embeddings=True``): the features and distributions the head sees when it proposes."""
    from decoder.sampling import topk_rows as _topk_rows

    out = []
    for w in windows:
        if len(w) < 3:
            continue
        logits, hid = engine.start().forward(list(w), len(w), hidden=True)
        ti, tp, tail = _topk_rows(logits.float(), k)
        out.append({"ids": torch.tensor(w), "feats": hid.float().half(), "topk_ids": ti.long(),
                    "topk_probs": tp.float(), "tail": tail.float()})
    return out


class EagleProposer:
    """Proposals from an :class:`EagleHead` (``"eagle"``), one head row per draft token.

    The decoder feeds it the target's features: after the prefill, the prompt's (row j:
    (f_j, x_{j+1})), and after each verification those of the input token and the accepted
    proposals, each with the token that followed it (the accepted ones, then the bonus token):
    :meth:`features`. Those rows are the head's committed cache; the first proposal of a step
    runs them (the last of them gives q for x_1), then the head continues on its own features g
    for x_2 .. x_γ. Speculative rows are never committed, so a rollback needs no crop.

    Args:
        head: the head (eval mode; its ``vocab_ids`` map its columns to token ids).
        vocab_size: V_p, the target's vocabulary: q has this width, 0 outside the head's ids.
    """

    name = "eagle"
    needs_features = True

    def __init__(self, head: EagleHead, vocab_size: int):
        self.head = head
        self.vocab_size = vocab_size
        self.cache: KVCache | None = None
        self.length = 0  # committed head rows
        self._feats: list[torch.Tensor] = []
        self._next: list[int] = []

    def start(self, ids: list[int], prefill: bool) -> None:
        pass  # the prompt's features arrive through features()

    def features(self, feats: torch.Tensor, next_tokens: list[int]) -> None:
        """Queue committed rows: ``feats`` (m, H) target features, ``next_tokens`` (m,) the token
        after each. Raises ValueError if the two lengths differ."""
        if feats.shape[0] != len(next_tokens):
            raise ValueError(f"features: {feats.shape[0]} feature rows for {len(next_tokens)} tokens")
        if len(next_tokens):
            self._feats.append(feats.float())
            self._next.extend(int(t) for t in next_tokens)

    def _q(self, logits: torch.Tensor, params):
        from decoder.sampling import process_logits
        return process_logits(self.head.full_logits(logits.float(), self.vocab_size), params)

    def propose(self, ids: list[int], gamma: int, params, gen: torch.Generator):
        from decoder.proposers import Proposal
        from decoder.sampling import sample

        if not self._next:  # a one-token prompt: no feature yet; the plain step brings its own
            return Proposal([], torch.zeros((0, self.vocab_size)))
        dev = self.head.embed.device
        f = torch.cat(self._feats).to(dev)[None]  # (1, m, H)
        x = torch.tensor([self._next], device=dev)
        logits, g, self.cache = self.head(f, x, self.length, self.cache, last_only=True)
        self.length += x.shape[1]
        self._feats, self._next = [], []
        tokens, qs = [], []
        cache, g_last, logit = self.cache, g[:, -1:], logits[0, -1]
        for i in range(gamma):
            q_i = self._q(logit, params)
            t = int(q_i.argmax()) if params.greedy else int(sample(q_i, gen))
            tokens.append(t)
            qs.append(q_i)
            if i + 1 < gamma:
                lg, g_last, cache = self.head(g_last, torch.tensor([[t]], device=dev), self.length + i, cache)
                logit = lg[0, -1]
        return Proposal(tokens, torch.stack(qs) if qs else torch.zeros((0, self.vocab_size)))

    def rollback(self, length: int) -> None:
        pass  # speculative rows were never committed


def target_digest(target: nn.Module) -> str:
    """16 hex digits identifying the target's weights a head depends on: every 64th row of its
    input embedding and its last decoder layer's query projection (float32 bytes, sha256)."""
    import hashlib

    h = hashlib.sha256()
    for t in (target.get_input_embeddings().weight[::64], target.get_decoder().layers[-1].self_attn.q_proj.weight):
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def save_head(head: EagleHead, path, target: nn.Module, meta: dict | None = None) -> None:
    """Write the head's trained weights (fc and the layer; the frozen embedding and LM head are
    the target's and are rebuilt from it) and its vocabulary to a safetensors file, with
    ``meta`` (str -> str) and the target's :func:`target_digest` in its header."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    if head.vocab_ids is not None:
        tensors["vocab_ids"] = head.vocab_ids.long().contiguous()
    header = {k: str(v) for k, v in (meta or {}).items()}
    header["target_digest"] = target_digest(target)
    save_file(tensors, str(path), metadata=header)


def load_head(target: nn.Module, path) -> EagleHead:
    """The head saved by :func:`save_head`, rebuilt on ``target`` (which supplies the embedding
    and LM head).

    Raises:
        ValueError: the file is missing or not a safetensors file, it was saved for other target
            weights (its ``target_digest``), or its tensors do not fit this target.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, ValueError, RuntimeError, Exception) as e:  # SafetensorError derives from Exception only
        raise ValueError(f"head file {str(path)!r} cannot be read ({type(e).__name__}: {e}); write one with "
                         f"bench/head_buffer_bench.py --save (from served traffic) or bench/eagle_bench.py --save") from e
    want = target_digest(target)
    if header.get("target_digest") not in (None, want):
        raise ValueError(f"head file {str(path)!r} was trained for other target weights (digest "
                         f"{header['target_digest']}, this target's {want}): train one for this target")
    vocab = tensors.pop("vocab_ids", None)
    head = EagleHead.from_target(target, vocab)
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:
        raise ValueError(f"head file {str(path)!r} does not fit this target: {' '.join(str(e).split())}") from e
    return head.eval()
