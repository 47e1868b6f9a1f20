"""LoRA distillation of the target's stored distributions into the draft.

Online Speculative Decoding (Liu et al., ICML 2024) re-runs draft and target on buffered requests
and minimises a divergence at the positions where the draft was wrong. Here the target's side is
already in each ``VerifiedSample`` (top-k + tail per emitted position), so only the draft runs,
and only a LoRA adapter (peft) is trained, never the draft's own weights.

For a sample with P prompt tokens and N emitted tokens the draft reads
``prompt_ids ++ output_ids[:-1]`` (length P + N - 1) and its logits at sequence index P - 1 + j
are distilled towards the target's row j, p(. | prompt, output[:j]), for j in 0..N-1.

The ``Distiller`` owns the peft-wrapped draft and its AdamW state (carried across rounds);
the caller (``trainer.service``) decides what to train on and whether to publish.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import numbers
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import PreTrainedModel

from store import copy_channel as CC
from store.schema import VerifiedSample
from trainer import losses as L
from trainer.gate import decoded_acceptance

ADAPTER_NAME = "draftd"
# Written beside peft's files by ``Distiller.save`` when the adapter was trained on a restricted
# draft vocabulary: {"size": |S|, "sha256": of the int64 ids, "ids": [...]}.
VOCAB_FILE = "draft_vocab.json"
WEIGHTINGS = ("all", "rejected", "upweight_rejected")
PRECISIONS = ("auto", "fp32", "bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), where oneDNN's
    bf16 matmul runs 2-4x faster than fp32 (bench/RESULTS.md). False when torch cannot tell."""
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                return True
        except Exception:  # noqa: BLE001 - a private probe; unknown means no
            pass
    return False


def autocast_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for a ``precision`` setting on ``device`` (None = plain fp32).

    "fp32": None. "bf16": bfloat16. "auto": bfloat16 on a CPU with native bf16
    (:func:`cpu_has_native_bf16`) or a CUDA device that supports it, else None.

    Raises:
        ValueError: ``precision`` is not one of PRECISIONS.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}; choose one of {PRECISIONS}")
    dev = torch.device(device)
    if precision == "fp32":
        return None
    if precision == "bf16":
        return torch.bfloat16
    if dev.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else None
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    return None


def _ids_sha256(ids: torch.Tensor) -> str:
    """sha256 of (V',) token ids as little-endian int64 bytes: the identity of a draft vocabulary."""
    import hashlib

    return hashlib.sha256(ids.to(torch.int64).numpy().astype("<i8").tobytes()).hexdigest()


class TrainerError(Exception):
    """Base class of the trainer's errors."""


class AdapterMismatch(TrainerError):
    """A saved adapter does not fit the Distiller's LoRA config."""


@dataclass
class DistillConfig:
    """How a round of distillation runs. Library code takes this object; only daemon/ reads env."""

    # Divergence minimised per position, one of trainer.losses.LOSSES. Default forward KL, by
    # measurement (bench/train_bench.py --pair tiny --lr 1e-3, 200 steps, batch 8, 2 cores):
    # held-out alpha 0.059 -> forward_kl 0.643, jsd(0.5) 0.501, reverse_kl 0.468, tv 0.424, and
    # forward KL led at every checkpoint (50 steps: 0.40 vs 0.34 / 0.34 / 0.30). From an untrained
    # draft the mode-seeking losses (reverse KL, JSD) and TV learn slowly: their gradient on a
    # bucket scales with q, which is ~0 where the target puts its mass. TV (= 1 - alpha) is the
    # natural fine-tuning objective once the draft is close; re-measure on the real pair.
    loss: str = "forward_kl"
    # The temperature the teacher is distilled at (``losses.at_temperature``): 1 = the target's own
    # p; 0 = greedy decoding's target (its top-1, as greedy acceptance counts it); "served" = each
    # record's own request temperature (greedy records at 0), the acceptance the gate judges.
    teacher_temperature: float | str = 1.0
    # beta of the generalised JSD (GKD): weight of the target in the mixture m = beta p + (1-beta) q.
    jsd_beta: float = 0.5
    # Which output positions count: "all"; "rejected" = only where the draft was wrong (OSD), i.e.
    # the target's correction token of each step with a rejection; "upweight_rejected" = all, with
    # rejected positions weighted ``rejected_weight``. Bootstrap samples (gamma = 0) have no
    # rejections, so they need "all" or "upweight_rejected".
    weighting: str = "all"
    rejected_weight: float = 4.0
    # LoRA (peft LoraConfig fields): rank, scaling alpha, dropout, modules ("all-linear" = every
    # linear layer of the draft except the LM head).
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    # AdamW learning rate and weight decay; state is kept across rounds.
    lr: float = 1e-3
    weight_decay: float = 0.0
    # Gradient clipping by global L2 norm (0 disables).
    grad_clip: float = 1.0
    # Linear learning-rate warm-up over the first N steps of each new optimiser (0 disables). A
    # fresh AdamW moves every weight by about lr on its first steps whatever the gradient's size
    # (m / sqrt(v) = ±1 at step 1): from trained weights (a rejected round restarts from the
    # serving adapter with a new optimiser) that is a jump, not a step.
    warmup_steps: int = 0
    # Bounds of one round: optimiser steps, wall seconds (checked before each step, so a round may
    # overrun by one step), and passes over the round's samples.
    max_steps: int = 64
    max_seconds: float = 120.0
    max_epochs: int = 4
    # Sequences per optimiser step, and the longest input fed to the draft (older prompt tokens are
    # dropped first, then the output is cut).
    batch_size: int = 4
    max_seq_len: int = 512
    # Seed of the per-round sample order.
    seed: int = 0
    # Training forward/backward under autocast: "auto" (bf16 where the hardware multiplies it
    # natively, see autocast_dtype), "fp32" or "bf16". The adapter's weights, the optimiser and
    # the loss stay fp32, and evaluation always runs in fp32, as the decoder serves the draft.
    precision: str = "auto"
    # The copy channel (``store.copy_channel``): the draft's q is mixed with the copy candidate,
    # q_mix = (1 - λ) q + λ 1[x = c], λ = sigmoid(w · f), in the loss and the held-out evaluation;
    # w (6 floats) trains jointly with the LoRA, at its own AdamW learning rate ``copy_gate_lr``
    # (the LoRA's 5e-3 would move it ~0.3 in a 64-step round), from ``copy_gate_init`` (the bias;
    # the other weights start at 0) the first time an adapter without a gate is trained on, and is
    # saved beside the adapter (``store.copy_channel.GATE_FILE``). False: no gate is trained, mixed
    # or saved (λ = 0, the draft alone).
    copy_gate: bool = True
    copy_gate_lr: float = 0.1
    copy_gate_init: float = -3.0

    def __post_init__(self) -> None:
        if not isinstance(self.copy_gate, bool):
            raise ValueError(f"DistillConfig.copy_gate={self.copy_gate!r}; use True or False")
        for name in ("copy_gate_lr", "copy_gate_init"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or (name == "copy_gate_lr" and v <= 0):
                raise ValueError(f"DistillConfig.{name}={v!r}; use a finite number" + (" > 0" if name == "copy_gate_lr" else ""))
        if self.loss not in L.LOSSES:
            raise ValueError(f"DistillConfig.loss={self.loss!r}; choose one of {L.LOSSES}")
        t = self.teacher_temperature
        if t != "served" and not (isinstance(t, numbers.Real) and t >= 0 and math.isfinite(t)):
            raise ValueError(f"DistillConfig.teacher_temperature={t!r}; use a finite value >= 0 (0 = greedy decoding's "
                             "target, 1 = the target's own distribution) or 'served' (each record's own)")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"DistillConfig.weighting={self.weighting!r}; choose one of {WEIGHTINGS}")
        if self.loss == "jsd" and not 0.0 < self.jsd_beta < 1.0:
            raise ValueError(f"DistillConfig.jsd_beta={self.jsd_beta} must lie strictly between 0 and 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"DistillConfig.precision={self.precision!r}; choose one of {PRECISIONS}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"DistillConfig.warmup_steps={self.warmup_steps!r}; use an integer >= 0 (0 = no warm-up)")
        if self.batch_size < 1 or self.max_seq_len < 2:
            raise ValueError(
                f"DistillConfig batch_size={self.batch_size} must be >= 1 and max_seq_len={self.max_seq_len} >= 2"
            )


