"""Lossless speculative decoding with Hugging Face causal LMs, every request measured.

One step (gpt-fast's shape, the papers' notation; see :mod:`decoder.sampling`):

1. the draft proposes γ tokens autoregressively, x_i ~ q_i (greedy: argmax);
2. the target scores the pending token plus the γ proposals in one forward, giving p_1..p_{γ+1};
3. :func:`decoder.sampling.verify` keeps the accepted prefix and emits a recovered or bonus token;
4. both KV caches are cropped back to the tokens that survived (never rebuilt).

Cache invariant at the start of a step: the target's cache holds every token but the last one
(the *pending* token); the draft's cache holds a prefix of that and catches up lazily, so a step
with γ = 0 (plain decoding) never runs the draft. Plain decoding is this same loop with γ = 0,
so "ours vs plain" compares like with like.
"""

from __future__ import annotations

import resource
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from decoder.engines.base import Engine, last_fused_rows, last_fused_size, note_emitted, sequence_scope, supports
from decoder.engines.torch_engine import TorchEngine
from decoder.fastpath import SMALL_M, calibrate_small_m, padded_row, small_m_linear
from decoder.draft_weights import DTYPES, PRECISIONS, ServingDraft, calibrate_draft_precision
from decoder.metrics import AcceptanceCounts, StepStats
from store.jsonsafe import nan_none
from decoder.proposers.base import Proposer, crop_to
from decoder.proposers.cost import StepCost
from decoder.proposers.ngram import NgramGate, NgramHistory, NgramShadow
from decoder.proposers.registry import DEFAULT_PROPOSER, REQUEST_PROPOSERS, spec as proposer_spec, versioned_by
from decoder.sampling import (MAX_LOGPROBS, SamplingParams, TokenLogprob, alpha, argmax, process_logits, seeded_generator, seeded_sampling, token_logprobs,
                              topk_rows, verify, verify_greedy)

HEAD = versioned_by("head")  # the proposer whose versions are heads: a result names the head that served
log = structlog.get_logger("decoder.speculative")


class GammaPolicy(Protocol):
    """Chooses γ for the next step and learns from each verification."""

    def gamma(self) -> int: ...

    def update(self, step: StepStats) -> None:
        """Called after every verification step with its counts and timings."""
        ...


@dataclass
class FixedGamma:
    """Constant γ (vLLM's ``num_speculative_tokens``); γ = 0 is plain decoding."""

    value: int

    def gamma(self) -> int:
        return self.value

    def update(self, step: StepStats) -> None:
        pass

    def describe(self) -> str:
        return f"fixed γ={self.value}"


@dataclass
class HeuristicGamma:
    """transformers' "heuristic" schedule (candidate_generator.py ``update_candidate_strategy``):
    γ += 2 after a step whose proposals were all accepted, else γ = max(1, γ - 1)."""

    value: int = 5
    max_value: int = 64

    def gamma(self) -> int:
        return self.value

    def update(self, step: StepStats) -> None:
        if step.proposed == 0:
            return
        if step.accepted == step.proposed:
            self.value = min(self.max_value, self.value + 2)
        else:
            self.value = max(1, self.value - 1)

    def describe(self) -> str:
        return f"heuristic γ (now {self.value})"


@dataclass
class DecodeRequest:
    """One generation request (batch size 1 per request; the decoder may batch requests later).

    prompt_ids: (P,) token ids, P >= 1.
    gamma: fixed γ for this request; None uses the decoder's policy (or its factory).
    stop: strings that end generation; the output is cut right after the token completing one.
    proposer: ``"draft"`` or ``"ngram"`` (:mod:`decoder.proposers`) for this request; None takes
        the policy's choice (``GoodputController``), else ``"draft"``.
    ngram_history: the n-gram proposer also looks up the workload's past requests (default);
        False: the request's own tokens only, so its proposals, and the random draws a seed feeds,
        do not change with what was served before (the serving loop sets it for seeded requests).
    sampling_bucket: the key its acceptance is kept under; None = ``params.bucket()`` (a server
        folds the buckets past its bound into one, ``daemon.serve``).
    logprobs: None (default) computes none; n in 0..20 gives every emitted token its
        log-probability under the served distribution and the n most probable alternatives
        (:func:`decoder.sampling.token_logprobs`), in ``DecodeResult.logprobs``.
    cache_prompt: False: prefill the whole prompt, keeping no prompt-cache cells
        (``DecoderConfig.prompt_cache``; llama-server's request field of that name).
    constraint: constrained output (:class:`decoder.constrain.JsonObjectConstraint`, or a
        grammar's :class:`decoder.grammar.GrammarConstraint`): the
        target's logits are masked at every verified row, so the output follows it and stays
        lossless against the constrained distribution; None = unconstrained.
    """

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    gamma: int | None = None
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    workload: str = "default"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    proposer: str | None = None
    ngram_history: bool = True
    sampling_bucket: str | None = None
    logprobs: int | None = None
    constraint: Any = None
    cache_prompt: bool = True

    def __post_init__(self):
        if len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.gamma is not None and self.gamma < 0:
            raise ValueError(f"gamma={self.gamma}: must be >= 0 (0 = plain decoding)")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r}: use None or 0..{MAX_LOGPROBS} alternatives per position")
        if self.proposer is not None and self.proposer not in REQUEST_PROPOSERS:
            raise ValueError(f"proposer={self.proposer!r}: use one of {REQUEST_PROPOSERS} (or None: the policy's choice)")


@dataclass
class DecodeResult:
    """Output and measurement record of one request.

    output_ids: (N,) emitted token ids, N <= max_new_tokens.
    steps: per verification step: proposed γ, accepted prefix, emitted, first rejection, α sum,
        draft ms, verify ms.
    counts: the same pooled (see :class:`decoder.metrics.AcceptanceCounts` for rate definitions).
    latency_ms: wall time from the request's start to its last token (prefill included).
    peak_memory_bytes: process peak RSS (CPU; ``ru_maxrss``) or peak CUDA allocation for the
        request (GPU).
    matches_plain / first_diff_index: filled by :meth:`SpeculativeDecoder.check_against_plain`
        (greedy only): token-identical to plain greedy decoding of the target, and the first
        index where they differ (None when identical).
    """

    request_id: str
    workload: str
    prompt_len: int
    output_ids: list[int]
    text: str
    finish_reason: str
    steps: list[StepStats]
    counts: AcceptanceCounts
    latency_ms: float
    peak_memory_bytes: int
    adapter_version: int
    sampling_bucket: str
    policy: str
    proposer: str = DEFAULT_PROPOSER
    engine: str = "torch"
    head_version: int = 0  # the feature-level head that served (decoder.heads; 0 = none or one given at build)
    matches_plain: bool | None = None
    first_diff_index: int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per output id when the request asked (DecodeRequest.logprobs)
    cached_prompt_tokens: int = 0  # prompt tokens whose target cells the prompt cache kept (not prefilled again)

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / (self.latency_ms / 1000.0) if self.latency_ms else float("nan")

    @property
    def rejection_positions(self) -> list[int]:
        return [s.rejected_at for s in self.steps]

    @property
    def accepted_prefix_lengths(self) -> list[int]:
        return [s.accepted for s in self.steps]

    def record(self) -> dict[str, Any]:
        """The request's measurement record, JSON-ready."""
        c = self.counts
        return {
            "request_id": self.request_id,
            "workload": self.workload,
            "sampling": self.sampling_bucket,
            "policy": self.policy,
            "proposer": self.proposer,
            "engine": self.engine,
            "adapter_version": self.adapter_version,
            "head_version": self.head_version,
            "prompt_tokens": self.prompt_len,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "output_tokens": len(self.output_ids),
            "finish_reason": self.finish_reason,
            "proposed_tokens": c.num_draft_tokens,
            "accepted_tokens": c.num_accepted_tokens,
            "accepted_prefix_lengths": self.accepted_prefix_lengths,
            "proposal_lengths": [s.proposed for s in self.steps],
            "rejection_positions": self.rejection_positions,
            "draft_ms": round(c.draft_ms, 3),
            "verify_ms": round(c.verify_ms, 3),
            "prefill_ms": round(c.prefill_ms, 3),
            "latency_ms": round(self.latency_ms, 3),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "peak_memory_bytes": self.peak_memory_bytes,
            "acceptance_rate": nan_none(c.acceptance_rate, 4),
            "mean_accepted_length": nan_none(c.mean_accepted_length, 4),
            "alpha": nan_none(c.alpha, 4),
            "goodput_tokens_per_ms": nan_none(c.goodput, 4),
            "matches_plain": self.matches_plain,
            "first_diff_index": self.first_diff_index,
        }


