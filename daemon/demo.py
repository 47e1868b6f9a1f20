"""`daemonctl demo`: the whole loop on a real model pair and a shifting workload.

served traffic -> buffer -> training -> hot-swap -> acceptance per workload -> rollback

1. Redis: the configured URL, else the one on the default address, else an embedded server.
2. The default pair (SmolLM2-135M-Instruct target, draft derived from its first 4 layers),
   converted and cached on first use.
3. In this process, beside the decoder: the trainer (TrainerService on an APScheduler schedule,
   training a second, private copy of the derived draft), the adapter manager (hot-swaps every
   promoted adapter into the decoder's draft between requests), the acceptance tracker (windows
   per workload x sampling bucket x adapter version, flushed to the store's history, with a
   Page-Hinkley shift detector), the rollback monitor, and the goodput controller (γ per
   workload, 0 = plain decoding when speculation does not pay).
4. Traffic in phases: English prose (standard-library docstrings) -> Python code
   (standard-library functions) -> math word problems (GSM8K from ../shared/data, else
   generated) -> extract (copy-heavy: reproduce a given passage); no prompt repeats in a phase.
5. At the end, on prompts never served: frozen draft vs adapted draft vs plain decoding per
   phase (α, τ, tokens/s, speedup), a JSON report and a PNG of acceptance over time with the
   shifts and swaps marked.

Torch runs one intra-op thread per Python thread here, so decoding and training share a
2-core machine without oversubscribing it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape as rich_escape

from decoder.engines.base import supports
from store.jsonsafe import jsonable as _jsonable, nan_none
from store.wording import percent, requests as _requests, signed


@dataclass
class DemoConfig:
    """Sizes of the demo: the phases, their length, the evaluation and the trainer's schedule.

    A phase serves ``phase_seconds``, then on until its workload's adapter was promoted and judged
    ``phase_min_judged`` times, so a slower host serves each phase longer rather than training less.
    """

    # prose -> code -> math -> extract (copy-heavy); each has hundreds of distinct prompts
    # (decoder.workloads), so no prompt repeats within a phase
    phases: tuple[str, ...] = ("prose", "code", "math", "extract")
    phase_seconds: float = 255.0  # serving time per phase, at least
    # ... then on until the workload's own adapter was promoted and had this many turns judged on
    # enough held-out evidence (its gate's min_eval_requests / min_eval_positions), at most phase_max_seconds
    # (None: 3 x phase_seconds); 0: time-bounded phases. _phase_progress
    phase_min_judged: int = 2
    # ... and until the workload's own promoted version has served this many of the phase's
    # requests (a version promoted in the phase's last second served nothing of it); 0: not asked
    phase_min_served: int = 6
    phase_max_seconds: float | None = None
    # while v0 bootstraps (the first run on a pair), the demo's client leaves the cores to it: it
    # waits after each request so that serving takes at most this share of the wall time (the
    # service still answers at once; beside a decoding loop its scoring ran at a third of its
    # speed alone, bench/bootstrap_scoring_check.py, bench/RESULTS.md "The bootstrap beside
    # serving"; at 0.25 serving still took about a minute of the AVX2 host's bootstrap, "Twenty-sixth
    # session"); 1: no waiting
    bootstrap_duty: float = 0.10
    max_new_tokens: int = 32
    eval_prompts: int = 12  # per phase, never served, for the frozen-vs-adapted table (paired per prompt)
    eval_new_tokens: int = 64  # tokens decoded per evaluation prompt
    confidence: float = 0.95  # of the paired bootstrap intervals in the report (trainer.gate)
    eval_gamma: int = 3  # γ of the frozen-vs-adapted draft rows; the "adapted" row takes the controller's pick
    proposers: tuple[str, ...] = ("ngram", "draft")  # what the goodput controller chooses among
    train_interval_s: float = 30.0
    train_min_new_samples: int = 8
    round_steps: int = 40
    round_seconds: float = 60.0
    # one adapter per workload (trainer.per_workload, shared_turn off): each phase trains and is
    # judged on its own traffic, so learning math cannot cost prose (bench/RESULTS.md: one shared
    # adapter's candidates for a new workload were refused for the loss they caused on the others)
    per_workload: bool = True
    min_workload_samples: int = 8  # new training samples of a workload in a round before its turn
    # the trainer's cross-workload tolerance (ServiceConfig.regress_margin): a promotion may lower
    # another workload's held-out acceptance as served by up to this much (point estimate)
    regress_margin: float = 0.05
    # FR-Spec (models.draft_vocab): the draft's head restricted to the N most frequent tokens, trained
    # and served alike (on llama.cpp as a restricted draft GGUF, gguf_export.restricted_draft_gguf);
    # training steps at 40 % of the full head's cost at the same gain per step (docs/training.md).
    # None: models.draft_vocab when set (0: the full vocabulary), else 8192; 0: the full vocabulary
    draft_vocab: int | None = None
    # --heads: the feature-level head as a third proposer: v0 bootstrapped on the corpora (cached),
    # records carry hidden states, each round also distils the head (head_steps steps) and the
    # serving loop hot-swaps the promoted heads; the table adds frozen-v0 and adapted head rows
    heads: bool = False
    head_steps: int = 60
    head_gamma: int = 1  # γ of the frozen-vs-adapted head rows (on 2 CPU cores γ = 1 is the head's best)
    # the copy channel's ablation rows on the same prompts (store.copy_channel): the final LoRA
    # without its gate ("adapted_nogate": what the gate adds), and v0 with the untrained fixed gate
    # FIXED_COPY_GATE ("frozen_fixedgate": λ = 1 where the match is >= 3 tokens: the heuristic the
    # learnt gate competes with)
    copy_ablation: bool = True
    # requests per workload that measure step costs again once the trainer has stopped, before the
    # evaluation asks the controller for its picks (_remeasure); 0: the picks priced beside the trainer
    remeasure_requests: int = 16
    seed: int = 0
    out_dir: Path = field(default_factory=lambda: Path("out/demo"))

    def __post_init__(self) -> None:
        if not (self.phase_seconds > 0 and math.isfinite(self.phase_seconds)):
            raise ValueError(f"phase_seconds={self.phase_seconds}: must be a finite number > 0 (--phase-seconds)")
        if not math.isfinite(3 * self.phase_seconds):
            raise ValueError(f"phase_seconds={self.phase_seconds}: too large (3x it, the longest a phase serves by "
                             f"default, is not finite); use at most {sys.float_info.max / 3:.3g} (--phase-seconds)")
        if not (isinstance(self.phase_min_judged, int) and self.phase_min_judged >= 0):
            raise ValueError(f"phase_min_judged={self.phase_min_judged}: must be >= 0 (0 = time-bounded phases; "
                             f"--phase-min-judged)")
        if not (isinstance(self.phase_min_served, int) and not isinstance(self.phase_min_served, bool)
                and self.phase_min_served >= 0):
            raise ValueError(f"phase_min_served={self.phase_min_served!r}: must be an int >= 0 (0: not asked)")
        if isinstance(self.bootstrap_duty, bool) or not isinstance(self.bootstrap_duty, (int, float)) \
                or not 0 < self.bootstrap_duty <= 1:
            raise ValueError(f"bootstrap_duty={self.bootstrap_duty!r}: must be a fraction in (0, 1] (1: no waiting)")
        if isinstance(self.remeasure_requests, bool) or not isinstance(self.remeasure_requests, int) or self.remeasure_requests < 0:
            raise ValueError(f"remeasure_requests={self.remeasure_requests!r}: must be an int >= 0 (0: no re-measurement)")
        if isinstance(self.regress_margin, bool) or not isinstance(self.regress_margin, (int, float)) \
                or not 0 <= self.regress_margin < math.inf:
            raise ValueError(f"regress_margin={self.regress_margin!r}: must be a finite number >= 0 (the most a "
                             f"promotion may lower another workload's held-out acceptance; 0: no loss allowed)")
        if self.phase_max_seconds is not None and not (self.phase_seconds <= self.phase_max_seconds < math.inf):
            raise ValueError(f"phase_max_seconds={self.phase_max_seconds}: must be finite and >= phase_seconds="
                             f"{self.phase_seconds} (--phase-max-seconds)")

    def max_phase_seconds(self) -> float:
        """The longest a phase serves (s): ``phase_max_seconds``, else 3 x ``phase_seconds``."""
        return self.phase_max_seconds if self.phase_max_seconds is not None else 3 * self.phase_seconds

    @classmethod
    def quick(cls, **kw) -> "DemoConfig":
        # the ablation rows add two decoded runs per prompt (a third of the evaluation): --ablation
        # phases of 60 s at least, on until the learner's part is done (_phase_progress), at most 180 s:
        # the learner's part, not the minimum, sizes them (shifts' "learner_done_s"; bench/RESULTS.md,
        # "Twenty-seventh session")
        base = dict(phase_seconds=60.0, eval_prompts=8, train_interval_s=15.0, train_min_new_samples=4,
                    round_steps=30, round_seconds=30.0, copy_ablation=False)
        base.update(kw)
        return cls(**base)


DEMO_DRAFT_VOCAB = 8192  # DemoConfig.draft_vocab's default
# An untrained copy gate for the ablation row: z = 800 ℓ/8 - 250, so z = -50 at ℓ = 2 and +50 at
# ℓ = 3: λ = 0 below a 3-token match and 1 (in float64) from it on (store.copy_channel.FEATURES order)
FIXED_COPY_GATE = (-250.0, 800.0, 0.0, 0.0, 0.0, 0.0)


def demo_settings(settings, cfg: DemoConfig):
    """``settings`` with the demo's restricted draft head (``cfg.draft_vocab``; None: ``models.draft_vocab``
    when set, else :data:`DEMO_DRAFT_VOCAB`), which the bootstrap's cache key, the trainer and the
    decoder all read from them."""
    dv = cfg.draft_vocab if cfg.draft_vocab is not None else (
        settings.models.draft_vocab if settings.models.draft_vocab is not None else DEMO_DRAFT_VOCAB)
    return settings.model_copy(update={"models": settings.models.model_copy(update={"draft_vocab": dv})})


def _prompts(workload: str, n: int, skip: int = 0):
    from decoder.workloads import get_workload

    return get_workload(workload, n + skip)[skip:]


def run_demo(settings, cfg: DemoConfig, console) -> dict[str, Any]:
    """Run the demo; returns the report (also written to ``cfg.out_dir/report.json``).

    The phases, in order: the store, the model pair, the trainer, the serving loop behind its API,
    the phases' traffic, the final adapter settled, the evaluation, the report. On the way out the
    ExitStack closes them in reverse: the API server, the serving loop, the trainer, Redis.

    It runs under ``serve.gil_switch_interval_ms``, as ``daemonctl serve`` does (restored after):
    at CPython's default 5 ms the decoding thread waited for the GIL behind the API's, the
    client's and the trainer's threads at every hand-off, so the served steps the controller
    prices cost more than the same steps decoded by the evaluation.
    """
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    settings = demo_settings(settings, cfg)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(settings.serve.gil_switch_interval_ms / 1e3)
    try:
        return _run_demo(settings, cfg, console)
    finally:
        sys.setswitchinterval(switch)


def _run_demo(settings, cfg: DemoConfig, console) -> dict[str, Any]:
    """:func:`run_demo`'s body (its settings already the demo's)."""
    from contextlib import ExitStack

    from decoder.sampling import SamplingParams

    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    run_id = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
    with ExitStack() as stack:
        models = _load_models(settings, console, embeddings=cfg.heads)  # first: a pair that cannot load leaves the last run's state alone
        if cfg.per_workload and not supports(models.engines.draft, "lora"):  # the evaluation sets each workload's LoRA
            console.log("one shared adapter: per-workload adapters are evaluated on a draft engine with LoRA (llama.cpp)")
            cfg = dataclasses.replace(cfg, per_workload=False)
        store = _open_store(stack, settings, console)
        trainer = _start_trainer(stack, settings, cfg, store, models, out_dir, run_id, console)
        loop, oai, resends = _start_serving(stack, settings, cfg, store, models, trainer, console)
        params = SamplingParams()  # greedy: α per position = agreement with the target's argmax
        traffic = _serve_phases(cfg, oai, loop, models.tok, settings.models.target, trainer.svc, params, console, trainer)
        remeasured = _finish_serving(trainer, loop, console, remeasure=(
            (lambda: _remeasure(cfg, oai, loop, models.tok, settings.models.target, traffic, console))
            if cfg.remeasure_requests else None))
        table = evaluate_phases(cfg, trainer.heldout, traffic.phase_end_version, traffic.timeline, trainer.distiller,
                                trainer.registry, loop.decoder, frozen_draft=_v0_draft(models, trainer),
                                tok=models.tok, params=params, console=console, controller=loop.controller,
                                v0_version=trainer.v0.version or 0, frozen_head=_v0_head(loop, trainer),
                                peer=stack.enter_context(_llamacpp_peer(settings, models, loop.decoder, console)))
        loop.tracker.flush()
        report = _report(cfg, run_id, t_start, store, models, trainer, loop, traffic, table)
        report["remeasured"] = remeasured
        report["client_retries"] = resends.retried  # requests resent after a connection failed before any response
        report["llamacpp_peer_file"] = _peer_file(settings, models)
        report["llamacpp_peer_kernels"] = "upstream (scripts/patches switched off, a process of its own)"
        report["promotions_that_lowered_decoded_alpha"] = lowered_promotions(report)
    (out_dir / "report.json").write_text(json.dumps(_jsonable(report), indent=1))
    plot_timeline(traffic.timeline, traffic.shifts, out_dir / "acceptance.png",
                  scopes={a["version"]: a.get("scope") or "" for a in report.get("adapters") or ()})
    report["plot"] = str(out_dir / "acceptance.png")
    return report


@dataclass
class _Store:
    """The demo's Redis (open for the run) and the store config under the demo's own key prefix."""

    rh: Any  # daemon.redis_embed.RedisHandle
    config: Any  # store.StoreConfig, key_prefix = prefix
    prefix: str

    @property
    def client(self):
        return self.rh.client


@dataclass
class _Models:
    """The loaded pair, the engines it runs on, and what the trainer and the serving loop share."""

    pair: Any  # decoder.models.loading.ModelPair
    engines: Any  # decoder.engines.registry.EngineChoice
    layers: str  # the derived draft's blocks (models.draft = 'layers:<spec>')
    vocab: Any  # FR-Spec draft vocabulary ids (None = full vocabulary)
    fp: Any  # store.schema.PairFingerprint

    @property
    def tok(self):
        return self.pair.tokenizer


@dataclass
class _Trainer:
    """The in-process trainer and the held-out split it leaves for the final table."""

    registry: Any  # store.AdapterRegistry
    distiller: Any  # trainer.distill.Distiller
    svc: Any  # trainer.service.TrainerService
    heldout: dict[str, list]  # workload -> served samples the trainer's split holds out
    keep_heldout: Any  # the serving loop's tap that fills ``heldout``
    v0: Any = None  # daemon.warm_start.WarmStart: the bootstrapped v0 (version None: the base draft)
    head_registry: Any = None  # --heads: the head registry (kind "head")
    head_v0: Any = None  # --heads: daemon.warm_start.WarmStart of the head's v0
    ready: Any = None  # threading.Event: v0 (and head v0) settled and the trainer's schedule started
    ready_at: float | None = None  # time.time() when ``ready`` was set
    # the trainer's schedule started (False once ``ready`` is set: the warm start raised before
    # svc.start(), so no turn will be judged and the phases are time-bounded)
    started: bool = False


@dataclass
class _Traffic:
    """What serving the phases recorded."""

    timeline: list[dict] = field(default_factory=list)  # a row per request
    shifts: list[dict] = field(default_factory=list)  # where each phase began
    phase_end_version: dict[str, int] = field(default_factory=dict)  # the adapter each phase ended on
    phase_end_head: dict[str, int] = field(default_factory=dict)  # --heads: the head each phase ended on
    t0: float = 0.0  # time.time() at the first phase's start: the timeline's and shifts' "t" count from it


def _open_store(stack, settings, console) -> _Store:
    """Redis (kept open on ``stack``), with the demo's key prefix emptied."""
    from daemon.redis_embed import open_redis
    from daemon.settings import store_config

    rh = stack.enter_context(open_redis(settings.redis, settings.redis_dir))
    console.log(f"redis: {rh.mode} {rh.url}")
    scfg = store_config(settings)
    # One fixed namespace, emptied at the start, so every demo starts from the untrained draft
    # and `daemonctl status/history` can inspect the last run (see the hint printed at the end).
    prefix = f"{scfg.key_prefix}demo:"
    scfg = scfg.model_copy(update={"key_prefix": prefix})
    _clear_prefix(rh.client, prefix)
    return _Store(rh, scfg, prefix)


def _load_models(settings, console, embeddings: bool = False) -> _Models:
    """The configured pair (converted and cached on first use) and the engines it runs on."""
    from daemon.settings import draft_vocab_ids
    from decoder.models.loading import load_pair
    from store.schema import PairFingerprint

    with console.status("loading the model pair (first run: GGUF conversion, ~30 s)"):
        pair = load_pair(settings.models.target, settings.models.draft, progress=console.log)
        from decoder.engines.registry import choose_engine

        m = settings.models  # the decoder's engine gets one core, the trainer the other (unless told)
        vocab = draft_vocab_ids(settings, pair.tokenizer)  # FR-Spec: trained and served alike (None = full vocabulary)
        engines = choose_engine(m.engine, m.target, m.device, m.draft, m.engine_threads or 1, embeddings=embeddings,
                                target_format=m.format, progress=console.log, draft_vocab=vocab, v_cache=m.v_cache,
                                format_max_seconds=m.format_max_seconds)
    for line in _engine_lines(engines):
        console.log(line)
    layers = settings.models.draft.split(":", 1)[1] if settings.models.draft.startswith("layers:") else None
    if layers is None:
        raise ValueError(f"the demo trains a derived draft: set models.draft to 'layers:<spec>', not "
                         f"{settings.models.draft!r}")
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    console.log(f"pair: {pair.target_name} + {pair.draft_name} ({pair.load_seconds:.1f} s)")
    return _Models(pair, engines, layers, vocab, fp)


def _monitor_checks(monitor) -> dict[str, list[dict]]:
    """The rollback monitor's checks of each promoted version as served: ``rollbacks``, those that
    rolled a version back; ``rollback_checks``, every check (kept ones too: a walkthrough read two
    "kept" checks under "rollbacks")."""
    return {"rollbacks": [d.__dict__ for d in monitor.decisions if d.rolled_back],
            "rollback_checks": [d.__dict__ for d in monitor.decisions]}


def _amx_line(amx: dict) -> str:
    """"AMX matmuls: the per-row kernel takes up to 3 rows at 1 thread, 5 at 2 threads or more, the AMX
    tiles more rows (GGML_AMX_VNNI_MAX_ROWS=3,5, measured; its costs: report.json amx_rows)" from
    :func:`decoder.engines.amx_rows.apply_amx_rows`'s answer (a walkthrough read "=3,5 rows" as one
    count, under 14 lines of milliseconds); a default answer says why it stood."""
    ks = [k.strip() for k in str(amx.get("setting", "")).split(",")]
    if len(ks) == 1:
        per = f"{ks[0]} rows at any thread count"
    else:
        per = ", ".join([f"{ks[0]} rows at 1 thread"] + [f"{k} at {i} threads" for i, k in enumerate(ks[1:], 2)]) + " or more"
    why = f"; {amx.get('reason')}" if amx.get("source") in ("default", "environment") else "; its costs: report.json amx_rows"
    return (f"AMX matmuls: the per-row kernel takes up to {per}, the AMX tiles more rows "
            f"(GGML_AMX_VNNI_MAX_ROWS={amx.get('setting')}, {amx.get('source')}{why})")


def _engine_lines(engines) -> list[str]:
    """The engine's line and, apart, the served format's (``EngineChoice.reason`` ends in "; serving
    <format> (<file>): <its reason>"): inside the engine line's parentheses the format's reason,
    with parentheses of its own, ended in "output))" and read as one clause."""
    from decoder.engines.llamacpp_lib import amx_rows

    amx = amx_rows()  # where llama.cpp's AMX path runs: the rows its per-row kernel takes (decoder.engines.amx_rows)
    extra = [_amx_line(amx)] if amx else []
    served = getattr(engines, "served", None)
    if served is None:
        return [f"engine: {engines.name} ({engines.reason})", *extra]
    tail = f"; serving {served.format} ({Path(served.path).name}): {served.reason}"
    if not engines.reason.endswith(tail):
        return [f"engine: {engines.name} ({engines.reason})", *extra]
    return [f"engine: {engines.name} ({engines.reason.removesuffix(tail)})",
            f"served format: {served.format} ({Path(served.path).name}), {served.reason}", *extra]


def _start_trainer(stack, settings, cfg: DemoConfig, store: _Store, models: _Models, out_dir: Path,
                   run_id: str, console) -> _Trainer:
    """The TrainerService on a second, private copy of the derived draft, started (stopped by ``stack``)."""
    from daemon.settings import distill_config
    from decoder.models.loading import derive_draft
    from store import AdapterRegistry, SampleReader
    from store.buffer import group_info
    from trainer.distill import Distiller
    from trainer.service import ServiceConfig, TrainerService, is_heldout, split_key

    client, scfg = store.client, store.config
    reader = SampleReader(client, scfg, "trainer", "demo", expected_fingerprint=models.fp)
    registry = AdapterRegistry(client, out_dir / "adapters" / run_id, scfg)

    dcfg = distill_config(settings)
    dcfg = dataclasses.replace(dcfg, max_steps=cfg.round_steps, max_seconds=cfg.round_seconds)
    distiller = Distiller(derive_draft(models.pair.target, models.layers), dcfg, vocab=models.vocab)
    trainer = _Trainer(registry, distiller, None, {}, None, ready=threading.Event())
    if cfg.heads:
        from daemon.heads import head_trainer

        trainer.head_registry = AdapterRegistry(client, out_dir / "heads" / run_id, scfg, kind="head")
        heads = head_trainer(settings, client, models.pair, scfg, head_dir=out_dir / "heads" / run_id,
                             work_dir=out_dir / "work" / run_id, steps=cfg.head_steps)
    else:
        heads = None
    svc = TrainerService(
        reader, registry, distiller,
        ServiceConfig(interval_s=cfg.train_interval_s, min_new_samples=cfg.train_min_new_samples,
                      check_interval_s=2.0, max_samples_per_round=256, holdout_fraction=0.25,
                      holdout_per_workload=48, min_eval_samples=6, min_eval_requests=8, min_eval_positions=256,
                      confidence=cfg.confidence, promote_margin=0.0, regress_margin=cfg.regress_margin,
                      replay_per_workload=64, replay_ratio=0.5, work_dir=str(out_dir / "work" / run_id),
                      per_workload=cfg.per_workload, shared_turn=not cfg.per_workload,
                      min_workload_samples=cfg.min_workload_samples),
        backlog=lambda: sum(g.lag or 0 for g in group_info(client, scfg) if g.name == "trainer"),
        heads=heads,
    )
    trainer.svc = svc

    def warm_then_train() -> None:
        """v0 (cached: a second; the first run on a pair: minutes), then the trainer's schedule.
        Serving does not wait for it: the first requests go to the base draft and the n-gram
        proposer, and the serving loop hot-swaps v0 in once it is promoted."""
        try:
            trainer.v0 = _warm_start(settings, models, registry, distiller, console)
            if cfg.heads:
                trainer.head_v0 = _head_warm_start(settings, models, trainer.head_registry, console)
            svc.start()
            trainer.started = True
        finally:
            trainer.ready_at = time.time()
            trainer.ready.set()

    warm = threading.Thread(target=warm_then_train, name="demo-warm-start", daemon=True)
    warm.start()
    stack.callback(svc.stop)
    stack.callback(warm.join)  # the ExitStack runs these in reverse: the warm start ends before svc.stop

    heldout: dict[str, list] = {}  # the trainer's own held-out split, kept for the final table

    def keep_heldout(sample) -> None:
        if is_heldout(split_key(sample), svc.config.holdout_fraction):
            heldout.setdefault(sample.workload, []).append(sample)

    trainer.heldout, trainer.keep_heldout = heldout, keep_heldout
    return trainer