@dataclass
class RoundResult:
    """What one ``train_round`` did. ``finite`` False means the round was rolled back."""

    steps: int
    samples: int  # distinct samples that went into at least one step
    tokens: int  # their output positions with non-zero weight
    loss_first: float  # weighted loss of the first step (nan when no step ran)
    loss_last: float  # weighted loss of the last step
    seconds: float
    finite: bool
    reason: str = ""


@dataclass
class EvalCounts:
    """Counts over evaluated output positions; rates are derived when read."""

    samples: int = 0
    positions: int = 0
    alpha_sum: float = 0.0  # sum over positions of sum_b min(p_b, q_b) (top-k + tail buckets)
    greedy_matches: int = 0  # positions where the draft's argmax == the target's top-1 id
    # sum over positions of the acceptance as each record was served: its greedy match when the
    # request was greedy (temperature 0), sum_b min(p_T, q_T) at the request's temperature T else
    served_sum: float = 0.0
    # decoding at a fixed γ (Distiller.evaluate's ``gamma``) simulated on each record's per-position
    # acceptance as served (trainer.gate.decoded_acceptance): expected accepted proposals and proposals
    decoded_accepted: float = 0.0
    decoded_proposed: float = 0.0

    @property
    def alpha(self) -> float:
        """Mean per-position alpha = alpha_sum / positions (nan when no positions)."""
        return self.alpha_sum / self.positions if self.positions else float("nan")

    @property
    def greedy(self) -> float:
        """Greedy agreement = greedy_matches / positions (nan when no positions)."""
        return self.greedy_matches / self.positions if self.positions else float("nan")

    @property
    def served(self) -> float:
        """Acceptance as served = served_sum / positions (nan when no positions): what the
        decoder's α will be on these records' requests, greedy or sampled."""
        return self.served_sum / self.positions if self.positions else float("nan")

    def add(self, other: EvalCounts) -> None:
        self.samples += other.samples
        self.positions += other.positions
        self.alpha_sum += other.alpha_sum
        self.greedy_matches += other.greedy_matches
        self.served_sum += other.served_sum
        self.decoded_accepted += other.decoded_accepted
        self.decoded_proposed += other.decoded_proposed

    @property
    def decoded(self) -> float:
        """Decoded acceptance = decoded_accepted / decoded_proposed (nan when none proposed): the
        share of proposals accepted when decoding these records at the evaluation's γ."""
        return self.decoded_accepted / self.decoded_proposed if self.decoded_proposed else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "alpha": self.alpha, "greedy": self.greedy, "served": self.served, "decoded": self.decoded}


@dataclass
class EvalResult:
    """Held-out evaluation, overall and per workload tag."""

    overall: EvalCounts = field(default_factory=EvalCounts)
    per_workload: dict[str, EvalCounts] = field(default_factory=dict)
    # per record id: (workload, counts); lets a caller reuse an adapter's evaluation of a sample
    per_sample: dict[str, tuple[str, EvalCounts]] = field(default_factory=dict, repr=False)

    def add_sample(self, record_id: str, workload: str, c: EvalCounts) -> None:
        """Count one sample's evaluation in, overall and under its workload."""
        self.overall.add(c)
        self.per_workload.setdefault(workload, EvalCounts()).add(c)
        self.per_sample[record_id] = (workload, c)

    @property
    def alpha(self) -> float:
        return self.overall.alpha

    @property
    def greedy(self) -> float:
        return self.overall.greedy

    @property
    def served(self) -> float:
        return self.overall.served

    def pooled(self, workloads: Sequence[str]) -> EvalCounts:
        """Counts pooled over the given workloads (positions-weighted, not a mean of means)."""
        out = EvalCounts()
        for w in workloads:
            if w in self.per_workload:
                out.add(self.per_workload[w])
        return out

    def to_dict(self) -> dict:
        return {
            "overall": self.overall.to_dict(),
            "per_workload": {w: c.to_dict() for w, c in sorted(self.per_workload.items())},
        }


DECODED_GAMMA = 3  # γ of the decoding Distiller.evaluate simulates by default (EvalCounts.decoded)

