"""Distilling a feature-level head (``decoder.eagle.EagleHead``) from buffered records alone.

A record that carries the target's hidden states (``store.schema.VerifiedSample.hidden``,
``DecoderConfig.record_hidden``) holds everything EAGLE's loss needs (Li et al. 2024, §3.2): at
each emitted position j the target's feature f_j, the token that followed it and the target's
distribution there as top-k. So the head trains from the buffer with no target forward at all,
as the draft's LoRA adapters do (Online Speculative Decoding, Liu et al. 2024), and as Aurora
(Together AI, 2026) trains its EAGLE-3 head from served traffic.

Alignment: row j of a record is the target at sequence index P - 1 + j (P prompt tokens): its
input token is ``prompt_ids[-1]`` for j = 0 and ``output_ids[j - 1]`` after, its feature
``hidden[j]`` and its distribution ``topk_*[j]`` over ``output_ids[j]``. A prefill record
(``source="prefill"``: P = 1) lines up the same way. :func:`record_items` turns records into
the windows ``head_batch`` stacks; :class:`HeadDistiller` runs the optimiser. The head is any module with
``decoder.eagle.EagleHead``'s call signature (``head(feats, tokens) -> (logits, g, cache)``) and
``trainable()``; this module imports nothing of ``decoder/`` (the daemon hands models over).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from trainer.losses import alpha, forward_kl, student_bucket_logprobs, teacher_buckets, teacher_on_vocab

__all__ = ["column_map", "head_batch", "head_loss", "chained_alpha", "record_items", "groups", "heldout_alpha",
           "HeadDistiller", "learning_curve"]


def column_map(vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """(vocab_size,) int64: token id -> its column in a head restricted to ``vocab_ids`` (-1
    outside it); None for an unrestricted head."""
    if vocab_ids is None:
        return None
    col = torch.full((vocab_size,), -1, dtype=torch.long)
    col[vocab_ids] = torch.arange(vocab_ids.numel())
    return col


def head_batch(items: list[dict], col: torch.Tensor | None, noise: float = 0.0,
               gen: torch.Generator | None = None) -> dict:
    """Stack scored windows of equal length into one training batch for the head.

    Row j of a window (j = 0 .. L - 3): input (f_j, x_{j+1}); targets the target's distribution
    at position j + 1 (over x_{j+2}) and the feature f_{j+1} (EAGLE's regression target).

    Returns tensors: feats (B, L-2, H), tokens (B, L-2), next_feats (B, L-2, H), topk (B, L-2, k)
    column ids, present (B, L-2, k) bool, p (B, L-2, k+1) teacher buckets (restricted to the
    head's vocabulary: ``trainer.losses.teacher_on_vocab``), top1 (B, L-2) the column of the
    target's most probable id before that restriction (-1 outside the vocabulary).
    """
    feats = torch.stack([it["feats"][:-2] for it in items]).float()
    if noise > 0:  # EAGLE §3.3: features at decode time are the head's own, so train on noisy ones
        feats = feats + (torch.rand(feats.shape, generator=gen) * 2 - 1) * noise
    tokens = torch.stack([it["ids"][1:-1] for it in items])
    next_feats = torch.stack([it["feats"][1:-1] for it in items]).float()
    ti = torch.stack([it["topk_ids"][1:-1] for it in items])
    tp = torch.stack([it["topk_probs"][1:-1] for it in items])
    tail = torch.stack([it["tail"][1:-1] for it in items])
    B, T, k = ti.shape
    p = teacher_buckets(tp.reshape(-1, k), tail.reshape(-1))
    top1 = ti.gather(-1, tp.float().argmax(-1, keepdim=True)).squeeze(-1)  # (B, T): the target's own top-1 id
    if col is not None:
        cols = col[ti]
        present = cols >= 0
        p = teacher_on_vocab(p, present.reshape(-1, k))
        cols = cols.clamp_min(0)
        top1 = col[top1]  # its column, -1 outside the head's vocabulary
    else:
        cols, present = ti, torch.ones_like(ti, dtype=torch.bool)
    return {"feats": feats, "tokens": tokens, "next_feats": next_feats, "topk": cols, "present": present,
            "p": p.view(B, T, k + 1), "top1": top1}


def _unrolled(head, batch: dict, depth: int):
    """Yield (d, logits, g, rows) for proposal depths d = 0 .. depth - 1 over a batch: depth 0
    runs on the target's features; depth d feeds row j the head's depth-(d-1) prediction for
    position j (its g_{j-1}) and keeps the target's features for rows < d, as the d-th token of a
    proposal does (EAGLE-3's training-time test, Li et al. 2025, §3.2). ``rows`` = slice(d, None):
    the rows whose last d inputs are the head's own. Approximate in one respect: the attention
    context rows carry the head's own features too, where a real proposal's cache holds the
    target's (refilled after each verification)."""
    feats, tokens = batch["feats"], batch["tokens"]
    if depth < 1:
        raise ValueError(f"depth={depth}: need >= 1 proposal depth")
    cur = feats
    for d in range(min(depth, feats.shape[1])):  # depth d needs a row with d earlier rows
        logits, g, _ = head(cur, tokens)
        yield d, logits, g, slice(d, None)
        cur = torch.cat([feats[:, : d + 1], g[:, d:-1]], dim=1)


def _bucket_logq(logits: torch.Tensor, batch: dict, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    k = batch["topk"].shape[-1]
    lg = logits[:, rows]
    logq = student_bucket_logprobs(lg.reshape(-1, lg.shape[-1]), batch["topk"][:, rows].reshape(-1, k),
                                   batch["present"][:, rows].reshape(-1, k))
    return logq, batch["p"][:, rows].reshape(-1, k + 1)


def head_loss(head, batch: dict, feature_weight: float = 1.0, unroll: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-1's loss (§3.2): forward KL of the head's next-token distribution from the target's
    (over the stored top-k + tail buckets: ``trainer.losses``) plus ``feature_weight`` x the
    smooth-L1 regression of g_{t+1} on f_{t+1}, summed over ``unroll`` proposal depths
    (:func:`_unrolled`). Returns (loss, per-position depth-1 α (B*T,))."""
    loss, a1 = 0.0, None
    for d, logits, g, rows in _unrolled(head, batch, unroll):
        logq, p = _bucket_logq(logits, batch, rows)
        loss = loss + forward_kl(p, logq).mean()
        if feature_weight:
            loss = loss + feature_weight * F.smooth_l1_loss(g[:, rows], batch["next_feats"][:, rows])
        if d == 0:
            a1 = alpha(p, logq.detach())
    return loss, a1


@torch.no_grad()
def chained_alpha(head, batch: dict, depth: int = 2, greedy: bool = False) -> list[float]:
    """Teacher-forced α at proposal depths 1 .. ``depth`` (:func:`_unrolled`; tokens are the
    text's). α = Σ min(p, q) over the stored buckets (Leviathan et al. 2023, §3.1), p and q at
    temperature 1; with ``greedy``, greedy agreement instead (the head's argmax is the target's
    top-1: the acceptance a greedy request sees, which T = 1 α overstates on flat
    distributions). Returns one mean per depth."""
    out = []
    for _, logits, _, rows in _unrolled(head, batch, depth):
        if greedy:  # the target's own top-1 (-1 outside the head's vocabulary: never matched)
            out.append(float((logits[:, rows].argmax(-1) == batch["top1"][:, rows]).float().mean()))
            continue
        logq, p = _bucket_logq(logits, batch, rows)
        out.append(float(alpha(p, logq).mean()))
    return out


def record_items(samples: Iterable, window: int = 64) -> list[dict]:
    """Cut records that carry hidden states into training windows of ``window`` rows (the last
    part of a record, if at least 3 rows, is a shorter window of its own).

    Returns dicts as ``decoder.eagle.score_features`` does: ``ids`` (L,) int64, ``feats`` (L, H)
    float16, ``topk_ids`` (L, k) int64, ``topk_probs`` (L, k) float32, ``tail`` (L,) float32,
    row j being p(. | ..., ids[: j + 1]). Records without hidden states (schema 1, or a decoder
    that did not record them) or without top-k rows are skipped.

    Raises:
        ValueError: ``window`` < 3 (a head's training row needs its input, its successor and the
            distribution after it).
    """
    if window < 3:
        raise ValueError(f"window={window}: need >= 3 rows")
    out = []
    for s in samples:
        h = getattr(s, "hidden", None)
        n = int(s.output_ids.shape[0])
        if h is None or n < 3 or s.topk_ids.shape[1] == 0 or s.prompt_ids.shape[0] == 0:
            continue
        ids = torch.from_numpy(s.output_ids.astype("int64"))
        ids = torch.cat([torch.tensor([int(s.prompt_ids[-1])]), ids[:-1]])
        feats = torch.from_numpy(h)
        ti = torch.from_numpy(s.topk_ids.astype("int64"))
        tp = torch.from_numpy(s.topk_probs.astype("float32"))
        tail = torch.from_numpy(s.tail_mass.astype("float32"))
        for a in range(0, n, window):
            b = min(n, a + window)
            if b - a >= 3:
                out.append({"ids": ids[a:b], "feats": feats[a:b], "topk_ids": ti[a:b], "topk_probs": tp[a:b],
                            "tail": tail[a:b]})
    return out


def _shape(it: dict) -> tuple[int, int, int]:
    return len(it["ids"]), int(it["topk_ids"].shape[1]), int(it["feats"].shape[1])


def groups(items: list[dict], size: int = 8) -> list[list[dict]]:
    """Items of equal length, top-k width and feature width in groups of at most ``size``
    (``head_batch`` stacks without padding)."""
    by: dict[tuple, list] = {}
    for it in items:
        by.setdefault(_shape(it), []).append(it)
    return [g[i : i + size] for g in by.values() for i in range(0, len(g), size)]


def heldout_alpha(head, batches: list[dict], depth: int = 3, greedy: bool = False) -> list[float]:
    """Teacher-forced α (``greedy``: greedy agreement) at proposal depths 1 .. ``depth``
    (:func:`chained_alpha`), the mean over batches weighted by their rows. Returns ``depth``
    floats (NaN without batches)."""
    was = head.training
    head.eval()
    try:
        n = [b["tokens"].numel() for b in batches]
        per = [chained_alpha(head, b, depth, greedy) for b in batches]
    finally:
        head.train(was)
    if not n:
        return [float("nan")] * depth
    return [sum(d[i] * k for d, k in zip(per, n) if i < len(d)) / sum(k for d, k in zip(per, n) if i < len(d))
            if any(i < len(d) for d in per) else float("nan") for i in range(depth)]


class HeadDistiller:
    """AdamW over the head's trainable parameters (``fc`` and its layer), EAGLE-1's loss
    (:func:`head_loss`: forward KL on the stored top-k buckets + ``feature_weight`` x
    smooth-L1 on the next feature, over ``unroll`` proposal depths), gradient norm clipped at 1,
    a warm-up of ``warmup`` steps then a cosine decay to ``min_lr`` x ``lr`` over ``total_steps``.
    Under bf16 autocast where the CPU (or CUDA) multiplies bf16 natively (``autocast``).

    Raises:
        ValueError: no items, items of more than one (top-k, hidden) width, or ``lr`` outside
            (0, 1], ``batch`` < 1, ``unroll`` < 1, ``min_lr`` outside [0, 1], ``total_steps`` < 1,
            ``feature_weight`` negative or not finite.
    """

    def __init__(self, head, items: list[dict], col: torch.Tensor | None, *, lr: float = 1e-3, batch: int = 8,
                 unroll: int = 2, noise: float = 0.0, feature_weight: float = 1.0, total_steps: int = 1000,
                 min_lr: float = 0.1, warmup: int = 20, seed: int = 0, autocast: torch.dtype | None = None):
        if not items:
            raise ValueError("no training windows: records need hidden states (DecoderConfig.record_hidden) and >= 3 rows")
        if not (0 < lr <= 1 and batch >= 1 and unroll >= 1 and 0 <= min_lr <= 1 and total_steps >= 1
                and 0 <= feature_weight < math.inf):
            raise ValueError(f"lr={lr} (in (0, 1]), batch={batch} (>= 1), unroll={unroll} (>= 1), min_lr={min_lr} "
                             f"(in [0, 1]), total_steps={total_steps} (>= 1), feature_weight={feature_weight} (finite, >= 0)")
        widths = {_shape(it)[1:] for it in items}
        if len(widths) > 1:
            raise ValueError(f"training windows of {len(widths)} different (top-k, hidden) widths {sorted(widths)}: "
                             f"records from decoders with different topk_record, or another model; train on one kind")
        self.head, self.col = head, col
        self.lr, self.batch, self.unroll, self.noise = lr, batch, unroll, noise
        self.feature_weight, self.total_steps, self.min_lr, self.warmup = feature_weight, total_steps, min_lr, warmup
        self.autocast = autocast
        self.by_len: dict[int, list] = {}
        for it in items:
            self.by_len.setdefault(len(it["ids"]), []).append(it)  # one width (checked above): length is the shape
        self._lengths = [L for L, g in self.by_len.items() for _ in range(0, len(g), batch)]
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(head.trainable(), lr=lr, weight_decay=0.0)
        self.steps = 0
        self.train_s = 0.0

    def step(self) -> float:
        """One optimiser step on a random batch of equal-length windows; returns its loss."""
        L = self.rng.choice(self._lengths)
        b = head_batch(self.rng.sample(self.by_len[L], min(self.batch, len(self.by_len[L]))), self.col,
                       self.noise, self.gen)
        frac = min(1.0, self.steps / self.total_steps)
        for grp in self.opt.param_groups:
            grp["lr"] = self.lr * min(1.0, (self.steps + 1) / max(1, self.warmup)) * (
                self.min_lr + (1 - self.min_lr) * 0.5 * (1 + math.cos(math.pi * frac)))
        self.head.train()
        t0 = time.perf_counter()
        device = b["feats"].device.type
        with torch.autocast(device, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            loss, _ = head_loss(self.head, b, self.feature_weight, self.unroll)
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.trainable(), 1.0)
        self.opt.step()
        self.train_s += time.perf_counter() - t0
        self.steps += 1
        return float(loss.detach())


def learning_curve(dist: HeadDistiller, held_batches: dict[str, list[dict]], *, minutes: float, max_steps: int = 0,
                   round_steps: int = 100, cpu_start: float = 0.0, log=None, final: bool = True,
                   depth: int = 3) -> list[dict]:
    """Train ``dist`` for ``max_steps`` steps, or (0) ``minutes`` of training time, and evaluate
    held-out teacher-forced α (:func:`heldout_alpha`, depths 1 .. ``depth``) per workload of
    ``held_batches`` at step 0, every ``round_steps`` steps and (``final``) at the end. Time-bounded,
    the cosine runs over the steps the pace so far predicts (re-estimated after 20 steps).

    Returns the points: ``steps``, ``train_s`` (s), ``cpu_min`` (process CPU minutes since
    ``cpu_start``, a ``time.process_time()``), ``loss`` (the last step's; not at step 0 or the
    final point), ``alpha_depth_1_2_3`` (mean over workloads), ``greedy_depth_1_2_3`` (greedy
    agreement, likewise) and ``per_workload``. ``log`` gets
    each point as JSON text."""
    import json
    import statistics

    def point(**extra) -> dict:
        per = {w: [round(a, 4) for a in heldout_alpha(dist.head, bs, depth)] for w, bs in held_batches.items()}
        gr = {w: [round(a, 4) for a in heldout_alpha(dist.head, bs, depth, greedy=True)] for w, bs in held_batches.items()}
        p = {"steps": dist.steps, "train_s": round(dist.train_s, 1),
             "cpu_min": round((time.process_time() - cpu_start) / 60, 2), **extra,
             "alpha_depth_1_2_3": [round(statistics.mean(v[i] for v in per.values()), 4) for i in range(depth)],
             "greedy_depth_1_2_3": [round(statistics.mean(v[i] for v in gr.values()), 4) for i in range(depth)],
             "per_workload": per}
        if log is not None:
            log(json.dumps(p))
        return p

    curve = [point()]
    while (dist.steps < max_steps) if max_steps else (dist.train_s < minutes * 60):
        if not max_steps and dist.steps >= 20:
            dist.total_steps = max(dist.steps + 1, int(dist.steps * minutes * 60 / dist.train_s))
        loss = dist.step()
        if dist.steps % round_steps == 0:
            curve.append(point(loss=round(loss, 4)))
    if final and dist.steps % round_steps:
        curve.append(point())
    return curve
