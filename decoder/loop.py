"""The serving loop: one decoding engine fed by a bounded queue, with the adaptive loop wired once.

    submit(req) -> bounded queue -> worker thread -> decoder.generate(req, policy, on_step=...)
                                                      |  between requests: adapter swaps (AdapterManager)
                                                      |  per step: tokens to the submitter, cancellation
                                                      v
                 VerifiedSample -> SampleWriter (Redis buffer; the decoder's sink)
                 DecodeResult   -> AcceptanceTracker (history) -> RollbackMonitor
                 steps          -> GoodputController (γ per workload x sampling bucket)

:class:`ServingLoop` is what ``daemonctl serve`` (``daemon/serve.py``) puts behind HTTP, and what
an in-process driver (the demo) calls directly: ``loop.generate(req)`` blocks for one request,
``loop.submit(req, on_tokens=...)`` returns a :class:`Ticket` at once.

Batch 1 (``LoopConfig.max_batch = 1``, or an engine without ``Capabilities.batch``): requests are
decoded one at a time (the decoder holds a lock per request). Continuous batching
(``max_batch`` > 1 on an engine that holds that many sequences, the draft's engine too if it has
one): up to ``max_batch`` requests decode together, each on its own thread with its own proposer,
γ, stop strings, seed, streaming, cancellation and record, their forwards fused into one per
engine and step (:mod:`decoder.batching`); waiting requests are admitted and finished ones
retired at step boundaries. A request whose workload would swap the adapter or head joins only an
empty batch (the batch drains first; the requests behind it wait with it, in order).

Per-step streaming and cancellation need the decoder's step hook:
``SpeculativeDecoder.generate(req, policy, on_step=fn)``, ``fn(new_ids) -> bool | None`` called
after every verification step with the tokens it emitted (already cut at EOS, stop strings and
length); returning False ends the request with ``finish_reason == "cancelled"``. Without that
hook (an older decoder) the loop still serves: each request's tokens reach ``on_tokens`` in one
chunk when it finishes, and a request can be cancelled only while it waits in the queue.

Redis down: the sample writer counts its drops and resumes by itself, the tracker keeps its
counts until a flush succeeds, the adapter manager keeps the adapter it has, and the rollback
monitor records the error; serving goes on. Nothing here talks to the sidecar.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import structlog

from decoder.batching import STEP_TOKEN_BUDGET, StepScheduler, check_step_ms_target
from decoder.control import ControllerConfig, GoodputController, batch_sizes_up_to, forward_rows, new_request_id
from decoder.engines.base import forward_router, last_fused_rows, last_fused_size, supports
from decoder.rollback import RollbackMonitor
from decoder.shift import key_str
from decoder.tracking import HEAD, AcceptanceTracker, key_of
from decoder.proposers.ngram import SPEC as _NGRAM_SPEC
from decoder.proposers.registry import DEFAULT_PROPOSER
from decoder.speculative import DecodeRequest, DecodeResult, FixedGamma, GammaPolicy
from store.history import DRAFT_KIND

NGRAM = _NGRAM_SPEC.name

log = structlog.get_logger("decoder.loop")


class LoopError(Exception):
    """Base class of the serving loop's refusals."""


class QueueFull(LoopError):
    """The bounded request queue is full; retry later (HTTP 429)."""


class Draining(LoopError):
    """The loop is shutting down and takes no new requests (HTTP 503)."""


class Cancelled(LoopError):
    """The request was cancelled before it started decoding."""


@dataclass
class LoopConfig:
    """Serving loop options.

    queue_size: requests that may wait besides the one decoding; ``submit`` raises
        :class:`QueueFull` beyond it.
    check_plain_every: every N-th greedy request is also decoded plainly (γ = 0) to fill
        ``matches_plain`` (0 = never). That second decode costs a plain request and streams
        its own VerifiedSample to the buffer.
    rollback_per_workload: judge promotions per workload (``RollbackMonitor.check(v, workload)``),
        as adapters are routed per workload; False judges all keys together, as the demo does.
    seeded_gamma: γ of a sampled request that gives a seed but no γ. Speculative sampling is
        lossless in distribution, but which random draws a seed feeds depends on the γ of each
        step, so a seed reproduces a completion only under the same γ schedule; the goodput
        controller's γ changes as it learns, so such requests get this fixed γ instead (their
        steps still feed the controller's estimates).
    max_batch: requests decoded at once (continuous batching, module docstring); 1 = one at a
        time. Above 1 only on an engine that declares ``Capabilities.batch`` with at least this
        many sequences (and the same of the draft's engine, if any); otherwise batch 1, and
        :meth:`ServingLoop.status` says why.
    step_token_budget: with continuous batching, tokens a request's forward (a prefill chunk,
        a draft's catch-up) may feed into a step that other requests' decode or verification rows
        share; the rest goes into the following steps, so their steps stay cheap while a long
        prompt still progresses every step (:mod:`decoder.batching`). None: no budget (a 512-token
        prefill chunk rides every step of its batch mates). Alone, a prefill goes in full chunks.
    step_ms_target: with continuous batching, a step time (ms) the steps that carry such pieces
        are kept under by feeding fewer of their tokens (:mod:`decoder.batching`, Sarathi-Serve's
        stall-free batching); ``"auto"``: twice a lone request's median step; None: the token
        budget only.
    """

    queue_size: int = 64
    check_plain_every: int = 0
    rollback_per_workload: bool = True
    seeded_gamma: int = 4
    max_batch: int = 1
    step_token_budget: int | None = STEP_TOKEN_BUDGET
    step_ms_target: float | str | None = None

    def __post_init__(self):
        check_step_ms_target(self.step_ms_target)
        if self.step_ms_target is not None and self.step_token_budget is None:
            raise ValueError(f"step_ms_target={self.step_ms_target!r} with step_token_budget=None: the target only "
                             "cuts the pieces the token budget makes; set a budget or drop the target")
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch!r}: must be an int >= 1 (1 = one request at a time)")
        b = self.step_token_budget
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"step_token_budget={b!r}: must be an int >= 1 (tokens per step), or None (no budget)")
        if self.queue_size < 1:
            raise ValueError(f"queue_size={self.queue_size}: must be >= 1")
        if self.seeded_gamma < 0:
            raise ValueError(f"seeded_gamma={self.seeded_gamma}: must be >= 0 (0 = plain decoding)")
        if self.check_plain_every < 0:
            raise ValueError(f"check_plain_every={self.check_plain_every}: must be >= 0 (0 = never)")