@dataclass
class DecoderConfig:
    """Decoder options.

    topk_record: k of the target distribution streamed per emitted position (0 = none).
    record_prompt: also stream the target's top-k over the prompt, from the prefill it runs
        anyway (one extra LM-head row per prompt token: (P - 1) x V logits, then top-k), as a
        second record with ``source="prefill"`` and the same request id. Served prompts are
        in-distribution text of the workload; this multiplies the trainer's data per request
        by ~(P + N) / N at a few per cent of the request's time (measured in the bench's
        prefill ms).
    prompt_cache: keep the target's cells of the longest prefix a request shares with what the
        engine last held there (the chat template's system prompt, a conversation's earlier turns,
        the same prompt again) and prefill only the rest, on an engine that declares
        ``Capabilities.prompt_cache`` (llama.cpp: :meth:`LlamaCppEngine.start`; exact there). Off
        for a request whose prompt rows are recorded or fed to a feature-level proposer (they need
        every row's output). ``DecodeResult.cached_prompt_tokens`` says how many were kept.
    draft_vocab: optional (V',) integer token ids (a torch tensor, 1 <= V', each in
        0..min(V_p, V_q) - 1; else ValueError: shape, type and sign when the config is built, the
        range when the decoder is) to which the draft's LM head is restricted
        (FR-Spec, Zhao et al. 2025): the draft scores only frequent tokens, q = 0 elsewhere;
        lossless because the target still scores the full vocabulary.
    small_m_linear: on CPU, switch the target's and the draft's ``nn.Linear`` modules to
        ``decoder.fastpath.SmallMLinear`` (in place; same weights) so that a verification step
        over γ + 1 <= 16 rows costs about one plain step instead of 1.5-1.7 on CPUs where
        ``W @ x^T`` beats ``F.linear`` for a few rows (see that module). "auto" (default) times
        both on the target's weights at construction (``calibrate_small_m``, ~0.5 s; the result
        is in ``SpeculativeDecoder.small_m_calibration``) and switches only where it wins; True
        always switches, False never does. The LM head is switched too. The switch is one-way:
        False, or "auto" deciding against it, leaves the models as they are, and a model an
        earlier decoder switched stays switched (``decoder.fastpath.plain_linear`` undoes it).
    record_hidden: also stream the target's final hidden state (H float16 per emitted position:
        ``store.schema.VerifiedSample.hidden``) in every record, the feature a feature-level head
        (``decoder.eagle``) is distilled from without the target (``trainer.head``). The
        verification returns them with its logits (on llama.cpp the engine must be built with
        ``embeddings=True``, else ValueError at construction); each record grows by H x 2 bytes
        a row (1152 for SmolLM2-135M, beside 196 for its top-32; ``bench/store_bench.py``).
        Needs ``topk_record`` > 0 (the head learns the distributions beside the features).
    ngram_max_n / ngram_min_n: longest and shortest context suffix the n-gram proposer matches.
        ``ngram_min_n=None`` (default) takes it from the engine's verification cost: 1 on torch
        (a verification of a few rows costs about one plain step there, so every match is worth
        proposing), 2 on llama.cpp, whose CPU kernels make each extra verified row cost about
        0.4-0.8 of a plain step, so only the likelier proposals pay (measured in bench/RESULTS.md,
        ``bench/verify_cost_bench.py``).
    ngram_history_tokens: tokens of past requests the n-gram proposer indexes per workload.
    ngram_gate: the n-gram proposer proposes, at each step, only as many matched tokens as are
        expected to pay (:class:`decoder.proposers.ngram.NgramGate`: acceptance estimates per kind of
        match, learnt from every verification, against the engine's measured step cost per
        verified row count, ``SpeculativeDecoder.step_cost``), so γ is the most it proposes and
        a match unlikely to pay costs a plain step, not a verification (default). False proposes
        every matched token up to γ. A seeded sampled request never uses it (its γ would depend
        on timings, so the seed would not reproduce the completion).
    draft_precision: the dtype proposals are computed in. A separate, unquantised draft
        proposes through ``decoder.draft_weights.ServingDraft``, built at construction from the draft
        as it is then (its active LoRA adapter merged; an ``AdapterManager`` adds each adapter
        version to it): "fp32" shares the draft's tensors, "bf16" is a bf16 copy. Lossless
        either way: acceptance uses the q the proposal was drawn from, so only α can move.
        "auto" (default) times one draft step's GEMVs in both (``decoder.draft_weights.calibrate_draft_precision``, ~0.2 s on CPU; the result is in
        ``SpeculativeDecoder.draft_precision_calibration``) and takes bf16 where it is faster
        by 10 %; "auto" stays fp32 off the CPU, for a draft that is the target itself (which
        then proposes as it is, every proposal accepted; "bf16" proposes with a bf16 copy of
        it), and for an int8-quantised draft ("bf16" is refused there).
    first_token_from_prefill: take a request's first token from the prefill's last row, as
        llama-server, llama-cpp-python and transformers' ``generate`` do: the prefill feeds the
        whole prompt and samples from its last row's logits (1, V), so a request runs one target
        forward fewer, and the first verification (with proposals) comes at the second token
        (default). False: the prefill stops before the prompt's last token, which the first
        step feeds with its proposals (one more forward a request; the tests of the acceptance
        rule use it to speculate at a position whose p they compute from the prompt alone).
        Where the prompt's rows are recorded (``record_prompt``), hidden states are recorded
        (``record_hidden``) or fed to a feature-level proposer, the prefill still stops before the
        last token (those paths want that row's hidden state or every prompt row, which the
        prefill's one-row logits do not carry); so it does with the prompt cache on an engine
        whose cells depend on the call that computed them (llama.cpp with an f16 V cache:
        ``LlamaCppEngine.shape_invariant_cells`` False), whose cache keeps only cells a prefill
        of the prompt but its last token computes alike.
    target_format: the weight format the target engine serves (``"packaged"``, ``"F16"``, ...:
        ``decoder.engines.registry.EngineChoice.served_format``), put in every record
        (``VerifiedSample.target_format``); None = not stated.
    """

    topk_record: int = 32
    record_prompt: bool = False
    record_hidden: bool = False
    prompt_cache: bool = True
    draft_vocab: torch.Tensor | None = None
    small_m_linear: bool | str = "auto"
    draft_precision: str = "auto"
    target_format: str | None = None
    ngram_max_n: int = 4
    ngram_min_n: int | None = None
    ngram_history_tokens: int = 65536
    ngram_gate: bool = True
    first_token_from_prefill: bool = True

    def __post_init__(self):
        dv = self.draft_vocab
        if dv is not None:
            # shape and type here; the range (which needs the models' vocabularies) at decoder construction
            if not isinstance(dv, torch.Tensor) or dv.dim() != 1 or dv.numel() == 0 or dv.dtype == torch.bool \
                    or dv.dtype.is_floating_point or dv.dtype.is_complex or int(dv.min()) < 0:
                got = (f"dtype {dv.dtype}, shape {tuple(dv.shape)}" if isinstance(dv, torch.Tensor)
                       else f"a {type(dv).__name__}")
                raise ValueError(f"DecoderConfig.draft_vocab: need a non-empty 1-D torch tensor of integer token "
                                 f"ids >= 0 (got {got}); build one with decoder.vocab.frequent_token_ids, or "
                                 f"torch.tensor(ids) from a list")
            if torch.unique(dv).numel() != dv.numel():
                raise ValueError(f"DecoderConfig.draft_vocab: {dv.numel() - torch.unique(dv).numel()} duplicate token "
                                 f"ids; each id must appear once (build one with decoder.vocab.frequent_token_ids)")
        if self.small_m_linear not in (True, False, "auto"):
            raise ValueError(f"DecoderConfig.small_m_linear={self.small_m_linear!r}: use True, False or 'auto'")
        if self.ngram_min_n is not None and not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(f"DecoderConfig: need 1 <= ngram_min_n <= ngram_max_n (got {self.ngram_min_n}, "
                             f"{self.ngram_max_n})")
        if self.draft_precision not in PRECISIONS:
            raise ValueError(f"DecoderConfig.draft_precision={self.draft_precision!r}: use one of {PRECISIONS}")
        if not isinstance(self.ngram_gate, bool):
            raise ValueError(f"DecoderConfig.ngram_gate={self.ngram_gate!r}: use True (default) or False")
        if not isinstance(self.first_token_from_prefill, bool):
            raise ValueError(f"DecoderConfig.first_token_from_prefill={self.first_token_from_prefill!r}: "
                             f"use True (default) or False")
        if not isinstance(self.record_hidden, bool):
            raise ValueError(f"DecoderConfig.record_hidden={self.record_hidden!r}: use True or False (default)")
        if self.record_hidden and self.topk_record <= 0:
            raise ValueError(f"DecoderConfig.record_hidden=True needs topk_record > 0 (got {self.topk_record}): "
                             f"a head distils the target's distributions beside its hidden states")