def _warm_start(settings, models: _Models, registry, distiller, console):
    """v0 before the first request (daemon.warm_start): the cached bootstrap of this pair promoted,
    or trained now on both cores (the first run on a pair)."""
    import torch

    from daemon.settings import warm_start_config
    from daemon.warm_start import WarmStart, ensure_v0

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))  # the bootstrap's torch work takes every core (serving runs on llama.cpp's threads)
    try:
        v0 = ensure_v0(models.pair, models.fp, registry, distiller, warm_start_config(settings), settings.trainer.precision,
                       progress=console.log)
    except Exception as e:  # noqa: BLE001 - e.g. Redis refused the registration: the demo runs from the base draft
        v0 = WarmStart("failed", None, f"{type(e).__name__}: {e}")
    finally:
        torch.set_num_threads(threads)
    console.log(_v0_line(v0.version, v0.reason) if v0.version else f"[yellow]v0 is the base draft:[/] {v0.reason}")
    return v0


def _v0_line(version: int, reason: str) -> str:
    """The loading line of a promoted v0: the registry's name of the adapter (``v1``: version 0 is
    the base draft) and, once, that it is the v0 bootstrap, so the live lines' "serving v1" names
    the same adapter ("v0: v0 bootstrap ..." then "serving v1" read as two adapters).
    ``reason``: :class:`daemon.warm_start.WarmStart`'s, "v0 bootstrap (cached, <key>): held-out
    α ..." (another wording is kept whole after the name)."""
    head = "v0 bootstrap ("
    if reason.startswith(head):
        return f"v{version} (the v0 bootstrap, {reason[len(head):]}; served as v{version} from here on"
    return f"v{version} (the v0 bootstrap): {reason}; served as v{version} from here on"


def _head_warm_start(settings, models: _Models, registry, console):
    """The head's v0 (daemon.heads.ensure_head_v0) on every core, before anything is served."""
    import torch

    from daemon.heads import HeadBootstrapConfig, ensure_head_v0

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    try:
        v0 = ensure_head_v0(models.pair, models.fp, registry, HeadBootstrapConfig(), settings.trainer.precision,
                            progress=console.log)
    finally:
        torch.set_num_threads(threads)
    console.log(f"head v0: {v0.reason}")
    return v0


def _v0_head(loop, trainer: _Trainer):
    """The head's frozen v0 as it serves (None without --heads or without a v0 head)."""
    if trainer.head_v0 is None or not trainer.head_v0.version:
        return None
    from daemon.serve import head_dtype
    from decoder.heads import serving_head_loader

    return serving_head_loader(loop.decoder, head_dtype())(trainer.head_registry.fetch(trainer.head_v0.version))


def _v0_draft(models: _Models, trainer: _Trainer):
    """A torch copy of the frozen v0 draft: the derived draft with the bootstrapped adapter merged in."""
    from decoder.models.loading import derive_draft

    draft = derive_draft(models.pair.target, models.layers)
    if trainer.v0 is not None and trainer.v0.version:
        from peft import PeftModel

        draft = PeftModel.from_pretrained(draft, str(trainer.registry.fetch(trainer.v0.version))).merge_and_unload()
    return draft


def _start_serving(stack, settings, cfg: DemoConfig, store: _Store, models: _Models, trainer: _Trainer, console):
    """The serving loop, started, behind its API server; returns the loop, an OpenAI client of it
    that resends a request whose connection failed before any response byte (said once on the
    console), and that client's transport (``retried`` counts the resends; ``stack`` closes the
    server, then the loop)."""
    from daemon.http_retry import retrying_openai
    from daemon.serve import InferenceService, ServeServer, holds_base_draft
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.proposers.registry import versioned_by
    from decoder.speculative import DecoderConfig

    pair, tok, vocab = models.pair, models.tok, models.vocab
    head = versioned_by("head")  # the proposer the heads serve
    proposers = tuple(cfg.proposers) + ((head,) if cfg.heads and head not in cfg.proposers else ())
    head_kw = {}
    if cfg.heads:
        from daemon.serve import head_dtype

        head_kw = {"head_registry": trainer.head_registry, "head_dtype": head_dtype()}
    # The serving loop `daemonctl serve` runs (decoder, adapter manager, goodput controller over
    # the n-gram and draft proposers, acceptance tracker, rollback monitor, sample writer), behind
    # its OpenAI-compatible API on a free loopback port: the demo's traffic is a client's.
    # record_prompt: each request also streams the target's distributions over its prompt
    # (from the prefill it runs anyway), ~3x the trainer's data per request.
    loop = build_serving_loop(
        pair.target, pair.draft, tok, client=store.client, store_config=store.config, registry=trainer.registry,
        decoder_config=DecoderConfig(topk_record=32, record_prompt=True, draft_vocab=vocab, record_hidden=cfg.heads,
                                     target_format=models.engines.served_format),
        pair_fingerprint=models.fp,
        tap=trainer.keep_heldout, config=LoopConfig(rollback_per_workload=False), poll_interval_s=1.0,
        rollback_min_requests=6, rollback_margin=0.15, proposers=proposers,
        engine=models.engines.target, draft_engine=models.engines.draft, hold_base_draft=holds_base_draft(settings),
        **head_kw)
    loop.start()
    stack.callback(loop.close)
    # No wait for v0: the first requests are served at once (the n-gram proposer and plain decoding;
    # the derived draft is offered once v0 is prepared: serve.base_draft), and the adapter manager
    # hot-swaps v0 in between requests once the warm start promotes it.
    model_name = settings.models.target
    service = InferenceService(loop, tok, model_name, context_len=getattr(pair.target.config, "max_position_embeddings", None))
    server = stack.enter_context(ServeServer(service, "127.0.0.1", 0, keep_alive_s=settings.serve.keep_alive_s))
    # the client pauses between requests while v0 bootstraps: it lets an idle connection go before
    # the server closes it, and resends one reset before its response (daemon/http_retry.py)
    oai, resends = retrying_openai(f"{server.url}/v1", server_keep_alive_s=settings.serve.keep_alive_s, timeout_s=600,
                                   on_retry=_resend_note(console), api_key="demo")
    console.log(f"serving on {server.url}/v1 (OpenAI API); proposers {', '.join(proposers)}")
    return loop, oai, resends


def _resend_note(console) -> Callable[[Exception], None]:
    """The demo client's ``on_retry``: says on the console, the first time only, that a request was
    resent after its connection failed before any response byte, and where the count goes."""
    said = False

    def note(error: Exception) -> None:
        nonlocal said
        if not said:
            said = True
            console.log(f"[yellow]the demo's client resent a request whose connection failed before any response "
                        f"({type(error).__name__}: {rich_escape(str(error))}; e.g. a kept-alive connection the server "
                        f"closed as it was reused); every resend is counted in report.json's client_retries[/]")

    return note


def _serve_phases(cfg: DemoConfig, oai, loop, tok, model_name: str, svc, params, console, trainer=None) -> _Traffic:
    """Each phase's workload, a request at a time through the API (its first ``eval_prompts``
    prompts kept back for the evaluation), the live table after each. A phase serves for
    ``cfg.phase_seconds`` (the first one from its first request where the learner's progress ends
    phases, the bootstrap's minutes included, else from v0's arrival), then on until its workload's own
    adapter was promoted and had ``cfg.phase_min_judged`` turns judged on enough held-out evidence
    (:func:`_phase_progress`), at most ``cfg.phase_max_seconds`` (at its seconds when the trainer's
    schedule never started); each entry of ``shifts`` says how long its phase served and why it ended."""
    traffic = _Traffic()
    timeline, shifts = traffic.timeline, traffic.shifts
    t0 = traffic.t0 = time.time()
    rounds = _RoundWatch(svc, console)
    stopped = False  # said once that the trainer never started
    paced = False  # said once that the client waits while v0 bootstraps
    with _live(console) as live:
        for k, phase in enumerate(cfg.phases):
            shift = {"t": time.time() - t0, "request": len(timeline), "workload": phase}
            shifts.append(shift)
            first_waits = k == 0 and trainer is not None and not trainer.ready.is_set()
            console.log(f"phase {k + 1}/{len(cfg.phases)}: {phase} traffic for {cfg.phase_seconds:.0f} s"
                        + ((" from its first request (v0 bootstraps first; served meanwhile)"
                            if cfg.phase_min_judged and svc is not None and cfg.per_workload else
                            " once v0 is ready (the bootstrap runs first; served meanwhile)") if first_waits else "")
                        + (f", then until its adapter was promoted and judged {cfg.phase_min_judged} times (at most "
                           f"{cfg.max_phase_seconds():.0f} s{' after v0' if first_waits else ''})"
                           if cfg.phase_min_judged and svc is not None else ""))
            prompts = _prompts(phase, 1000, skip=cfg.eval_prompts)  # every distinct prompt there is (hundreds)
            start, i, extended = time.time(), 0, False
            began = start  # the phase's first request (the first phase's clock starts later, at v0)
            while True:
                now = time.time()
                bootstrapping = k == 0 and trainer is not None and not trainer.ready.is_set()
                if bootstrapping:
                    start = now  # the first phase serves from the first second; its clock starts at v0
                elif k == 0 and trainer is not None and trainer.ready_at is not None:
                    start = max(start, trainer.ready_at)
                learner = svc
                if trainer is not None and trainer.ready.is_set() and not trainer.started:
                    learner = None  # no turn will come to wait for: time-bounded
                    if not stopped:
                        stopped = True
                        console.log("[yellow]the trainer's schedule did not start (its warm start raised: see the "
                                    "error above), so no adapter is trained and each phase ends at its seconds[/]")
                # where the learner's progress ends a phase, the first one's minimum counts its traffic from
                # its first request (the bootstrap's minutes served it too) and its cap from v0: its adapter's
                # judged turns, all after v0, still decide; a time-bounded phase's seconds start at v0
                learns = bool(cfg.phase_min_judged and learner is not None and cfg.per_workload)
                done, why = (False, "") if bootstrapping else _phase_progress(
                    cfg, learner, phase, now - (began if learns else start), timeline[shift["request"]:], cap_s=now - start)
                if learns and not bootstrapping and "learner_done_s" not in shift \
                        and _learner_done(cfg, learner, phase, timeline[shift["request"]:])[0]:
                    # when the learner's part was done, on the clock of the shift's "seconds": what a
                    # shorter phase_seconds would have served (the minimum's share of each phase)
                    shift["learner_done_s"] = round(now - start, 1)
                if done:
                    break
                if why and not extended:
                    extended = True
                    console.log(f"{phase}: {cfg.phase_seconds:.0f} s served; {why}, so the phase goes on")
                p = prompts[i % len(prompts)]
                t_req = time.monotonic()
                row = _serve_one(oai, loop, tok, model_name, phase, p, cfg.max_new_tokens, t0)
                if k == 0 and trainer is not None and not trainer.ready.is_set() and cfg.bootstrap_duty < 1:
                    paced = _pace_bootstrap(cfg, trainer, console, time.monotonic() - t_req, paced)
                row["repeat"] = i >= len(prompts)  # served before in this phase: its output is in the n-gram history
                rounds.poll()  # a turn that gave way at the shift, a tail that waits: said as they happen
                i += 1
                timeline.append(row)
                live.update(_progress_table(timeline, phase, svc, loop.manager, loop.controller, (phase, params.bucket()),
                                            loop.heads),  # its seconds with the request just served
                            _progress_line(timeline, phase, i, now - began + time.monotonic() - t_req))
            live.phase_end()  # off a terminal: the phase's last table, once
            shift.update(seconds=round(time.time() - start, 1), wall_seconds=round(time.time() - began, 1), ended=why, requests=i,
                         turns=_workload_turns(svc, phase))
            rounds.note_first_promotion(shift, phase, max(began, start), start > began)  # the first phase's clock: v0
            console.log(_phase_end_line(phase, shift))  # live, not only in the summary
            traffic.phase_end_version[phase] = loop.decoder.adapter_version
            if loop.heads is not None:
                traffic.phase_end_head[phase] = loop.heads.route(phase)
    return traffic


class _RoundWatch:
    """The trainer's rounds as the phases run (``TrainerService.rounds_log``; a stand-in without it
    says nothing): :meth:`poll` says on the console a workload turn that gave way to another's newer
    traffic and a shift's tail that waits behind the newer workload, once until that workload's
    turn trains (each round it waits behind the newest: a walkthrough read prose's wait three
    times, behind code, math and extract); both otherwise only in a round's reason
    (docs/training.md)."""

    def __init__(self, svc, console):
        self._log = getattr(svc, "rounds_log", None)
        self.console, self.seen, self._said = console, 0, set()  # _said: workloads whose wait was said

    def poll(self) -> None:
        if self._log is None:
            return
        for r in self._log(since=self.seen):
            self.seen = max(self.seen, r["round"])
            self._said -= {w for w, t in (r.get("turns") or {}).items() if t.get("decision") in ("promoted", "rejected", "non_finite")}
            y = r.get("yielded")
            if y:  # its records are a waiting tail now: that is said here, not again on the next round
                self._said.add(y["workload"])
                self.console.log(f"trainer: {y['workload']}'s turn gave way to {y['to']}'s newer traffic after "
                                 f"{_count(y['steps'], 'step')} (not judged; {y['workload']}'s last records wait, "
                                 f"{y['to']} is learnt first)")
            for w, v in sorted((r.get("waits") or {}).items()):
                if w not in self._said:
                    self._said.add(w)
                    self.console.log(f"trainer: {w}'s last records wait behind {v}'s newer traffic ({v} is learnt "
                                     f"first; they train once a round holds nothing newer, or trainer.tail_wait_s after)")

    def note_first_promotion(self, shift: dict, workload: str, since: float, from_v0: bool = False) -> None:
        """``shift["first_promotion_s"]``: seconds from ``since`` (time.time(): the phase's first
        request, or v0's arrival, ``from_v0``, for a first phase served while v0 bootstrapped, as its
        clock) to the end of the first round after it that promoted ``workload``'s own adapter
        (``shift["first_promotion_from"]`` names the start); left out when none did (or the log is
        unavailable)."""
        if self._log is None:
            return
        ends = [r["started_at"] + r["seconds"] for r in self._log()
                if r["started_at"] >= since and ((r.get("turns") or {}).get(workload) or {}).get("decision") == "promoted"]
        if ends:
            shift["first_promotion_s"] = round(min(ends) - since, 1)
            shift["first_promotion_from"] = "v0's arrival" if from_v0 else "its first request"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _pace_bootstrap(cfg: DemoConfig, trainer: "_Trainer", console, served_s: float, said: bool) -> bool:
    """While v0 bootstraps, wait after a request that took ``served_s`` seconds so that serving takes
    at most ``cfg.bootstrap_duty`` of the wall time (back at once when v0 is ready); says so once
    (``said``: already said). Returns True (said)."""
    if not said:
        console.log(f"while v0 bootstraps, the demo's client waits between requests (serving at most "
                    f"{cfg.bootstrap_duty:.0%} of the time), leaving the cores to the bootstrap")
    trainer.ready.wait(max(0.0, served_s) * (1.0 / cfg.bootstrap_duty - 1.0))
    return True


def _workload_turns(svc, workload: str, st: dict | None = None) -> dict[str, int]:
    """The trainer's count of ``workload``'s own adapter turns (TrainerService.status()'s
    ``workload_turns``: turns, judged, promoted); zeros before its first, and for a count the
    status lacks. ``st``: a status already read."""
    st = (svc.status() if svc is not None else {}) if st is None else st
    return {"turns": 0, "judged": 0, "promoted": 0} | ((st.get("workload_turns") or {}).get(workload) or {})


def _phase_progress(cfg: DemoConfig, svc, workload: str, served_s: float, rows=(), cap_s: float | None = None) -> tuple[bool, str]:
    """Whether a phase that has served ``served_s`` seconds (since its start) ends now, and why;
    ``cap_s``: its seconds on the clock ``cfg.max_phase_seconds()`` caps (``served_s`` when None; the
    first phase's runs from v0's arrival).

    It ends at ``cfg.phase_seconds`` once its workload's own adapter has been promoted, has had
    ``cfg.phase_min_judged`` turns judged on enough held-out evidence (the gate's min_eval_requests
    and min_eval_positions: promoted or refused on evidence, not for the lack of it), and its
    promoted version (the status's ``workload_versions``) has served ``cfg.phase_min_served`` of
    the phase's requests ``rows`` (timeline rows: a version promoted in the phase's last second
    served none of it, and the phase's own traffic never met what it learnt); and at
    ``cfg.max_phase_seconds()`` whatever the trainer did: phases sized by the learner's progress,
    not by the clock alone (on a slower CPU, 120 s left a workload 14 held-out samples and nothing
    promoted). Returns ``(done, why)``; ``why`` is "" while the phase is inside its ``phase_seconds``.
    """
    if served_s < cfg.phase_seconds:
        return False, ""
    if not cfg.phase_min_judged or svc is None or not cfg.per_workload:
        return True, f"{cfg.phase_seconds:.0f} s served"
    met, t, own, by_own = _learner_done(cfg, svc, workload, rows)
    if met:
        return True, (f"{cfg.phase_seconds:.0f} s served and {t['judged']} judged turns of its adapter "
                      f"({t['promoted']} promoted)" + (f"; its v{own} served {_requests(by_own)}" if cfg.phase_min_served else ""))
    if (served_s if cap_s is None else cap_s) >= cfg.max_phase_seconds():
        return True, (f"phase_max_seconds {cfg.max_phase_seconds():.0f} s reached with {t['judged']} of "
                      f"{cfg.phase_min_judged} judged turns ({t['turns']} turns, {t['promoted']} promoted)")
    why = (f"its adapter has had {t['judged']} turn{'' if t['judged'] == 1 else 's'} judged on enough held-out evidence (the phase needs "
           f"{cfg.phase_min_judged}; {t['turns']} turns in all) and {t['promoted']} promotions")
    if t["judged"] >= cfg.phase_min_judged and t["promoted"]:
        why += (f"; its promoted v{own} has served {by_own} of {cfg.phase_min_served} requests" if own else
                "; its promoted version has not served yet")
    return False, why


def _learner_done(cfg: DemoConfig, svc, workload: str, rows=()) -> tuple[bool, dict[str, int], int, int]:
    """Whether ``workload``'s learner has done what ends its phase (:func:`_phase_progress`, the
    clock aside): its own adapter promoted, ``cfg.phase_min_judged`` turns judged, and its promoted
    version served ``cfg.phase_min_served`` of ``rows``. Returns (done, its turns, its own promoted
    version (0: none), the rows that version served)."""
    st = svc.status()
    t = _workload_turns(svc, workload, st)
    own = int(((st or {}).get("workload_versions") or {}).get(workload) or 0)
    by_own = sum(1 for r in rows if own and r.get("adapter_version") == own)
    return (t["judged"] >= cfg.phase_min_judged and bool(t["promoted"]) and by_own >= cfg.phase_min_served), t, own, by_own


# what the live table's two rates are, once a run (a walkthrough read "rolling tokens/s 62.40" beside
# "ngram γ=2: 0.114 tok/ms vs plain 0.091" as 62 tokens/s against 114)
_LIVE_RATES_NOTE = ("rolling tokens/s: whole requests, each one's output tokens over its time, prefill included; "
                    "speculation's tok/ms: the controller's goodput estimates per decoding step, prefill left out, "
                    "what it picks by: two rates, not one")


class _Snapshots:
    """The live table where rich's ``Live`` cannot redraw (a log file or a pipe): a full table at
    every update wrote 10 tables (52 KB) into one quick demo's log. Here each update keeps the
    table and prints its one-line summary at most once every ``every_s`` seconds (wall); the table
    itself is printed once, at each phase's end (:meth:`phase_end`), the first one with
    ``_LIVE_RATES_NOTE`` as its caption (once a run, not under every table)."""

    def __init__(self, console, every_s: float = 60.0):
        self.console, self.every_s = console, every_s
        self._last = float("-inf")
        self._table = None
        self._noted = False

    def update(self, table, line: str = "") -> None:
        """Keep ``table`` for the phase's end; print ``line`` if ``every_s`` passed since the last one."""
        self._table = table
        now = time.monotonic()
        if line and now - self._last >= self.every_s:
            self.console.log(line)
            self._last = now

    def phase_end(self) -> None:
        """Print the last table kept, once; the run's first with what its two rates are."""
        if self._table is not None:
            if not self._noted:
                self._noted = True
                self._table.caption = _LIVE_RATES_NOTE
            self.console.print(self._table)
            self._table = None


class _TerminalLive:
    """rich's ``Live`` behind :class:`_Snapshots`'s methods: the table redrawn in place, no line;
    ``_LIVE_RATES_NOTE`` its caption (one table on the screen, so said once)."""

    def __init__(self, live):
        self.live = live

    def update(self, table, line: str = "") -> None:
        if table is not None:
            table.caption = _LIVE_RATES_NOTE
        self.live.update(table)

    def phase_end(self) -> None:
        pass


@contextlib.contextmanager
def _live(console, every_s: float = 60.0):
    """:class:`_TerminalLive` on a terminal, else :class:`_Snapshots`: an object with
    ``update(table, line)`` and ``phase_end()``."""
    if console.is_terminal:
        from rich.live import Live

        with Live(console=console, refresh_per_second=2, transient=False) as live:
            yield _TerminalLive(live)
    else:
        yield _Snapshots(console, every_s)


_PROMPT_TOKENS = 256  # a prompt is served and evaluated on its last this many tokens
_RATE_MIN_REQUESTS, _RATE_MIN_SECONDS = 2, 1.0  # a progress line gives rates from this many requests and seconds


def _progress_line(timeline, phase: str, requests: int, seconds: float) -> str:
    """The live table's gist in one line (the log's progress off a terminal): the phase's requests
    and seconds so far (``seconds`` since its first request began, the last one included), its
    rolling α and tokens/s (:func:`_recent`), the version serving it. Before
    ``_RATE_MIN_REQUESTS`` requests and ``_RATE_MIN_SECONDS`` s it gives no rate and no rolling
    α, only what is known: "first request served" (one request, in under a second, gives no rate
    and no rolling mean)."""
    spec, recent, alpha, tau, tps = _recent(timeline, phase)
    v = recent[-1].get("adapter_version") if recent else None
    serving = "; no adapter yet (the draft waits for v0)" if v == 0 else f"; serving v{v}" if v is not None else ""
    if requests < _RATE_MIN_REQUESTS or seconds < _RATE_MIN_SECONDS:
        done = "first request served" if requests == 1 else f"{_requests(requests)} served"
        return f"{phase}: {done} (its rolling α and tokens/s once there are more){serving}"
    return (f"{phase}: {_requests(requests)} in {seconds:.0f} s; last {len(recent)}: "
            + (_alpha_per_proposer(spec) if alpha is not None and tau is not None else "plain decoding")
            + (f", {tps:.1f} tokens/s" if tps is not None else "") + serving)