# The adapter's trainable tensors, by parameter name (a snapshot, detached and cloned), with the
# copy gate's weights under GATE_W and whether the adapter carries a gate under GATE_ON.
AdapterState = dict[str, torch.Tensor]
GATE_W, GATE_ON = "copy_gate.w", "copy_gate.on"
# Sentinel for ``evaluate(adapter=BASE)``: the draft with the adapter disabled.
BASE = "base"


def rejected_positions(sample: VerifiedSample) -> np.ndarray:
    """(N,) bool: output positions where the draft was wrong (the target's correction tokens).

    Step s emits accepted_len[s] + 1 tokens (accepted prefix, then a correction or the bonus),
    except possibly the last step, truncated by a stop. When rejection_pos[s] >= 0 the token at
    offset accepted_len[s] of that step is the target's correction. Plain steps (gamma = 0) have
    rejection_pos -1 and mark nothing.
    """
    n = sample.num_tokens
    mask = np.zeros(n, dtype=bool)
    offset = 0
    for acc, rej in zip(sample.accepted_lens, sample.rejection_pos):
        if rej >= 0 and offset + acc < n:
            mask[offset + acc] = True
        offset += int(acc) + 1
    return mask


def position_weights(sample: VerifiedSample, weighting: str, rejected_weight: float = 4.0) -> np.ndarray:
    """(N,) float32 weight per output position for the given weighting mode (see DistillConfig)."""
    if weighting == "all":
        return np.ones(sample.num_tokens, dtype=np.float32)
    rej = rejected_positions(sample)
    if weighting == "rejected":
        return rej.astype(np.float32)
    if weighting == "upweight_rejected":
        return np.where(rej, rejected_weight, 1.0).astype(np.float32)
    raise ValueError(f"weighting={weighting!r}; choose one of {WEIGHTINGS}")


@dataclass
class _Batch:
    input_ids: torch.Tensor  # (B, T) int64, right-padded with 0
    attention_mask: torch.Tensor  # (B, T) int64
    rows_b: torch.Tensor  # (M,) batch index of each distilled position
    rows_t: torch.Tensor  # (M,) sequence index of each distilled position
    topk_ids: torch.Tensor  # (M, k) int64
    p: torch.Tensor  # (M, k+1) teacher buckets, float32
    weights: torch.Tensor  # (M,) float32
    row_sample: np.ndarray  # (M,) index into the batch's samples
    temperature: torch.Tensor  # (M,) float32, the sampling temperature of each row's request (0 = greedy)
    copy_c: torch.Tensor | None = None  # (M,) int64 copy candidate per row (-1: none); None without the copy channel
    copy_len: torch.Tensor | None = None  # (M,) int64 its matched length ℓ (0: none)


def _build_batch(
    samples: Sequence[VerifiedSample], cfg: DistillConfig, device: torch.device, weighting: str = "all"
) -> _Batch:
    ks = {s.topk_ids.shape[1] for s in samples}
    if len(ks) != 1:
        raise TrainerError(f"samples in one batch have different top-k widths {sorted(ks)}; the decoder's k must be fixed")
    seqs, rows_b, rows_t, ids, probs, tails, weights, row_sample, temps = [], [], [], [], [], [], [], [], []
    cands, lens = [], []
    L_max = cfg.max_seq_len
    for b, s in enumerate(samples):
        n = min(s.num_tokens, L_max)  # kept output positions (>= 1 prompt token must remain)
        p_keep = min(len(s.prompt_ids), L_max - n + 1)
        if p_keep < 1:
            raise TrainerError(f"sample {s.record_id} has an empty prompt; the draft needs one token of context")
        prompt = s.prompt_ids[len(s.prompt_ids) - p_keep :]
        seq = np.concatenate([prompt, s.output_ids[: n - 1]])  # (p_keep + n - 1,)
        seqs.append(seq)
        rows_b.append(np.full(n, b))
        rows_t.append(p_keep - 1 + np.arange(n))
        ids.append(s.topk_ids[:n])
        probs.append(s.topk_probs[:n])
        tails.append(s.tail_mass[:n])
        weights.append(position_weights(s, weighting, cfg.rejected_weight)[:n])
        row_sample.append(np.full(n, b))
        temps.append(np.full(n, float(s.sampling.temperature), dtype=np.float32))
        if cfg.copy_gate:
            c, ln = _record_candidates(s)
            cands.append(c[:n])
            lens.append(ln[:n])
    T = max(len(x) for x in seqs)
    input_ids = np.zeros((len(seqs), T), dtype=np.int64)
    mask = np.zeros((len(seqs), T), dtype=np.int64)
    for b, x in enumerate(seqs):
        input_ids[b, : len(x)] = x
        mask[b, : len(x)] = 1
    p = L.teacher_buckets(torch.from_numpy(np.concatenate(probs)), torch.from_numpy(np.concatenate(tails)))
    return _Batch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=torch.from_numpy(mask).to(device),
        rows_b=torch.from_numpy(np.concatenate(rows_b)).to(device),
        rows_t=torch.from_numpy(np.concatenate(rows_t)).to(device),
        topk_ids=torch.from_numpy(np.concatenate(ids).astype(np.int64)).to(device),
        p=p.to(device),
        weights=torch.from_numpy(np.concatenate(weights)).to(device),
        row_sample=np.concatenate(row_sample),
        temperature=torch.from_numpy(np.concatenate(temps)).to(device),
        copy_c=torch.from_numpy(np.concatenate(cands)).to(device) if cfg.copy_gate else None,
        copy_len=torch.from_numpy(np.concatenate(lens)).to(device) if cfg.copy_gate else None,
    )


_CANDIDATES: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = {}  # record -> its rows' candidates
_CANDIDATES_KEPT = 4096