class SpeculativeDecoder:
    """Speculative decoding of a target with a draft sharing its tokenizer.

    Args:
        target, draft: causal LMs (``draft`` may be ``target`` itself: every proposal accepted).
        tokenizer: the pair's tokenizer (for stop strings and the output text).
        config: :class:`DecoderConfig`.
        sink: called with a :class:`store.schema.VerifiedSample` per finished request (e.g.
            ``SampleWriter.submit``, which never blocks); None disables streaming.
        pair_fingerprint: :class:`store.schema.PairFingerprint` put in each record.
        clock: monotonic clock in seconds (injected for tests).
        engine: the target's :class:`decoder.engines.base.Engine` (default: a
            :class:`decoder.engines.torch_engine.TorchEngine` over ``target``); e.g. a
            :class:`decoder.engines.llamacpp.LlamaCppEngine` on the target's GGUF. ``target`` stays the
            torch module of the same weights (its config and tokenizer; the trainer's teacher).
        draft_engine: the draft on an engine of its own (the derived draft's GGUF on llama.cpp);
            None: the draft proposes in torch (``draft``, through its serving copy).
    """

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module,
        tokenizer,
        config: DecoderConfig | None = None,
        sink: Callable[[Any], Any] | None = None,
        pair_fingerprint=None,
        clock: Callable[[], float] = time.perf_counter,
        engine: Engine | None = None,
        draft_engine: Engine | None = None,
    ):
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.config = config or DecoderConfig()
        self.sink = sink
        self.pair_fingerprint = pair_fingerprint
        self.clock = clock
        self.adapter_version = 0  # the draft adapter in use (0 = the base draft); set by the adapter manager
        # the copy gate of that adapter (store.copy_channel: (6,) weights, mixed into the draft
        # proposer's q; decoder.proposers.draft), None = none (λ = 0); set with adapter_version
        self.copy_gate = None
        # Requests run one at a time per decoder; between two requests (a step boundary) the
        # hooks run under the same lock, so an adapter swap never lands inside a request. A hook
        # is called as hook(decoder, request): the request about to run, or None when idle.
        self._lock = threading.Lock()
        self.between_requests: list[Callable[["SpeculativeDecoder", DecodeRequest | None], None]] = []
        self.device = next(target.parameters()).device
        self.eos_ids = _eos_ids(target, tokenizer)
        self._attach_engines(engine, draft_engine)
        torch_target = self.engine.capabilities.torch_module
        self._pad_one_row = self._choose_kernels(torch_target)  # also for the FR-Spec head
        # the prompt's LM head in chunks (record_prompt); other engines return prompt logits in chunks
        self._target_head = small_m_head(target) if torch_target else None
        self._build_proposal_model()
        self._draft_head_w = None
        if self.config.draft_vocab is not None:
            self._restrict_draft_head(self.config.draft_vocab)
        self._draft_vocab_off = self._draft_engine_vocab(draft_engine)
        self.ngram_min_n = self.config.ngram_min_n or (1 if torch_target else min(2, self.config.ngram_max_n))
        self._per_thread = threading.local()  # the running request's state (several run at once when batched)
        # every finished request's tokens, per workload, for the n-gram proposer (fed whatever served it)
        self.ngram_history = NgramHistory(self.config.ngram_max_n, self.ngram_min_n,
                                          self.config.ngram_history_tokens)
        # what a step costs by verified rows (steps that ran no draft model), and the n-gram
        # proposer's per-step length estimates (DecoderConfig.ngram_gate)
        self.step_cost = StepCost()
        # the feature-level proposer's head (decoder.eagle.EagleHead; proposer "eagle"), if any, and
        # its registry version (decoder.heads.HeadManager swaps both between requests; 0 = given at build)
        self.eagle_head = None
        self.head_version = 0
        self.ngram_gate: NgramGate | None = NgramGate() if self.config.ngram_gate else None

    # ---- construction phases --------------------------------------------------------------------
    def _attach_engines(self, engine: Engine | None, draft_engine: Engine | None) -> None:
        """The target's engine (default: torch over ``target``) and the draft's, checked against
        each other and the config: the draft's own sequence, hidden states when records carry them,
        one vocabulary for the engine and the torch target."""
        target = self.target
        self.engine = engine if engine is not None else TorchEngine(target, self.eos_ids)
        if draft_engine is not None and draft_engine is self.engine:
            raise ValueError("draft_engine is the target's engine: an engine holds one sequence, so the draft's "
                             "would overwrite the target's cache; give the draft its own (choose_engine(..., "
                             "draft='self') does)")
        self.draft_engine = draft_engine
        self.vocab_p = self.engine.vocab_size
        self.vocab_q = (draft_engine.vocab_size if draft_engine is not None
                        else self.draft.get_output_embeddings().weight.shape[0])
        if self.config.record_hidden and not self.engine.capabilities.hidden_states:
            raise ValueError(f"DecoderConfig.record_hidden needs the target's hidden states, and engine "
                             f"{self.engine.name} was built without them: LlamaCppEngine(embeddings=True) "
                             f"(choose_engine(..., embeddings=True))")
        if not self.engine.capabilities.torch_module and \
                self.engine.vocab_size != target.get_output_embeddings().weight.shape[0]:
            raise ValueError(f"engine {self.engine.name} has a vocabulary of {self.engine.vocab_size} ids, the torch "
                             f"target {target.get_output_embeddings().weight.shape[0]}: they must be the same model")

    def _draft_engine_vocab(self, draft_engine: Engine | None) -> torch.Tensor | None:
        """FR-Spec on a GGUF draft: a restricted draft GGUF (gguf_export.restricted_draft_gguf, what
        choose_engine(..., draft_vocab=...) builds) computes only the V' rows; a full one computes the
        full head, and the rows outside the restricted vocabulary are masked to -inf. Either way q is
        the restricted head's softmax, the q the trainer fits and judges (decoder.vocab; an adapter
        trained on it proposes what was judged). Returns the mask, (V_p,) True outside the restricted
        vocabulary, or None where none is needed."""
        restricted = getattr(draft_engine, "out_ids", None)  # a restricted-vocabulary draft GGUF (V' head rows)
        if restricted is not None:
            # its logits are already -inf outside its rows: the same q as the mask, at a V'-row
            # head's cost; the restricted set must be the one the trainer fits (DecoderConfig.draft_vocab)
            dv = self.config.draft_vocab
            if dv is None or dv.numel() != restricted.numel() or not torch.equal(
                    torch.sort(dv.cpu().long()).values, torch.sort(restricted).values):
                raise ValueError(f"draft_engine {draft_engine.path.name} has a restricted vocabulary of "
                                 f"{restricted.numel()} ids; set DecoderConfig.draft_vocab to the same ids "
                                 f"(got {None if dv is None else dv.numel()} ids) so the draft is trained on the "
                                 f"q it serves")
            return None
        if draft_engine is not None and self.config.draft_vocab is not None:
            off = torch.ones(self.vocab_p, dtype=torch.bool)
            off[self._draft_vocab_ids.cpu()] = False
            return off
        return None

    def _choose_kernels(self, torch_target: bool = True) -> bool:
        """DecoderConfig.small_m_linear: time (under "auto") and switch both models' linear layers
        to the small-M kernel where it wins; returns whether one row is padded to two. A target on
        another engine is left alone (the draft is timed and switched instead)."""
        target, draft = (self.target, self.draft) if torch_target else (self.draft, self.draft)
        self.small_m_calibration: dict | None = None  # calibrate_small_m's result under "auto"
        use_small_m, pad_one_row = self.config.small_m_linear is True, False
        if self.config.small_m_linear == "auto" and self.device.type == "cpu":
            self.small_m_calibration = calibrate_small_m(target)
            use_small_m = self.small_m_calibration["use"]
            pad_one_row = self.small_m_calibration["pad_one_row"]
            log.debug("small_m_linear_calibrated", **self.small_m_calibration)
        if (use_small_m or pad_one_row) and self.device.type == "cpu":
            rows = SMALL_M if use_small_m else 1
            small_m_linear(target, max_rows=rows, pad_one_row=pad_one_row)
            if draft is not target:
                small_m_linear(draft, max_rows=rows, pad_one_row=pad_one_row)
        return pad_one_row and self.device.type == "cpu"

    def _build_proposal_model(self) -> None:
        """The proposals' model: the draft's serving copy (DecoderConfig.draft_precision, timed
        under "auto"), or the draft itself (self-drafting in fp32, an int8 draft)."""
        target, draft, pad_one_row = self.target, self.draft, self._pad_one_row
        self.draft_precision_calibration: dict | None = None
        self.serving: ServingDraft | None = None
        quantized = _is_quantized(draft)
        want = self.config.draft_precision
        if want == "auto":
            want = "fp32"
            if self.device.type == "cpu" and draft is not target and not quantized:
                self.draft_precision_calibration = calibrate_draft_precision(draft, pad_one_row=pad_one_row)
                log.debug("draft_precision_calibrated", **self.draft_precision_calibration)
                if self.draft_precision_calibration["use_bf16"]:
                    want = "bf16"
        if want == "bf16" and quantized:
            raise ValueError("DecoderConfig.draft_precision='bf16' with an int8-quantised draft: use one or the other")
        if want == "bf16" or (draft is not target and not quantized):
            # fp32: a merged view sharing the draft's tensors (an adapter costs no peft forward);
            # bf16: a bf16 copy (of the target itself when it drafts for itself)
            self.serving = ServingDraft(draft, DTYPES[want])
        self.draft_precision = want

    def _restrict_draft_head(self, dv: torch.Tensor) -> None:
        """FR-Spec: the draft's LM head rows for the token ids ``dv`` (V',), checked against both
        vocabularies (shape, type, sign and duplicates were checked by DecoderConfig)."""
        hi = min(self.vocab_p, self.vocab_q)
        if int(dv.max()) >= hi:  # shape, type and sign were checked by DecoderConfig
            raise ValueError(
                f"DecoderConfig.draft_vocab: token ids must be in 0..{hi - 1} (min(V_p, V_q)); got ids "
                f"{int(dv.min())}..{int(dv.max())}; build one with decoder.vocab.frequent_token_ids")
        ids = dv.to(self.device).long()
        self._draft_vocab_ids = ids
        self._draft_head_w = self.proposer.get_output_embeddings().weight.detach()[ids].clone()  # (V', H)

    def make_proposer(self, name: str, req: DecodeRequest) -> Proposer:
        """The proposer ``name`` (``"draft"``, ``"ngram"`` or ``"eagle"``) for one request.

        Raises:
            ValueError: an unknown name, or ``"eagle"`` without ``eagle_head``.
        """
        return proposer_spec(name).build(self, req)

    def check_eagle_head(self, need_head: bool = True, head=None) -> None:
        """Raises ValueError unless ``eagle_head`` (or ``head``, a candidate, checked without
        touching the decoder) is set and this target can feed it: an engine that returns hidden
        states, of the head's width, over the head's vocabulary. With ``need_head=False`` and no
        head yet (one will come from a registry), only the engine."""
        head = head if head is not None else self.eagle_head
        if head is None and need_head:
            raise ValueError("proposer 'eagle' needs a head: set SpeculativeDecoder.eagle_head "
                             "(decoder.eagle.EagleHead.from_target, then trained)")
        if not self.engine.capabilities.hidden_states:
            raise ValueError(f"proposer 'eagle' needs the target's hidden states, and engine {self.engine.name} "
                             f"was built without them: LlamaCppEngine(embeddings=True) "
                             f"(choose_engine(..., embeddings=True))")
        if head is None:
            return
        if head.hidden_size != self.engine.hidden_size:
            raise ValueError(f"the eagle head takes {head.hidden_size}-wide features, the target's are "
                             f"{self.engine.hidden_size}: a head trained for another model")
        head_vocab = head.embed.shape[0]
        if head_vocab != self.vocab_p:
            raise ValueError(f"the eagle head embeds {head_vocab} token ids, the target's vocabulary has "
                             f"{self.vocab_p}: a head built for another model")

    def _shadow(self, req: DecodeRequest) -> NgramShadow | None:
        """What teaches the shared n-gram gate from this request's steps that propose nothing
        (:class:`decoder.proposers.ngram.NgramShadow`); None without a gate, for a request decoded
        without the served history, and for a seeded sampled one (which runs without the gate)."""
        if self.ngram_gate is None or not req.ngram_history or seeded_sampling(req.params):
            return None
        return NgramShadow(self.ngram_history, req.workload, self.ngram_gate, self.vocab_p)

    @property
    def streamed_logprobs(self) -> list[TokenLogprob]:
        """The running request's :class:`~decoder.sampling.TokenLogprob` (``DecodeRequest.logprobs``),
        per thread: requests decoded in one batch each run on a thread of their own."""
        lp = getattr(self._per_thread, "logprobs", None)
        if lp is None:
            lp = self._per_thread.logprobs = []
        return lp

    @streamed_logprobs.setter
    def streamed_logprobs(self, value: list[TokenLogprob]) -> None:
        self._per_thread.logprobs = value

    @property
    def proposer(self) -> torch.nn.Module:
        """The module proposals run on: ``serving.module`` (bf16 copy) or ``draft``."""
        return self.serving.module if self.serving is not None else self.draft

    # ---- model calls ------------------------------------------------------------------------
    def _draft_logits(self, tokens: list[int], cache) -> torch.Tensor:
        """Draft logits at the last fed position, aligned to the target's vocab: (V_p,)."""
        x = torch.tensor([tokens], device=self.device)
        draft = self.proposer
        if self._draft_head_w is not None:
            h = draft.get_decoder()(input_ids=x, cache=cache, use_cache=True).last_hidden_state[0, -1]
            out = torch.full((self.vocab_p,), float("-inf"), device=self.device)
            w = self._draft_head_w
            out[self._draft_vocab_ids] = (padded_row(w, h[None]) if self._pad_one_row else w @ h).float()
            return out
        logits = draft(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()
        if self.vocab_q < self.vocab_p:  # padded tail of the target: q = 0 there
            logits = torch.cat([logits, logits.new_full((self.vocab_p - self.vocab_q,), float("-inf"))])
        elif self.vocab_q > self.vocab_p:
            logits = logits[: self.vocab_p]
        return logits

    def _engine_draft_logits(self, tokens: list[int], seq) -> torch.Tensor:
        """Draft logits at the last fed position from the draft's engine, aligned to the target's
        vocab: (V_p,)."""
        logits = seq.forward(tokens, 1)[0]
        if self.vocab_q < self.vocab_p:
            logits = torch.cat([logits, logits.new_full((self.vocab_p - self.vocab_q,), float("-inf"))])
        logits = logits[: self.vocab_p]
        if self._draft_vocab_off is not None:  # FR-Spec (DecoderConfig.draft_vocab): q = 0 outside it
            logits = logits.masked_fill(self._draft_vocab_off, float("-inf"))
        return logits

    def _target_logits(self, tokens: list[int], seq, keep: int) -> torch.Tensor:
        """Target logits at the last ``keep`` fed positions: (keep, V_p), from the target's engine
        (on torch through the model's own LM head, so it takes the small-M kernel
        ``DecoderConfig.small_m_linear`` chose, as every layer does)."""
        return seq.forward(tokens, keep)

    def _prompt_topk(self, tokens: list[int], cache, k: int):
        """Prefill ``tokens`` into ``cache`` and return the target's top-k rows at every position:
        ids (P-1, k) int32, probs (P-1, k), tail (P-1,). The LM head runs over ``_PROMPT_CHUNK``
        rows at a time, so memory stays O(chunk x V) however long the prompt (a 4k-token prompt
        with a 49k vocabulary would otherwise hold 0.8 GB of logits); a model type without a known
        plain head falls back to transformers' full logits."""
        if self._target_head is None:  # another engine, or an unknown head: logits chunk by chunk
            parts = [topk_rows(self._target_logits(tokens[i : i + _PROMPT_CHUNK], cache,
                                                    len(tokens[i : i + _PROMPT_CHUNK])), k)
                     for i in range(0, len(tokens), _PROMPT_CHUNK)]
            return tuple(torch.cat([p[j] for p in parts]) for j in range(3))
        x = torch.tensor([tokens], device=self.device)
        h = self.target.get_decoder()(input_ids=x, cache=cache.cache, use_cache=True).last_hidden_state[0]  # (P-1, H)
        parts = [topk_rows(self._target_head(h[i : i + _PROMPT_CHUNK]), k) for i in range(0, h.shape[0], _PROMPT_CHUNK)]
        return tuple(torch.cat([p[j] for p in parts]) for j in range(3))

    def _prompt_features(self, ids: list[int], seq, k: int, proposer, keep_hidden: bool = False, poll=None):
        """Prefill ``ids[:-1]`` with the target's hidden states, in chunks, feeding them to a
        feature-level ``proposer`` if one is given (row j: f_j with token ids[j + 1]); returns the
        prompt's top-k rows as :meth:`_prompt_topk` does when ``k`` > 0, with the hidden states
        (P - 1, H) float16 as a fourth element when ``keep_hidden``; else None. ``poll([])``
        returning False between two chunks raises :class:`_PrefillCancelled`."""
        parts, hids = [], []
        for i in range(0, len(ids) - 1, _PROMPT_CHUNK):
            if i and poll is not None and poll([]) is False:
                raise _PrefillCancelled
            chunk = ids[i : min(i + _PROMPT_CHUNK, len(ids) - 1)]
            logits, hid = seq.forward(chunk, len(chunk), hidden=True)
            if proposer is not None:
                proposer.features(hid, ids[i + 1 : i + 1 + len(chunk)])
            if k:
                parts.append(topk_rows(logits, k))
                if keep_hidden:
                    hids.append(hid.detach().to("cpu", torch.float16))
        if not k:
            return None
        rows = tuple(torch.cat([p[j] for p in parts]) for j in range(3))
        return rows + (torch.cat(hids),) if keep_hidden else rows

    # ---- the loop -----------------------------------------------------------------------------
    def generate(self, req: DecodeRequest, policy: GammaPolicy | None = None,
                 on_step: Callable[[list[int]], bool | None] | None = None) -> DecodeResult:
        """Decode one request (thread-safe: concurrent callers are served one at a time).

        ``policy`` chooses γ per step; default: ``FixedGamma(req.gamma)`` (γ = 4 when neither is
        given). γ is capped each step so that max_new_tokens is never exceeded. The proposer is
        ``req.proposer``, else the policy's ``proposer_name()`` (asked after its first
        ``gamma()``), else ``"draft"``. The hooks in
        ``between_requests`` run first, under the decoder's lock, with ``req`` (adapter swaps
        happen there, and choose the adapter of ``req.workload``).

        ``on_step(new_ids)`` is called after every verification step with the tokens it added to
        the output (already cut at EOS, stop strings and length; never empty); returning False
        cancels the request there (``finish_reason="cancelled"``; streaming, client disconnects).
        During a prefill longer than ``PREFILL_CHUNK`` tokens it is also called with ``[]``
        between chunks (a poll: nothing was emitted); False cancels before decoding starts (no
        output, no record). With ``req.logprobs`` set, ``self.streamed_logprobs`` holds the
        request's :class:`~decoder.sampling.TokenLogprob` for every token ``on_step`` has been given.

        Raises:
            ValueError: a prompt token id outside the target's vocabulary, or prompt +
                max_new_tokens beyond the target's context window.
        """
        with self._lock:
            for hook in self.between_requests:
                hook(self, req)
            return self._generate(req, policy, on_step)

    def generate_batched(self, req: DecodeRequest, policy: GammaPolicy | None = None,
                         on_step: Callable[[list[int]], bool | None] | None = None) -> DecodeResult:
        """:meth:`generate` for a request decoded beside others (continuous batching,
        :mod:`decoder.batching`): on a member thread of a step scheduler, whose driver holds the
        decoder's lock and has run the ``between_requests`` hooks for ``req``; its target (and
        draft) forwards are fused with its batch mates'. Same output, records and hooks as
        :meth:`generate`."""
        return self._generate(req, policy, on_step)

    def wants_switch(self, req: DecodeRequest) -> bool:
        """Whether the ``between_requests`` hooks would change what serves ``req`` (an adapter or
        head swap) from what serves now; True for a hook that cannot say (then ``req`` may join a
        batch only when it is empty)."""
        for hook in self.between_requests:
            owner = getattr(hook, "__self__", None)
            ask = getattr(owner, "wants_switch", None)
            if ask is None or ask(self, req):
                return True
        return False

    def run_between_requests(self) -> None:
        """Run the between-request hooks now, with no request (e.g. apply a prepared swap of the
        shared adapter while idle)."""
        with self._lock:
            for hook in self.between_requests:
                hook(self, None)

    def _generate(self, req: DecodeRequest, policy: GammaPolicy | None, on_step=None) -> DecodeResult:
        with sequence_scope():  # the engine sequences this request starts are released at its end
            return self._generate_one(req, policy, on_step)

    @torch.inference_mode()
    def _generate_one(self, req: DecodeRequest, policy: GammaPolicy | None, on_step=None) -> DecodeResult:
        run = self._begin(req, policy)
        prompt_rows, cancelled = self._prefill(run, on_step)
        run.cstate = req.constraint.start() if req.constraint is not None else None
        finish, reason, block = "cancelled" if cancelled else "length", None, []
        decode_t0 = self.clock()
        while not cancelled and len(run.out) < req.max_new_tokens:
            block, reason = self._step(run)
            if reason:
                finish = reason
                break
            if on_step is not None and block and on_step(list(block)) is False:
                finish = "cancelled"
                break
            # 4. roll the caches back to the surviving tokens (all but the new pending token)
            crop_to(run.tcache, len(run.ids) - 1)
            run.proposer.rollback(len(run.ids) - 1)
        if finish != "cancelled" and on_step is not None and reason and block:
            on_step(list(block))  # the last step's tokens (the request has ended either way)
        run.counts.decode_ms = (self.clock() - decode_t0) * 1e3
        return self._finish(run, finish, prompt_rows)

    def _begin(self, req: DecodeRequest, policy: GammaPolicy | None) -> _Running:
        """The request's running state: its policy, random stream, checked prompt, the target's
        sequence, and its proposer (the policy's first ``gamma()`` call is here: a controller
        decides there)."""
        if policy is None:
            policy = FixedGamma(4 if req.gamma is None else req.gamma)
        params = req.params
        gen = seeded_generator(params.seed if params.seed is not None else int(torch.randint(0, 2**32, (1,))))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started_wall, t_start = time.time(), self.clock()
        ids = self._checked_prompt(req)
        self.streamed_logprobs = []  # this request's, appended before on_step sees their tokens
        k_rec = self.config.topk_record if self.sink is not None else 0
        prefill_t0 = self.clock()  # the prefill's time counts the proposer's construction
        speculate = policy.gamma() > 0  # the policy's first call: a controller decides here
        name = req.proposer or (policy.proposer_name() if hasattr(policy, "proposer_name") else None) or DEFAULT_PROPOSER
        spec = proposer_spec(name)
        # the prompt cache: not where every prompt row's output is wanted (records, a feature-level proposer)
        cache = (self.config.prompt_cache and req.cache_prompt and supports(self.engine, "prompt_cache")
                 and not spec.needs_features
                 and not (k_rec and self.config.record_prompt))
        # the first token from the prefill's last row (DecoderConfig.first_token_from_prefill), where
        # that row needs no hidden state or prompt record, and where the prompt cache's cells are the
        # same bits whatever call computed them: with an f16 V cache llama.cpp keeps only cells a fresh
        # prefill of ``ids[:-1]`` computes alike, and a prefill that also fed the last token computed
        # them in another call (a kept prefix then changed a greedy output)
        fold = (self.config.first_token_from_prefill and not spec.needs_features
                and not (k_rec and (self.config.record_prompt or self.config.record_hidden))
                and not (cache and not getattr(self.engine, "shape_invariant_cells", True)))
        tcache = self.engine.start(prefix=ids[:-1]) if cache else self.engine.start()
        return _Running(req=req, policy=policy, gen=gen, started_wall=started_wall, t_start=t_start,
                        prefill_t0=prefill_t0, ids=ids,
                        tcache=tcache, k_rec=k_rec, rec_hidden=bool(k_rec) and self.config.record_hidden,
                        speculate=speculate, name=name, proposer=self.make_proposer(name, req),
                        # a feature-level proposer (decoder.eagle) learns the target's hidden state at
                        # every position: the prompt's in the prefill, each verification's in a step
                        features=spec.needs_features, model_free=spec.model_free, fold=fold)

    def _prefill(self, run: _Running, on_step) -> tuple[tuple | None, bool]:
        """Everything but the pending last token into the target (and the draft if it is going to
        be used; otherwise it catches up lazily on its first proposal), in chunks polled with
        ``on_step([])``; then the proposer and the n-gram shadow start. Returns the prompt's
        top-k rows to record (or None) and whether the request was cancelled."""
        ids, tcache, k_rec, req = run.ids, run.tcache, run.k_rec, run.req
        prompt_rows, cancelled = None, False
        if run.features or (run.rec_hidden and self.config.record_prompt):
            if len(ids) > 1:
                try:  # in chunks of _PROMPT_CHUNK, polled as below
                    prompt_rows = self._prompt_features(ids, tcache, k_rec if self.config.record_prompt else 0,
                                                        run.proposer if run.features else None, run.rec_hidden,
                                                        poll=on_step)
                except _PrefillCancelled:
                    cancelled = True
        else:  # in chunks: a cancelled request (on_step([]) is False) stops at the next one
            rows, record, fold = [], bool(k_rec and self.config.record_prompt), run.fold
            # the first token from the prefill's last row, as llama-server and transformers take it
            # (one target forward fewer a request; decided in _begin)
            end = len(ids) if fold else len(ids) - 1
            run.cached = first = int(getattr(tcache, "length", 0))  # kept by the prompt cache (_begin)
            for i in range(first, end, PREFILL_CHUNK):
                if i > first and on_step is not None and on_step([]) is False:
                    cancelled = True
                    break
                seg = ids[i: min(i + PREFILL_CHUNK, end)]
                if record:
                    rows.append(self._prompt_topk(seg, tcache, k_rec))
                else:
                    last = self._target_logits(seg, tcache, 1)  # (1, V)
            if fold and not cancelled:
                run.first_logits = last
            if rows and not cancelled:
                prompt_rows = rows[0] if len(rows) == 1 else tuple(torch.cat([r[j] for r in rows]) for j in range(3))
        if not cancelled:
            run.proposer.start(ids, run.speculate)
            run.shadow = self._shadow(req)
            if run.shadow is not None:
                run.shadow.start(ids)
        run.counts.prefill_ms = (self.clock() - run.prefill_t0) * 1e3
        return prompt_rows, cancelled

    def _step(self, run: _Running) -> tuple[list[int], str | None]:
        """One speculative step: propose, verify, accept (cut at the stop conditions), then the
        observers (records, logprobs, features) and the accounting. Returns the emitted block and
        the finish reason if the request ends with it. The request's first step takes the
        prefill's last row (``run.first_logits``, :meth:`_prefill`) where there is one: no
        proposals, no forward, nothing for the controller's step costs."""
        first = run.first_logits
        if first is not None:
            run.first_logits = None
            return self._first_step(run, first)
        remaining = run.req.max_new_tokens - len(run.out)
        asked = max(0, min(run.policy.gamma(), remaining - 1))  # γ, capped so max_new_tokens is never exceeded
        td = self.clock()
        prop = self._propose(run, asked)
        proposals: list[int] = prop.tokens if prop is not None else []
        g = len(proposals)  # a proposer may propose fewer (the n-gram one: none without a match)
        draft_ms = (self.clock() - td) * 1e3
        if run.shadow is not None:  # outside draft ms: the controller's plain step must not carry it
            run.shadow.proposing(run.ids) if g else run.shadow.idle_step(run.ids)
        tv = self.clock()
        logits, hid, served, a_sum, v = self._verify(run, proposals, prop)
        verify_ms = (self.clock() - tv) * 1e3
        if g and hasattr(run.proposer, "verified"):
            run.proposer.verified(v.num_accepted)
        # 3. accept: the accepted prefix and the recovered or bonus token, cut at EOS, stop strings, length
        block = proposals[: v.num_accepted] + [v.next_token]
        cut, reason = self._truncate(run.out, block, run.req)
        block = block[:cut]
        self._observe(run, block, logits, hid, served)
        self._accept(run, block)
        note_emitted(len(block))  # inside a batch: what the batch's goodput is measured by
        # a proposal after the cut was never used: the accepted prefix counts up to the cut only
        st = StepStats(g, min(v.num_accepted, len(block)), len(block), v.rejected_at, a_sum, draft_ms, verify_ms, asked)
        # what a step of g + 1 rows costs with no model in it, alone or in a fused forward of
        # B sequences (keyed by B: StepCost.fused_ms)
        if g == 0 or run.model_free:
            self.step_cost.add(g + 1, (self.clock() - td) * 1e3, last_fused_size(), last_fused_rows())
        run.policy.update(st)
        run.steps.append(st)
        run.counts.add_step(st)
        return block, reason

    def _first_step(self, run: _Running, logits: torch.Tensor) -> tuple[list[int], str | None]:
        """The first token from the prefill's last row ``logits`` (1, V): sampled and observed
        as a plain step's (records, logprobs, the n-gram shadow), in the request's accounting
        with no draft or verify ms (the prefill's ms hold its forward); the policy and the step
        costs do not see it (it cost no step of its own)."""
        if run.shadow is not None:
            run.shadow.idle_step(run.ids)
        _, _, served, a_sum, v = self._verify(run, [], None, logits)
        block = [v.next_token]
        cut, reason = self._truncate(run.out, block, run.req)
        block = block[:cut]
        self._observe(run, block, logits, None, served)
        self._accept(run, block)
        note_emitted(len(block))
        st = StepStats(0, 0, len(block), v.rejected_at, a_sum, 0.0, 0.0, 0, prefill=True)
        run.steps.append(st)
        run.counts.add_step(st)
        return block, reason

    def _propose(self, run: _Running, g: int):
        """1. proposal: up to ``g`` tokens from the request's proposer, as a
        :class:`~decoder.proposers.base.Proposal` (None for g = 0)."""
        return run.proposer.propose(run.ids, g, run.req.params, run.gen) if g else None

    def _verify(self, run: _Running, proposals: list[int], prop, logits: torch.Tensor | None = None):
        """2. verification: the pending token + the proposals in one target forward (g + 1 rows),
        p under the request's constraint and sampling, and the accept test against q. Returns
        the raw logits (g+1, V), the hidden states (g+1, H) or None, the served logits, Σ α over
        the g proposals (Leviathan et al. Definition 3.1) and the :func:`decoder.sampling.verify`
        result. Greedy, p is the one-hot of each row's argmax, so the test needs only the argmax
        ids and α_i = q_i(argmax p_i): p is never built. ``logits`` given (the prefill's last
        row, (1, V), no proposals: :meth:`_first_step`), no forward runs."""
        req, params, g, hid = run.req, run.req.params, len(proposals), None
        if logits is None and (run.features or run.rec_hidden):
            logits, hid = run.tcache.forward([run.ids[-1]] + proposals, g + 1, hidden=True)  # (g+1, V), (g+1, H)
        elif logits is None:
            logits = self._target_logits([run.ids[-1]] + proposals, run.tcache, g + 1)  # (g+1, V)
        # constrained output: p restricted to what keeps the output valid (the records keep `logits`)
        # (top_k: the rows are used through their best 1 / top_k tokens only, so only those need checking)
        served = logits if run.cstate is None else req.constraint.constrain(
            logits, run.cstate, proposals, self.eos_ids,
            top_k=None if req.logprobs is not None else 1 if params.greedy else params.top_k or None)
        if params.greedy:
            choice = argmax(served.float())  # (g+1,)
            a_sum = float(prop.q.float().gather(-1, choice[:g].unsqueeze(-1)).sum()) if g else 0.0
            return logits, hid, served, a_sum, verify_greedy(proposals, choice.tolist())
        p = process_logits(served, params)
        q = prop.q.to(p.dtype) if g else p.new_zeros((0, p.shape[-1]))
        v = verify(torch.tensor(proposals, dtype=torch.long), q, p, params.greedy, run.gen)
        return logits, hid, served, (float(alpha(p[:g], q).sum()) if g else 0.0), v

    def _observe(self, run: _Running, block: list[int], logits, hid, served) -> None:
        """The step's observers on the emitted ``block``: the streamed logprobs, the records'
        top-k and hidden rows, and the feature-level proposer's features."""
        req = run.req
        if req.logprobs is not None and block:  # row j emitted block[j], as plain decoding's would
            self.streamed_logprobs.extend(token_logprobs(served[: len(block)], req.params, block, req.logprobs))
        if run.k_rec and block:
            self._record_rows(run, logits[: len(block)])
            if run.rec_hidden:  # row j: the state whose distribution emitted block[j]
                run.hid_rows.append(hid[: len(block)].detach().to("cpu", torch.float16))
        if run.features and block:  # the input token and the accepted proposals, each with its successor
            run.proposer.features(hid[: len(block)], block)

    @staticmethod
    def _record_rows(run: _Running, rows: torch.Tensor | None = None) -> None:
        """The records' top-k of emitted ``rows`` (n, V) (None: of those still pending): computed
        ``REC_TOPK_ROWS`` rows at a time, since one :func:`~decoder.sampling.topk_rows` call over
        many rows costs less a row than one a step (its fixed cost is shared), and gives the same
        bits whatever the grouping. A request's first group is shorter by an amount its sequence id
        sets, so requests decoded together from the same step do not all take theirs in one step.
        Rows that are part of a larger tensor (a verification's γ + 1 rows of which fewer were
        emitted) are copied, so what waits is the emitted rows only."""
        if rows is not None:
            if rows.untyped_storage().nbytes() > 2 * rows.numel() * rows.element_size():
                rows = rows.clone()
            run.rec_pending.append(rows)
            run.rec_pending_n += rows.shape[0]
            stagger = 0 if run.rec_topk else 7 * getattr(run.tcache, "seq_id", 0) % max(1, REC_TOPK_ROWS // 2)
            if run.rec_pending_n < REC_TOPK_ROWS - stagger:
                return
        if run.rec_pending:
            pending = run.rec_pending[0] if len(run.rec_pending) == 1 else torch.cat(run.rec_pending)
            run.rec_topk.append(topk_rows(pending, run.k_rec))
            run.rec_pending, run.rec_pending_n = [], 0

    def _accept(self, run: _Running, block: list[int]) -> None:
        """The emitted ``block`` joins the output and the context; the constraint and the n-gram
        shadow follow it."""
        run.out.extend(block)
        run.ids.extend(block)
        if run.cstate is not None:
            for t in block:
                run.cstate = run.req.constraint.advance(run.cstate, t, self.eos_ids) or run.cstate
        if run.shadow is not None:
            run.shadow.settle(run.ids)

    def _finish(self, run: _Running, finish: str, prompt_rows) -> DecodeResult:
        """The request's end: the n-gram history learns it, its result, its records to the sink."""
        req, steps = run.req, run.steps
        if run.shadow is not None:
            run.shadow.settle(run.ids, final=True)
        self.ngram_history.add(req.workload, run.ids)
        result = self._result(req, run.policy, run.out, finish, steps, run.counts, (self.clock() - run.t_start) * 1e3,
                              run.name if any(s.proposed for s in steps) or run.speculate else "none")
        result.cached_prompt_tokens = run.cached
        if req.logprobs is not None:
            result.logprobs = list(self.streamed_logprobs)
        if self.sink is not None and run.out:
            self._record_rows(run)  # the rows still pending
            if prompt_rows is not None:
                self._emit_prefill(req, result, prompt_rows, run.started_wall)
            self._emit(req, result, run.rec_topk, run.started_wall, run.hid_rows if run.rec_hidden else None)
        return result

    def _checked_prompt(self, req: DecodeRequest) -> list[int]:
        """The prompt's ids, checked against the target's vocabulary and context window.

        Raises:
            ValueError: a token id outside the vocabulary, or prompt + max_new_tokens too long.
        """
        ids = [int(t) for t in req.prompt_ids]
        bad = next((t for t in ids if not 0 <= t < self.vocab_p), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} outside the target's vocab 0..{self.vocab_p - 1}")
        ctx = self.engine.context_length
        if ctx and len(ids) + req.max_new_tokens > ctx:
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_new_tokens={req.max_new_tokens} exceeds the target's context "
                f"window of {ctx} tokens: shorten the prompt or lower max_new_tokens"
            )
        return ids

    def _result(self, req: DecodeRequest, policy, out: list[int], finish: str, steps: list[StepStats],
                counts: AcceptanceCounts, latency_ms: float, proposer: str) -> DecodeResult:
        """The request's DecodeResult: output text (cut at a stop string), peak memory, policy."""
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        if finish == "stop":
            text = _cut_at_stop(text, req.stop)
        return DecodeResult(
            request_id=req.request_id,
            workload=req.workload,
            prompt_len=len(req.prompt_ids),
            output_ids=out,
            text=text,
            finish_reason=finish,
            steps=steps,
            counts=counts,
            latency_ms=latency_ms,
            peak_memory_bytes=peak,
            adapter_version=self.adapter_version,
            sampling_bucket=req.sampling_bucket or req.params.bucket(),
            policy=policy.describe() if hasattr(policy, "describe") else type(policy).__name__,
            proposer=proposer,
            engine=self.engine.name,
            head_version=self.head_version if proposer == HEAD else 0,
        )

    def _truncate(self, out: list[int], block: list[int], req: DecodeRequest) -> tuple[int, str | None]:
        """How many tokens of ``block`` to keep, and the finish reason if generation ends."""
        cut = len(block)
        reason = None
        if not req.ignore_eos:
            for i, t in enumerate(block):
                if t in self.eos_ids:
                    cut, reason = i + 1, "eos"
                    break
        if req.stop:
            for i in range(cut):
                text = self.tokenizer.decode(out + block[: i + 1], skip_special_tokens=True)
                if any(s in text for s in req.stop):
                    cut, reason = i + 1, "stop"
                    break
        room = req.max_new_tokens - len(out)
        if cut >= room:
            cut = room
            reason = reason or "length"
        return cut, reason

    def _emit(self, req: DecodeRequest, result: DecodeResult, topk_rows, started_wall: float,
              hid_rows: list[torch.Tensor] | None = None) -> None:
        hidden = _finite_or_none(torch.cat(hid_rows)) if hid_rows else None
        if topk_rows:
            ids_, probs, tail = (torch.cat([r[j] for r in topk_rows]).numpy() for j in range(3))
        else:
            n = len(result.output_ids)
            ids_, probs, tail = np.zeros((n, 0)), np.zeros((n, 0)), np.ones(n)
        self._send(req, result, started_wall, prompt_ids=np.asarray(req.prompt_ids),
                   output_ids=np.asarray(result.output_ids),
                   proposal_lens=np.asarray([s.proposed for s in result.steps]),
                   rejection_pos=np.asarray([s.rejected_at for s in result.steps]),
                   topk_ids=ids_, topk_probs=probs, tail_mass=tail, hidden=hidden)

    def _emit_prefill(self, req: DecodeRequest, result: DecodeResult, rows, started_wall: float) -> None:
        """The prompt's teacher-forced record: prompt_ids = the first prompt token, output_ids =
        the rest of the prompt, row j = p(. | prompt[: j + 1]) from the prefill."""
        ids = np.asarray(req.prompt_ids)
        self._send(req, result, started_wall, prompt_ids=ids[:1], output_ids=ids[1:], proposal_lens=np.zeros(0),
                   rejection_pos=np.zeros(0), topk_ids=rows[0].numpy(), topk_probs=rows[1].numpy(),
                   tail_mass=rows[2].numpy(), source="prefill", hidden=_finite_or_none(rows[3]) if len(rows) > 3 else None)

    def _send(self, req: DecodeRequest, result: DecodeResult, started_wall: float, **arrays) -> None:
        """Build the request's VerifiedSample from ``arrays`` and hand it to the sink; a failing
        sink never fails the request."""
        from store.schema import SamplingSettings, VerifiedSample

        sample = VerifiedSample(
            request_id=result.request_id,
            workload=result.workload,
            adapter_version=result.adapter_version,
            pair=self.pair_fingerprint,
            sampling=SamplingSettings(req.params.temperature, req.params.top_p, req.params.top_k, req.params.seed),
            started_at=started_wall,
            finished_at=time.time(),
            target_format=self.config.target_format,
            **arrays,
        )
        try:
            self.sink(sample)
        except Exception:  # noqa: BLE001 - the buffer must never fail a request
            pass

    def check_against_plain(self, req: DecodeRequest, result: DecodeResult, batched: bool = False) -> DecodeResult:
        """Fill ``matches_plain`` / ``first_diff_index`` by decoding the same request plainly
        (γ = 0, greedy only: sampled outputs are equal in distribution, not token by token);
        ``batched``: from a batch member's thread (:meth:`generate_batched`)."""
        if not req.params.greedy:
            return result
        run = self.generate_batched if batched else self.generate
        plain = run(_replace(req, gamma=0), FixedGamma(0))
        a, b = result.output_ids, plain.output_ids
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None and len(a) != len(b):
            diff = min(len(a), len(b))
        result.matches_plain = diff is None
        result.first_diff_index = diff
        return result


def _replace(req: DecodeRequest, **kw) -> DecodeRequest:
    from dataclasses import replace

    return replace(req, **kw)


@dataclass
class _Running:
    """One request's state while it decodes (:meth:`SpeculativeDecoder._generate_one`)."""

    req: DecodeRequest
    policy: GammaPolicy
    gen: Any  # the request's torch.Generator (seeded_generator)
    started_wall: float
    t_start: float
    prefill_t0: float
    ids: list[int]  # the prompt, then every emitted token
    tcache: Any  # the target's engine Sequence
    k_rec: int  # k of the top-k rows recorded (0 = no records)
    rec_hidden: bool  # the records carry hidden states
    speculate: bool
    name: str  # the proposer's name
    proposer: Proposer
    features: bool  # the proposer is fed the target's hidden states
    model_free: bool  # the proposer runs no model (its steps measure the step cost)
    cstate: Any = None  # the constraint's state, None = unconstrained
    shadow: NgramShadow | None = None
    out: list[int] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    counts: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(num_requests=1))
    rec_topk: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    rec_pending: list[torch.Tensor] = field(default_factory=list)  # emitted rows whose top-k is not taken yet
    rec_pending_n: int = 0  # their rows
    hid_rows: list[torch.Tensor] = field(default_factory=list)
    cached: int = 0  # prompt tokens the prompt cache kept in the target's cells
    first_logits: torch.Tensor | None = None  # (1, V): the prefill's last row, the first token's (_prefill)
    fold: bool = False  # the first token comes from the prefill's last row (_begin decides)