def _alpha_per_proposer(spec: list[dict]) -> str:
    """The rolling α and τ of ``spec`` (timeline rows that speculated, each with an ``alpha``) per
    ``proposer``, in the order each first appears: "ngram α 0.800, τ 2.00 (4 speculated) and draft
    α 0.250, τ 1.10 (2 speculated)". One mean over the n-gram's and the draft's requests moved
    with their mix, not with either's acceptance (a walkthrough read 0.690 -> 0.282 around v1's
    arrival as the bootstrap halving α). Rows without a proposer are one group, named by none."""
    groups: dict[str | None, list[dict]] = {}
    for r in spec:
        groups.setdefault(r.get("proposer"), []).append(r)
    parts = []
    for name, rows in groups.items():
        a = sum(r["alpha"] for r in rows) / len(rows)
        taus = [r["tau"] for r in rows if r.get("tau") is not None]
        at = _alpha_tau(a, sum(taus) / len(taus), len(rows)) if taus else f"{a:.2f}" if len(rows) == 1 else f"{a:.3f}"
        n = ("(one request's: the only one that speculated)" if len(spec) == 1 else
             "(one request's)" if len(rows) == 1 else f"({len(rows)} speculated)")
        parts.append(f"{name + ' ' if name else ''}α {at} {n}")
    return " and ".join(parts)


def _serve_one(oai, loop, tok, model_name: str, phase: str, p, max_new_tokens: int, t0: float,
               ignore_eos: bool = False) -> dict:
    """One greedy completion of prompt ``p`` through the API (``ignore_eos``: all
    ``max_new_tokens`` of it, as the evaluation decodes); its timeline row (draftd's metrics for
    the request, and whether a shift alarm or a rollback came with it)."""
    alarms, rollbacks = len(loop.tracker.alarms), len(loop.monitor.decisions)
    head_judged = len(loop.head_monitor.decisions) if loop.head_monitor is not None else 0
    t_req = time.perf_counter()
    resp = oai.completions.create(model=model_name, prompt=p.token_ids(tok)[-_PROMPT_TOKENS:], temperature=0,
                                  max_tokens=max_new_tokens,
                                  extra_body={"workload": phase, **({"ignore_eos": True} if ignore_eos else {})})
    wall_ms = (time.perf_counter() - t_req) * 1e3
    m = (resp.model_extra or {})["draftd"]
    rb = next((d for d in loop.monitor.decisions[rollbacks:] if d.rolled_back), None)
    if rb is None and loop.head_monitor is not None:
        rb = next((d for d in loop.head_monitor.decisions[head_judged:] if d.rolled_back), None)
    return {
        "t": round(time.time() - t0, 2), "workload": phase, "adapter_version": m["adapter_version"],
        "head_version": m.get("head_version", 0), "gamma": m["gamma"], "proposer": m.get("proposer"),
        "alpha": m["alpha"], "tau": m["tau"], "acceptance_rate": m["acceptance_rate"],
        "tokens": m["output_tokens"], "latency_ms": m["latency_ms"], "http_ms": round(wall_ms, 1),
        "tokens_per_s": round(m["output_tokens"] / m["latency_ms"] * 1e3, 3) if m["latency_ms"] else None,
        "shift_alarm": len(loop.tracker.alarms) > alarms, "rollback": rb.reason if rb else None,
        "decision": m.get("why"), "proposed": m.get("proposed_tokens"),
    }


def _finish_serving(trainer: _Trainer, loop, console, remeasure: Callable[[], Any] | None = None) -> Any:
    """Stop the trainer and the adapter manager with the last promoted adapter installed, so the
    decoder runs one fixed adapter through the evaluation. ``remeasure`` runs once the trainer
    has stopped and the last promoted version is prepared, while each workload's requests still
    get their own adapter (:func:`_remeasure`); its result is returned."""
    decoder, manager = loop.decoder, loop.manager
    trainer.ready.wait()  # the warm start has settled (the first phase waited for it) and started the schedule
    # a walkthrough sat 70 s without a line here: the round in flight, then the re-measurement's requests
    console.log("stopping the trainer (a round under way stops training at once)"
                + (", then the step costs are measured again with the cores free" if remeasure is not None else ""))
    # the serving is over: the round under way stops training at its next step (what it trained is
    # judged; the turns it had not begun leave their records pending) instead of training a turn more
    trainer.svc.stop(cut_round=True)
    # A version promoted by that last round is swapped in now, and the watcher stopped, so the
    # "final adapter" evaluated below is the one the decoder runs (no swap mid-evaluation).
    latest = trainer.registry.active_version()
    if latest != decoder.adapter_version:
        manager.wait_prepared(latest, 60)
    remeasured = remeasure() if remeasure is not None else None
    # The watcher thread briefly holds the model lock (eviction) and the switch never waits for
    # it (a request must not block), so stop the watcher before the last switch.
    manager.stop()
    decoder.run_between_requests()
    if decoder.adapter_version != latest:
        console.log(f"[yellow]the last promoted adapter v{latest} could not be installed; evaluating "
                    f"v{decoder.adapter_version}[/]")
    manager.close()  # no hook left to swap during the evaluation
    if loop.heads is not None:  # the same for the head: the last promoted one, then no more swaps
        latest = trainer.head_registry.active_version()
        loop.heads.wait_prepared(latest, 60)
        loop.heads.stop()
        decoder.run_between_requests()
        loop.heads.close()
        console.log(f"final head v{decoder.head_version}")
    own = {w: v for w, v in trainer.registry.active_versions().items() if w and v}  # per-workload adapters
    console.log(f"serving done (shared adapter v{decoder.adapter_version}"
                + (f"; per workload: {', '.join(f'{w} v{v}' for w, v in sorted(own.items()))}" if own else "")
                + "); evaluating frozen vs adapted drafts")
    return remeasured


def _remeasure(cfg: DemoConfig, oai, loop, tok, model_name: str, traffic: _Traffic, console) -> dict[str, Any]:
    """The controller's step costs measured again with the trainer stopped, before the evaluation
    asks it for each workload's pick: every step of the phases ran beside the trainer's rounds,
    where a verified row cost more of a plain step than it does alone, and the evaluation decodes
    alone. ``GoodputController.remeasure_costs`` and ``StepCost.clear`` forget the costs, the
    draft's α and the n-gram's accepted lengths, then ``cfg.remeasure_requests`` requests per
    workload, prompts of its pool its phase never reached (never served, never evaluated), warm each proposer and plain
    decoding up again through the API, as after any change of load. They decode what the evaluation
    decodes, ``cfg.eval_new_tokens`` tokens past any end of sequence, not the phases'
    ``max_new_tokens``: the n-gram's accepted lengths are learnt again here, and a copy-heavy
    request's first 32 tokens copy more than its 64 do (bench/RESULTS.md, "Twenty-fourth
    session"). Returns what it served."""
    t0 = time.time()
    cost = loop.decoder.step_cost
    first_alarm = len(loop.tracker.alarms)  # the alarms this re-measurement raises: shift_alarms[first:last]
    before = {"step_cost_ms": cost.status(), "engine_ceiling": cost.ceiling(loop.controller.config.gamma_max)}
    keys = loop.controller.remeasure_costs()
    cost.clear()
    # every request may probe a candidate inside its bound (not every other): these requests are for measuring
    every = loop.controller.config.unsure_probe_every
    loop.controller.config.unsure_probe_every = 1
    served = {s["workload"]: int(s.get("requests") or 0) for s in traffic.shifts}
    rows = []
    try:
        for phase in cfg.phases:
            pool = _prompts(phase, 1000, skip=cfg.eval_prompts)
            for j in range(cfg.remeasure_requests):
                rows.append(_serve_one(oai, loop, tok, model_name, phase, pool[(served.get(phase, 0) + j) % len(pool)],
                                       cfg.eval_new_tokens, t0, ignore_eos=True))
    finally:
        loop.controller.config.unsure_probe_every = every
    out = {"requests": len(rows), "new_tokens": cfg.eval_new_tokens, "keys": keys, "seconds": round(time.time() - t0, 1),
           "alarms": {"before": first_alarm, "after": len(loop.tracker.alarms)},
           "alarms_are": ("the count of the report's shift_alarms before and after these requests: they raised "
                          "shift_alarms[before:after] (none where equal)"),
           "beside_trainer": before, "step_cost_ms": cost.status(),
           "engine_ceiling": cost.ceiling(loop.controller.config.gamma_max),
           "decisions": [{"workload": r["workload"], "proposer": r["proposer"], "gamma": r["gamma"],
                          "decision": r["decision"]} for r in rows]}
    out["picks"] = _picks_now(loop.controller, cfg.phases)
    console.log(f"the trainer stopped: step costs measured again on {len(rows)} requests ({out['seconds']:.0f} s) "
                f"before the evaluation asks the controller for its picks; they are now "
                + ", ".join(f"{w} {p}" for w, p in out["picks"].items())
                + " (the phases' live lines priced them beside the trainer's rounds)")
    return out


def _picks_now(controller, phases) -> dict[str, str]:
    """``{workload: "ngram γ=8" | "plain"}``: the controller's greedy pick per workload now (a
    walkthrough read "speculation off" on the phases' live lines and n-gram picks in the table
    after the re-measurement, and nothing on the console between the two)."""
    from decoder.sampling import SamplingParams

    bucket = SamplingParams().bucket()
    out = {}
    for w in phases:
        d = controller.decision((w, bucket)) or {}
        g = int(d.get("gamma") or 0)
        out[w] = f"{d.get('proposer') or 'draft'} γ={g}" if g else "plain"
    return out


def _report(cfg: DemoConfig, run_id: str, t_start: float, store: _Store, models: _Models, trainer: _Trainer, loop,
            traffic: _Traffic, table: list[dict]) -> dict[str, Any]:
    """The run's report (before the plot's path is added)."""
    from decoder.engines.llamacpp_lib import amx_rows
    from decoder.shift import recovery_stats

    pair, decoder, controller = models.pair, loop.decoder, loop.controller
    timeline, shifts = traffic.timeline, traffic.shifts
    st = trainer.svc.status()
    for sh in shifts:  # its "turns" are counted at the phase's end; the trainer goes on with its records later
        sh["turns_by_run_end"] = _workload_turns(None, sh.get("workload"), st)
    return {
        "run_id": run_id, "key_prefix": store.prefix, "redis": store.rh.describe(), "pair": {"target": pair.target_name, "draft": pair.draft_name},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
        "seconds": round(time.time() - t_start, 1), "requests": len(timeline),
        "active_adapter": decoder.adapter_version,
        "workload_adapters": {w: v for w, v in trainer.registry.active_versions().items() if w},  # per_workload
        "adapters": [_adapter_row(r) for r in trainer.registry.list()],
        "heads": ([_adapter_row(r) for r in trainer.head_registry.list()] if trainer.head_registry is not None else None),
        "head_v0": trainer.head_v0.__dict__ if trainer.head_v0 is not None else None,
        "trainer": _jsonable(st), "swaps": loop.manager.status(),
        **_monitor_checks(loop.monitor),
        "head_rollbacks": [d.__dict__ for d in loop.head_monitor.decisions] if loop.head_monitor is not None else None,
        "shift_alarms": [a.__dict__ for a in loop.tracker.alarms], "shifts": shifts,
        "serving": loop.status(), "ngram_history_tokens": decoder.ngram_history.status(),
        "ngram_gate": decoder.ngram_gate.status() if decoder.ngram_gate is not None else None,
        "served_format": models.engines.served.describe() if models.engines.served is not None else None,
        "amx_rows": amx_rows(),  # llama.cpp's AMX path: the rows its per-row kernel takes (decoder.engines.amx_rows)
        "v_cache": getattr(models.engines.target, "v_cache", None),  # plain decoding's and every row's (llamacpp.py)
        "step_cost_ms": decoder.step_cost.status(),
        "engine_ceiling": decoder.step_cost.ceiling(controller.config.gamma_max),
        "controller": _jsonable(controller.status()),
        "phases": table, "recovery": recovery_stats(timeline, shifts), "timeline": timeline,
        # the trainer's rounds (TrainerService.rounds_log: the latest 512), "t" on the timeline's clock
        "trainer_rounds": [r | {"t": round(r["started_at"] - traffic.t0, 1)} for r in trainer.svc.rounds_log()]
        if hasattr(trainer.svc, "rounds_log") else None,
    }


def _peer_gguf(settings, models: _Models):
    """The packaged target GGUF file llama.cpp's peer decodes; None off llama.cpp or for a target
    that is not a GGUF file."""
    from decoder.engines.registry import target_gguf

    return target_gguf(settings.models.target) if models.engines.name == "llamacpp" else None


def _peer_file(settings, models: _Models) -> str | None:
    """The file name of :func:`_peer_gguf` (the report's ``llamacpp_peer_file``), None without a peer."""
    gguf = _peer_gguf(settings, models)
    return Path(gguf).name if gguf is not None else None


def _llamacpp_peer(settings, models: _Models, decoder, console):
    """llama-cpp-python's own plain generation on the packaged target file with upstream llama.cpp's
    kernels (``decoder.bench.UpstreamLlamaCppPeer``: a process of its own, every draftd patch
    switched off), at the decoder's thread count: what a user of llama.cpp gets without draftd. A
    context manager: ``contextlib.nullcontext(None)`` off llama.cpp or for a target that is not a
    GGUF file."""
    import contextlib

    gguf = _peer_gguf(settings, models)
    if gguf is None:
        return contextlib.nullcontext(None)
    from decoder.bench import UpstreamLlamaCppPeer

    console.log(f"llama.cpp's own plain generation on {Path(gguf).name} joins the evaluation (the peer, paired per "
                f"prompt; in a process of its own with upstream's kernels, none of draftd's patches)")
    return UpstreamLlamaCppPeer(str(gguf), threads=getattr(decoder.engine, "threads", 1))


def evaluate_phases(cfg, heldout, phase_end_version, timeline, distiller, registry, decoder, frozen_draft, tok,
                    params, console, controller=None, v0_version: int = 0, frozen_head=None, peer=None) -> list[dict]:
    """The per-phase table: frozen v0 vs what adaptation built, on prompts never served.

    v0 is what served the first request: the bootstrapped adapter ``v0_version`` (daemon.warm_start)
    or, when there is none (0), the base draft; ``frozen_draft`` is its torch copy.

    - ``heldout_alpha``: α = Σ min(p, q) at temperature 1 over the stored top-k support, on the
      phase's held-out samples (served requests the trainer never trained on; Distiller.evaluate),
      for v0 (frozen), the adapter active when the phase ended, and the final one;
      ``heldout_served``: the same records' acceptance as served (greedy agreement on these
      greedy requests: ``EvalCounts.served``), the rate the promotion gate judges.
    - decoded, on ``eval_prompts`` prompts never served, greedy, ``max_new_tokens`` each:
      ``plain`` (γ = 0); ``frozen`` (v0) and ``adapted_draft`` (the final adapter)
      at γ = ``eval_gamma``; ``adapted``: what the goodput controller picks for the phase's
      workload at the end (proposer and γ; plain decoding when it keeps speculation off), the
      n-gram proposer indexing only what was served (each evaluation request decodes against a
      copy of the served history, so evaluation requests never see each other). Greedy α (share
      of proposals accepted), τ, tokens/s and speedup vs plain, all measured.
    - with ``--heads`` (``frozen_head``: the head's v0 as it serves): ``frozen_head`` and
      ``adapted_head`` (the final head), the ``"eagle"`` proposer at γ = ``head_gamma``.
    - ``llamacpp_plain`` (``peer``, a ``decoder.bench.LlamaCppPeer`` on the packaged file): llama.cpp's
      own plain generation on the same prompts, back to back with the others; ``speed_vs_llamacpp_ci``:
      plain decoding of the served format and the pick against it, paired per prompt.
    - every speculative run's ``matches_plain``: "k/n" prompts whose greedy output is token-identical
      to the plain run's (lossless), ``differs_from_plain`` the others' indices.
    - live: the phase's served requests, first and last third: greedy α and tokens/s.

    Every decoded side runs without the decoder's record sink (restored after): nothing decoded
    here reaches the buffer, and no side pays for the records serving streams.
    """
    from decoder.speculative import DecoderConfig, SpeculativeDecoder

    ev = _PhaseEval(cfg, heldout, phase_end_version, timeline, distiller, registry, decoder, None, tok, params,
                    console, controller, v0_version, frozen_head, peer)
    ev.v0_state = ev.state_of(v0_version)
    ev.served_history, ev.served_gate = decoder.ngram_history, decoder.ngram_gate
    ev.gate_of = _gate_loader(registry)
    # one measurement for every phase's prediction: the step costs as the evaluation begins (re-measured
    # with the trainer stopped, when the demo did); the evaluation's own steps move StepCost phase by phase
    ev.step_costs = dict(decoder.step_cost.status())
    # the same head as the adapted draft (FR-Spec or not), so the rows differ by training only
    # on llama.cpp the frozen draft is the draft's own context with v0's LoRA set (see _frozen_lora)
    ev.frozen = SpeculativeDecoder(decoder.target, frozen_draft, tok, DecoderConfig(draft_vocab=decoder.config.draft_vocab),
                                   engine=decoder.engine, draft_engine=decoder.draft_engine)
    # the evaluation's prompts stay unseen by the learner, and every side decodes alike: no records
    # (the served decoder's sink also scored each prompt's top-k, prefill at every prompt row)
    sink, decoder.sink = decoder.sink, None
    try:
        return [ev.phase_row(phase) for phase in cfg.phases]
    finally:
        decoder.ngram_history, decoder.ngram_gate = ev.served_history, ev.served_gate
        decoder.sink = sink