def _record_candidates(s: VerifiedSample) -> tuple[np.ndarray, np.ndarray]:
    """The copy candidate and matched length at each output position j of ``s`` (N,), N = its
    output positions: ``store.copy_channel.copy_candidate`` on the whole record (prompt + output),
    context = prompt + output[:j], as the decoder computes it when proposing output[j] (the
    prompt is never cut here, unlike the draft's input at ``max_seq_len``). Cached per record (a
    held-out record is evaluated every round)."""
    key = (s.record_id, len(s.prompt_ids), s.num_tokens)
    got = _CANDIDATES.get(key)
    if got is None:
        seq = np.concatenate([np.asarray(s.prompt_ids, dtype=np.int64), np.asarray(s.output_ids, dtype=np.int64)])
        got = CC.copy_candidates(seq, len(s.prompt_ids) - 1 + np.arange(s.num_tokens))
        if len(_CANDIDATES) >= _CANDIDATES_KEPT:
            _CANDIDATES.pop(next(iter(_CANDIDATES)))
        _CANDIDATES[key] = got
    return got


@dataclass
class _CopyMix:
    """The copy channel at M rows of a batch (``Distiller._copy_mix``)."""

    c: torch.Tensor  # (M,) int64 candidate id (-1: none)
    has: torch.Tensor  # (M,) bool
    c_bucket: torch.Tensor  # (M,) int64 the candidate's bucket: its top-k column, else k (the tail)
    z: torch.Tensor  # (M,) gate logits w · f (differentiable in w)
    in_topk: torch.Tensor  # (M, k) bool, the top-k column holding the candidate
    q_c: torch.Tensor  # (M,) the draft's temperature-1 q(c), detached
    q_max: torch.Tensor  # (M,) its largest probability
    top: torch.Tensor  # (M,) its argmax id

    def __call__(self, logq: torch.Tensor) -> torch.Tensor:
        """(M, k+1) bucket log q -> log q_mix (``losses.mix_copy_logq``)."""
        return L.mix_copy_logq(logq, self.c_bucket, self.z, self.has)

    def argmax(self) -> torch.Tensor:
        """(M,) argmax of q_mix per row (``store.copy_channel.mix_argmax``, as the decoder proposes)."""
        lam = torch.where(self.has, torch.sigmoid(self.z.detach().double()), torch.zeros_like(self.z, dtype=torch.float64))
        rows = zip(self.top.tolist(), self.q_max.tolist(), self.c.tolist(), self.q_c.tolist(), lam.tolist())
        return torch.tensor([CC.mix_argmax(t, qm, c, qc, la) for t, qm, c, qc, la in rows], dtype=torch.long,
                            device=self.top.device)