@dataclass(eq=False)
class Ticket:
    """One submitted request, its progress and its outcome.

    future: resolves to the :class:`DecodeResult` (``finish_reason`` ``"cancelled"`` when
        cancelled mid-request), or raises :class:`Cancelled` (cancelled while queued) or the
        decoder's error (e.g. ValueError for a prompt beyond the context).
    tokens: ids emitted so far (appended on the worker thread before ``on_tokens`` is called).
    logprobs: with ``request.logprobs`` set, each of ``tokens``' :class:`~decoder.sampling.TokenLogprob`
        (appended with them).
    times: loop clock (seconds) at submission, start, first token, each emission, finish.
    decision: the goodput controller's decision for this request (None with a fixed γ).
    """

    request: DecodeRequest
    policy: GammaPolicy | None = None
    on_tokens: Callable[[list[int]], Any] | None = None
    future: Future = field(default_factory=Future)
    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    submitted_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    emitted_at: list[float] = field(default_factory=list)
    finished_at: float | None = None
    decision: dict[str, Any] | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Cancel: dropped if still queued, else stopped at its next verification step (needs
        the decoder's ``on_step`` hook; without it the request runs to its end)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def result(self, timeout: float | None = None) -> DecodeResult:
        return self.future.result(timeout)


class _ObservedGamma(FixedGamma):
    """A fixed γ (a request's own, or a seeded request's) whose steps still feed the goodput
    controller's estimates, proposed by ``proposer``."""

    def __init__(self, controller: GoodputController, key, value: int, proposer: str = DEFAULT_PROPOSER, why: str = "seeded"):
        super().__init__(value)
        self.controller, self.key, self.proposer, self.why = controller, key, proposer, why
        self.request_id = new_request_id()

    def proposer_name(self) -> str:
        return self.proposer

    def update(self, step) -> None:
        batch, total = last_fused_size(), last_fused_rows()
        self.controller.observe(self.key, step, proposer=self.proposer,
                                asked=step.asked if step.asked is not None else self.value, batch=batch,
                                first=not getattr(self, "_updated", False), total=total,
                                request=self.request_id,
                                after_rows=getattr(self, "_rows", 0) if batch <= 1 else None)  # 0: after the prefill
        self._rows = forward_rows(step, batch, total)
        self._updated = getattr(self, "_updated", False) or bool(step.asked or step.proposed)

    def describe(self) -> str:
        if self.why == "seeded":
            return f"fixed γ={self.value} (seeded: a seed reproduces only under the same γ; {self.proposer})"
        return f"fixed γ={self.value} ({self.why}; {self.proposer})"


def supports_step_hook(decoder) -> bool:
    """True when ``decoder.generate`` takes ``on_step`` (per-step streaming and cancellation)."""
    try:
        return "on_step" in inspect.signature(decoder.generate).parameters
    except (TypeError, ValueError):
        return False


class ServingLoop:
    """The decoder and the adaptive loop behind one bounded queue and one worker thread.

    Args:
        decoder: a :class:`decoder.speculative.SpeculativeDecoder`. Its ``sink`` (e.g.
            ``SampleWriter.submit``) receives each request's VerifiedSample; set it when the
            decoder is built.
        manager: an :class:`decoder.adapters.AdapterManager` on ``decoder`` (its hook already
            installed; the loop starts and closes it), or None to serve the draft as it is.
        heads: a :class:`decoder.heads.HeadManager` on ``decoder`` (the same), or None to serve
            the head given at build (if any) as it is.
        controller: γ per (workload, sampling bucket); default a GoodputController following
            ``decoder.adapter_version``.
        tracker: an :class:`AcceptanceTracker` (the loop starts and stops it), or None.
        monitor: a :class:`RollbackMonitor` checked after every request, or None.
        head_monitor: a :class:`RollbackMonitor` with ``proposer="eagle"`` on the head registry,
            checked after every request the head proposed for (its head version), or None.
        writer: the ``SampleWriter`` behind the decoder's sink, for its counts in
            :meth:`status` and closed by :meth:`close` (the loop does not wire it: the sink does).
        config: :class:`LoopConfig`.
        clock: monotonic seconds (timings of tickets).

    Use ``with ServingLoop(...) as loop:`` or :meth:`start` / :meth:`close`. ``observers`` are
    called as ``fn(ticket, result)`` on the worker thread after each finished request
    (metrics); an observer's exception is logged, never raised.
    """

    def __init__(self, decoder, *, manager=None, controller: GoodputController | None = None,
                 tracker: AcceptanceTracker | None = None, monitor: RollbackMonitor | None = None,
                 writer=None, config: LoopConfig | None = None, clock: Callable[[], float] = time.perf_counter,
                 heads=None, head_monitor: RollbackMonitor | None = None):
        self.decoder = decoder
        self.manager = manager
        self.heads = heads
        self.head_monitor = head_monitor
        self.config = config or LoopConfig()
        self.controller = controller or GoodputController(
            ControllerConfig(batch_sizes=batch_sizes_up_to(self.config.max_batch)),
            adapter_version=lambda: decoder.adapter_version, step_cost=decoder.step_cost)
        if getattr(self.controller, "step_cost", False) is None:  # a step's price at its batch size: the decoder's
            self.controller.step_cost = getattr(decoder, "step_cost", None)
        self.tracker = tracker
        self.monitor = monitor
        self.writer = writer
        self.clock = clock
        self.streams_steps = supports_step_hook(decoder)
        self.observers: list[Callable[[Ticket, DecodeResult], Any]] = []
        self._q: queue.Queue[Ticket | None] = queue.Queue(maxsize=self.config.queue_size)
        self._cv = threading.Condition()
        self._active: Ticket | None = None
        self._running: list[Ticket] = []  # decoding in the batch (continuous batching)
        # every submitted ticket not yet resolved, by id: queued, decoding, or in between (taken from
        # the queue and held for an empty batch, or running the hooks that swap its adapter)
        self._open: dict[int, Ticket] = {}
        self.batching, self.batch_why = self._batch_plan()
        self._draining = False
        self._thread: threading.Thread | None = None
        self._greedy_seen = itertools.count(1)
        self._n: Counter = Counter()
        self._by_workload: Counter = Counter()
        self._workload_versions: dict[str, int] = {}
        # called by the batched driver at every step boundary, before the step's forward (which
        # releases the GIL): a consumer of the members' tokens wakes its event loop here, once a
        # step, instead of from each member's thread in turn (:meth:`member_thread`)
        self.boundary_hooks: list[Callable[[], Any]] = []

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "ServingLoop":
        if self._thread is None:
            if self.manager is not None:
                self.manager.start()
            if self.heads is not None:
                self.heads.start()
            if self.tracker is not None:
                self.tracker.start()
            self._thread = threading.Thread(target=self._run_batched if self.batching is not None else self._run,
                                            name="draftd-serving", daemon=True)
            self._thread.start()
        return self

    def __enter__(self) -> "ServingLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, grace_s: float, cut: threading.Event | None = None) -> bool:
        """Stop taking requests (``submit`` raises :class:`Draining`), let the queued and the
        running ones finish for up to ``grace_s`` seconds, or until ``cut`` is set (an operator's
        second SIGTERM), then cancel what is left (at its next step). Returns True when everything
        finished first."""
        deadline = time.monotonic() + max(0.0, grace_s)
        with self._cv:
            self._draining = True
            while not (done := not self._open and self._active is None and not self._running):
                left = deadline - time.monotonic()
                if left <= 0 or (cut is not None and cut.is_set()):
                    break
                self._cv.wait(min(left, 0.2))
        if not done:
            left = deadline - time.monotonic()
            if cut is not None and cut.is_set() and left > 0:
                log.warning("drain_cut_short", grace_s=grace_s, left_s=round(left, 1), queued=self._q.qsize())
            else:
                log.warning("drain_grace_exceeded", grace_s=grace_s, queued=self._q.qsize())
            self._cancel_all()
        return done

    def close(self, grace_s: float = 0.0) -> None:
        """Drain (``grace_s``), stop the worker, then the adapter manager, the tracker (a last
        flush) and the writer (a last flush)."""
        if self._thread is not None:
            self.drain(grace_s)
            self._q.put(None)  # the worker exits after what is queued (cancelled: dropped at once)
            self._thread.join(30)
            self._thread = None
        if self.manager is not None:
            self.manager.close()
        if self.heads is not None:
            self.heads.close()
        if self.tracker is not None:
            self.tracker.stop()
        if self.writer is not None:
            self.writer.close()

    def _cancel_all(self) -> None:
        with self._cv:
            if self._active is not None:
                self._active.cancel()
            for t in list(self._running) + list(self._open.values()):  # the held and admitting ones too
                t.cancel()
            for t in list(self._q.queue):
                if t is not None:
                    t.cancel()

    def _resolved(self, t: Ticket) -> None:
        with self._cv:
            self._open.pop(id(t), None)
            self._cv.notify_all()

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, req: DecodeRequest, *, policy: GammaPolicy | None = None,
               on_tokens: Callable[[list[int]], Any] | None = None) -> Ticket:
        """Queue ``req``; returns its :class:`Ticket` at once.

        ``policy`` overrides the γ choice (default: ``FixedGamma(req.gamma)`` when the request
        fixes γ, else the goodput controller's policy for ``key_of(req)``). ``on_tokens(ids)``
        is called on the worker thread with the ids of each verification step (see the module
        docstring); it must not block, and its exceptions are ignored.

        Raises:
            Draining: the loop is draining or closed.
            QueueFull: ``config.queue_size`` requests already wait.
        """
        t = Ticket(req, policy, on_tokens, submitted_at=self.clock())
        with self._cv:
            if self._draining or self._thread is None:
                self._n["refused_draining"] += 1
                raise Draining("the server is not taking requests (shutting down, or not started); retry on another instance")
            try:
                self._q.put_nowait(t)
            except queue.Full:
                self._n["refused_queue_full"] += 1
                raise QueueFull(f"the request queue is full ({self.config.queue_size} waiting); retry later") from None
            self._n["submitted"] += 1
            self._open[id(t)] = t
        t.future.add_done_callback(lambda _f, t=t: self._resolved(t))
        return t

    def generate(self, req: DecodeRequest, policy: GammaPolicy | None = None, timeout: float | None = None) -> DecodeResult:
        """Submit ``req`` and wait for its result (what an in-process driver calls)."""
        return self.submit(req, policy=policy).result(timeout)

    @property
    def queue_depth(self) -> int:
        """Requests waiting, not counting the one decoding."""
        return self._q.qsize()

    @property
    def busy(self) -> bool:
        """A request is decoding, or taken from the queue and about to (held for an empty batch,
        or in the hooks that swap its adapter)."""
        return self._active is not None or bool(self._running) or len(self._open) > self._q.qsize()

    @property
    def running(self) -> int:
        """Requests decoding now (at most ``config.max_batch``)."""
        return len(self._running) + (self._active is not None)

    def _batch_plan(self) -> tuple[StepScheduler | None, str]:
        """The step scheduler when requests can be batched, and why (or why not)."""
        mb = self.config.max_batch
        if mb <= 1:
            return None, "max_batch = 1: one request at a time"
        dec = self.decoder
        if not self.streams_steps or not hasattr(dec, "generate_batched"):
            return None, "the decoder has no per-step hook: one request at a time"
        engines = [("the target's", getattr(dec, "engine", None))]
        if getattr(dec, "draft_engine", None) is not None:
            engines.append(("the draft model's", dec.draft_engine))
        for role, eng in engines:
            if not supports(eng, "batch"):
                return None, f"{role} engine ({getattr(eng, 'name', None)}) decodes one sequence at a time"
            n = getattr(eng.capabilities, "max_sequences", 1)
            if n < mb:
                return None, f"{role} engine holds {n} sequences, fewer than max_batch = {mb}"
        sched = StepScheduler(self.clock, self.config.step_token_budget, step_ms_target=self.config.step_ms_target)
        sched.primary = dec.engine  # forwards on another engine (the draft's) make a cycle speculative
        return sched, f"continuous batching of up to {mb} requests"

    # ---- the worker --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            t = self._q.get()
            if t is None:
                return
            with self._cv:
                self._active = t
            try:
                self._serve(t)
            except BaseException as e:  # noqa: BLE001 - the worker must survive any request
                log.exception("serving_failed", request_id=t.request.request_id)
                if not t.future.done():
                    t.future.set_exception(e)
            finally:
                with self._cv:
                    self._active = None
                    self._cv.notify_all()

    def _run_batched(self) -> None:
        """The driver of continuous batching: at every step boundary (no member running), admit
        waiting requests up to ``max_batch`` (running the decoder's between-request hooks for
        each; the decoder's lock is held while the batch is not empty), then fire the waiting
        forwards."""
        sched, dec, cap = self.batching, self.decoder, self.config.max_batch
        held: list[Ticket] = []  # taken from the queue, waiting for an empty batch (an adapter/head swap)
        stopping = locked = False
        # a lone member fires its own steps while nothing waits to be admitted (StepScheduler.call)
        sched.solo = lambda: not held and not stopping and self._q.empty()
        sched.on_boundary = self._at_boundary
        while True:
            sched.wait_boundary()
            self._at_boundary()
            n = len(sched.members)
            if n == 0 and locked:
                dec._lock.release()  # idle: the managers' idle swaps may run
                locked = False
            admitted = 0
            while n < cap:
                if held:
                    t = held.pop(0)
                elif stopping:
                    break
                else:
                    try:
                        t = self._q.get() if n == 0 and not sched.pending else self._q.get_nowait()
                    except queue.Empty:
                        break
                    if t is None:
                        stopping = True
                        continue
                if t.cancelled:
                    self._serve(t)  # resolves it as cancelled while queued
                    continue
                if n and dec.wants_switch(t.request):
                    held.insert(0, t)  # joins once the batch has drained
                    break
                if not locked:
                    dec._lock.acquire()
                    locked = True
                try:
                    for hook in dec.between_requests:
                        hook(dec, t.request)
                except Exception as e:  # noqa: BLE001 - as batch 1: the request fails with it
                    with self._cv:
                        self._n["failed"] += 1
                    t.finished_at = self.clock()
                    t.future.set_exception(e)
                    continue
                with self._cv:
                    self._running.append(t)
                sched.spawn(lambda t=t: self._member(t), t.request.request_id, t)
                n += 1
                admitted += 1
            if admitted:
                continue  # the new members run up to their first forward, then this step fires
            if sched.pending:
                sched.fire()
            elif n == 0 and stopping and not held:
                if locked:
                    dec._lock.release()
                return

    def _member(self, t: Ticket) -> None:
        try:
            self._serve(t, batched=True)
        except BaseException as e:  # noqa: BLE001 - a member must always leave the batch
            log.exception("serving_failed", request_id=t.request.request_id)
            if not t.future.done():
                t.future.set_exception(e)
        finally:
            with self._cv:
                self._running.remove(t)
                self._cv.notify_all()

    def _at_boundary(self) -> None:
        """Run :attr:`boundary_hooks` (each failure logged, never raised)."""
        for hook in list(self.boundary_hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001 - a consumer's failure never stops decoding
                log.exception("boundary_hook_failed")

    def member_thread(self) -> bool:
        """True on a batch member's thread (continuous batching), alone in the batch or not: the
        driver calls :attr:`boundary_hooks` before this member's next step is decoded (a lone
        member waking its stream's loop itself ran slower at 1 client: bench/RESULTS.md, "Ninth
        session")."""
        return self.batching is not None and forward_router() is self.batching

    def _policy(self, t: Ticket) -> GammaPolicy:
        if t.policy is not None:
            return t.policy
        req = t.request
        # a client's fixed γ (or a seeded request's) runs the first configured proposer that can
        # propose now (serve.proposers; "eagle" only while a head serves), else the draft model
        offered = self.controller.offered() if hasattr(self.controller, "offered") else self.controller.config.proposers
        first = offered[0] if offered else DEFAULT_PROPOSER
        if req.gamma is not None:
            return _ObservedGamma(self.controller, key_of(req), req.gamma, first, "the request's gamma")
        if req.params.seed is not None and not req.params.greedy:
            return _ObservedGamma(self.controller, key_of(req), self.config.seeded_gamma, first)
        return self.controller.policy_for(key_of(req))

    def _on_step(self, t: Ticket, ids: list[int]) -> bool:
        if ids:
            now = self.clock()
            if t.first_token_at is None:
                t.first_token_at = now
            t.emitted_at.append(now)
            if t.request.logprobs is not None:  # the decoder's for the tokens given so far, then these
                t.logprobs.extend(getattr(self.decoder, "streamed_logprobs", [])[len(t.tokens): len(t.tokens) + len(ids)])
            t.tokens.extend(ids)
            if t.on_tokens is not None:
                try:
                    t.on_tokens(list(ids))
                except Exception:  # noqa: BLE001 - a consumer's failure never stops decoding
                    log.exception("on_tokens_failed", request_id=t.request.request_id)
        return not t.cancelled

    def _serve(self, t: Ticket, batched: bool = False) -> None:
        req = t.request
        if t.cancelled:
            with self._cv:
                self._n["cancelled"] += 1
            t.future.set_exception(Cancelled(f"request {req.request_id} was cancelled while queued"))
            return
        t.started_at = self.clock()
        policy = self._policy(t)
        kw = {"on_step": lambda ids: self._on_step(t, ids)} if self.streams_steps else {}
        if req.params.seed is not None and not req.params.greedy and req.ngram_history:
            # a seed reproduces a completion only if the proposals do not depend on what was served
            # before: the n-gram proposer looks up this request's own tokens only
            req = dataclasses.replace(req, ngram_history=False)
        try:
            res = (self.decoder.generate_batched if batched else self.decoder.generate)(req, policy, **kw)
        except Exception as e:  # noqa: BLE001 - the submitter gets it (ValueError: context, vocab)
            with self._cv:
                self._n["failed"] += 1
            t.finished_at = self.clock()
            if batched:
                self._at_boundary()  # the tokens streamed so far reach their consumer before the error
            t.future.set_exception(e)
            return
        if not self.streams_steps and res.output_ids:
            self.decoder.streamed_logprobs = res.logprobs or []
            self._on_step(t, res.output_ids)  # one chunk: the decoder has no step hook
        every = self.config.check_plain_every
        if every and req.params.greedy and res.finish_reason != "cancelled" and next(self._greedy_seen) % every == 0:
            try:
                self.decoder.check_against_plain(req, res, **({"batched": True} if batched else {}))
            except Exception:  # noqa: BLE001 - a failed check leaves matches_plain None
                log.exception("check_against_plain_failed", request_id=req.request_id)
        t.finished_at = self.clock()
        t.decision = getattr(policy, "decision", None)
        self._after(res)
        with self._cv:
            self._n["served" if res.finish_reason != "cancelled" else "cancelled"] += 1
            self._n["output_tokens"] += len(res.output_ids)
            self._by_workload[res.workload] += 1
            self._workload_versions[res.workload] = res.adapter_version
        for obs in list(self.observers):
            try:
                obs(t, res)
            except Exception:  # noqa: BLE001
                log.exception("observer_failed", request_id=req.request_id)
        if batched:
            self._at_boundary()  # its last tokens (held for the next step boundary) go before its result
        t.future.set_result(res)

    def _after(self, res: DecodeResult) -> None:
        """Acceptance history and the rollback monitor (neither raises on Redis errors)."""
        if self.tracker is not None:
            try:
                self.tracker.observe(res)
            except Exception:  # noqa: BLE001
                log.exception("tracker_observe_failed", request_id=res.request_id)
        if self.monitor is not None:
            try:
                self.monitor.check(res.adapter_version, res.workload if self.config.rollback_per_workload else None)
            except Exception:  # noqa: BLE001
                log.exception("rollback_check_failed", request_id=res.request_id)
        if self.head_monitor is not None and res.proposer == HEAD and res.head_version:
            try:
                self.head_monitor.check(res.head_version, res.workload if self.config.rollback_per_workload else None)
            except Exception:  # noqa: BLE001
                log.exception("head_rollback_check_failed", request_id=res.request_id)

    # ---- observation -------------------------------------------------------------------------
    def speculation(self) -> dict[str, dict[str, Any]]:
        """Per (workload, sampling bucket) key: whether the controller speculates now, γ and why,
        and under ``"by_batch"`` the same at each batch size the controller reports
        ({"B": {"on", "gamma", "proposer", "why"}}: what a request runs at when B requests decode
        together; :meth:`GoodputController.decision`)."""
        out = {}
        for k, d in self.controller.status().items():
            out[k] = {"on": bool(d.get("speculate")), "gamma": d.get("gamma"), "why": d.get("why")}
            if d.get("by_batch"):
                out[k]["by_batch"] = {str(b): {"on": bool(v.get("speculate")), "gamma": v.get("gamma"),
                                               "proposer": v.get("proposer"), "why": v.get("why")}
                                      for b, v in d["by_batch"].items()}
        return out

    def status(self) -> dict[str, Any]:
        """Counts, queue, adapter, speculation and store health; JSON-ready."""
        with self._cv:
            n = dict(self._n)
            by_w = dict(self._by_workload)
            versions = dict(self._workload_versions)
            active = self._active is not None or bool(self._running)
            running = len(self._running) + (self._active is not None)
        st: dict[str, Any] = {
            "requests_served": n.get("served", 0),
            "requests_failed": n.get("failed", 0),
            "requests_cancelled": n.get("cancelled", 0),
            "refused_queue_full": n.get("refused_queue_full", 0),
            "refused_draining": n.get("refused_draining", 0),
            "output_tokens": n.get("output_tokens", 0),
            "requests_by_workload": by_w,
            "adapter_version": self.decoder.adapter_version,
            "adapter_by_workload": versions,
            "queue_depth": self.queue_depth,
            "queue_size": self.config.queue_size,
            "decoding": active,
            # continuous batching: the cap, how many decode now, why (not), and the fused forwards
            "batch": {"max_batch": self.config.max_batch if self.batching is not None else 1, "running": running,
                      "why": self.batch_why, **(self.batching.status() if self.batching is not None else {})},
            "draining": self._draining,
            "streams_steps": self.streams_steps,
            "speculation": self.speculation(),
            # the configured proposers the controller may choose now (the head before its first version, the
            # draft under hold_base_draft before its first adapter are not)
            "proposers_offered": list(self.controller.offered()) if hasattr(self.controller, "offered") else None,
            # what a step costs by verified rows, and the n-gram proposer's acceptance per kind of match
            "step_cost_ms": self.decoder.step_cost.status(),
            # the most any proposer could buy at those costs (α = 1, no proposing cost)
            "engine_ceiling": self.decoder.step_cost.ceiling(
                getattr(getattr(self.controller, "config", None), "gamma_max", 8)),
            "ngram_gate": self.decoder.ngram_gate.status() if self.decoder.ngram_gate is not None else None,
        }
        if self.writer is not None:
            ws = self.writer.stats()
            st["buffer"] = {"written": ws.written, "queued": ws.queued, "redis_up": ws.redis_up,
                            "dropped": ws.dropped_queue_full + ws.dropped_redis_down + ws.dropped_error + ws.dropped_on_close,
                            "dropped_redis_down": ws.dropped_redis_down, "errors": ws.errors,
                            "last_error": ws.last_error, "last_error_at": ws.last_error_at, "outages": ws.outages,
                            "down_since": ws.down_since, "last_outage": list(ws.last_outage) if ws.last_outage else None}
        if self.manager is not None:
            ms = self.manager.status()
            st["adapters"] = {"routes": ms["routes"], "swaps": ms["swaps"], "failures": ms["failures"]}
        if self.heads is not None:
            hs = self.heads.status()
            st["heads"] = {"serving_version": hs["serving_version"], "routes": hs["routes"], "swaps": hs["swaps"],
                           "failures": hs["failures"], "last_failure": hs["last_failure"]}
            if self.head_monitor is not None:
                st["heads"]["judged"] = [{"version": d.version, "previous": d.previous, "rolled_back": d.rolled_back,
                                          "reason": d.reason} for d in self.head_monitor.decisions[-10:]]
        return st


def build_serving_loop(target, draft, tokenizer, *, client=None, store_config=None, registry=None,
                       decoder_config=None, pair_fingerprint=None, tap: Callable[[Any], Any] | None = None,
                       config: LoopConfig | None = None, controller=None, poll_interval_s: float = 1.0,
                       rollback_min_requests: int = 20, rollback_margin: float = 0.1,
                       history_flush_s: float = 5.0, proposers: tuple[str, ...] = (DEFAULT_PROPOSER,),
                       engine=None, draft_engine=None, eagle_head=None, head_registry=None,
                       head_dtype=None, hold_base_draft: bool = False) -> ServingLoop:
    """Wire the decoder and the adaptive loop once (what ``serve`` and an in-process driver share).

    - ``client`` + ``store_config``: a SampleWriter as the decoder's sink (``tap(sample)`` is
      called first, e.g. to keep a held-out split) and the acceptance history; None: neither.
    - ``registry``: an AdapterManager following its promotions and rollbacks (per-workload
      routing) and a RollbackMonitor; None: the draft is served as it is.
    - ``engine`` / ``draft_engine``: the target's (and the draft's) :mod:`decoder.engines` engines
      (``decoder.engines.registry.choose_engine``); None: transformers on ``target`` / ``draft``.
    - ``controller``: a GoodputController (default: one following the decoder's adapter version,
      choosing among ``proposers``, see :class:`decoder.control.ControllerConfig`).
    - ``eagle_head``: the feature-level head (``decoder.eagle.EagleHead``, e.g. ``load_head(...)
      .serving_copy()``) the ``"eagle"`` proposer proposes with; the target's engine must return
      hidden states (llama.cpp: ``choose_engine(..., embeddings=True)``).
    - ``head_registry``: a registry of kind ``"head"``: a :class:`decoder.heads.HeadManager`
      keeps the served head on its promoted one (per-workload scopes, hot-swapped between
      requests, rolled back with it), a RollbackMonitor (``proposer="eagle"``, the same
      ``rollback_min_requests`` / ``rollback_margin``) rolls back a promoted head whose live α on
      the requests it proposed for falls below its predecessor's, and the acceptance history of
      those requests is kept by head version (``AcceptanceHistory(kind="head")``), each served as a frozen copy in ``head_dtype`` (default
      float32; bf16 where the CPU multiplies it natively: :func:`decoder.heads.serving_head_loader`). ``"eagle"`` may then be configured
      without ``eagle_head``: the controller offers it once a head serves.
    - ``hold_base_draft``: with ``registry``, the controller offers the draft only once the
      registry's first version (v0, bootstrapped or cached) is prepared: a draft cut from the
      target's layers proposes almost nothing before it is trained, and each request that
      measures it decodes slower than plain. A DecodeRequest whose ``proposer`` names the draft
      (the demo's evaluation, ``daemonctl generate``) still gets it.

    Returns the loop, not started (``with build_serving_loop(...) as loop:``).

    Raises:
        ValueError: ``"eagle"`` among ``proposers`` without ``eagle_head`` or ``head_registry``,
            or a head the target cannot feed (another width or vocabulary, an engine without
            hidden states).
    """
    from decoder.adapters import AdapterManager
    from decoder.shift import ShiftDetector
    from decoder.speculative import SpeculativeDecoder

    writer, history, sink = _store_sink(client, store_config, tap) if client is not None else (None, None, None)
    if HEAD in proposers and eagle_head is None and head_registry is None:
        raise ValueError(f"proposers={tuple(proposers)!r} include 'eagle', which needs a head: pass eagle_head= "
                         f"(decoder.eagle.load_head(target, path), trained by bench/head_buffer_bench.py --save) "
                         f"or head_registry= (heads the trainer promotes: trainer.heads)")
    try:
        decoder = SpeculativeDecoder(target, draft, tokenizer, decoder_config, sink=sink,
                                     pair_fingerprint=pair_fingerprint, engine=engine, draft_engine=draft_engine)
        if eagle_head is not None:
            decoder.eagle_head = eagle_head
            decoder.check_eagle_head()  # a head this target cannot feed fails here, not on the first request
        elif head_registry is not None and HEAD in proposers:
            decoder.check_eagle_head(need_head=False)  # an engine without hidden states fails here
    except Exception:
        if writer is not None:  # its thread started above: nothing else will close it
            writer.close()
        raise
    manager = AdapterManager(decoder, registry, poll_interval_s=poll_interval_s) if registry is not None else None
    heads = _head_manager(decoder, head_registry, poll_interval_s, head_dtype) if head_registry is not None else None
    head_history = history.of_kind("head") if history is not None and head_registry is not None else None
    # the draft-proposed requests by adapter version, every replica's: what a rollback is judged on
    draft_history = history.of_kind(DRAFT_KIND) if history is not None and registry is not None else None
    tracker = AcceptanceTracker(history, ShiftDetector(), flush_interval_s=history_flush_s, head_history=head_history,
                                draft_history=draft_history)
    monitor = (RollbackMonitor(registry, tracker, min_requests=rollback_min_requests, margin=rollback_margin,
                               merged=draft_history) if registry is not None else None)
    head_monitor = (RollbackMonitor(head_registry, tracker, min_requests=rollback_min_requests, margin=rollback_margin,
                                    proposer=HEAD, merged=head_history) if head_registry is not None else None)
    if controller is None:
        controller = _controller(decoder, manager, tuple(proposers), config or LoopConfig(), hold_base_draft)
    return ServingLoop(decoder, manager=manager, controller=controller, tracker=tracker, monitor=monitor,
                       writer=writer, config=config, heads=heads, head_monitor=head_monitor)


def _controller(decoder, manager, proposers: tuple[str, ...], config: LoopConfig,
                hold_base_draft: bool) -> GoodputController:
    """The serving loop's default goodput controller over ``proposers``: following the decoder's
    adapter and head versions, pricing steps on its StepCost, the gated n-gram proposer capped
    (its gate picks each step's length below γ: ControllerConfig.capped)."""
    capped = tuple(n for n in proposers if n == NGRAM and decoder.ngram_gate is not None)
    return GoodputController(ControllerConfig(proposers=proposers, capped=capped,
                                              batch_sizes=batch_sizes_up_to(config.max_batch)),
                             step_cost=decoder.step_cost,
                             adapter_version=lambda: decoder.adapter_version,
                             head_version=lambda: decoder.head_version,
                             proposer_available=_availability(decoder, manager, hold_base_draft))


def _availability(decoder, manager, hold_base_draft: bool) -> Callable[[str], bool]:
    """The controller's ``proposer_available``: the head once one serves; the draft, under
    ``hold_base_draft`` with a registry followed, once a version of it is prepared."""
    from decoder.proposers.registry import versioned_by

    draft = versioned_by("adapter")
    hold = hold_base_draft and manager is not None

    def available(name: str) -> bool:
        if name == HEAD:
            return decoder.eagle_head is not None
        return name != draft or not hold or manager.has_version

    return available


def _head_manager(decoder, head_registry, poll_interval_s: float, head_dtype):
    """The HeadManager keeping ``decoder``'s head on ``head_registry``'s promoted one (float32 copies by default)."""
    import torch

    from decoder.heads import HeadManager, serving_head_loader

    return HeadManager(decoder, head_registry, poll_interval_s=poll_interval_s,
                       load=serving_head_loader(decoder, head_dtype or torch.float32))


def _store_sink(client, store_config, tap: Callable[[Any], Any] | None):
    """(SampleWriter, AcceptanceHistory, the decoder's sink): each verified sample to ``tap``
    (whose failure never fails the buffer), then to the writer."""
    from store import AcceptanceHistory, SampleWriter

    writer = SampleWriter(client, store_config)
    history = AcceptanceHistory(client, store_config)

    def sink(sample):
        if tap is not None:
            try:
                tap(sample)
            except Exception:  # noqa: BLE001 - a tap never fails the buffer
                log.exception("sample_tap_failed")
        return writer.submit(sample)

    return writer, history, sink


def speculation_by_workload(speculation: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """``{workload: on}`` from :meth:`ServingLoop.speculation` (on if any sampling bucket speculates)."""
    out: dict[str, bool] = {}
    for k, v in speculation.items():
        w = k.rsplit("@", 1)[0]
        out[w] = out.get(w, False) or bool(v.get("on"))
    return out


def speculation_by_batch(speculation: dict[str, dict[str, Any]]) -> dict[str, dict[str, int | None]]:
    """``{"workload@bucket": {"B": γ}}`` from :meth:`ServingLoop.speculation`: the γ a request of
    each key runs at when B requests decode together (0: plain decoding, None: warming up)."""
    return {k: {b: d.get("gamma") for b, d in (v.get("by_batch") or {}).items()}
            for k, v in speculation.items() if v.get("by_batch")}


__all__ = ["build_serving_loop", "Cancelled", "Draining", "LoopConfig", "LoopError", "QueueFull", "ServingLoop", "Ticket", "key_str",
           "speculation_by_batch", "speculation_by_workload", "supports_step_hook"]