@dataclass
class _PhaseEval:
    """What :func:`evaluate_phases` measures each phase with, and one method per measured side:
    held-out α, the decoded runs (ours, v0, the pick, the heads, llama.cpp's plain), the adapter
    versions, the live requests."""

    cfg: Any
    heldout: dict
    phase_end_version: dict
    timeline: list
    distiller: Any
    registry: Any
    decoder: Any
    frozen: Any  # the SpeculativeDecoder over the frozen v0 draft
    tok: Any
    params: Any
    console: Any
    controller: Any
    v0_version: int
    frozen_head: Any
    peer: Any
    v0_state: Any = None  # v0's adapter state (Distiller.adapter_state, or BASE)
    served_history: Any = None  # the n-gram history and gate as serving left them
    served_gate: Any = None
    gate_of: Any = None  # version -> its copy gate (_gate_loader)
    step_costs: Any = None  # {rows: ms} as the evaluation began: every phase's Leviathan prediction reads these
    wall: dict = field(default_factory=dict)  # side -> wall seconds in the phase being evaluated

    def state_of(self, version: int):
        """The adapter state of ``version`` (0: the base draft)."""
        from trainer.distill import BASE

        if version == 0:
            return BASE
        self.distiller.load_adapter_weights(self.registry.fetch(version))
        return self.distiller.adapter_state()

    def phase_row(self, phase: str) -> dict[str, Any]:
        """The table's row of ``phase``."""
        cfg, decoder = self.cfg, self.decoder
        # the version serving the phase's workload now: its own scope's (per_workload), else the shared one
        final = self.registry.resolve(phase) if cfg.per_workload else decoder.adapter_version
        final_state = self.state_of(final)
        row: dict[str, Any] = {"workload": phase, "adapter_at_phase_end": self.phase_end_version.get(phase, 0),
                               "final_adapter": final, "v0_version": self.v0_version}
        pick_g, pick_p = self.controller_pick(row, phase)
        ps = _prompts(phase, cfg.eval_prompts)
        runs = self.runs(pick_g, pick_p, row["controller_pick"].get("runner_up"))
        up = row["controller_pick"].get("runner_up")
        # the versions _versions_check decodes besides v0 and the final one (none off a LoRA engine)
        between = (len(_version_chain(self.timeline, phase, self.v0_version, final)[1])
                   if supports(getattr(decoder, "draft_engine", None), "lora") else 0)
        self.console.log(f"evaluating {phase}: held-out α on {len(self.heldout.get(phase, []))} served requests never "
                         f"trained on, then {len(ps)} prompts never served: plain, frozen v0, adapted draft, "
                         + (f"the pick ({pick_p} γ={pick_g})" if pick_g else "the pick (plain: speculation off)"
                            + (f", the speculation it left off ({up['proposer']} γ={up['gamma']})" if up else ""))
                         + (", llama.cpp's plain" if self.peer is not None else "")
                         + (f", and the {between} version{'' if between == 1 else 's'} that "
                            f"served the phase between v0 and the final one" if between else ""))
        self.wall = {}  # side -> wall seconds: where the evaluation's minutes go (row["eval_wall_s"])
        t0 = time.perf_counter()
        self.heldout_side(row, phase, final_state)
        self.wall["heldout"] = time.perf_counter() - t0
        tot, per_prompt, differs, peer_runs = self.decode_side(phase, ps, runs, final)
        row["copy_gate"] = {"v0": _gate_list(self.gate_of(self.v0_version)), "final": _gate_list(self.gate_of(final))}
        _decoded_rows(row, runs, tot, differs, len(ps))
        row.update(_paired_intervals(per_prompt, cfg.confidence))
        _price_with_prefill(row["controller_pick"], tot["plain"][0].prefill_ms, tot["plain"][1])
        from decoder.proposers.cost import read_off

        costs = self.step_costs
        row["adapted_draft"]["prediction"] = pred = leviathan_prediction(
            tot["adapted_draft"][0], tot["plain"][0], decoder.step_cost.ms if costs is None else (lambda n: read_off(costs, n)),
            gamma_max=self.controller.config.gamma_max if self.controller is not None else 8)
        if pred is not None and costs is not None:
            pred["step_cost_ms"] = costs  # which measurement: the same for every phase
        if peer_runs:
            row["llamacpp_plain"] = {"tokens_per_s": round(sum(n for n, _, _ in peer_runs) / sum(ms for _, ms, _ in peer_runs) * 1e3, 3),
                                     "same_tokens_as_plain": f"{sum(s for *_, s in peer_runs)}/{len(peer_runs)}"}
            row["speed_vs_llamacpp_ci"] = _speed_vs_peer(per_prompt, peer_runs, cfg.confidence)
        t0 = time.perf_counter()
        self.versions_side(row, phase, ps, per_prompt, final)
        self.wall["versions"] = time.perf_counter() - t0
        row["eval_wall_s"] = {k: round(v, 1) for k, v in self.wall.items()}
        said = {"heldout": "held-out α", "frozen": "frozen v0", "adapted_draft": "adapted draft", "adapted": "the pick",
                "llamacpp_plain": "llama.cpp's plain", "versions": "versions between",
                "runner_up": "the speculation left off"}
        self.console.log(f"{phase} evaluated in {sum(self.wall.values()):.0f} s: "
                         + ", ".join(f"{said.get(k, k).replace('_', ' ')} {v:.0f} s" for k, v in self.wall.items()
                                     if k != "versions" or v >= 0.5))
        if "adapted_head" in row:
            row["final_head"] = decoder.head_version
            row["head_alpha_gain"] = _nn((row["adapted_head"]["alpha"] or 0) - (row["frozen_head"]["alpha"] or 0))
        # what training bought the draft: the adapted draft's α over the frozen v0's (the pick may be
        # plain decoding, whose α is None, or the n-gram proposer, which is not trained)
        row["alpha_gain"] = _nn((row["adapted_draft"]["alpha"] or 0) - (row["frozen"]["alpha"] or 0))
        _live_side(row, self.timeline, phase)
        return row

    def heldout_side(self, row: dict, phase: str, final_state) -> None:
        """Held-out α and served acceptance of v0, the phase-end adapter and the final one."""
        held = self.heldout.get(phase, [])
        row["heldout_samples"] = len(held)
        if held:
            import torch

            d = self.distiller
            # one evaluation per distinct version (the phase-end adapter is usually the final one), on
            # every core: the trainer is stopped and nothing else runs while the evaluation does (the
            # demo keeps torch at 1 thread beside serving)
            versions = {"frozen": self.v0_version, "phase_end": row["adapter_at_phase_end"], "final": row["final_adapter"]}
            done: dict[int, Any] = {}
            threads = torch.get_num_threads()
            torch.set_num_threads(max(1, os.cpu_count() or 1))
            try:
                for k, v in versions.items():
                    if v not in done:
                        done[v] = d.evaluate(held, adapter=self.v0_state if k == "frozen" else
                                             final_state if k == "final" else self.state_of(v))
            finally:
                torch.set_num_threads(threads)
            ev = {k: done[v] for k, v in versions.items()}
            row["heldout_alpha"] = {k: _nn(e.alpha) for k, e in ev.items()}
            row["heldout_served"] = {k: _nn(e.served) for k, e in ev.items()}  # what the gate judges

    def controller_pick(self, row: dict, phase: str) -> tuple[int, str | None]:
        """The controller's proposer and γ for the phase's workload now: (γ, proposer); (0, None) plain."""
        pick = self.controller.decision((phase, self.params.bucket())) if self.controller is not None else {}
        pick_g = int(pick.get("gamma") or 0)
        pick_p = pick.get("proposer") if pick_g else None
        row["controller_pick"] = {"proposer": pick_p, "gamma": pick_g, "why": pick.get("why"),
                                  "priced_vs_plain": _priced(pick, pick_p, pick_g),
                                  "t_plain_ms": pick.get("t_plain_ms")}  # the plain step its `why` prices on
        if not pick_g:
            up = _runner_up(pick)
            if up is not None:
                row["controller_pick"]["runner_up"] = up
        return pick_g, pick_p

    def runs(self, pick_g: int, pick_p: str | None, runner_up: dict | None = None) -> tuple:
        """The decoded rows: (name, decoder, γ, proposer) each; with a plain pick's ``runner_up``
        (:func:`_runner_up`) its row too, ``"runner_up"``: what speculation the controller left
        off would have run on the same prompts."""
        cfg, decoder, frozen = self.cfg, self.decoder, self.frozen
        runs = (("plain", decoder, 0, None), ("frozen", frozen, cfg.eval_gamma, "draft"),
                ("adapted_draft", decoder, cfg.eval_gamma, "draft"))
        if cfg.copy_ablation:  # what the copy gate adds, and what a fixed, untrained one gives
            runs += (("adapted_nogate", decoder, cfg.eval_gamma, "draft"), ("frozen_fixedgate", frozen, cfg.eval_gamma, "draft"))
        if pick_g:  # a plain pick is the plain run itself (no second measurement of the same thing)
            runs += (("adapted", decoder, pick_g, pick_p),)
        elif runner_up is not None:
            runs += (("runner_up", decoder, runner_up["gamma"], runner_up["proposer"]),)
        if self.frozen_head is not None and decoder.eagle_head is not None:
            runs += (("frozen_head", decoder, cfg.head_gamma, "eagle"), ("adapted_head", decoder, cfg.head_gamma, "eagle"))
        return runs

    def fresh_history(self) -> None:
        """The n-gram history and gate as serving left them (evaluation teaches neither)."""
        self.decoder.ngram_history = self.served_history.copy()
        self.decoder.ngram_gate = self.served_gate.copy() if self.served_gate is not None else None

    def decode_side(self, phase: str, ps, runs, final: int):
        """Every run on every prompt, back to back per prompt (paired: a slower host slows all
        alike), and llama.cpp's plain generation of the same prompt. Plain decoding prefills the
        prompt itself (the prompt cache cleared); every later run keeps those cells (the same bits,
        ``LlamaCppEngine.start``) and is charged plain's measured prefill time for them, so each row's
        milliseconds are what it would take alone at the cost of one prefill per prompt instead of one per
        row (on a CPU a prompt's prefill can cost more than its decoded tokens: bench/RESULTS.md, "The
        prompt cache"). Returns per run the pooled
        (counts, ms), the per-prompt (counts, ms), the prompts whose greedy output differs from
        plain's, and the peer's (tokens, ms, same tokens as our plain) per prompt."""
        from decoder.metrics import AcceptanceCounts
        from decoder.speculative import DecodeRequest

        cfg, params = self.cfg, self.params
        tot = {name: [AcceptanceCounts(), 0.0] for name, *_ in runs}
        per_prompt: dict[str, list] = {name: [] for name, *_ in runs}  # (counts, ms) per prompt, paired
        differs: dict[str, list[int]] = {name: [] for name, *_ in runs}  # prompts whose greedy output != plain's
        peer_runs: list[tuple[int, float, bool]] = []  # llama.cpp plain: (tokens, ms, same tokens as our plain)
        forget = getattr(self.decoder.engine, "clear_prompt_cache", None)
        for i, p in enumerate(ps):
            ids = p.token_ids(self.tok)[-_PROMPT_TOKENS:]
            if i == 0:  # warm-up (caches, allocator), not counted, against a throwaway history copy
                self.fresh_history()
                self.decoder.generate(DecodeRequest(ids, params, 4, gamma=0, ignore_eos=True, workload=phase))
            for name, dec, g, prop in runs:
                if name == "plain" and forget is not None:
                    forget()  # plain decoding pays its own prefill: the prompt's, measured once
                t0 = time.perf_counter()
                r = self.decode_run(name, dec, g, prop, ids, phase, final)
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
                ms = r.latency_ms
                if name == "plain":
                    # its prefill fed the prompt but its last token, or all of it (the first token from
                    # the prefill's last row: DecoderConfig.first_token_from_prefill)
                    plain_ids, prefill_ms = list(r.output_ids), r.counts.prefill_ms
                    fed = len(ids) - 1 + r.counts.num_prefill_tokens
                else:  # the prompt cache kept plain's prefill (the same bits): charged its measured time
                    ms += prefill_ms * r.cached_prompt_tokens / max(1, fed)
                tot[name][0].merge(r.counts)
                tot[name][1] += ms
                per_prompt[name].append((r.counts, ms))
                if name != "plain" and list(r.output_ids) != plain_ids:  # greedy: lossless = token-identical to plain
                    differs[name].append(i)
            if self.peer is not None:  # llama.cpp's own plain generation of the packaged file, the same prompt
                t0 = time.perf_counter()
                out, ms, n_out = self.peer.generate(ids, params, cfg.eval_new_tokens, cfg.seed + i)
                self.wall["llamacpp_plain"] = self.wall.get("llamacpp_plain", 0.0) + time.perf_counter() - t0
                peer_runs.append((n_out, ms, out == plain_ids[:len(out)]))
        return tot, per_prompt, differs, peer_runs

    def decode_run(self, name: str, dec, g: int, prop: str | None, ids: list[int], phase: str, final: int):
        """One run on one prompt, with the history and gate as serving left them, its version's
        LoRA and copy gate (and v0's head for ``frozen_head``)."""
        from decoder.speculative import DecodeRequest

        cfg, decoder = self.cfg, self.decoder
        self.fresh_history()
        # v0's LoRA for the frozen rows; per_workload, the workload's own final version for the
        # draft's rows, decoded by ``frozen`` (it shares the draft's engine; the adapter manager is
        # closed, so nothing routes per request, and _frozen_lora holds ``decoder``'s lock)
        if dec is self.frozen:
            lora = self.v0_version
        elif cfg.per_workload and prop == "draft":
            dec, lora = self.frozen, final
        else:
            lora = None
        # each draft row proposes with its version's copy gate (none for v0 unless it has one);
        # the ablation rows: the final LoRA without its gate, v0 with the fixed gate
        gate = {"frozen": self.gate_of(self.v0_version), "adapted_nogate": None,
                "frozen_fixedgate": FIXED_COPY_GATE}.get(name, self.gate_of(final))
        with (_frozen_lora(decoder if lora is not None else None, lora or 0, self.registry),
              _swapped_head(decoder, self.frozen_head if name == "frozen_head" else None),
              _copy_gate(dec, gate)):
            return dec.generate(DecodeRequest(ids, self.params, cfg.eval_new_tokens, gamma=g, ignore_eos=True,
                                              workload=phase, proposer=prop))

    def versions_side(self, row: dict, phase: str, ps, per_prompt: dict, final: int) -> None:
        """Each adapter version that served the phase against the one before it, and the phase-end
        version against v0, paired on the same prompts."""
        cfg, v0_version = self.cfg, self.v0_version
        runs: dict = {}
        row["versions"] = _versions_check(cfg, phase, ps, self.tok, self.params, self.decoder, self.frozen,
                                          self.registry, v0_version, self.timeline, per_prompt, runs, final)
        # what the learner had made of this workload when its phase ended (before later phases
        # trained the shared adapter on other traffic), against v0 on the same prompts
        end = next((r["adapter_version"] for r in reversed(self.timeline) if r["workload"] == phase), None)
        if end in runs and v0_version in runs:
            from trainer.gate import paired_ratio_gain

            g = paired_ratio_gain({str(i): (a.alpha_sum, a.num_draft_tokens, b.alpha_sum, b.num_draft_tokens)
                                   for i, ((a, _), (b, _)) in enumerate(zip(runs[v0_version], runs[end]))},
                                  cfg.confidence)
            # v0 itself at the phase's end: nothing of the phase's own was promoted (gain 0 by construction)
            row["phase_end_gain_ci"] = {"version": end, "is_v0": end == v0_version, **_jsonable(g.to_dict())}


def _decoded_rows(row: dict, runs, tot: dict, differs: dict, n_prompts: int) -> None:
    """Each run's measured row (α, τ, acceptance rate, tokens/s, matches with plain) and its
    speedup over plain decoding; ``adapted`` is the plain run when the pick is plain."""
    for name, _, g, prop in runs:
        c, ms = tot[name]
        row[name] = {"proposer": prop, "gamma": g, "alpha": _nn(c.alpha),
                     "tau": _nn(c.mean_accepted_length), "acceptance_rate": _nn(c.acceptance_rate),
                     "tokens_per_s": round(c.num_emitted_tokens / ms * 1e3, 3)}
        if name != "plain":
            row[name]["matches_plain"] = f"{n_prompts - len(differs[name])}/{n_prompts}"
            if differs[name]:
                row[name]["differs_from_plain"] = differs[name]  # prompt indices
    if "adapted" not in row:
        row["adapted"] = {**row["plain"], "same_run_as": "plain"}
    for name in ("frozen", "adapted_draft", "adapted", "frozen_head", "adapted_head", "adapted_nogate",
                 "frozen_fixedgate", "runner_up"):
        if name in row:
            row[name]["speedup_vs_plain"] = round(row[name]["tokens_per_s"] / row["plain"]["tokens_per_s"], 3)


def _live_side(row: dict, timeline: list, phase: str) -> None:
    """The phase's served requests, first and last third: greedy α (all speculating requests, and
    per proposer: the draft's α is the learner's, the n-gram proposer's moves with the text) and
    tokens/s."""
    served = [r for r in timeline if r["workload"] == phase]
    row["served"] = {"requests": len(served), "repeats": sum(bool(r.get("repeat")) for r in served)}
    third = max(1, len(served) // 3)
    for label, part in (("live_first_third", served[:third]), ("live_last_third", served[-third:])):
        al = [r["alpha"] for r in part if r["alpha"] is not None]
        tps = [r["tokens_per_s"] for r in part if r.get("tokens_per_s") is not None]
        by: dict[str, list[float]] = {}
        for r in part:
            if r["alpha"] is not None and r.get("proposer"):
                by.setdefault(r["proposer"], []).append(r["alpha"])
        row[label] = {"requests": len(part), "alpha": _nn(sum(al) / len(al)) if al else None,
                      "alpha_by_proposer": {p: {"requests": len(v), "alpha": _nn(sum(v) / len(v))} for p, v in sorted(by.items())},
                      "tokens_per_s": _nn(sum(tps) / len(tps)) if tps else None}


def _live_cell(r: dict) -> str:
    """The live α first → last third of a phase, per proposer ("draft 0.11→0.55, ngram 0.74→0.33"),
    or of all speculating requests for a report without the split."""
    a, b = r.get("live_first_third") or {}, r.get("live_last_third") or {}
    pa, pb = a.get("alpha_by_proposer"), b.get("alpha_by_proposer")
    if pa is None or pb is None:
        return f"{_cell(a.get('alpha'))} → {_cell(b.get('alpha'))}"
    names = sorted(set(pa) | set(pb))
    return ", ".join(f"{n} {_cell((pa.get(n) or {}).get('alpha'))}→{_cell((pb.get(n) or {}).get('alpha'))}"
                     for n in names) or "-"


_VERSIONS_CHECKED = 4  # adapter versions decoded per phase besides v0 and the final one, at most


def _version_chain(timeline, phase: str, v0_version: int, final: int) -> tuple[list[int], list[int]]:
    """The adapter versions :func:`_versions_check` walks for ``phase``: (the chain from v0 through each
    version that served the phase, in order of first use, to the final one; the ones between v0 and
    the final one it decodes, at most ``_VERSIONS_CHECKED``: the first ones and the one that served the
    phase's end)."""
    # the base draft (0) that served before v0 was ready is no promotion after v0: not in the chain
    served = [r["adapter_version"] for r in timeline if r["workload"] == phase and (r["adapter_version"] or not v0_version)]
    chain = list(dict.fromkeys([v0_version, *served, final]))
    middle = [v for v in chain if v not in (v0_version, final)]
    if len(middle) > _VERSIONS_CHECKED:
        middle = middle[: _VERSIONS_CHECKED - 1] + middle[-1:]
    return [v for v in chain if v in (v0_version, final) or v in middle], middle


def _versions_check(cfg, phase, ps, tok, params, decoder, frozen, registry, v0_version, timeline, per_prompt,
                    runs_out: dict | None = None, final: int | None = None) -> list[dict]:
    """Did any promotion lower decoded α on the phase's never-served prompts? Each adapter version
    that served the phase (in order of first use, from v0 to the final one) decoded on the same
    prompts at γ = ``eval_gamma``, paired against the version before it (``paired_ratio_gain``):
    a row per step with its gain, interval and ``lowered`` (a measured loss: the whole interval below
    0; a negative point estimate whose interval reaches 0 is noise on these prompts). v0's and the final
    version's runs are the table's ``frozen`` and ``adapted_draft``; at most ``_VERSIONS_CHECKED``
    others are decoded (the phase's last one always among them). Only on an engine whose draft
    swaps LoRAs (llama.cpp): [] otherwise. ``runs_out`` receives each decoded version's per-prompt
    (counts, ms)."""
    from decoder.speculative import DecodeRequest
    from trainer.gate import paired_ratio_gain

    if not supports(getattr(decoder, "draft_engine", None), "lora"):
        return []
    final = decoder.adapter_version if final is None else final  # the version the adapted rows ran
    runs = {v0_version: per_prompt["frozen"], final: per_prompt["adapted_draft"]}
    chain, middle = _version_chain(timeline, phase, v0_version, final)
    history = decoder.ngram_history
    gate_of = _gate_loader(registry)
    for v in middle:
        runs[v] = []
        with _frozen_lora(decoder, v, registry), _copy_gate(frozen, gate_of(v)):
            for p in ps:
                decoder.ngram_history = history.copy()
                r = frozen.generate(DecodeRequest(p.token_ids(tok)[-_PROMPT_TOKENS:], params, cfg.eval_new_tokens, gamma=cfg.eval_gamma,
                                                  ignore_eos=True, workload=phase, proposer="draft"))
                runs[v].append((r.counts, r.latency_ms))
    decoder.ngram_history = history
    if runs_out is not None:
        runs_out.update(runs)
    out = []
    for prev, v in zip(chain, chain[1:]):
        rows = {str(i): (a.alpha_sum, a.num_draft_tokens, b.alpha_sum, b.num_draft_tokens)
                for i, ((a, _), (b, _)) in enumerate(zip(runs[prev], runs[v]))}
        g = paired_ratio_gain(rows, cfg.confidence)
        out.append({"version": v, "parent": prev, "alpha_before": _nn(g.before), "alpha_after": _nn(g.after),
                    "gain": _nn(g.gain), "low": _nn(g.low), "high": _nn(g.high), "lowered": bool(g.high < 0)})
    return out


def _paired_intervals(per_prompt: dict[str, list], confidence: float) -> dict[str, Any]:
    """The evaluation's paired evidence (trainer.gate.paired_ratio_gain, a bootstrap over the
    prompts): ``alpha_gain_ci``, the adapted draft's decoded α over the frozen v0's (Σ α over
    proposals / proposals, same prompts); ``head_alpha_gain_ci`` likewise for the head; and
    ``speed_vs_plain_ci``: per run, tokens per ms against plain decoding's on the same prompts, as
    a ratio with its interval."""
    from trainer.gate import paired_ratio_gain

    def alpha_rows(a: str, b: str) -> dict:
        return {str(i): (x.alpha_sum, x.num_draft_tokens, y.alpha_sum, y.num_draft_tokens)
                for i, ((x, _), (y, _)) in enumerate(zip(per_prompt[a], per_prompt[b]))}

    out: dict[str, Any] = {"eval_prompts": len(per_prompt.get("plain", []))}
    if "frozen" in per_prompt and "adapted_draft" in per_prompt:
        out["alpha_gain_ci"] = _jsonable(paired_ratio_gain(alpha_rows("frozen", "adapted_draft"), confidence).to_dict())
    for key, (a, b) in {"nogate_alpha_gain_ci": ("frozen", "adapted_nogate"),  # the LoRA alone over v0
                        "gate_alpha_gain_ci": ("adapted_nogate", "adapted_draft"),  # what the learnt gate adds
                        "fixedgate_alpha_gain_ci": ("frozen", "frozen_fixedgate")}.items():  # a fixed gate on v0
        if a in per_prompt and b in per_prompt:
            out[key] = _jsonable(paired_ratio_gain(alpha_rows(a, b), confidence).to_dict())
    if "frozen_head" in per_prompt and "adapted_head" in per_prompt:
        out["head_alpha_gain_ci"] = _jsonable(paired_ratio_gain(alpha_rows("frozen_head", "adapted_head"), confidence).to_dict())
    speed = {}
    for name, runs in per_prompt.items():
        if name == "plain":
            continue
        r = _speed_ratio({str(i): (p.num_emitted_tokens, pms, x.num_emitted_tokens, xms)
                          for i, ((p, pms), (x, xms)) in enumerate(zip(per_prompt["plain"], runs))}, confidence)
        if r is not None:
            speed[name] = r
    out["speed_vs_plain_ci"] = speed
    return out


def leviathan_prediction(draft, plain, step_ms, gamma_max: int = 8) -> dict | None:
    """The learner's measured α and c beside Leviathan et al. 2023's prediction (Theorem 3.8 /
    eq. 1): expected tokens per step E(α, γ) = (1 - α^(γ+1)) / (1 - α); speedup over plain decoding
    E / (γc + 1) when a verification costs one plain step, and E / (γc + t(γ+1) / t(1)) with this
    engine's measured cost t(n) of a step verifying n rows, taken as the least-squares fit that
    never falls with more rows (:func:`_monotone_fit`: a verification of more rows cannot cost
    less, a dip is noise, priced as ``StepCost.ms`` prices it); each at the γ that maximises it.

    Args:
        draft: the draft run's pooled ``AcceptanceCounts`` (α = alpha_sum / num_draft_tokens, c =
            draft ms per proposed token over plain ms per step).
        plain: the plain run's pooled counts (ms per step = decode_ms / num_steps).
        step_ms: rows -> ms of a step verifying that many rows (``StepCost.ms``; NaN when unmeasured).
        gamma_max: the largest γ considered.

    Returns:
        {alpha, c, tau, verify_cost_rows: {n: t(n) / t(1)}, one_step: {gamma, speedup}, this_engine:
        {gamma, speedup}}, or None when the draft proposed nothing or plain ran no step.
    """
    from decoder.sampling import expected_tokens_per_step

    if not draft.num_draft_tokens or not plain.num_steps or not plain.decode_ms:
        return None
    a = draft.alpha
    c = draft.draft_ms / draft.num_draft_tokens / (plain.decode_ms / plain.num_steps)
    t1 = step_ms(1)
    ratio = {n: step_ms(n) / t1 for n in range(1, gamma_max + 2)} if t1 == t1 and t1 > 0 else {}
    ratio = _monotone_fit({n: r for n, r in ratio.items() if r == r})[0]  # more rows never cost less
    one = {g: expected_tokens_per_step(a, g) / (g * c + 1) for g in range(1, gamma_max + 1)}
    eng = {g: expected_tokens_per_step(a, g) / (g * c + ratio[g + 1]) for g in range(1, gamma_max + 1) if g + 1 in ratio}
    best = (lambda d: {"gamma": max(d, key=d.get), "speedup": round(max(d.values()), 3)} if d else None)
    return {"alpha": round(a, 4), "c": round(c, 4), "tau": _nn(draft.mean_accepted_length),
            "verify_cost_rows": {n: round(r, 3) for n, r in ratio.items()}, "one_step": best(one), "this_engine": best(eng)}


def _speed_vs_peer(per_prompt: dict[str, list], peer_runs: list[tuple[int, float, bool]], confidence: float) -> dict:
    """Plain decoding of the served format (``plain``) and the controller's pick (``adapted``; the
    plain run when the pick is plain decoding) against llama.cpp's own plain generation of the
    packaged file: tokens per ms, the ratio of pooled rates and its paired bootstrap interval over
    prompts (``trainer.gate.paired_ratio_gain``)."""
    out = {}
    for name in ("plain", "adapted"):
        runs = per_prompt.get(name) or per_prompt["plain"]
        r = _speed_ratio({str(i): (n, ms, x.num_emitted_tokens, xms)
                          for i, ((n, ms, _), (x, xms)) in enumerate(zip(peer_runs, runs))}, confidence)
        if r is not None:
            out[name] = r
    return out


def _speed_ratio(rows: dict, confidence: float) -> dict | None:
    """Tokens per ms after over before, pooled over prompts (``rows``: prompt -> (before tokens,
    before ms, after tokens, after ms)), with the paired bootstrap interval of
    ``trainer.gate.paired_ratio_gain`` as ratios; None when the before rate is 0 or NaN."""
    from trainer.gate import paired_ratio_gain

    g = paired_ratio_gain(rows, confidence)
    if not (g.before and g.before == g.before):  # nothing to divide by
        return None
    return {"ratio": round(g.after / g.before, 4), "low": round(1 + g.low / g.before, 4),
            "high": round(1 + g.high / g.before, 4), "prompts": g.clusters}


def _gate_loader(registry):
    """version -> its copy gate's weights (store.copy_channel.load_gate; None for version 0 and an
    adapter without a gate), each version's file read once."""
    from store.copy_channel import load_gate

    cache: dict[int, Any] = {}

    def gate_of(version: int):
        if not version:
            return None
        if version not in cache:
            cache[version] = load_gate(registry.fetch(version))
        return cache[version]

    return gate_of


def _gate_list(gate) -> list[float] | None:
    return None if gate is None else [round(float(x), 4) for x in gate]


@contextlib.contextmanager
def _copy_gate(decoder, gate):
    """``decoder.copy_gate`` = ``gate`` for the block, put back after (the adapter manager is
    closed by the evaluation, so nothing switches it meanwhile)."""
    was = decoder.copy_gate
    decoder.copy_gate = gate
    try:
        yield
    finally:
        decoder.copy_gate = was


@contextlib.contextmanager
def _swapped_head(decoder, head):
    """``decoder.eagle_head`` = ``head`` for the block (None: a no-op), put back after; the head
    manager is closed by then, so nothing swaps it meanwhile."""
    if head is None:
        yield
        return
    old = decoder.eagle_head
    decoder.eagle_head = head
    try:
        yield
    finally:
        decoder.eagle_head = old


@contextlib.contextmanager
def _frozen_lora(decoder, v0_version: int = 0, registry=None):
    """With ``decoder`` (whose draft runs on llama.cpp): its draft's context with v0's LoRA for
    the block (``v0_version``'s GGUF LoRA, loaded if the manager evicted it; none for the base
    draft), the adapter put back after; a no-op otherwise."""
    from decoder.adapters import adapter_name

    eng = getattr(decoder, "draft_engine", None) if decoder is not None else None
    want = adapter_name(v0_version) if v0_version else None
    if not supports(eng, "lora") or eng.lora == want:
        yield
        return
    with decoder._lock:  # no request runs meanwhile
        was = eng.lora
        if want is not None and want not in eng.loras:
            from decoder.models.gguf_export import lora_gguf_cached
            from decoder.models.packaged import cache_root

            eng.load_lora(want, lora_gguf_cached(Path(registry.fetch(v0_version)), cache_root() / "gguf" / "lora", eng.path))
        eng.set_lora(want)
        try:
            yield
        finally:
            eng.set_lora(was)


def _clear_prefix(client, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + UNLINK, never KEYS); returns how many."""
    n = 0
    batch = []
    for k in client.scan_iter(match=prefix.replace("*", r"\*") + "*", count=1000):
        batch.append(k)
        if len(batch) >= 500:
            n += client.unlink(*batch)
            batch = []
    if batch:
        n += client.unlink(*batch)
    return n


def _adapter_row(r) -> dict:
    d = dict(r.__dict__)
    return _jsonable(d)


def _nn(x):
    return nan_none(x, 4)


def _brief(reason, n: int = 160) -> str:
    """``reason`` cut to about ``n`` characters at its last clause or word boundary, marked "…"."""
    text = str(reason or "")
    if len(text) <= n:
        return text
    cut = max(text.rfind("; ", 0, n), text.rfind(", ", 0, n))
    cut = cut if cut > n // 2 else text.rfind(" ", 0, n)
    return text[: cut if cut > 0 else n].rstrip(" :;,") + " …"


def _alpha_tau(alpha: float, tau: float, n: int, sep: str = ", τ ") -> str:
    """A rolling α and τ over ``n`` speculating requests: α to 3 decimals over several, to 2 over
    one (one request's α is no rolling mean to 3 places; the callers say it is one request's)."""
    return f"{alpha:.2f}{sep}{tau:.2f}" if n == 1 else f"{alpha:.3f}{sep}{tau:.2f}"


def _recent(timeline, phase: str, k: int = 12) -> tuple[list, list, float | None, float | None, float | None]:
    """Of the last ``k`` requests, ``phase``'s (``recent``) and those that speculated (``spec``, a
    probe too), with the mean α and τ of ``spec`` and the mean tokens/s of ``recent`` (None: none)."""
    recent = [r for r in timeline[-k:] if r.get("workload") == phase]
    spec = [r for r in recent if r.get("alpha") is not None]
    taus = [r["tau"] for r in spec if r["tau"] is not None]
    tps = [r["tokens_per_s"] for r in recent if r.get("tokens_per_s") is not None]
    return (spec, recent, sum(r["alpha"] for r in spec) / len(spec) if spec else None,
            sum(taus) / len(taus) if taus else None, sum(tps) / len(tps) if tps else None)


def _progress_table(timeline, phase, svc, manager, controller, key, heads=None):
    from rich.table import Table

    spec, recent, alpha, tau, tps = _recent(timeline, phase)
    st = svc.status()
    last = st.get("last_round") or {}
    t = Table(title="draftd demo (live)", show_header=False)
    t.add_row("requests done", str(len(timeline)))
    t.add_row("current workload", phase)
    t.add_row(f"one request's α, τ (1 of the last {len(recent)} speculated)" if len(spec) == 1 else
              f"rolling α, τ ({len(spec)} of the last {len(recent)} speculated)",
              (_alpha_per_proposer(spec) if any(r.get("proposer") for r in spec) else _alpha_tau(alpha, tau, len(spec), sep=", "))
              if alpha is not None and tau is not None else "- (plain decoding)")
    t.add_row("rolling tokens/s", f"{tps:.2f}" if tps is not None else "-")
    ms = manager.status()
    routes = {w: v for w, v in (ms.get("routes") or {}).items() if w and v}
    t.add_row("active adapter", f"v{ms.get('active_version', 0)}"
              + (f" ({', '.join(f'{w} v{v}' for w, v in sorted(routes.items()))})" if routes else ""))
    if heads is not None:
        h = (st.get("heads") or {}).get("last") or {}
        t.add_row("head (eagle)", f"v{heads.route(phase)}; last turn: {h.get('decision', '-')} {_brief(h.get('reason'))}")
    t.add_row("speculation", controller.decision(key).get("why", "-"))
    turns = last.get("scopes") or {}  # per_workload: each workload's own turn
    if turns and last.get("decision") == "idle":
        # "prose rejected: α ...", not "prose rejected on prose: α ..." (a reason opens with its own scope)
        what = "; ".join(f"{w} {sr.get('decision', '-')}: {_brief(str(sr.get('reason') or '').removeprefix(f'on {w}: '))}"
                         for w, sr in sorted(turns.items()))
    else:
        what = f"{last.get('decision', '-')} {_brief(last.get('reason'))}"
    t.add_row("trainer", f"rounds {st.get('rounds', 0)}, last: {what}")
    return t


def _rolling(ys: list[float], k: int = 8) -> list[float]:
    return [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]


def _speculated(r: dict) -> bool:
    """Whether a timeline row's request proposed anything: its ``proposed`` tokens > 0 where the row
    has them, else a measured α (None for a request that proposed nothing). Not ``gamma`` > 0: a
    probe that moved on to plain decoding after its first steps ends with γ 0 beside its proposer."""
    if r.get("proposed") is not None:
        return r["proposed"] > 0
    return r.get("alpha") is not None


def _alpha_by_proposer(timeline: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """(t s, greedy α) of each timeline row that proposed (:func:`_speculated`) and has an α, by its
    ``proposer``, in order: what the acceptance plot draws per proposer."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in timeline:
        if r.get("proposer") and _speculated(r) and r.get("alpha") is not None:
            out.setdefault(r["proposer"], []).append((r["t"], r["alpha"]))
    return out