class _PrefillCancelled(Exception):
    """A request was cancelled between two chunks of its prompt's prefill."""


_PROMPT_CHUNK = 256  # rows of prompt logits materialised at once when recording the prompt
# emitted rows whose records' top-k is taken in one call (SpeculativeDecoder._record_rows): at most
# this many (n, V) float32 rows wait per request (3 MB at V = 49152)
REC_TOPK_ROWS = 16
# prompt tokens per prefill call; between two, a cancelled request stops (issue 37 item 2: a
# request past serve.request_timeout_s, or whose client left, no longer holds the decoder for the
# rest of a long prompt's prefill). Prompts up to it prefill in one call, as before.
PREFILL_CHUNK = 512
_PLAIN_HEAD_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}


def small_m_head(model: torch.nn.Module):
    """The model's LM head as ``h (M, H) -> (W @ h^T)^T (M, V)`` (plus bias, and Gemma's final
    logit soft-capping), or None for a model type whose logits may be more than that."""
    cfg = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if cfg is None or head is None or getattr(cfg, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    if not hasattr(model, "get_decoder") or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    w, b = head.weight, getattr(head, "bias", None)
    cap = getattr(cfg, "final_logit_softcapping", None)

    def apply(h: torch.Tensor) -> torch.Tensor:
        out = (w @ h.to(w.dtype).T).T
        if b is not None:
            out = out + b
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    return apply


def _eos_ids(target: torch.nn.Module, tokenizer) -> frozenset[int]:
    """The end-of-sequence ids: the target's generation config's and the tokenizer's."""
    eos = set()
    for src in (getattr(target.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif src:
            eos.update(int(x) for x in src)
    return frozenset(eos)


def _finite_or_none(hidden: torch.Tensor):
    """(N, H) float16 hidden states as numpy, or None (logged) where a row is not finite (NaN, or
    beyond float16's range): the record then goes without them rather than be dead-lettered with
    its top-k rows."""
    if bool(torch.isfinite(hidden).all()):
        return hidden.numpy()
    log.warning("hidden_states_not_recorded", reason="NaN or beyond float16's range", rows=int(hidden.shape[0]))
    return None


def _is_quantized(model: torch.nn.Module) -> bool:
    """True when ``model`` holds torch.ao dynamically quantised layers (``--int8-draft``)."""
    return any("quantized" in type(m).__module__ for m in model.modules())


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    ends = [text.find(s) + len(s) for s in stops if s in text]
    return text[: min(ends)] if ends else text