class Distiller:
    """The draft wrapped with a peft LoRA adapter, trained round by round.

    Args:
        draft: the draft model (injected by the daemon). ``get_peft_model`` injects LoRA layers
            into it in place; the caller should use ``distiller.model`` from then on.
        config: DistillConfig.
        clock: monotonic seconds, injected so tests can drive the round's time bound.
        vocab: optional (V',) int64 token ids, the restricted draft vocabulary S the draft will be
            served with (FR-Spec, ``decoder.vocab.frequent_token_ids``; the decoder's
            ``DecoderConfig.draft_vocab``). Training then computes the LM head on S only (on a
            2-core CPU a 4-layer SmolLM2 draft's step went from 2.9 s to 1.0 s with |S| = 8192:
            the 49k-row head was two thirds of its FLOPs) and distils p(. | S)
            (``losses.teacher_on_vocab``); evaluation measures the served draft's acceptance,
            alpha_S = sum over S of min(p, q), with q = 0 outside S. The adapter then fits that
            restricted head only; serve it with the same ids.

    Raises:
        ValueError: ``vocab`` is not a non-empty 1-D tensor of distinct integer ids in
            0..V-1 (V = rows of the draft's LM head).
    """

    def __init__(
        self,
        draft: PreTrainedModel,
        config: DistillConfig,
        clock: Callable[[], float] = time.monotonic,
        vocab: torch.Tensor | None = None,
    ):
        self.config = config
        self.clock = clock
        self.lora_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=config.target_modules,
            task_type="CAUSAL_LM",
        )
        self.model: PeftModel = get_peft_model(draft, self.lora_config, adapter_name=ADAPTER_NAME)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self._vocab, self._vocab_pos = self._check_vocab(vocab)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        # the copy channel's gate weights w (store.copy_channel.FEATURES), part of the adapter's
        # state; ``_gate_on`` False = an adapter without a gate (λ = 0: v0, the base draft)
        self.gate_w = torch.nn.Parameter(self._gate_init())
        self._gate_on = False
        self.optimizer = self._new_optimizer()
        self._rounds = 0
        self._initial = self.adapter_state()  # peft's init: LoRA B = 0, so the adapter is a no-op
        # set: train_round ends at its next step as at its bounds (TrainerService.stop(cut_round=True))
        self.interrupt = threading.Event()
        # asked before each step as well: True ends train_round there (TrainerService's yield check)
        self.should_stop: Callable[[], bool] | None = None

    def _check_vocab(self, vocab: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(V',) ids on the device and the (V,) map id -> column (-1 outside S), or (None, None)."""
        if vocab is None:
            return None, None
        n_rows = self.model.get_output_embeddings().weight.shape[0]
        if not isinstance(vocab, torch.Tensor):
            raise ValueError(f"Distiller vocab: got a {type(vocab).__name__}; pass a 1-D integer torch tensor of token "
                             f"ids, e.g. torch.tensor(ids) or decoder.vocab.frequent_token_ids(tokenizer, 8192), or None")
        if (vocab.dim() != 1 or vocab.numel() == 0 or vocab.dtype.is_floating_point or vocab.dtype.is_complex
                or vocab.dtype == torch.bool or vocab.is_meta):
            raise ValueError(f"Distiller vocab: got a tensor of shape {tuple(vocab.shape)}, dtype {vocab.dtype}, device "
                             f"{vocab.device}; need a non-empty 1-D integer tensor of token ids with values, or None "
                             f"for the full vocabulary")
        ids = vocab.detach().to("cpu", torch.long, copy=True)  # a copy: the caller may reuse its tensor
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= n_rows:
            raise ValueError(f"Distiller vocab: token ids must be in 0..{n_rows - 1} (the draft's LM head rows); "
                             f"got ids from {lo} to {hi}")
        uniq, counts = torch.unique(ids, return_counts=True)
        if uniq.numel() != ids.numel():
            raise ValueError(f"Distiller vocab: {ids.numel() - uniq.numel()} duplicate token ids, e.g. "
                             f"{uniq[counts > 1][:5].tolist()}; pass each id once (e.g. torch.unique(vocab))")
        pos = torch.full((n_rows,), -1, dtype=torch.long)
        pos[ids] = torch.arange(ids.numel())
        return ids.to(self.device), pos.to(self.device)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate from the next step on, keeping AdamW's moments (for a schedule
        over several rounds, e.g. a bootstrap's cosine decay).

        Raises:
            ValueError: ``lr`` is not a finite number > 0.
        """
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
            raise ValueError(f"lr={lr!r}: need a real number (a {type(lr).__name__} is not one), e.g. 1e-3")
        lr = float(lr)
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr={lr!r}: need a finite learning rate > 0, e.g. 1e-3")
        self.config = dataclasses.replace(self.config, lr=lr)
        for group in self.optimizer.param_groups:
            group["lr"] = self._group_lr(group)

    @property
    def optimizer_steps(self) -> int:
        """Steps the current optimiser has taken (0 after a new one; restored with its state)."""
        st = self.optimizer.state.get(self._params[0], {}) if self._params else {}
        return int(st.get("step", 0))

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([{"params": self._params},
                                  {"params": [self.gate_w], "copy_gate": True, "lr": self.config.copy_gate_lr,
                                   "weight_decay": 0.0}],
                                 lr=self.config.lr, weight_decay=self.config.weight_decay)

    def _group_lr(self, group: dict) -> float:
        """The configured learning rate of an optimiser group: the gate's or the LoRA's."""
        return self.config.copy_gate_lr if group.get("copy_gate") else self.config.lr

    def _gate_init(self) -> torch.Tensor:
        w = torch.zeros(len(CC.FEATURES), device=self.device)
        w[0] = float(self.config.copy_gate_init)
        return w

    @property
    def gate_active(self) -> bool:
        """The copy channel mixes into q now: the config has it and the adapter carries a gate."""
        return bool(self.config.copy_gate and self._gate_on)

    @property
    def copy_gate(self) -> np.ndarray | None:
        """The current adapter's gate weights (6,) float64, or None when it carries no gate."""
        return self.gate_w.detach().cpu().double().numpy().copy() if self.gate_active else None

    # ---- adapter state ---------------------------------------------------------------------

    def adapter_state(self) -> AdapterState:
        """A detached copy of the adapter's trainable tensors (small: LoRA A and B), with the copy
        gate's weights (``GATE_W``, (6,)) and whether it carries one (``GATE_ON``, () 0/1)."""
        state = {n: p.detach().clone() for n, p in zip(self._names, self._params)}
        state[GATE_W] = self.gate_w.detach().clone()
        state[GATE_ON] = torch.tensor(1.0 if self._gate_on else 0.0)
        return state

    def load_adapter_state(self, state: AdapterState) -> None:
        """Copy a snapshot from ``adapter_state`` back into the adapter (a snapshot without the
        gate's entries: no gate)."""
        with torch.no_grad():
            for n, p in zip(self._names, self._params):
                p.copy_(state[n])
            if GATE_W in state:
                self.gate_w.copy_(state[GATE_W])
            else:
                self.gate_w.copy_(self._gate_init())
        self._gate_on = bool(state.get(GATE_ON, torch.tensor(0.0)).item())

    def reset_adapter(self) -> None:
        """Back to the freshly initialised adapter (a no-op on the draft) with a new optimiser."""
        self.start_from(BASE)

    def start_from(self, state: AdapterState | str) -> None:
        """Train on from ``state`` (an ``adapter_state`` snapshot, or ``BASE`` = the freshly
        initialised no-op adapter) with a new optimiser."""
        if isinstance(state, str):
            if state != BASE:
                raise ValueError(f"state={state!r}; pass trainer.distill.BASE or an AdapterState")
            state = self._initial
        self.load_adapter_state(state)
        self.optimizer = self._new_optimizer()

    def training_context(self) -> tuple[AdapterState, dict, int]:
        """The adapter weights, a copy of the optimiser state and the round counter (which
        seeds each round's sample order): what ``train_round`` continues from. Lets one
        Distiller train several adapters in turn (per-workload adapters), each as if alone."""
        return self.adapter_state(), copy.deepcopy(self.optimizer.state_dict()), self._rounds

    def load_training_context(self, context: tuple[AdapterState, dict, int]) -> None:
        """Restore a ``training_context`` snapshot."""
        state, opt, rounds = context
        self.load_adapter_state(state)
        self.optimizer = self._new_optimizer()
        self.optimizer.load_state_dict(copy.deepcopy(opt))
        self._rounds = rounds

    def _weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self._params) and bool(torch.isfinite(self.gate_w).all())

    @property
    def weights_finite(self) -> bool:
        """Every adapter tensor is finite (a round must not start from broken weights)."""
        return self._weights_finite()

    @property
    def vocab_size(self) -> int:
        """Token ids a record may carry: 0..vocab_size-1 (rows of both the input embeddings and the LM head)."""
        base = self.model.get_base_model()
        return min(base.get_input_embeddings().weight.shape[0], base.get_output_embeddings().weight.shape[0])

    def sample_problem(self, sample: VerifiedSample, width: int | None = None) -> str | None:
        """Why ``sample`` cannot be trained on or evaluated by this draft (None if it can): an empty
        prompt, a token id outside the vocabulary, or a top-k width other than ``width`` (the
        round's). The schema already refused non-finite values and mismatched shapes."""
        if sample.prompt_ids.shape[0] < 1:
            return f"record {sample.record_id} has an empty prompt; the draft needs at least one token of context"
        v = self.vocab_size
        for name in ("prompt_ids", "output_ids", "topk_ids"):
            x = getattr(sample, name)
            if x.size and int(x.max()) >= v:
                return (f"record {sample.record_id}: {name} holds token id {int(x.max())}, outside this draft's "
                        f"vocabulary of {v} (ids 0..{v - 1}); written by another model pair or corrupt")
        k = sample.topk_ids.shape[1]
        if width is not None and k != width and sample.num_tokens:
            return f"record {sample.record_id} has top-k width {k}, the round's records have {width}; the decoder's k must be fixed"
        return None

    @torch.no_grad()
    def probe(self, sample: VerifiedSample) -> str | None:
        """Run one sample through the training loss alone (no step): None if it works, else why
        not. Used to find the record that makes a round fail."""
        if sample.num_tokens == 0:
            return None
        try:
            loss = self._batch_loss(_build_batch([sample], self.config, self.device, self.config.weighting))
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            return f"record {sample.record_id} cannot be trained on: {type(e).__name__}: {e}"
        if not bool(torch.isfinite(loss)):
            return f"record {sample.record_id} gives a non-finite loss {loss.item()}"
        return None

    # ---- training --------------------------------------------------------------------------

    def _batch_loss(self, batch: _Batch) -> torch.Tensor:
        dtype = autocast_dtype(self.config.precision, self.device)
        with torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = self._row_logits(batch)  # (M, V) or (M, V')
        logq_b, present = self._bucket_logq(logits, batch)  # (M, k+1), one pass over the vocabulary
        gate = self._copy_mix(logits, batch)
        if gate is not None:  # q_mix: the candidate's bucket is reachable even outside S
            logq_b = gate(logq_b)
            if present is not None:
                present = present | gate.in_topk
        weights = batch.weights
        if present is None:
            p = batch.p
        else:
            p = L.teacher_on_vocab(batch.p, present)  # (M, k+1)
            weights = weights * (p.sum(-1) > 0.5)  # a row with all its mass outside S has no target on S
        t = self.config.teacher_temperature
        p = L.at_temperature(p, batch.temperature if t == "served" else float(t))
        per_pos = L.per_position_loss(self.config.loss, p, logq_b, self.config.jsd_beta)  # (M,)
        return L.weighted_mean(per_pos, weights)

    def _copy_mix(self, logits: torch.Tensor, batch: _Batch) -> "_CopyMix | None":
        """The copy channel at the batch's rows (None when the gate is not active): the
        candidates' buckets, the gate's λ from ``store.copy_channel.copy_features`` (the draft's
        temperature-1 q(c) and max q over its vocabulary, detached: the gate learns when to trust
        the candidate, the LoRA what to propose) and the mixture to apply to bucket log q."""
        if not self.gate_active or batch.copy_c is None:
            return None
        with torch.no_grad():
            x = logits.detach().float()
            log_z = torch.logsumexp(x, dim=-1)  # (M,)
            c = batch.copy_c
            has = c >= 0
            col = c.clamp_min(0)
            if self._vocab_pos is not None:
                col = self._vocab_pos[col]  # -1 outside S: q(c) = 0
                inside = col >= 0
                col = col.clamp_min(0)
            else:
                inside = torch.ones_like(has)
            q_c = torch.where(inside, (x.gather(-1, col.unsqueeze(-1)).squeeze(-1) - log_z).exp(), torch.zeros_like(log_z))
            q_max = (x.max(-1).values - log_z).exp()
            top = x.argmax(-1)
            if self._vocab is not None:
                top = self._vocab[top]
            feats = CC.copy_features(batch.copy_len.cpu().numpy(), q_c.cpu().numpy(), q_max.cpu().numpy())
            match = (batch.topk_ids == c.unsqueeze(-1)) & has.unsqueeze(-1)  # (M, k)
            in_topk = match.any(-1)
            k = batch.topk_ids.shape[1]
            c_bucket = torch.where(in_topk, match.float().argmax(-1), torch.full_like(c, k))
        f = torch.as_tensor(feats, dtype=self.gate_w.dtype, device=self.device)
        z = f @ self.gate_w  # (M,), differentiable in w
        return _CopyMix(c, has, c_bucket, z, match, q_c, q_max, top)

    def _bucket_logq(self, logits: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(M, k+1) log q over the teacher's buckets, and the (M, k) in-vocabulary mask (None
        without a restricted vocabulary)."""
        if self._vocab_pos is None:
            return L.student_bucket_logprobs(logits, batch.topk_ids), None
        cols = self._vocab_pos[batch.topk_ids]  # (M, k), -1 outside S
        present = cols >= 0
        return L.student_bucket_logprobs(logits, cols.clamp_min(0), present), present

    def _row_logits(self, batch: _Batch) -> torch.Tensor:
        """The draft's logits at the distilled positions only: (M, V), or (M, V') over the
        restricted vocabulary's ids in order.

        The LM head runs on the sequence indices some row distils (``logits_to_keep`` with
        their union), not on every position: a served record's prompt (e.g. 256 tokens before
        32 emitted ones) would otherwise cost the head, the largest matrix of a small draft,
        9x over. Without a restricted vocabulary the model's own head code runs, so soft-capping
        and scaling are kept; with one, the head's rows of S are applied as the decoder's
        FR-Spec path does (plus the bias and Gemma-2 style soft-capping where the model has them)."""
        if self._vocab is not None:
            base = self.model.get_base_model()
            hidden = base.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            h = hidden[batch.rows_b, batch.rows_t]  # (M, H)
            head = base.get_output_embeddings()
            if hasattr(head, "base_layer"):  # LoRA on the head itself: run it whole, keep S's columns
                logits = head(h)[:, self._vocab]
            else:
                bias = None if head.bias is None else head.bias[self._vocab]
                logits = F.linear(h, head.weight[self._vocab], bias)  # (M, V')
            cap = getattr(base.config, "final_logit_softcapping", None)
            return logits if not cap else torch.tanh(logits / cap) * cap
        keep, col = torch.unique(batch.rows_t, return_inverse=True)  # (U,), (M,)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep).logits
        return logits[batch.rows_b, col]  # (B, U, V) -> (M, V)

    def train_round(self, samples: Sequence[VerifiedSample]) -> RoundResult:
        """Train the adapter on ``samples`` within the config's step, time and epoch bounds (and
        until ``interrupt`` is set or ``should_stop()`` says so, both asked before each step).

        The adapter weights and optimiser state are snapshotted first; if a loss, gradient step or
        the resulting weights are non-finite, both are restored and the result has
        ``finite=False`` (the caller must not publish). Batches whose positions all have weight 0
        (e.g. "rejected" weighting with no rejections) are skipped without a step.
        """
        cfg = self.config
        t0 = self.clock()
        samples = [s for s in samples if s.num_tokens > 0]
        snapshot = self.adapter_state()
        opt_snapshot = copy.deepcopy(self.optimizer.state_dict())
        for group in self.optimizer.param_groups:  # config.lr rules (set_lr, or a replaced config)
            group["lr"] = self._group_lr(group)
        if cfg.copy_gate and not self._gate_on:  # an adapter without a gate (v0) grows one, from the init
            with torch.no_grad():
                self.gate_w.copy_(self._gate_init())
            self.optimizer.state.pop(self.gate_w, None)
            self._gate_on = True
        gen = torch.Generator().manual_seed(cfg.seed + self._rounds)
        self._rounds += 1
        steps, used, tokens = 0, set(), 0
        loss_first = loss_last = float("nan")

        def result(finite: bool, reason: str = "") -> RoundResult:
            return RoundResult(steps, len(used), tokens, loss_first, loss_last, self.clock() - t0, finite, reason)

        def rollback(reason: str) -> RoundResult:
            self.load_adapter_state(snapshot)
            self.optimizer.load_state_dict(opt_snapshot)
            self.model.eval()
            return result(False, reason)

        self.model.train()
        try:
            for _epoch in range(cfg.max_epochs):
                if _epoch > 0 and steps == 0:
                    break  # a whole pass had no weighted position: more passes would not either
                order = torch.randperm(len(samples), generator=gen).tolist()
                for i in range(0, len(order), cfg.batch_size):
                    if (steps >= cfg.max_steps or self.clock() - t0 >= cfg.max_seconds or self.interrupt.is_set()
                            or (self.should_stop is not None and self.should_stop())):
                        return result(True)
                    idx = order[i : i + cfg.batch_size]
                    batch = _build_batch([samples[j] for j in idx], cfg, self.device, cfg.weighting)
                    if float(batch.weights.sum()) <= 0:
                        continue
                    loss = self._batch_loss(batch)
                    if not torch.isfinite(loss):
                        return rollback(f"non-finite loss {loss.item()} at step {steps}")
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if cfg.grad_clip > 0:
                        torch.nn.utils.clip_grad_norm_(self._params, cfg.grad_clip)
                    if cfg.warmup_steps:
                        scale = min(1.0, (self.optimizer_steps + 1) / cfg.warmup_steps)
                        for group in self.optimizer.param_groups:
                            group["lr"] = self._group_lr(group) * scale
                    self.optimizer.step()
                    if not self._weights_finite():
                        return rollback(f"non-finite adapter weights after step {steps} (lr={cfg.lr})")
                    loss_last = loss.item()
                    if steps == 0:
                        loss_first = loss_last
                    steps += 1
                    for j in idx:
                        if j not in used:
                            used.add(j)
                            tokens += int((position_weights(samples[j], cfg.weighting, cfg.rejected_weight) > 0).sum())
            return result(True)
        except BaseException:
            rollback("error")  # a failed round leaves the weights and the optimiser as they were
            raise
        finally:
            self.model.eval()

    # ---- evaluation ------------------------------------------------------------------------

    @contextmanager
    def _weights(self, adapter: AdapterState | str | None) -> Iterator[None]:
        """Evaluate under: None = current adapter; BASE = adapter disabled; a state = that snapshot."""
        if adapter is None:
            yield
        elif isinstance(adapter, str):
            if adapter != BASE:
                raise ValueError(f"adapter={adapter!r}; pass None, trainer.distill.BASE or an AdapterState")
            on = self._gate_on
            self._gate_on = False  # the base draft carries no gate
            try:
                with self.model.disable_adapter():
                    yield
            finally:
                self._gate_on = on
        else:
            current = self.adapter_state()
            self.load_adapter_state(adapter)
            try:
                yield
            finally:
                self.load_adapter_state(current)

    @torch.no_grad()
    def evaluate(
        self, samples: Sequence[VerifiedSample], adapter: AdapterState | str | None = None, batch_size: int | None = None,
        gamma: int = DECODED_GAMMA,
    ) -> EvalResult:
        """Held-out alpha, greedy agreement and acceptance as served, overall and per workload,
        over all output positions.

        alpha per position = sum_b min(p_b, q_b) over the stored support (target's top-k ids and
        the tail bucket); greedy agreement = draft argmax over its full vocabulary equals the
        target's most probable id. Both are pooled over positions. With a restricted vocabulary
        S (the ``vocab`` argument) both are the served FR-Spec draft's: q = 0 outside S, so a
        top-k id outside S adds nothing to alpha, and the argmax runs over S. Acceptance as
        served (``EvalCounts.served``) is, per record, its greedy agreement when it was decoded
        greedily and alpha between p and q both at its temperature T (``losses.at_temperature``;
        the request's top-k / top-p cuts are not applied) when sampled: the acceptance rate the
        decoder sees on such requests (Leviathan et al. 2023, §3.1 with the processed p and q).
        With the copy channel (an adapter carrying a gate, ``DistillConfig.copy_gate``) q is the
        mixture q_mix = (1 - λ) q + λ 1[x = c] throughout (alpha, argmax, served), as the decoder
        proposes and verifies with it.

        Args:
            samples: samples never trained on.
            adapter: None (current weights), ``BASE`` (the draft without adapter), or an
                ``AdapterState`` snapshot (e.g. the promoted adapter's).
            gamma: γ of the decoding simulated on each record's per-position acceptance as served
                (``EvalCounts.decoded``, ``trainer.gate.decoded_acceptance``), >= 1.
        """
        res = EvalResult()
        samples = [s for s in samples if s.num_tokens > 0]
        bs = batch_size or max(self.config.batch_size, 8)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._weights(adapter):
                for i in range(0, len(samples), bs):
                    chunk = samples[i : i + bs]
                    batch = _build_batch(chunk, self.config, self.device)
                    logits = self._row_logits(batch)  # (M, V) or (M, V'): buckets and argmax need no log_softmax
                    gate = self._copy_mix(logits, batch)  # q_mix with the copy channel, as the decoder proposes
                    logq = self._bucket_logq(logits, batch)[0]
                    a = L.alpha(batch.p, gate(logq) if gate is not None else logq).cpu().numpy()  # (M,)
                    top1 = batch.topk_ids.gather(-1, batch.p[:, :-1].argmax(-1, keepdim=True)).squeeze(-1)  # (M,)
                    if gate is not None:
                        pred = gate.argmax()
                    else:
                        pred = logits.argmax(-1)  # (M,)
                        if self._vocab is not None:
                            pred = self._vocab[pred]
                    match = (pred == top1).cpu().numpy()  # (M,)
                    at_t = {}  # temperature -> (M,) alpha at that temperature, for sampled records
                    for b, s in enumerate(chunk):
                        rows = batch.row_sample == b
                        t = float(s.sampling.temperature)
                        if t == 0.0:
                            per_pos = match[rows].astype(np.float64)
                        else:
                            if t not in at_t:
                                lq = self._bucket_logq(logits.float() / t, batch)[0]
                                at_t[t] = a if t == 1.0 else L.alpha(
                                    L.at_temperature(batch.p, t), gate(lq) if gate is not None else lq).cpu().numpy()
                            per_pos = at_t[t][rows]
                        dec = decoded_acceptance(per_pos, gamma)
                        c = EvalCounts(1, int(rows.sum()), float(a[rows].sum()), int(match[rows].sum()), float(per_pos.sum()),
                                       *dec)
                        res.add_sample(s.record_id, s.workload, c)
        finally:
            self.model.train(was_training)
        return res

    # ---- persistence -----------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write the adapter in peft's layout (adapter_config.json + adapter_model.safetensors),
        plus ``VOCAB_FILE`` with the restricted draft vocabulary's ids when it was trained on one,
        and ``store.copy_channel.GATE_FILE`` with the copy gate's weights when it carries one.

        ``directory`` must not exist or be empty; the files land directly in it (peft would nest
        a non-default adapter name in a sub-folder; we flatten it so any loader reads the dir).
        """
        if not self._weights_finite():
            raise TrainerError("refusing to save an adapter with non-finite weights")
        out = Path(directory)
        if out.exists() and any(out.iterdir()):
            raise TrainerError(f"adapter directory {out} is not empty; pass a fresh directory")
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            self.model.save_pretrained(tmp, selected_adapters=[ADAPTER_NAME])
            src = Path(tmp) / ADAPTER_NAME
            if not src.is_dir():
                src = Path(tmp)
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.move(str(src / name), str(out / name))
        if self.gate_active:
            CC.save_gate(out, self.copy_gate)
        if self._vocab is not None:
            ids = self._vocab.cpu()
            (out / VOCAB_FILE).write_text(json.dumps({"size": ids.numel(), "sha256": _ids_sha256(ids), "ids": ids.tolist()}))
        return out

    def load_adapter_weights(self, directory: str | Path) -> None:
        """Start from a saved adapter (e.g. the registry's promoted version).

        The adapter's copy gate (``store.copy_channel.GATE_FILE``) comes with it; one without has
        none (λ = 0) until a round trains one. The adapter's rank and target modules must match
        this Distiller's config, and so must its restricted draft vocabulary (``VOCAB_FILE``): an adapter trained on S fits S's head only,
        so it is refused by a full-vocabulary Distiller or one on other ids (a full-vocabulary
        adapter may start a restricted one). The optimiser state is reset: its moments belonged to
        other weights.

        Raises:
            AdapterMismatch: missing files, another rank, unknown or missing LoRA tensors,
                non-finite weights, another draft vocabulary, or an unreadable copy gate file.
        """
        d = Path(directory)
        cfg_path, w_path = d / "adapter_config.json", d / "adapter_model.safetensors"
        if not cfg_path.is_file() or not w_path.is_file():
            raise AdapterMismatch(f"{d} has no adapter_config.json + adapter_model.safetensors (peft layout)")
        saved = json.loads(cfg_path.read_text())
        if saved.get("r") != self.config.lora_r:
            raise AdapterMismatch(f"adapter in {d} has rank r={saved.get('r')}, this trainer uses lora_r={self.config.lora_r}")
        if (d / VOCAB_FILE).is_file():
            try:
                vocab = json.loads((d / VOCAB_FILE).read_text())
                theirs = (int(vocab["size"]), str(vocab["sha256"]))
            except (ValueError, KeyError, TypeError) as e:
                raise AdapterMismatch(f"adapter in {d} has an unreadable {VOCAB_FILE}: {e}") from e
            mine = None if self._vocab is None else (self._vocab.numel(), _ids_sha256(self._vocab.cpu()))
            if mine != theirs:
                have = "the full vocabulary" if mine is None else f"{mine[0]} other ids"
                raise AdapterMismatch(
                    f"adapter in {d} was trained on a draft vocabulary of {theirs[0]} ids (FR-Spec), this trainer uses "
                    f"{have}; set the same restricted vocabulary (models.draft_vocab / Distiller(vocab=...)) or "
                    f"start from the base draft")
        try:
            tensors = load_file(str(w_path))
        except Exception as e:  # noqa: BLE001 - truncated or not safetensors
            raise AdapterMismatch(f"adapter in {d}: {w_path.name} is not a loadable safetensors file ({e})") from e
        bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if bad:  # checked before anything is loaded, so the current weights stay as they are
            raise AdapterMismatch(f"adapter in {d} has non-finite weights (NaN or inf) in {len(bad)} tensors, e.g. {bad[:3]}")
        try:
            gate = CC.load_gate(d)
        except CC.CopyGateError as e:
            raise AdapterMismatch(f"adapter in {d}: {e}") from e
        before = self.adapter_state()
        try:
            with torch.no_grad():  # its gate, or none (λ = 0 until a round trains one)
                self.gate_w.copy_(torch.as_tensor(gate, dtype=self.gate_w.dtype) if gate is not None else self._gate_init())
            self._gate_on = gate is not None
            result = set_peft_model_state_dict(self.model, tensors, adapter_name=ADAPTER_NAME)
            unexpected = list(getattr(result, "unexpected_keys", []) or [])
            if unexpected:
                raise AdapterMismatch(f"adapter in {d} has tensors this draft lacks, e.g. {unexpected[:3]}")
            missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k]
            if missing:
                raise AdapterMismatch(f"adapter in {d} lacks LoRA tensors of this config, e.g. {missing[:3]}")
            if not self._weights_finite():
                raise AdapterMismatch(f"adapter in {d} has non-finite weights")
        except BaseException:
            self.load_adapter_state(before)  # a refused adapter leaves no trace in the weights
            raise
        self.optimizer = self._new_optimizer()