def _adapter_name(version: int, scopes: dict[int, str], workload: str) -> str:
    """``version`` as the plot names it: "base draft" for 0, "v1 (shared)" for a shared-scope
    version (``scopes``: version -> scope, "" shared), "v7" for a workload's own (or unknown)."""
    if not version:
        return "base draft"
    scope = scopes.get(version)
    return f"v{version} (shared)" if scope == "" else f"v{version}" if scope in (None, workload) else f"v{version} ({scope}'s)"


def _plot_labels(timeline: list[dict], shifts: list[dict],
                 scopes: dict[int, str]) -> tuple[list[str], list[tuple[float, str, int]]]:
    """The acceptance plot's labels: per shift, its workload and the adapter its first request was
    served by (" code: v1 (shared)", :func:`_adapter_name`), and each adapter swap inside a phase as
    (t s, label, row 0-2). A swap at a phase's first request is the shift's label, not a label of
    its own: each shift read "v1", the shared adapter routed before the workload had its own, and
    two labels overlapped there. A swap label goes on the first of the rows where the label before it
    ends before it starts (each label's width: :data:`_LABEL_CHAR_AXES` of the axis a character),
    the row that frees first where none does: two swaps closer than a label's width never print on
    one row. Shifts without ``request`` (an index into ``timeline``) begin at their ``t``."""
    firsts = []
    for s in shifts:
        i = s.get("request")
        if i is None:
            i = next((k for k, r in enumerate(timeline) if r["t"] >= s["t"]), len(timeline))
        firsts.append(i)
    labels = [f" {s['workload']}" + (f": {_adapter_name(timeline[i]['adapter_version'], scopes, s['workload'])}"
                                    if i < len(timeline) else "") for s, i in zip(shifts, firsts)]
    span = max((r["t"] for r in timeline), default=1.0) or 1.0
    swaps: list[tuple[float, str, int]] = []
    prev, ends = timeline[0]["adapter_version"] if timeline else 0, [float("-inf")] * 3  # each row's last label's end
    for k, r in enumerate(timeline):
        if r["adapter_version"] != prev and k not in firsts:
            text = f" {_adapter_name(r['adapter_version'], scopes, r.get('workload'))}"
            row = next((i for i, end in enumerate(ends) if end <= r["t"]), min(range(3), key=ends.__getitem__))
            ends[row] = r["t"] + len(text) * _LABEL_CHAR_AXES * span
            swaps.append((r["t"], text, row))
        prev = r["adapter_version"]
    return labels, swaps


_LABEL_CHAR_AXES = 0.0065
"""A swap label's width per character as a share of the plot's axis (8 pt text on the 11-inch
figure of :func:`plot_timeline`: matplotlib measured about 0.006 a character, this a little over)."""


LABEL_BOX = {"boxstyle": "square,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.75}
"""The plot's shift and swap labels sit on a white, slightly see-through box: drawn straight over
the dense per-request α points and rolling means (extract's n-gram line), they read poorly."""


def _draw_labels(ax, shifts: list[dict], shift_labels: list[str], swaps: list[tuple[float, str, int]]) -> None:
    """:func:`_plot_labels`' labels on ``ax``: each shift's at the top, each swap's dotted line and
    its label on its row, every label on :data:`LABEL_BOX` above the lines."""
    for s, text in zip(shifts, shift_labels):
        ax.text(s["t"], 0.97, text, fontsize=8, va="top", transform=ax.get_xaxis_transform(), bbox=LABEL_BOX, zorder=5)
    for t, text, row in swaps:
        ax.axvline(t, ls=":", color="tab:red", lw=1)
        ax.text(t, 0.88 - 0.08 * row, text, color="tab:red", fontsize=8, transform=ax.get_xaxis_transform(),
                bbox=LABEL_BOX, zorder=5)


def plot_timeline(timeline: list[dict], shifts: list[dict], path: Path, scopes: dict[int, str] | None = None) -> None:
    """Top: per-request greedy α and its rolling mean (8 requests) per proposer (the draft model,
    the n-gram proposer, the head: what each learnt, apart), shifts (dashed, labelled with the
    adapter that served the phase's first request) and adapter swaps inside a phase (dotted,
    labelled) marked (:func:`_plot_labels`; ``scopes``: version -> scope, "" shared). Bottom:
    tokens/s, rolling per workload, against the plain-decoding requests' rate (grey: what
    speculation must beat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 8), sharex=True, height_ratios=(3, 2))
    styles = {"draft": ("tab:blue", "o"), "ngram": ("tab:orange", "^"), "eagle": ("tab:green", "s")}
    labelled: set = set()
    for prop, part in _alpha_by_proposer(timeline).items():
        color, marker = styles.get(prop, ("tab:purple", "D"))
        xs, ys = [t for t, _ in part], [a for _, a in part]
        ax.scatter(xs, ys, s=10, alpha=0.3, color=color, marker=marker)
        # the rolling mean restarts at each shift, so the dip after a shift and the recovery show
        for i, s in enumerate(shifts):
            end = shifts[i + 1]["t"] if i + 1 < len(shifts) else float("inf")
            seg = [(x, y) for x, y in zip(xs, ys) if s["t"] <= x < end]
            if seg:
                label = f"{prop} (rolling mean of 8)" if prop not in labelled else None
                labelled.add(prop)
                ax.plot([x for x, _ in seg], _rolling([y for _, y in seg]), color=color, lw=2, label=label)
    for s in shifts[1:]:
        ax.axvline(s["t"], ls="--", color="k", lw=1)
    _draw_labels(ax, shifts, *_plot_labels(timeline, shifts, scopes or {}))
    for w in dict.fromkeys(r["workload"] for r in timeline):
        spec = [r for r in timeline if r["workload"] == w and _speculated(r) and r.get("tokens_per_s") is not None]
        plain = [r for r in timeline if r["workload"] == w and not _speculated(r) and r.get("tokens_per_s") is not None]
        if spec:
            ax2.plot([r["t"] for r in spec], _rolling([r["tokens_per_s"] for r in spec]), color="tab:blue", lw=2,
                     label="speculating requests" if w == timeline[0]["workload"] else None)
        if plain:
            ax2.plot([r["t"] for r in plain], _rolling([r["tokens_per_s"] for r in plain]), color="grey", lw=2,
                     label="plain-decoding requests" if w == timeline[0]["workload"] else None)
    for s in shifts[1:]:
        ax2.axvline(s["t"], ls="--", color="k", lw=1)
    ax2.set_ylabel("tokens/s (rolling mean of 8)")
    ax2.set_xlabel("seconds since serving started")
    ax2.legend(fontsize=7, loc="lower right")
    ax.set_ylabel("α (greedy: share of proposals the target accepts)")
    ax.set_ylim(-0.02, 1.0)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.03), ncol=4)
    ax.set_title("draftd: acceptance per proposer (dashed: workload shift, dotted: adapter swap)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_report(report: dict, console) -> None:
    """The demo's report as tables: held-out α, the decoded comparison (and the copy channel's and
    the head's when measured), each phase's notes, adapters, recovery, the engine ceiling."""
    if not console.is_terminal:  # a log file or pipe: rich would wrap the tables at 80 columns
        console.width = max(console.width, 170)
    pct = percent((report.get("config") or {}).get("confidence", 0.95))
    _heldout_table(report, console)
    _decoded_table(report, console, pct)
    _copy_table(report, console, pct)
    _prediction_table(report, console)
    _head_table(report, console)
    _phase_notes(report, console)
    _phase_lengths(report, console)
    _adapter_tables(report, console)
    _recovery_and_footer(report, console)


def _served_for(shift: dict) -> str:
    """How long a phase (a ``shifts`` entry) served: its seconds, and where its traffic began before
    its clock (the first phase serves from the first second, its clock starts at v0's arrival:
    ``wall_seconds`` against ``seconds``) both, so "ended after 120 s" never stands for 212 s of traffic."""
    wall, s = shift.get("wall_seconds"), shift["seconds"]
    if wall is None or wall - s <= 1:
        return f"{s:.0f} s"
    # rounded once, the "before" from the printed figures, so the line's sum adds up (a walkthrough read
    # "216 s of traffic, 120 s of them ... the 95 s before": 215.5 - 120.2)
    wall, s = round(wall), round(s)
    return (f"{wall} s of traffic, {s} s of them on the phase's clock (it starts at v0's arrival; "
            f"the {wall - s} s before served while v0 bootstrapped)")


def _phase_end_line(workload: str, shift: dict) -> str:
    """The console's live line at a phase's end (``shift``, its ``shifts`` entry): how long it served,
    its requests and its adapter's turns, then why it ended as the rule it met (:func:`_ended_rule`)
    and, where it came a second or more before the end, when the learner's part was done
    (``learner_done_s``: what phase_seconds added):
    the why's own seconds and turns beside the line's said each twice (a walkthrough read "code ended
    after 120 s and 241 requests: 120 s served and 3 judged turns of its adapter ...")."""
    t = shift.get("turns") or {}
    turns = (f" and {t['turns']} turns of its adapter ({t.get('judged', 0)} judged, {t.get('promoted', 0)} promoted)"
             if t.get("turns") else "")
    return (f"{workload} ended after {_served_for(shift)}, {_requests(shift['requests'])}{turns}: "
            f"{_ended_rule(str(shift.get('ended')))}" + _learner_times(shift))


def _learner_times(shift: dict) -> str:
    """" (its adapter first promoted N s after its first request; the learner's part done at M s)":
    ``first_promotion_s`` where a promotion came (on the phase's clock: "after v0's arrival" where
    the phase served while v0 bootstrapped), ``learner_done_s`` where it came a second or more
    before the phase's end (what phase_seconds added); "" when neither."""
    first, done = shift.get("first_promotion_s"), shift.get("learner_done_s")
    after = shift.get("first_promotion_from") or "its first request"
    parts = ([f"its adapter first promoted {first:.0f} s after {after}"] if first is not None else []) + (
        [f"the learner's part done at {done:.0f} s"] if done is not None and shift["seconds"] - done >= 1 else [])
    return f" ({'; '.join(parts)})" if parts else ""


def _phase_lengths(report: dict, console) -> None:
    """How long each phase served and why it ended (``_phase_progress``: its seconds, its
    adapter's judged turns, or the cap)."""
    for sh in report.get("shifts") or []:
        if "seconds" in sh:
            t = sh.get("turns") or {}
            console.print(f"{sh['workload']}: served {_served_for(sh)}, "
                          f"{_requests(sh['requests']) if 'requests' in sh else '? requests'}, "
                          f"{t.get('turns', 0)} turns of its adapter ({t.get('judged', 0)} judged, "
                          f"{t.get('promoted', 0)} promoted); ended: {_ended_rule(str(sh.get('ended')))}"
                          + _learner_times(sh))


def _ended_rule(ended: str) -> str:
    """A phase's ``ended`` (:func:`_phase_progress`'s why) as the rule it met, for the closing line
    that gives its seconds and its adapter's turns already: the why's own seconds and counts beside
    the line's said each fact twice, in two figures a second apart (the setting's and the clock's).
    What only ``ended`` says stays (its promoted version's requests, the judged turns a capped phase
    needed); a why of another shape is given as it is."""
    own = re.search(r"; its (v\d+ served .+)$", ended)
    tail = f"; its {own.group(1)}" if own else ""
    if re.fullmatch(r"\d+ s served and \d+ judged turns of its adapter \(\d+ promoted\)(; its v\d+ served .+)?", ended):
        return "its phase_seconds passed with its adapter judged phase_min_judged times and promoted" + tail
    if re.fullmatch(r"\d+ s served", ended):
        return "its phase_seconds passed"
    cap = re.fullmatch(r"phase_max_seconds \d+ s reached with \d+ of (\d+) judged turns \(.*\)", ended)
    if cap:
        return (f"phase_max_seconds reached before the rest of its rule was met ({cap.group(1)} judged turns of its "
                f"adapter, a promotion, its promoted version serving phase_min_served requests)")
    return ended


def _cell(x) -> str:
    """A report cell: '-' for None, 3 decimals for a float."""
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def _gain_ci(gain, low, high) -> str:
    """A gain and its interval in the notes, signed as the table prints them ("+0.422, CI [+0.314,
    +0.564]"; the notes printed "0.422, CI [0.314, 0.564]" beside the table's "+0.422 [+0.314, +0.564]");
    '-' for a figure missing."""
    def one(x):
        return "-" if x is None else signed(x, 3)

    return f"{one(gain)}, CI [{one(low)}, {one(high)}]"


def _ratio_bound(x: float) -> str:
    """A ratio's interval bound to 2 decimals, or as many more (up to 6) as keep a bound that is
    not 1 from printing as 1.00 (a walkthrough read math's 0.9993 as "[1.00, ..." and so above 1)."""
    places = 2
    while x != 1 and round(x, places) == 1 and places < 6:
        places += 1
    return f"{x:.{places}f}"


def _interval(d: dict | None, key_lo: str = "low", key_hi: str = "high") -> str:
    """An interval cell: signed for a gain's interval, else 2 decimals (:func:`_ratio_bound`);
    '-' when there is none."""
    if not d or d.get(key_lo) is None:
        return "-"
    if key_lo == "low" and "gain" in d:
        return f"[{signed(d[key_lo], 3)}, {signed(d[key_hi], 3)}]"
    return f"[{_ratio_bound(d[key_lo])}, {_ratio_bound(d[key_hi])}]"


def _heldout_table(report: dict, console) -> None:
    """Held-out α per phase: frozen v0, the adapter at the phase end, the final one."""
    from rich.table import Table

    h = Table(title="held-out α (T=1, Σ min(p,q) on served requests never trained on)")
    for c in ("phase", "samples", "frozen", "adapter at phase end", "final adapter"):
        h.add_column(c)
    for r in report["phases"]:
        ha = r.get("heldout_alpha") or {}
        h.add_row(r["workload"], str(r["heldout_samples"]), _cell(ha.get("frozen")),
                  f"{_cell(ha.get('phase_end'))} ({_version_name(r['adapter_at_phase_end'], r)})",
                  f"{_cell(ha.get('final'))} ({_version_name(r['final_adapter'], r)})")
    console.print(h)


def _decoded_table(report: dict, console, pct: str) -> None:
    """The decoded comparison on never-served prompts, with the paired intervals, as two tables of
    the same rows: the drafts' acceptance (frozen v0 against the adapted draft, and the live α of
    the phase), then the speed of the controller's pick (against plain decoding and llama.cpp's).
    One table of 14 columns folded its cells at a 170-column terminal."""
    from rich.table import Table

    same, files = _peer_files(report)
    peer_col = f"pick ×llama.cpp plain [{pct} % CI]" if same else f"pick ×llama.cpp plain of the packaged file [{pct} % CI]"
    at = _draft_gammas(report)
    a = Table(title="decoded on prompts never served (greedy), acceptance: the frozen v0 draft vs the adapted draft"
                    + (f", both decoded at γ={at}" if at else ""))
    for c in ("phase", "prompts", "frozen α", f"frozen ×plain{f' (γ={at})' if at else ''}", "adapted draft α",
              f"adapted draft ×plain{f' (γ={at})' if at else ''}", f"α gain [{pct} % CI]", "live α first→last third, per proposer"):
        a.add_column(c, overflow="fold")  # a narrow terminal or a log folds a cell, never cuts it
    s = Table(title="decoded on the same prompts, speed: the controller's pick vs plain decoding and llama.cpp",
              caption=_peer_caption(report, same, files))
    # plain decoding against llama.cpp's plain: where the report has it (older ones have only the pick's)
    plain_peer = any((r.get("speed_vs_llamacpp_ci") or {}).get("plain") for r in report["phases"])
    for c in ("phase", "plain tok/s", "pick", "pick α", "pick τ", f"pick ×plain [{pct} % CI]",
              f"left off ×plain [{pct} % CI]", *([f"plain ×llama.cpp [{pct} % CI]"] if plain_peer else []), peer_col):
        s.add_column(c, overflow="fold")
    for r in report["phases"]:
        pk = r["adapted"]
        g = r.get("alpha_gain_ci") or {}
        sp = (r.get("speed_vs_plain_ci") or {}).get("adapted")
        lp = (r.get("speed_vs_llamacpp_ci") or {}).get("adapted")  # the pick against llama.cpp's own plain generation
        pp = (r.get("speed_vs_llamacpp_ci") or {}).get("plain")  # plain decoding against it: the engine's share
        a.add_row(r["workload"], str(r.get("eval_prompts", "-")), _cell(r["frozen"]["alpha"]),
                  _cell(r["frozen"]["speedup_vs_plain"]), _cell(r["adapted_draft"]["alpha"]),
                  _cell(r["adapted_draft"]["speedup_vs_plain"]), f"{'-' if g.get('gain') is None else signed(g['gain'], 3)} {_interval(g)}", _live_cell(r))
        # a plain pick is the plain run itself: no α, τ or ×plain of its own (said once, not in three cells);
        # the speculation it left off (decoded on the same prompts) has its ratio in a column of its own
        plain_pick = not pk["gamma"] or pk.get("same_run_as") == "plain"
        s.add_row(r["workload"], _cell(r["plain"]["tokens_per_s"]),
                  f"{pk['proposer']} γ={pk['gamma']}" if pk["gamma"] else "plain (off)",
                  "-" if plain_pick else _cell(pk["alpha"]), "-" if plain_pick else _cell(pk["tau"]),
                  "plain (same decoding)" if plain_pick else _pick_cell(pk, sp), _left_off_cell(r),
                  *([f"{_cell(pp['ratio'])} {_interval(pp)}" if pp else "-"] if plain_peer else []),
                  f"{_cell(lp['ratio'])} {_interval(lp)}" if lp else "-")
    console.print(a)
    console.print(s)
    gap = _live_rate_note(report)
    if gap:
        console.print(gap)


def _pick_cell(pick: dict, ci: dict | None) -> str:
    """A speculating pick's ×plain cell, its interval, and "LOST to plain" where the whole interval
    is below 1 or "below 0.97x" where the point is (issue 34: the pick never loses; walkthroughs
    read a losing pick's cell as one more number)."""
    ratio = pick.get("speedup_vs_plain")
    text = f"{_cell(ratio)} {_interval(ci)}" if ci else _cell(ratio)
    if ci and ci.get("high") is not None and ci["high"] < 1:
        return text + " LOST to plain"
    return text + " below 0.97x" if ratio is not None and ratio < 0.97 else text


def _peer_caption(report: dict, same: bool, files: str) -> str | None:
    """The speed table's caption: which file llama.cpp's plain decodes (where it is not the served
    one) and with which kernels (``llamacpp_peer_kernels``), so that "plain ×llama.cpp plain" reads as
    what draftd's engine and kernels buy before any speculation. None without a peer."""
    if not any(r.get("speed_vs_llamacpp_ci") for r in report.get("phases") or []):
        return None
    parts = [] if same else [f"×llama.cpp plain: {files}"]
    if report.get("llamacpp_peer_kernels"):
        parts.append(f"llama.cpp plain: {report['llamacpp_peer_kernels']}; plain ×llama.cpp is what this "
                     f"engine and its kernels buy before speculation (prefill included)")
    return "; ".join(parts) or None


def _draft_gammas(report: dict) -> str:
    """The γ the evaluation decoded the frozen and adapted drafts at (each phase's ``frozen`` and
    ``adapted_draft`` rows' ``gamma``, else ``config.eval_gamma``): "3", "1, 3" where they differ,
    "" unknown. A walkthrough held the adapted draft's 0.825x plain against the prediction table's
    "1.01x (γ=1)", no table saying the drafts were decoded at γ=3."""
    gs = {int(g) for r in report.get("phases") or [] for k in ("frozen", "adapted_draft")
          if (g := (r.get(k) or {}).get("gamma"))}
    if not gs and (report.get("config") or {}).get("eval_gamma"):
        gs = {int(report["config"]["eval_gamma"])}
    return ", ".join(map(str, sorted(gs)))


def _left_off_cell(r: dict) -> str:
    """A plain pick's left-off speculation (``controller_pick["runner_up"]``, decoded on the same
    prompts) as the speed table's cell: "ngram γ=1 0.942 [0.89, 0.98]", its ratio to plain decoding
    and interval; "-" where the pick speculated or nothing was left off and decoded."""
    up = (r.get("controller_pick") or {}).get("runner_up")
    ran = (r.get("speed_vs_plain_ci") or {}).get("runner_up")
    if not up or not (ran or r.get("runner_up")):
        return "-"
    ratio = ran["ratio"] if ran else r["runner_up"].get("speedup_vs_plain")
    return f"{up['proposer']} γ={up['gamma']} {_cell(ratio)}" + (f" {_interval(ran)}" if ran else "")


def _live_rate_note(report: dict) -> str | None:
    """One clause on why the phases' live tokens/s (each phase's first and last third of requests,
    ``live_*_third``) sit below this table's plain decoding: the phases shared the cores with the
    trainer, which this evaluation runs with stopped, and served ``config.max_new_tokens`` tokens a
    request against ``config.eval_new_tokens`` here (a request's prefill weighs more on fewer).
    None without both rates, or where live was not the slower."""
    rows = report.get("phases") or []
    live = [x for r in rows for k in ("live_first_third", "live_last_third")
            if (x := (r.get(k) or {}).get("tokens_per_s")) is not None]
    plain = [x for r in rows if (x := (r.get("plain") or {}).get("tokens_per_s")) is not None]
    if not live or not plain or max(live) >= min(plain):
        return None
    cfg = report.get("config") or {}
    tokens = (f", and served {cfg['max_new_tokens']} tokens a request against {cfg['eval_new_tokens']} here (the "
              f"prompt's prefill weighs more on fewer)"
              if cfg.get("max_new_tokens") and cfg.get("eval_new_tokens") and cfg["max_new_tokens"] < cfg["eval_new_tokens"]
              else "")
    return (f"live tokens/s in the phases {min(live):.1f}-{max(live):.1f} against plain decoding's "
            f"{min(plain):.1f}-{max(plain):.1f} here: the phases shared the cores with the trainer, stopped for this "
            f"evaluation{tokens}")


def _gate_cell(w) -> str:
    """A copy gate's weights, two decimals each, in store.copy_channel.FEATURES order ('none': no gate)."""
    return "none" if not w else " ".join(f"{x:+.2f}" for x in w)


def _prediction_costs(report: dict, preds: list[dict]) -> str:
    """Which step costs the Leviathan table's t(n)/t(1) come from, for its caption: one measurement
    for every phase (each prediction's ``step_cost_ms``, the costs as the evaluation began) and
    whether those were re-measured with the trainer stopped (``remeasured``); a report written
    before the predictions named their costs: each phase's own, as it was evaluated."""
    costs = [p.get("step_cost_ms") for p in preds]
    if any(c is None for c in costs) or any(c != costs[0] for c in costs):
        return "measured when each phase was evaluated (the evaluation's own steps move them, so phases differ)"
    rem = report.get("remeasured") or {}
    when = (f"re-measured on {rem['requests']} requests with the trainer stopped, the costs the controller's picks "
            f"were priced on" if rem.get("step_cost_ms") and rem.get("requests") else "as serving left them")
    measured = sorted(int(n) for n in costs[0])
    dips = _monotone_fit(costs[0])[1]
    first, first_cost, _ = _first_ceiling(report)
    if dips and first and _monotone_fit(first_cost)[0] == _monotone_fit(costs[0])[0]:
        # the first engine ceiling line below reads the same costs and says why a dip is noise: said once
        dipped = ", ".join(f"{n} rows measured below {m} rows'" for n, _, m, _ in dips)
        said = f"; {dipped}, pooled at the mean of their run: noise, as the first engine ceiling line below says"
    else:
        said = _dips_clause(dips)
    return (f"one measurement for every phase: the step costs as the evaluation began ({when}; "
            + (f"measured at {', '.join(map(str, measured))} rows, " if measured else "") + "other n read off them; "
            "t(n) as the least-squares fit that never falls with more rows" + said + ")")


def _prediction_table(report: dict, console) -> None:
    """The adapted draft's measured α, τ and c beside Leviathan et al.'s predicted speedup, with a
    verification that costs one plain step and with this engine's measured verification cost."""
    from rich.table import Table

    rows = [(r["workload"], (r.get("adapted_draft") or {}).get("prediction")) for r in report["phases"]]
    rows = [(w, p) for w, p in rows if p]
    if not rows:
        return
    at = _draft_gammas(report)
    t = Table(title="the adapted draft beside Leviathan et al.'s prediction (best γ of each; the draft's cost c per "
                    "proposed token in plain steps" + (f"; the evaluation decoded the draft at γ={at}, its ×plain in the "
                                                       f"acceptance table above" if at else "") + ")",
              caption="one-step verification: (1 - α^(γ+1)) / ((1 - α)(γc + 1)); this engine: a verification of n rows "
                      f"costs t(n)/t(1) plain steps, {_prediction_costs(report, [p for _, p in rows])}")
    for c in ("phase", "α", "τ", "c", "predicted, verification = 1 step", "predicted, this engine", "t(n)/t(1), n = 2..5"):
        t.add_column(c)
    for w, p in rows:
        one, eng = p.get("one_step") or {}, p.get("this_engine") or {}
        vc = p.get("verify_cost_rows") or {}
        t.add_row(w, _cell(p["alpha"]), _cell(p["tau"]), _cell(p["c"]),
                  f"{one['speedup']:.2f}x (γ={one['gamma']})" if one else "-",
                  f"{eng['speedup']:.2f}x (γ={eng['gamma']})" if eng else "-",
                  " ".join(f"{vc[k]:.2f}" for k in sorted(vc, key=int) if 2 <= int(k) <= 5) or "-")
    console.print(t)


def _copy_table(report: dict, console, pct: str) -> None:
    """The copy channel's ablation rows, when measured."""
    from rich.table import Table

    if any("adapted_nogate" in r for r in report["phases"]):
        tc = Table(title="the copy channel on the same prompts (draft γ=" + str((report.get("config") or {}).get("eval_gamma"))
                         + f"): decoded greedy α, gains paired per prompt [{pct} % CI]")
        for c in ("phase", "v0 α", "adapted (LoRA + gate) α", "gain over v0", "adapted LoRA, no gate α", "gain over v0",
                  "the gate adds", "v0 + fixed gate (λ=1 at ℓ≥3) α", "gain over v0", "final gate weights (store.copy_channel.FEATURES)"):
            tc.add_column(c)
        for r in report["phases"]:
            if "adapted_nogate" not in r:
                continue
            g = lambda k: (r.get(k) or {})  # noqa: E731
            cell = lambda k: f"{'-' if g(k).get('gain') is None else signed(g(k)['gain'], 3)} {_interval(g(k))}"  # noqa: E731
            tc.add_row(r["workload"], _cell(r["frozen"]["alpha"]), _cell(r["adapted_draft"]["alpha"]), cell("alpha_gain_ci"),
                       _cell(r["adapted_nogate"]["alpha"]), cell("nogate_alpha_gain_ci"), cell("gate_alpha_gain_ci"),
                       _cell(r["frozen_fixedgate"]["alpha"]), cell("fixedgate_alpha_gain_ci"),
                       _gate_cell((r.get("copy_gate") or {}).get("final")))
        console.print(tc)


def _head_table(report: dict, console) -> None:
    """The feature-level head's rows, when measured."""
    from rich.table import Table

    if any("adapted_head" in r for r in report["phases"]):
        th = Table(title=f"the feature-level head on the same prompts (eagle γ={report['config'].get('head_gamma')}): "
                         f"frozen v0 head vs the final head")
        for c in ("phase", "frozen head α", "frozen head ×plain", "adapted head α", "adapted head ×plain", "final head"):
            th.add_column(c)
        for r in report["phases"]:
            if "adapted_head" in r:
                th.add_row(r["workload"], _cell(r["frozen_head"]["alpha"]), _cell(r["frozen_head"]["speedup_vs_plain"]),
                           _cell(r["adapted_head"]["alpha"]), _cell(r["adapted_head"]["speedup_vs_plain"]), f"v{r['final_head']}")
        console.print(th)


def _is_v0(version: int | None, row: dict, pe: dict | None = None) -> bool:
    """Whether ``version`` is the phase row's v0 (the bootstrapped adapter, or the base draft 0
    when there was none): ``pe["is_v0"]`` when the report has it, else ``row["v0_version"]``."""
    if pe is not None and "is_v0" in pe:
        return bool(pe["is_v0"])
    return "v0_version" in row and version == row["v0_version"]


def _version_name(version: int | None, row: dict, pe: dict | None = None) -> str:
    """How the report names an adapter version: ``v3``; v0 as what it is, ``the bootstrap (v1)``
    or ``the base draft (v0)``, so a reader does not take it for a learnt version."""
    if _is_v0(version, row, pe):
        return f"the bootstrap (v{version})" if version else "the base draft (v0)"
    return f"v{version}"


def _adapted_row_is(row: dict, pe: dict) -> str:
    """Which version the table's adapted row decoded, beside the phase-end learner ``pe``: the final
    adapter serving the workload (``final_adapter``), which may have been promoted after the phase
    ended (code's v13 beside its phase-end v10 read as a contradiction when left unnamed)."""
    final = row.get("final_adapter")
    if final is None:
        return "the table's adapted row is the final adapter serving the workload"
    if final == pe["version"]:
        return "the table's adapted row is this same version, the final one serving the workload"
    return (f"the table's adapted row is the final adapter serving the workload, "
            f"{_version_name(final, row)}, which became active after the phase ended")


def _priced(decision: dict, proposer: str | None, gamma: int) -> float | None:
    """The pick's tokens per ms over plain decoding's as the controller priced it (None: plain, or
    either rate unknown)."""
    rates = decision.get("tokens_per_ms") or {}
    plain = rates.get(0)
    if not gamma or not plain:
        return None
    rate = rates.get(gamma) if proposer == "draft" else (decision.get("tokens_per_ms_by_proposer") or {}).get(
        proposer, {}).get(gamma)
    return round(rate / plain, 3) if rate else None


def _runner_up(decision: dict) -> dict | None:
    """A plain pick's best speculative candidate other than the draft (whose rows the evaluation
    decodes anyway), as the controller rated it: ``{"proposer", "gamma", "priced_vs_plain"}``, or
    None (no such candidate, or none rated). The demo decodes it on the same never-served prompts,
    so a speculation left off is shown for what it would have run (a walkthrough's extract phase
    served the n-gram proposer on most requests, left it off for the evaluation, and nothing said
    how it would have run)."""
    plain = (decision.get("tokens_per_ms") or {}).get(0)
    best = None
    for name, rates in (decision.get("tokens_per_ms_by_proposer") or {}).items():
        if name == "draft":
            continue
        for g, rate in (rates or {}).items():
            if int(g) > 0 and rate is not None and (best is None or rate > best[2]):
                best = (name, int(g), rate)
    if best is None or not plain:
        return None
    return {"proposer": best[0], "gamma": best[1], "priced_vs_plain": round(best[2] / plain, 3)}


def _price_with_prefill(pick: dict, prefill_ms: float, plain_ms: float) -> None:
    """Adds to ``pick`` (a row's ``controller_pick``) its price as a whole request would see it:
    plain decoding spent ``plain_ms`` on the evaluation's prompts, ``prefill_ms`` of it prefilling
    (a share f); a pick whose decoding steps run r times plain's (``priced_vs_plain``) takes
    f + (1 - f) / r of plain's time, so it is priced at 1 / (f + (1 - f) / r) per request: the
    figure to hold against the run's whole-request ratio (both sides pay the same prefill).
    ``priced_with_prefill`` and ``plain_prefill_share``; nothing without a price or a time."""
    r = pick.get("priced_vs_plain")
    if not r or not plain_ms or plain_ms <= 0 or not 0 <= prefill_ms <= plain_ms:
        return
    f = prefill_ms / plain_ms
    pick["plain_prefill_share"] = round(f, 3)
    pick["priced_with_prefill"] = round(1.0 / (f + (1.0 - f) / r), 3)


def _price_and_result(r: dict) -> str:
    """"priced at 1.45x plain, ran 0.98x [0.92, 1.05] on the never-served prompts", or "" (a plain
    pick: its runner-up's line, :func:`_runner_up_result`, or ""). The price per request is held
    against the run's interval as printed: a gap's why only where it lies outside."""
    pick = r["controller_pick"]
    if pick.get("runner_up"):
        return _runner_up_result(r)
    priced = pick.get("priced_vs_plain")
    ran = (r.get("speed_vs_plain_ci") or {}).get("adapted")
    if priced is None or not ran:
        return ""
    whole = pick.get("priced_with_prefill")
    if whole is not None:
        # the gap's why only for a price outside the interval as printed (a walkthrough read it beside
        # "1.14x a request" and "ran 1.16x [1.08, 1.24]")
        lo, hi = ran.get("low"), ran.get("high")
        outside = None if lo is None or hi is None else not round(lo, 2) <= round(whole, 2) <= round(hi, 2)
        return (f"; priced at {priced:.2f}x plain decoding per decoding step on the phase's traffic, i.e. {whole:.2f}x "
                f"a request with the prefill plain decoding spent on these prompts ({pick['plain_prefill_share']:.0%} "
                f"of its time); it ran {ran['ratio']:.2f}x {_interval(ran)} on the {r.get('eval_prompts', '?')} "
                f"never-served prompts, prefill included"
                + ((" (a gap between the two: what the phase's traffic, its n-gram history warm, taught the controller "
                    "that these prompts did not bear out)" if round(hi, 2) < round(whole, 2) else
                    " (above its price: these prompts paid more than the phase's traffic had taught the controller)")
                   if outside else ", an interval that holds the price" if outside is False else ""))
    return (f"; priced at {priced:.2f}x plain decoding per decoding step (on the phase's traffic, its prefill apart: "
            f"both sides pay the same prefill, which brings a ratio toward 1), it ran {ran['ratio']:.2f}x "
            f"{_interval(ran)} on the {r.get('eval_prompts', '?')} never-served prompts, prefill included")


def _runner_up_result(r: dict) -> str:
    """"; left off: ngram γ=4, priced at 1.11x plain, ran 1.02x [0.95, 1.09] ..." for a plain pick
    whose runner-up was decoded, or ""."""
    up = r["controller_pick"].get("runner_up")
    ran = (r.get("speed_vs_plain_ci") or {}).get("runner_up")
    if not up or not ran:
        return ""
    verdict = ("leaving it off cost speed" if ran["low"] > 1.0 else "leaving it off cost nothing measurable"
               if ran["high"] >= 1.0 else "leaving it off was right")
    return (f"; left off, {up['proposer']} γ={up['gamma']} (priced at {up['priced_vs_plain']:.2f}x plain decoding per "
            f"decoding step) ran {ran['ratio']:.2f}x {_interval(ran)} of plain on the {r.get('eval_prompts', '?')} "
            f"never-served prompts, prefill included: {verdict}")


def _turns_later(report: dict, workload: str) -> str:
    """Its adapter's turns at its phase's end against the run's end, where they differ (the trainer
    goes on with a workload's buffered records while later phases serve); "" otherwise."""
    sh = next((x for x in report.get("shifts") or () if x.get("workload") == workload), None)
    if not sh or not sh.get("turns") or not sh.get("turns_by_run_end"):
        return ""
    a, b = sh["turns"], sh["turns_by_run_end"]
    if a == b:
        return ""
    return (f"its adapter had {a.get('turns', 0)} turns ({a.get('judged', 0)} judged, {a.get('promoted', 0)} promoted) "
            f"when its phase ended and {b.get('turns', 0)} ({b.get('judged', 0)} judged, {b.get('promoted', 0)} "
            f"promoted) by the run's end: the trainer goes on with a workload's buffered records while later "
            f"phases serve (trainer.workload_turns counts them all)")


def _phase_notes(report: dict, console) -> None:
    """Per phase: the controller's reason (and its pick's price against its result), the learner at
    the phase end, each version's verdict, repeats."""
    for r in report["phases"]:
        console.print(f"  {r['workload']}: controller — {r['controller_pick']['why']}{_price_and_result(r)}")
        later = _turns_later(report, r["workload"])
        if later:
            console.print(f"  {r['workload']}: {later}")
        pe = r.get("phase_end_gain_ci")
        same = _same_as_phase_end(r, pe)  # a versions row of the same two versions: printed once, on pe's line
        if pe and _is_v0(pe["version"], r, pe):
            who = _version_name(pe["version"], r, pe)
            console.print(f"  {r['workload']}: at its phase's end the learner was still {who}: "
                          f"no version of its own was promoted in its phase (decoded α {_cell(pe['before'])}); "
                          f"{_adapted_row_is(r, pe)}")
        elif pe:
            moved = ("lowered" if pe.get("high") is not None and pe["high"] < 0 else
                     "raised" if pe.get("low") is not None and pe["low"] > 0 else "not measurably changed")
            console.print(f"  {r['workload']}: at its phase's end the learner (v{pe['version']}) had {moved} decoded α "
                          f"{_cell(pe['before'])} -> {_cell(pe['after'])} ({_gain_ci(pe['gain'], pe['low'], pe['high'])}); "
                          f"{_adapted_row_is(r, pe)}"
                          + (_lowered_note(report, r["workload"], same, r.get("eval_prompts"))
                             if same and same["lowered"] else ""))
        for v in [v for v in r.get("versions") or [] if v is not same]:
            verdict = ("LOWERED decoded α" if v["lowered"] else
                       "no measured change in decoded α" if v["low"] is not None and v["low"] <= 0 else "raised decoded α")
            console.print(f"  {r['workload']}: v{v['parent']} -> v{v['version']} {verdict}: {_cell(v['alpha_before'])} -> "
                          f"{_cell(v['alpha_after'])} ({_gain_ci(v['gain'], v['low'], v['high'])})"
                          + (_lowered_note(report, r["workload"], v, r.get("eval_prompts")) if v["lowered"] else ""))
        sv = r.get("served") or {}
        if sv.get("repeats"):
            console.print(f"  {r['workload']}: {sv['repeats']} of {sv['requests']} served requests repeated a prompt "
                          f"served earlier in the phase ({sv['requests'] - sv['repeats']} distinct prompts served); "
                          f"the n-gram proposer copies a repeat's earlier output, so live α and the controller's "
                          f"pick reflect repeated traffic; the table's rows are on prompts never served")


def _same_as_phase_end(row: dict, pe: dict | None) -> dict | None:
    """The phase row's ``versions`` entry that compares the same two versions as its phase-end
    learner ``pe`` (v0, ``row["v0_version"]``, against ``pe["version"]``), or None: the same paired
    bootstrap on the same prompts, kept to 4 decimals in ``versions``, so printed as well it gave
    the one comparison twice with intervals a rounding apart (a walkthrough read "+0.543]" and
    "+0.542]")."""
    if not pe or _is_v0(pe["version"], row, pe) or "v0_version" not in row:
        return None
    return next((v for v in row.get("versions") or () if v.get("parent") == row["v0_version"]
                 and v.get("version") == pe["version"]), None)


def _lowered_note(report: dict, workload: str, v: dict, prompts=None) -> str:
    """Why a promotion that measurably lowered ``workload``'s decoded α (``v``, a ``versions`` row)
    is no broken gate: the version's scope and the workloads its gate judged (its reason's "on
    code: ..."), and the trainer's cross-workload tolerance, ``regress_margin`` (the report's
    config; a report without it names the setting without a value), against the drop. Where
    ``workload`` is the version's own scope or one its gate judged, no tolerance applies: the note
    sets the gate's gain on held-out served traffic (from the reason) against the drop on the
    ``prompts`` (a count) never served (:func:`_own_lowered_note`)."""
    ad = next((a for a in report.get("adapters") or () if a.get("version") == v["version"]), {})
    m = re.match(r"on ([^:]+):", str(ad.get("reason") or ""))
    who = "a shared adapter" if not ad.get("scope") else f"{ad['scope']}'s adapter"
    judged = [w.strip() for w in m.group(1).split(",")] if m else []
    if workload == ad.get("scope") or workload in judged:
        return _own_lowered_note(v, who, m.group(1) if m else workload, str(ad.get("reason") or ""), prompts)
    on = f", promoted on {m.group(1)}'s held-out evidence" if m else ""
    margin = (report.get("config") or {}).get("regress_margin")
    drop = -(v.get("gain") or 0.0)
    if margin is None:
        return (f"; v{v['version']} is {who}{on}: the trainer's gate lets a promotion lower another workload's held-out "
                f"acceptance by up to its regress_margin (the cross-workload tolerance)")
    within = "within" if drop <= margin else "beyond"
    return (f"; v{v['version']} is {who}{on}: the trainer's gate lets a promotion lower another workload's held-out "
            f"acceptance by up to regress_margin {margin:g} (the demo's cross-workload tolerance), and this drop of "
            f"{drop:.3f} is {within} it" + ("" if within == "within" else ": more than the gate allows, worth a look"))


_GATE_GAIN = re.compile(r"\(([+-][\d.]+), [\d.]+ % CI \[([^\]]+)\]\) on (\d+) positions of (\d+) held-out requests")


def _own_lowered_note(v: dict, who: str, judged: str, reason: str, prompts=None) -> str:
    """The lowered note of a version on its own workload (its scope, or one its gate judged): the
    gate's gain on held-out served requests, acceptance as served, as ``reason`` gives it ("+0.0364
    [+0.0099, +0.0659] on 577 positions of 19 requests"), against the decoded drop on ``prompts``
    never-served prompts: two measurements that disagree, not a tolerance (a walkthrough's note
    claimed regress_margin allowed a drop on the adapter's own workload)."""
    g = _GATE_GAIN.search(reason)
    gain = (f", {g.group(1)} [{g.group(2)}] on {g.group(3)} positions of {g.group(4)} requests (the adapter's reason "
            f"has it)" if g else " (the adapter's reason has it)")
    on = f"the {prompts} never-served prompts" if prompts else "never-served prompts"
    return (f"; v{v['version']} is {who}, promoted on {judged}'s held-out served requests' acceptance as served{gain}, "
            f"while decoded on {on} it fell: the two measurements disagree (teacher-forced on held-out served traffic "
            f"against decoded on never-served prompts), worth a look (report.json's versions and adapters)")


def _adapter_tables(report: dict, console) -> None:
    """The adapters (and heads) registered in the run, with their reasons."""
    from rich.table import Table

    # the α columns are the held-out α at T = 1 (Σ min(p, q)); the gate judges acceptance as served
    # (greedy: the accepted prefix), which each reason gives with its interval
    a = Table(title="adapters (α before / after: held-out, at T = 1; the gate judges acceptance as served: see the reason)")
    for c in ("version", "scope", "state", "α before", "α after", "samples"):
        a.add_column(c)
    a.add_column("reason", overflow="fold")  # wrapped, never cut: the reason is the point
    for r in report["adapters"]:
        a.add_row(str(r.get("version")), r.get("scope") or "shared", str(r.get("state")), _cell(r.get("alpha_before")),
                  _cell(r.get("alpha_after")), str(r.get("samples_trained")), _reason_cell(str(r.get("reason", ""))))
    console.print(a)
    if report.get("heads"):
        hd = Table(title="heads")
        for c in ("version", "state", "α before", "α after", "records", "reason"):
            hd.add_column(c)
        for r in report["heads"]:
            hd.add_row(str(r.get("version")), str(r.get("state")), _cell(r.get("alpha_before")), _cell(r.get("alpha_after")),
                       str(r.get("samples_trained")), str(r.get("reason", "")))
        console.print(hd)


def _reason_cell(reason: str) -> str:
    """An adapter's ``reason`` as the table prints it: a registry whose trainer wrote "it fell while
    α at T=1 rose" beside "α at T=1 0.475 -> 0.475" (equal as printed, the rise below the third
    decimal) reads "held" there (a walkthrough's trip; the trainer now writes it so itself)."""
    m = re.search(r"α at T=1 (\d+\.\d+) -> (\d+\.\d+)", reason)
    if m and m.group(1) == m.group(2):
        return reason.replace("it fell while α at T=1 rose", "it fell while α at T=1 held")
    return reason


def _k_of_n(v: str) -> tuple[int, int]:
    """``"k/n"`` (prompts equal of prompts run) as (k, n)."""
    k, n = v.split("/")
    return int(k), int(n)


def _lossless_summary(report: dict) -> str | None:
    """One line: how many speculative greedy evaluation outputs were token-identical to plain
    decoding of the served format on the same prompt (each row's ``matches_plain``), naming the
    runs that were not; None when the report has no evaluation."""
    same = total = 0
    bad = []
    for r in report.get("phases", []):
        for name, v in r.items():
            if isinstance(v, dict) and isinstance(v.get("matches_plain"), str) and not v.get("same_run_as"):
                k, n = _k_of_n(v["matches_plain"])
                same, total = same + k, total + n
                if k < n:
                    bad.append(f"{r['workload']} {name} (prompts {v.get('differs_from_plain')})")
    if not total:
        return None
    k_n = [_k_of_n(r["llamacpp_plain"]["same_tokens_as_plain"]) for r in report.get("phases", [])
           if isinstance(r.get("llamacpp_plain"), dict) and isinstance(r["llamacpp_plain"].get("same_tokens_as_plain"), str)]
    return (f"greedy outputs equal to plain decoding: {same} of {total} speculative evaluation runs"
            + (f"; NOT LOSSLESS: {'; '.join(bad)}" if bad else "")
            + (f" (llama.cpp's own plain generation, the peer, gave the same tokens on {sum(k for k, _ in k_n)} of "
               f"{sum(n for _, n in k_n)} prompts: its logits round differently, its own V cache type and call "
               f"shapes, so greedy near-ties can go the other way; {_peer_files(report)[1]})"
               if k_n else ""))


def _peer_files(report: dict) -> tuple[bool, str]:
    """Whether llama.cpp's peer decodes the file our plain decoding serves (``served_format``'s
    ``model`` against ``llamacpp_peer_file``), and a clause that says which file each decodes. A
    served format other than the packaged file (``models.format`` = auto may pick one) makes every
    ×llama.cpp ratio compare the format choice and the engine together; unknown files say so."""
    sf = report.get("served_format") or {}
    served, peer = sf.get("file"), report.get("llamacpp_peer_file")
    if peer and (sf.get("format") == "packaged" or served == peer):
        return True, f"both are plain decoding of the same file, {peer}"
    if served and peer:
        return False, (f"llama.cpp decodes the packaged file {peer}, our plain decoding the served {sf.get('format')} "
                       f"({served}): the ×llama.cpp columns compare the format choice and the engine together, "
                       f"not two engines on one file")
    return False, ("llama.cpp decodes the packaged file, our plain decoding the served format (which may differ: "
                   "see served_format in report.json)")


def _adapters_serving(report: dict) -> str:
    """What serves each workload at the run's end, for the closing line. With per-workload adapters
    (``workload_adapters``) each workload's own scope serves it and the shared scope's version
    (``active_adapter``, the bootstrap in the demo) only a workload without a promoted one of its own:
    naming the shared one alone read as if it served every workload. One sentence, its full stop left
    to the caller."""
    own = {w: v for w, v in (report.get("workload_adapters") or {}).items() if v}
    shared = report.get("active_adapter") or 0
    phases = [r["workload"] for r in report.get("phases") or [] if r.get("workload")]
    if not own and not (report.get("config") or {}).get("per_workload"):
        return f"Serving at the end: v{shared}, the shared adapter, for every workload"
    order = phases + sorted(w for w in own if w not in phases)
    if order and all(w in own for w in order):
        return (f"Serving at the end, each workload its own adapter: {', '.join(f'{w} v{own[w]}' for w in order)}; "
                f"the shared v{shared} serves any other workload")
    mine, rest = [w for w in order if w in own], [w for w in order if w not in own]
    parts = [f"{', '.join(f'{w} v{own[w]}' for w in mine)} ({'its own' if len(mine) == 1 else 'each its own'})"] if mine else []
    if rest:
        parts.append(f"{', '.join(rest)} the shared v{shared} (no adapter of {'its' if len(rest) == 1 else 'their'} "
                     f"own promoted)")
    return f"Serving at the end: {'; '.join(parts) or f'the shared v{shared} for every workload (none promoted its own)'}"


class _Dips(list):
    """:func:`_monotone_fit`'s dips, a list of (rows, its ms, the fewer rows that cost the most
    before it, their ms), with ``blocks``: each run of two or more measured row counts the fit
    pooled, as (those row counts, the price of each)."""

    blocks: tuple = ()  # set per instance by _monotone_fit


def _monotone_fit(ms_by_rows: dict) -> tuple[dict[int, float], _Dips]:
    """``ms_by_rows`` ({rows: ms}, keys int or str; a non-finite reading left out) as a price may
    use them: the least-squares fit that never falls with more rows (a verification of more rows
    cannot cost less than one of fewer), by pool adjacent violators
    (:func:`decoder.proposers.cost.monotone_fit`, as ``StepCost.ms`` prices), each reading weighted
    alike (report.json keeps no reading counts); and each dip, a reading below one of fewer rows,
    with the runs pooled (:class:`_Dips`). A dip is noise between readings, not a cheaper
    verification; the fit prices a run that falls at its mean, where a running max priced it at its
    highest reading and so let one high reading raise every larger row count's price."""
    from decoder.proposers.cost import isotonic_blocks

    pts = [(n, t) for n, t in sorted((int(k), float(v)) for k, v in ms_by_rows.items()) if math.isfinite(t)]
    dips, top = _Dips(), None
    for n, t in pts:
        if top is not None and t < top[1]:
            dips.append((n, t, *top))
        if top is None or t >= top[1]:
            top = (n, t)
    out: dict[int, float] = {}
    dips.blocks = []
    for a, b, m in isotonic_blocks([t for _, t in pts]):
        out.update((n, m) for n, _ in pts[a:b])
        if b - a > 1:
            dips.blocks.append((tuple(n for n, _ in pts[a:b]), m))
    return out, dips


_running_max = _monotone_fit  # its former name, which tests still use


def _dips_clause(dips: list[tuple[int, float, int, float]], unit: str = "ms") -> str:
    """"; 3 rows measured <ms>, below 2 rows' <ms>: noise between two readings (...), priced on the
    fit that never falls with more rows: 2 and 3 rows at <ms>, the mean ..." for :func:`_monotone_fit`'s
    dips (the pooled runs from their ``blocks``, where they have them); "" without."""
    if not dips:
        return ""
    each = ", ".join(f"{n} rows measured {t:.2f} {unit}, below {m} rows' {tm:.2f}" for n, t, m, tm in dips)
    blocks = getattr(dips, "blocks", ())
    runs = ", ".join(f"{', '.join(map(str, ns[:-1]))} and {ns[-1]} rows at {v:.2f} {unit}" for ns, v in blocks)
    mean = "the mean of their readings" if len(blocks) == 1 else "each run at the mean of its readings"
    return (f"; {each}: noise between two readings (a verification of more rows cannot cost less), priced on the "
            f"least-squares fit that never falls with more rows" + (f": {runs}, {mean}" if runs else ""))


def _priced_ceiling(ceil: dict, cost: dict) -> tuple[dict, list[tuple[int, float, int, float]]]:
    """``ceil`` (``StepCost.ceiling``'s dict on ``cost``, ms by rows) as priced: on the monotone fit
    of the costs (:func:`_monotone_fit`) where a verification of more rows measured less than one of
    fewer, each line's headline figure; and the dips. ``ceil`` itself without dips, or without every
    row its γ need."""
    gammas = sorted(int(g) for g in (ceil.get("by_gamma") or {}))
    rows = [1, *(g + 1 for g in gammas)]  # a plain step and each γ's verification of γ + 1 rows
    envelope, dips = _monotone_fit(cost)
    if dips and gammas and all(n in envelope for n in rows):  # the ceiling on the costs as priced, dips lifted
        from decoder.proposers.cost import speculation_ceiling

        ceil = speculation_ceiling({n: envelope[n] for n in rows}, max(gammas)) or ceil
    return ceil, dips


def _rises_clause(ceil: dict, cost: dict, stopped_ceil: dict | None, stopped_cost: dict | None) -> str:
    """Where the ceiling beside the trainer (``ceil`` on ``cost``, ms by rows as priced) is above the
    one with the trainer stopped (``stopped_ceil`` on ``stopped_cost``, compared as that line's
    headline prices it, :func:`_priced_ceiling`), what was measured: each divides by its own
    moment's plain step, and its γ's rows in plain steps of each moment (a walkthrough read 1.10x
    stopped and 1.26x beside the trainer as a ceiling that rises under load; another met "above
    the 2.10x", the stopped line's dip-included figure, beside its headline 2.08x, and a cause
    the plain steps measured contradicted). "" where it is not above, or without both readings."""
    if not stopped_ceil or not stopped_cost:
        return ""
    stopped_ceil = _priced_ceiling(stopped_ceil, stopped_cost)[0]
    if round(ceil["speedup"], 2) <= round(stopped_ceil["speedup"], 2):
        return ""
    n = int(ceil["gamma"]) + 1
    here, still = _monotone_fit(cost)[0], _monotone_fit(stopped_cost)[0]
    if not all(k in m for m in (here, still) for k in (1, n)):
        return ""
    return (f"; above the {stopped_ceil['speedup']:.2f}x with the trainer stopped: each ceiling divides by its own "
            f"moment's plain step, and {n} rows cost {here[n] / here[1]:.2f} plain steps here against "
            f"{still[n] / still[1]:.2f} with the trainer stopped, medians of other requests' steps")


# two plain steps within this fraction of each other are one step read at two moments (a walkthrough read
# "9.51 ms measured beside the trainer, which slowed it (9.50 ms with the trainer stopped)")
_NOISE = 0.03


def _ceiling_line(ceil: dict, cost: dict, when: str, stopped_cost: dict | None = None,
                  key: str = "remeasured.engine_ceiling", stopped_ceil: dict | None = None) -> str:
    """One engine ceiling (``StepCost.ceiling``'s dict) for the footer: which γ it was measured at
    (the row counts of ``cost``, ms by rows, and the γ of ``ceil["by_gamma"]``), and the plain step
    it divides by. With ``stopped_cost`` (the costs with the trainer stopped) this is the ceiling
    beside the trainer: the line gives both plain steps (and says the trainer slowed it where it was
    the slower by more than ``_NOISE``, "about the same" within it), so it is not read against a live
    decision priced on another plain step. Costs that
    dip with more rows (:func:`_monotone_fit`) are priced on the monotone fit, the ceiling with them
    (:func:`_priced_ceiling`), and the line names each dip as noise, and where that moved the
    ceiling, the figure on the costs as measured that report.json keeps under ``key``
    (``ceil["speedup"]``), so the two are not read as one figure that disagrees."""
    two, one = cost.get(2, cost.get("2")), cost.get(1, cost.get("1"))
    gammas = sorted(int(g) for g in (ceil.get("by_gamma") or {}))
    rows = [1, *(g + 1 for g in gammas)]  # a plain step and each γ's verification of γ + 1 rows
    raw = ceil.get("speedup")
    ceil, dips = _priced_ceiling(ceil, cost)
    as_measured = (f" ({raw:.2f}x on the costs as measured, the dip included: report.json's {key}.speedup)"
                   if raw is not None and f"{raw:.2f}" != f"{ceil['speedup']:.2f}" else "")
    # a ceiling covers only the γ whose verifications were measured (model-free steps): say which, by name
    span = (f"γ={ceil['gamma']}, the best of γ={', '.join(map(str, gammas))} measured: steps measured at "
            f"{', '.join(map(str, rows))} rows, no other γ priced" if len(gammas) > 1 else
            f"γ={ceil['gamma']}, the only γ measured then")
    step = ""
    if one:
        step = f"; against a plain step of {one:.2f} ms"
        still = stopped_cost.get(1, stopped_cost.get("1")) if stopped_cost else None
        if still and abs(one - still) <= _NOISE * still:  # one moment and another: no slowdown to name
            step += (f" measured beside the trainer, about the same as with the trainer stopped ({still:.2f} ms): "
                     f"a live decision divides by the plain step of its moment")
        elif still:
            step += (f" measured beside the trainer{', which slowed it' if one > still else ''} ({still:.2f} ms with "
                     f"the trainer stopped): a live decision divides by the plain step of its moment")
    return (f"engine ceiling {when}: even if every proposal were accepted at no cost, speculation could run at most "
            f"{ceil['speedup']:.2f}x plain ({span})"
            + (f"; a verification of 2 rows cost {two / one:.2f} plain steps" if one and two else "")
            + _dips_clause(dips) + as_measured + _rises_clause(ceil, cost, stopped_ceil, stopped_cost) + step)


def _plain_ms(cost: dict | None) -> float | None:
    return (cost or {}).get(1, (cost or {}).get("1"))


def _price_sources(report: dict) -> str | None:
    """One line naming which plain step each price on the screen divides by, once: the ceiling
    lines and the Leviathan table read StepCost's steps by verified rows (re-measured with the
    trainer stopped, and beside the trainer), each pick's `why` the controller's own steps of its
    workload (``controller_pick["t_plain_ms"]``), and report.json's top-level ``step_cost_ms`` is
    StepCost after the evaluation's own steps (a walkthrough met four plain steps on one screen,
    none named). None for a report without the re-measurement."""
    rem = report.get("remeasured") or {}
    stopped, beside = _plain_ms(rem.get("step_cost_ms")), _plain_ms((rem.get("beside_trainer") or {}).get("step_cost_ms"))
    if not stopped:
        return None
    picks = [p for r in report.get("phases") or [] if (p := (r.get("controller_pick") or {}).get("t_plain_ms"))]
    last = _plain_ms(report.get("step_cost_ms"))
    top = _top_level_costs(report, last, stopped) if last else ""
    span = (f" (a plain step {min(picks):.2f}-{max(picks):.2f} ms)" if len(picks) > 1 and min(picks) != max(picks)
            else f" (a plain step {picks[0]:.2f} ms)" if picks else "")
    return (f"which plain step each price divides by: the ceiling with the trainer stopped and the Leviathan table, "
            f"StepCost's steps by verified rows re-measured with the trainer stopped ({stopped:.2f} ms)"
            + (f"; the ceiling while serving, the same beside the trainer ({beside:.2f} ms)" if beside else "")
            + f"; each pick's `why`, the controller's own steps of that workload, re-measured too{span}"
            + (f"; {top}" if last else ""))


def _top_level_costs(report: dict, last: float, stopped: float) -> str:
    """The price-sources line's clause on report.json's top-level ``step_cost_ms`` (plain step
    ``last`` ms) and ``engine_ceiling``: StepCost after the evaluation's own steps. Its ceiling with
    its value as report.json keeps it (a walkthrough met "a third ceiling" without its figure); one
    equal to 3 decimals to a ceiling printed above (``remeasured``'s, stopped or beside the trainer)
    is said to be that one, not "a third" (a walkthrough read "a third ceiling, 2.466x" beside the
    stopped 2.466x): compared with each line's headline, the ceiling as priced (:func:`_priced_ceiling`),
    then with the figure on the costs as measured that a line prints beside it where a dip moved it
    (a walkthrough read "2.585x ...: the same ceiling as with the trainer stopped" beside that line's
    "at most 2.55x", its 2.585 only the "2.58x on the costs as measured, the dip included"); a plain
    step other than the re-measured ``stopped`` ms says in a few words why."""
    third = (report.get("engine_ceiling") or {}).get("speedup")
    rem = report.get("remeasured") or {}
    beside = rem.get("beside_trainer") or {}
    shown = {"with the trainer stopped": (rem.get("engine_ceiling"), rem.get("step_cost_ms")),
             "beside the trainer": (beside.get("engine_ceiling"), beside.get("step_cost_ms"))}
    same = None
    for when, (ceil, cost) in shown.items() if third is not None else ():
        if not ceil or ceil.get("speedup") is None:
            continue
        raw, priced = ceil["speedup"], _priced_ceiling(ceil, cost or {})[0]["speedup"]
        if f"{priced:.3f}" == f"{third:.3f}":
            same = f"the same ceiling as {when}, above"
            break
        if f"{raw:.3f}" == f"{third:.3f}" and f"{raw:.2f}" != f"{priced:.2f}":  # the line's "as measured" figure
            same = (f"the same figure as the {raw:.2f}x {when} on the costs as measured, the dip included, above, "
                    f"not that line's {priced:.2f}x")
    if third is None:
        head = f"report.json's top-level step_cost_ms ({last:.2f} ms) is"
    elif same:
        head = f"report.json's top-level step_cost_ms ({last:.2f} ms) and engine_ceiling ({third:.3f}x on those steps: {same}) are"
    else:
        head = (f"report.json's top-level step_cost_ms ({last:.2f} ms) and engine_ceiling (a third ceiling, "
                f"{third:.3f}x, on those steps) are")
    why = (f" (its {last:.2f} ms is the median of the evaluation's last plain steps, another moment than the "
           f"re-measured {stopped:.2f} ms)" if f"{last:.2f}" != f"{stopped:.2f}" else "")
    return f"{head} StepCost after the evaluation's own steps, which priced nothing here{why}"


def _format_plain_ms(report: dict) -> tuple[float | None, int, str]:
    """The format measurement's plain step of the served file (ms; ``served_format["costs"]``' row
    of the served format, else the packaged file's, ``ms`` keyed by rows, int or str), the cached
    tokens its steps ran after (``served_format["measurement"]["cached_tokens"]``, 0 unknown) and
    which file ("the packaged file", or "the Q8_0 copy served"). (None, 0, "") without one."""
    sf = report.get("served_format") or {}
    rows = {c.get("format"): c for c in sf.get("costs") or () if isinstance(c, dict)}
    served = sf.get("format") if sf.get("format") in rows else "packaged"
    ms = (rows.get(served) or {}).get("ms") or {}
    name = "the packaged file" if served == "packaged" else f"the {served} copy served"
    return ms.get(1, ms.get("1")), int((sf.get("measurement") or {}).get("cached_tokens") or 0), name


def _plain_figures(report: dict) -> str | None:
    """One line naming what each plain-decoding figure on the screen measures, so they are not read
    as one figure that disagrees with itself (a walkthrough met a 15.72 ms re-measured step, a 14.72 ms
    format step and the evaluation's 50.8-61.7 tokens/s, nothing said which to trust): the format
    measurement's step (at startup, before the trainer, after its cached tokens of context), the
    re-measured step (the serving loop's, short requests, trainer stopped), the evaluation's tokens/s
    (whole requests, prefill included, trainer stopped). None with fewer than two of them."""
    fmt, ctx, which = _format_plain_ms(report)
    rem = report.get("remeasured") or {}
    stopped = _plain_ms(rem.get("step_cost_ms"))
    tps = [x for r in report.get("phases") or [] if (x := (r.get("plain") or {}).get("tokens_per_s")) is not None]
    cfg = report.get("config") or {}
    parts = []
    if fmt:
        parts.append(f"{fmt:.2f} ms, the format measurement's step of {which} at startup, before the trainer"
                     + (f", after {ctx} cached tokens" if ctx else ""))
    if stopped:
        n_new = rem.get("new_tokens") or cfg.get("max_new_tokens")  # an older report's: the phases' length
        new = f", {n_new} new tokens each" if n_new else ""
        parts.append(f"{stopped:.2f} ms, the serving loop's own steps re-measured on {rem.get('requests', '?')} requests "
                     f"(prompts of at most {_PROMPT_TOKENS} tokens{new}), the trainer stopped")
    if tps:
        new = f" of {cfg['eval_new_tokens']} new tokens" if cfg.get("eval_new_tokens") else ""
        span = f"{min(tps):.1f}-{max(tps):.1f}" if min(tps) != max(tps) else f"{tps[0]:.1f}"
        parts.append(f"{span} tokens/s, the evaluation's whole requests{new}, prefill included, the trainer stopped")
    if len(parts) < 2:
        return None
    return (f"plain decoding, {'three' if len(parts) == 3 else 'two'} measurements of their own: {'; '.join(parts)}. "
            f"Each moved with the host's load at its moment; speed is judged on the evaluation's ratios, paired per prompt")


def _first_ceiling(report: dict) -> tuple[dict | None, dict, str]:
    """The footer's first engine ceiling: (its ceiling, its costs by rows, when they were measured).
    With the trainer stopped: the costs re-measured before the evaluation (what its picks were priced
    on); without that re-measurement the run's last costs, after the evaluation's own steps (which
    stay in report.json's ``step_cost_ms`` either way)."""
    rem = report.get("remeasured") or {}
    if rem.get("engine_ceiling"):
        return rem["engine_ceiling"], rem.get("step_cost_ms") or {}, "with the trainer stopped (re-measured before the evaluation)"
    return (report.get("engine_ceiling"), report.get("step_cost_ms") or {},
            "at the evaluation, the trainer stopped" if rem.get("beside_trainer") else "beside the trainer")


def _recovery_and_footer(report: dict, console) -> None:
    """Recovery after each shift, the engine ceiling, and how to inspect the run."""
    from rich.table import Table

    rc = Table(title="recovery after each shift (greedy α of the last 5 speculating requests back to 90 % of pre-shift)",
               caption="- : not recovered within the phase, or too few requests speculated to tell")
    for c in ("shift", "pre-shift α", "requests", "seconds", "α then"):
        rc.add_column(c)
    for r in report.get("recovery", []):
        secs = r["seconds"]  # seconds to one decimal ("3.8"; _cell's 3 decimals read "3.800", a walkthrough's trip)
        rc.add_row(f"{r['from']} → {r['workload']}", _cell(r["pre_shift_alpha"]), _cell(r["requests"]),
                   f"{secs:.1f}" if isinstance(secs, (int, float)) else _cell(secs), _cell(r["recovered_alpha"]))
    console.print(rc)
    rem = report.get("remeasured") or {}
    beside = rem.get("beside_trainer")
    stopped = _first_ceiling(report)
    if stopped[0]:
        console.print(_ceiling_line(*stopped, key="remeasured.engine_ceiling" if rem.get("engine_ceiling")
                                    else "engine_ceiling"))
    if beside and beside.get("engine_ceiling"):
        console.print(_ceiling_line(beside["engine_ceiling"], beside.get("step_cost_ms") or {},
                                    "while serving, beside the trainer", stopped[1],
                                    key="remeasured.beside_trainer.engine_ceiling",
                                    stopped_ceil=rem.get("engine_ceiling")))
    sources = _price_sources(report)
    if sources:
        console.print(sources)
    figures = _plain_figures(report)
    if figures:
        console.print(figures)
    lossless = _lossless_summary(report)
    if lossless:
        console.print(lossless)
    extra = int((report.get("remeasured") or {}).get("requests") or 0)
    served = (f"{report['requests']} in the phases and {extra} in the re-measurement, {report['requests'] + extra} in all"
              if extra else f"{report['requests']}")
    # two sentences (a walkthrough read "requests served: 666 in the phases, 730 with the 64 of the
    # re-measurement, adapters serving, each workload's own scope: ..." as one garbled one)
    console.print(f"Requests served: {served}, in {report['seconds']} s (the plot: {report.get('plot')}).")
    console.print(f"{_adapters_serving(report)}.")
    console.print(f"inspect this run: export DRAFTD_STORE__KEY_PREFIX={report['key_prefix']}; .venv/bin/daemonctl status; "
                  f".venv/bin/daemonctl history --plot {Path(report.get('plot') or 'out/demo/acceptance.png').with_name('history.png')}"
                  + ("; .venv/bin/daemonctl heads list" if report.get("heads") else ""))




def _run_and_report(settings, cfg: DemoConfig, console) -> dict[str, Any]:
    """:func:`run_demo`, then :func:`print_report`. Log records (a shift alarm's ``acceptance_shift``,
    a library's warning) would break into the live table: while the demo runs they go to
    ``cfg.out_dir/demo.log`` (JSON lines, one run's), and the console says how many there were.

    An exception nothing expected (a lost connection, a library's bug) ends the run with one line
    on the console (:func:`_failure_line`: what failed, where the traceback went, whether a rerun
    is safe) and its full traceback appended to the log file, instead of pages of frames.

    Raises:
        typer.Exit: (code 2) the configured pair or engine cannot run, or ``cfg.out_dir`` cannot
            hold the log file (before anything runs); (code 1) the run failed unexpectedly; the
            message says why.
    """
    from daemon.logging import logs_to_file
    from decoder.engines.base import EngineError
    from decoder.models.packaged import ModelLoadError

    log_path = Path(cfg.out_dir) / "demo.log"
    with contextlib.ExitStack() as stack:
        try:
            logged = stack.enter_context(logs_to_file(log_path, mode="w"))
        except OSError as e:  # a file in the way, a read-only mount: the report could not be written either
            console.print(f"[red]error:[/] --out {cfg.out_dir}: cannot write the demo's log file {log_path} ({e}); "
                          f"pass --out a writable directory")
            raise typer.Exit(2) from e
        console.log(f"log messages of this run (warnings and above) go to {log_path}")
        try:
            report = run_demo(settings, cfg, console)
        except (ModelLoadError, EngineError) as e:  # the configured pair or engine cannot run: say so, no traceback
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from e
        except typer.Exit:
            raise
        except Exception as e:  # noqa: BLE001 - one line for the user, the traceback in the log file
            _log_traceback(log_path, e)
            console.print(_failure_line(e, log_path))
            raise typer.Exit(1) from e
    print_report(report, console)
    if logged.warnings:
        console.print(f"{logged.warnings} warning(s) logged during the run, the last {logged.last!r}: see {log_path}")
    note = _shift_alarms_note(report)
    if note:
        console.print(note)
    return report


def _log_traceback(log_path: Path, error: BaseException) -> None:
    """Append ``error``'s full traceback (its causes too) to the demo's log file ``log_path`` as one
    JSON line in the log's own shape (``event`` ``demo_failed``, ``level``, ``timestamp``,
    ``exception``: the text ``traceback`` prints). A file that cannot be written is let go: the
    console line still says what failed."""
    import datetime as dt
    import traceback

    line = {"event": "demo_failed", "level": "error", "logger": "daemon.demo",
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z"),
            "error": f"{type(error).__name__}: {error}",
            "exception": "".join(traceback.format_exception(type(error), error, error.__traceback__))}
    try:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass


def _failure_line(error: BaseException, log_path: Path) -> str:
    """The one console line of a demo that died of an unexpected ``error``: the exception and its
    deepest cause ("APIConnectionError: Connection error. (caused by ReadError: [Errno 104]
    Connection reset by peer)"), the innermost of draftd's own frames it passed through
    ("daemon/demo.py:748, _serve_one"), where the traceback is, and that a rerun is safe and quick."""
    import traceback

    what = f"{type(error).__name__}: {error}"
    cause, seen = error, {id(error)}
    while (cause.__cause__ or cause.__context__) is not None and id(cause.__cause__ or cause.__context__) not in seen:
        cause = cause.__cause__ or cause.__context__
        seen.add(id(cause))
    if cause is not error:
        what += f" (caused by {type(cause).__name__}: {cause})"
    root = Path(__file__).resolve().parents[1]
    ours = [f for f in traceback.extract_tb(error.__traceback__)
            if Path(f.filename).resolve().is_relative_to(root) and "site-packages" not in f.filename]
    where = f" in {Path(ours[-1].filename).resolve().relative_to(root)}:{ours[-1].lineno} ({ours[-1].name})" if ours else ""
    return (f"[red]error:[/] the demo stopped on an unexpected {rich_escape(what)}{where}; its full traceback is in "
            f"{rich_escape(str(log_path))}. Rerunning is safe: a run starts afresh (its Redis keys and "
            f"{rich_escape(str(log_path.parent))} are written anew) "
            f"and reuses the caches (the llama.cpp build, the converted model, v0 once bootstrapped), so it gets going "
            f"sooner; a failure that repeats is worth reporting with that log")


def _remeasured_alarms(report: dict, n_alarms: int) -> tuple[int, int]:
    """``remeasured["alarms"]`` as (before, after): the count of ``shift_alarms`` before and after
    the re-measurement's requests, so it raised ``shift_alarms[before:after]``. Read from
    ``{"before": b, "after": a}``, or from an earlier report's ``[b, a]``; (n, n) without it."""
    got = (report.get("remeasured") or {}).get("alarms")
    if isinstance(got, dict) and "before" in got and "after" in got:
        return int(got["before"]), int(got["after"])
    if isinstance(got, (list, tuple)) and len(got) >= 2:  # reports written before the fields were named
        return int(got[0]), int(got[1])
    return n_alarms, n_alarms


def _clock_late(shift: dict) -> float:
    """Seconds from a phase's first request to the start of its clock (``wall_seconds - seconds``
    of its ``shifts`` entry: the first phase's clock starts at v0's arrival); 0 within a second."""
    wall, s = shift.get("wall_seconds"), shift.get("seconds")
    return wall - s if wall is not None and s is not None and wall - s > 1 else 0.0


def _alarm_clock(report: dict, places: list[str]) -> str:
    """The alarm note's word on the first phase's clock, where an alarm of that phase is placed on it
    ("s into its phase") and it started late: "; "s into its phase" on the phase's clock: prose's
    starts at v0's arrival, 92 s after its first request" (a walkthrough read an alarm "2 s into its
    phase" at its phase's 49th request); "" otherwise. Said once, before the first alarm's place."""
    shifts, alarms = report.get("shifts") or [], report.get("shift_alarms") or []
    late = _clock_late(shifts[0]) if shifts else 0.0
    w = shifts[0].get("workload") if shifts else None
    if not late or not any(_alarm_workload(a) == w and " s into its phase" in p for a, p in zip(alarms, places)):
        return ""
    return f"; \"s into its phase\" on the phase's clock: {w}'s starts at v0's arrival, {late:.0f} s after its first request"


def _into_phase(since_first: float, shift: dict) -> str:
    """", 41 s into its phase" for an alarm ``since_first`` seconds after its phase's first request, on
    the clock its phase's closing line gives (:func:`_served_for`: the first phase's starts at v0's
    arrival, ``wall_seconds - seconds`` after its first request; a walkthrough read an alarm "122 s into
    its phase" of a phase whose clock ran 120 s); one before that clock started says so."""
    late = _clock_late(shift)
    if since_first >= late:
        return f", {since_first - late:.0f} s into its phase"
    return f", {since_first:.0f} s after its phase's first request, before its clock started (while v0 bootstrapped)"


def _alarm_places(report: dict) -> list[str]:
    """Where each of ``shift_alarms`` fired, in order: ", at request i of n, s s into its phase"
    for one a phase's request raised (the timeline rows flagged ``shift_alarm`` against ``shifts``,
    one alarm a row), ", during the re-measurement (n requests, trainer stopped)" for those
    ``remeasured["alarms"]`` (the counts before and after it, :func:`_remeasured_alarms`) holds, and
    ", outside any phase" for the rest (after the phases; their requests are not in the timeline)."""
    alarms = report.get("shift_alarms") or []
    timeline, shifts = report.get("timeline") or [], report.get("shifts") or []
    first, last = _remeasured_alarms(report, len(alarms))
    where = []
    for i, r in enumerate(timeline):
        sh = next((s for s in reversed(shifts) if s.get("request", 0) <= i), None)
        if r.get("shift_alarm") and sh is not None:
            into = _into_phase(r["t"] - sh["t"], sh) if "t" in r and "t" in sh else ""
            where.append(f" at request {i - sh['request'] + 1}" + (f" of {sh['requests']}" if sh.get("requests") else "") + into)
    n_req = (report.get("remeasured") or {}).get("requests")
    out = []
    for k in range(len(alarms)):
        if first <= k < last:  # raised by the re-measurement's requests
            out.append(", during the re-measurement" + (f" ({n_req} requests, trainer stopped)" if n_req else ""))
        elif k < first:  # raised in the phases: placed when each flagged row holds one alarm
            out.append(where[k] if len(where) == first else "")
        else:
            out.append(", outside any phase")
    return out


def _late_clause(late: list[int], alarms: int) -> str:
    """The alarm note's why for the alarms ``late`` s into their phases (of ``alarms`` in all), in
    plain words: "none of them is at a shift: they came 41, 42, 64 and 85 s into their phases (...)" where
    every alarm is one of them (a walkthrough read "the ones 122, 42, 64, 85 s into their phases are
    no shift's"); "" without."""
    if not late:
        return ""
    secs = f"{', '.join(map(str, late[:-1]))} and {late[-1]}" if len(late) > 1 else str(late[0])
    if len(late) == 1:
        return f"the one {secs} s into its phase is not at a shift (a run of harder prompts)"
    if len(late) == alarms:
        return f"none of them is at a shift: they came {secs} s into their phases (runs of harder prompts)"
    return f"the ones {secs} s into their phases are not at a shift (runs of harder prompts)"


def _alarm_workload(alarm: dict):
    """The workload of a ``shift_alarms`` entry (its key's first part)."""
    key = alarm.get("key")
    return key[0] if isinstance(key, (list, tuple)) and key else key


def _shift_alarms_note(report: dict) -> str | None:
    """The run's ``acceptance_shift`` warnings in a few lines: what fired (each alarm of
    ``shift_alarms``: workload, proposer, its running mean -> its last requests' α, and where,
    :func:`_alarm_places`), why in one clause per kind (after a shift, late in a phase, during the
    re-measurement), and where to look (a walkthrough's note ran 12 lines). None without alarms."""
    alarms = report.get("shift_alarms") or []
    if not alarms:
        return None
    places = _alarm_places(report)
    each = []
    for a, place in zip(alarms, places):
        workload = _alarm_workload(a)
        who = {"ngram": "n-gram", "draft": "draft", None: "draft", "eagle": "EAGLE head"}.get(a.get("proposer"),
                                                                                            a.get("proposer"))
        back = " (its last requests back at or above the mean)" if a["recent_alpha"] >= a["reference_alpha"] else ""
        each.append(f"{workload} {who} {a['reference_alpha']:.2f} -> {a['recent_alpha']:.2f}{back}{place}")
    outside = sum(p.startswith((", during", ", outside")) for p in places)
    into = [int(m.group(1)) if (m := re.search(r", (\d+) s into its phase", p)) else None for p in places]
    late = [t for t in into if t is not None and t > 30]
    # early in the first phase there was no shift before it (a walkthrough read "expected after a shift" of prose's):
    # on the phase's clock within 30 s, or before that clock started
    first = ((report.get("phases") or [{}])[0] or {}).get("workload")
    opening = sum(1 for a, p, t in zip(alarms, places, into) if first is not None and _alarm_workload(a) == first
                  and (t is not None and t <= 30 or " s after its phase's first request" in p))
    why = [w for w in (
        "expected after a shift (prompts the proposer had not seen)" if len(alarms) > outside + len(late) + opening
        else "",
        (f"{'the one' if opening == 1 else 'the ones'} early in the first phase, {first}, came before any shift (its "
         f"running mean was still young)") if opening else "",
        _late_clause(late, len(alarms)),
        f"{'the one' if outside == 1 else 'the ones'} after the phases {'is' if outside == 1 else 'are'} not at a "
        f"shift (the re-measurement serves each workload again, after the others' traffic)" if outside else "") if w]
    plot = Path(report.get("plot") or "out/demo/acceptance.png").name
    return (f"{len(alarms)} acceptance_shift alarm(s) (a proposer's windowed α fell below its running mean; mean -> "
            f"its last requests'{_alarm_clock(report, places)}): {'; '.join(each)}. Why: {'; '.join(why)}. No action needed while outputs equal plain "
            f"decoding's (above); one far from a shift or beside a rollback is worth a look: report.json's "
            f"shift_alarms, α per proposer in {plot}")


def lowered_promotions(report: dict) -> list[str]:
    """The promotions whose decoded α on the phase's never-served prompts fell below their
    parent's (interval wholly below 0), "workload: vP -> vV" each: issue 34's "no promoted
    version lowers it", in report.json and the console's summary line alike."""
    return [f"{r['workload']}: v{v['parent']} -> v{v['version']}"
            for r in report["phases"] for v in r.get("versions") or [] if v["lowered"]]


def _summary(report: dict, out_dir: Path) -> dict[str, Any]:
    """The demo's final JSON line: the run's keys, the report's path, each phase's gains, and the
    adapters serving at the end: ``shared_adapter`` (the shared scope's version, the bootstrap in the
    demo, serving a workload without its own) and ``workload_adapters`` (each workload's own
    promoted version). ``active_adapter`` stays, the shared one's value under its old name, for
    consumers of earlier lines."""
    keep = ("run_id", "key_prefix", "seconds", "requests", "active_adapter", "plot")
    summary = {k: report.get(k) for k in keep}
    summary["shared_adapter"] = report.get("active_adapter")
    summary["workload_adapters"] = {w: v for w, v in (report.get("workload_adapters") or {}).items() if v}
    summary["report"] = str(out_dir / "report.json")
    summary["alpha_gain"] = {r["workload"]: r["alpha_gain"] for r in report["phases"]}
    summary["alpha_gain_ci"] = {r["workload"]: [(r.get("alpha_gain_ci") or {}).get(k) for k in ("low", "high")]
                                for r in report["phases"]}
    summary["phase_end_gain"] = {r["workload"]: [(r.get("phase_end_gain_ci") or {}).get(k) for k in ("gain", "low", "high")]
                                 for r in report["phases"]}
    summary["promotions_that_lowered_decoded_alpha"] = lowered_promotions(report)
    # what a promotion may cost another workload (the trainer's cross-workload tolerance), beside that list
    summary["regress_margin"] = (report.get("config") or {}).get("regress_margin")
    return summary


def register(app) -> None:
    """Add ``demo`` to the ``daemonctl`` Typer app."""
    import sys

    from rich.console import Console

    @app.command("demo")
    def demo(
        quick: Annotated[bool, typer.Option(help="a shorter run (4 phases of 60 s, each longer until its adapter was promoted and judged twice, at most 180 s; then the evaluation on 8 prompts a phase)")] = False,
        phase_seconds: Annotated[float | None, typer.Option(help="serving seconds per phase, at least (overrides the preset)")] = None,
        phase_min_judged: Annotated[int | None, typer.Option(help="after --phase-seconds a phase serves on until its "
                                                             "workload's adapter was promoted and had this many turns "
                                                             "judged on enough held-out evidence; 0 = time-bounded "
                                                             "phases (default 2)")] = None,
        phase_min_served: Annotated[int | None, typer.Option(help="... and until its promoted version has served this "
                                                             "many of the phase's requests (default 6; 0 = not asked)")] = None,
        phase_max_seconds: Annotated[float | None, typer.Option(help="the longest a phase serves (default 3 x "
                                                                "--phase-seconds)")] = None,
        out: Annotated[Path, typer.Option(help="directory for report.json and acceptance.png")] = Path("out/demo"),
        heads: Annotated[bool, typer.Option(help="also serve and adapt the feature-level head (the 'eagle' proposer): "
                                                 "v0 bootstrapped once per pair (cached), distilled each round from "
                                                 "records with hidden states")] = False,
        shared_adapter: Annotated[bool, typer.Option(help="one shared adapter for every workload instead of one per "
                                                          "workload (trainer.per_workload)")] = False,
        draft_vocab: Annotated[int | None, typer.Option(help="FR-Spec: the draft's head restricted to the N most frequent "
                                                             "tokens, trained and served alike; 0 = the full vocabulary "
                                                             f"(default: models.draft_vocab when set, else {DEMO_DRAFT_VOCAB})")] = None,
        ablation: Annotated[bool | None, typer.Option(help="also decode the copy channel's ablation rows (the LoRA "
                                                        "without its gate, v0 with a fixed gate) on the evaluation "
                                                        "prompts (default: on, off with --quick)")] = None,
        config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file (else $DRAFTD_CONFIG)")] = None,
    ) -> None:
        """The main job: serve a shifting workload (prose -> code -> math -> extract) while the trainer adapts
        the draft in the background; live progress, then a frozen-vs-adapted table per phase and a
        PNG of acceptance over time. --quick takes about 13 minutes on 2 cores once v0 is cached (15-16
        with the first bootstrap on an AMX Xeon; longer on slower CPUs), the default about 25."""
        from daemon.logging import configure
        from daemon.settings import ConfigError, ensure_state_dir, load_settings

        console = Console(stderr=True)
        try:
            ensure_state_dir(settings := load_settings(config))  # a fresh DRAFTD_STATE_DIR exists from the start
        except ConfigError as e:
            console.print(f"[red]config error:[/] {rich_escape(str(e))}")
            raise typer.Exit(2) from e
        configure("console", "warning", stream=sys.stderr)  # the live table is the progress display
        # A round that outlasts the interval makes APScheduler skip the next run (max_instances=1,
        # by design); the live table shows the trainer's state, so these warnings are noise here.
        import logging

        logging.getLogger("apscheduler").setLevel(logging.ERROR)  # its scheduler and executors
        cfg = DemoConfig.quick(out_dir=out) if quick else DemoConfig(out_dir=out)
        sizes = {k: v for k, v in (("phase_seconds", phase_seconds), ("phase_min_judged", phase_min_judged),
                                   ("phase_min_served", phase_min_served), ("phase_max_seconds", phase_max_seconds)) if v is not None}
        try:
            cfg = dataclasses.replace(cfg, **sizes)
        except ValueError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from e
        if heads:
            cfg = dataclasses.replace(cfg, heads=True)
        if ablation is not None:
            cfg = dataclasses.replace(cfg, copy_ablation=ablation)
        if draft_vocab is not None and draft_vocab < 0:
            console.print(f"[red]error:[/] --draft-vocab={draft_vocab}: must be >= 0 (0 = the full vocabulary)")
            raise typer.Exit(2)
        cfg = dataclasses.replace(cfg, per_workload=not shared_adapter, draft_vocab=draft_vocab)
        report = _run_and_report(settings, cfg, console)
        print(json.dumps(_summary(report, Path(cfg.out_dir))))
