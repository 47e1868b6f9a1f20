"""Continuous batching: several requests' decoding steps fused into one forward per engine.

Each request runs the decoder's own per-request loop (:meth:`SpeculativeDecoder.generate_batched`:
its proposer, γ policy, stop strings, seed, streaming hook, cancellation and record, exactly as
batch 1) on a thread of its own, a *member* of the :class:`StepScheduler`. Members run one at a
time (a baton: no two touch the decoder's shared state, the n-gram history, the gate, the step
costs, at once), each until it asks a batched engine for a forward (``Sequence.forward`` on a
thread :func:`decoder.engines.base.route_forwards` points here). When every member waits on a
forward, the driver (the serving loop's worker) is at a *step boundary*: it retires finished
members, admits waiting requests as new members, and then :meth:`StepScheduler.fire` runs the
waiting forwards, one :meth:`~decoder.engines.llamacpp.LlamaCppEngine.forward_batch` per engine
(the target's verification blocks, plain rows and prefill chunks together; the draft model's
proposal rows together), and hands each member its own rows::

    member A: prefill ─┐        ┌─ verify γ+1 rows ─┐        ┌─ ...
    member B: plain row ┴ fire ─┴─ plain row ───────┴ fire ─┴─ ...
                        (one llama_decode per engine for all waiting rows)

A member's forward that fails in a fused call is retried alone, so only the request whose rows
are at fault gets the error.

A per-step token budget (``step_token_budget``; serve's ``serve.step_token_budget``, as vLLM's
``max_num_batched_tokens`` with chunked prefill and llama-server's batch of decode rows plus prompt
tokens) keeps the steps of short requests cheap while a long prompt prefills beside them: when a
step holds a forward of at most ``budget`` tokens (a plain row, a verification block, a short
prefill), every forward of another member longer than that feeds only its next ``budget`` tokens
in this step and the rest in the following ones, its member waiting meanwhile (it gets its whole
forward's rows at the end, as if fed at once)::

    member A: prefill chunk of 512 ──┬─ first 64 ─ fire ─ next 64 ─ fire ─ ... ─ fire ─┐ A goes on
    member B: plain row ─────────────┴───────────── fire ─ plain row ─ fire ─ ...      B goes on each step

A step whose forwards are all longer than the budget (prefills only, or one member alone) feeds
them whole, as without a budget.

A step time target (``step_ms_target``; serve's ``serve.itl_target_ms``) bounds the steps that the
budget cuts by their time as well, as Sarathi-Serve's stall-free batching sizes its token budget
from a time-between-tokens SLO (Agrawal et al. 2024, "Taming Throughput-Latency Tradeoff in LLM
Inference with Sarathi-Serve", section 4): a fused forward's wall time is fitted as a line in the
rows it feeds (:class:`StepCostFit`), and the long forwards of a step together feed only the
tokens that keep the step's predicted time under the target, first come first fed (one that gets
none waits a step). ``"auto"`` sets the target at twice a lone request's median step (so a token's
gap while others' prompts prefill stays within twice its gap alone; a lone request's step is the
interval between two of its target forwards, its draft's proposals included). The long forwards still feed
at least ``MIN_TIMED_PIECE`` tokens a step together, so a prompt progresses where the step's other
rows alone reach the target (a batch too big for it on these cores): the target then costs the
newcomer's time to first token and bounds the others' gap by their rows plus that piece. Cancellation is unchanged: the decoder polls between its own
prefill chunks (``decoder.speculative.PREFILL_CHUNK``), which now take several steps each.

Whether speculating pays inside a batch is measured here, where the whole batch's cost is seen
(:class:`BatchGoodput`): a request's own tokens per ms cannot say it, since its batch mates'
steps carry its proposals' rows and its sampling too. Each cycle (from one fire to the next) is a
*plain* one (every member fed one row) or a *speculative* one (a verification block or a draft
model's forward in it); cycles with a prefill or a budget-cut piece count as neither. The tokens
the members emit in the cycle over its wall time, per batch size, over the last cycles of each
kind, say whether speculation pays at that size (:meth:`StepScheduler.speculation_pays`): the
goodput controller's requests then decode plainly at that batch size where it does not.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import structlog
import torch

from decoder.engines.base import route_forwards

log = structlog.get_logger("decoder.batching")

# Under a step time target, the fewest prompt tokens a step's long forwards feed together (tokens): a
# prompt's prefill progresses however full the batch (module docstring)
MIN_TIMED_PIECE = 8

# The default step token budget (LoopConfig.step_token_budget, serve.step_token_budget), in tokens:
# bench/RESULTS.md "A short request behind a long prompt" measures it against none.
STEP_TOKEN_BUDGET = 64


def check_step_ms_target(v) -> None:
    """Raises ValueError unless ``v`` is None, ``"auto"`` or a number (ms) > 0."""
    if v is None or v == "auto":
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
        raise ValueError(f"step_ms_target={v!r}: must be a step time in ms > 0, 'auto' (twice a lone request's "
                         "step) or None (the token budget only)")


class _Call:
    __slots__ = ("member", "engine", "seq", "tokens", "keep", "hidden", "result", "error", "parts", "cut")

    def __init__(self, member, engine, seq, tokens, keep, hidden):
        self.member, self.engine, self.seq = member, engine, seq
        self.tokens, self.keep, self.hidden = list(tokens), int(keep), bool(hidden)  # what is still to feed
        self.result: Any = None
        self.error: BaseException | None = None
        self.parts: list = []  # the wanted rows of the pieces already fed (a forward cut by the budget)
        self.cut = False  # fed in more than one piece (its step spanned several fused forwards)

    def piece(self, budget: int | None) -> tuple[list[int], int, bool]:
        """What this call feeds in the coming step: (tokens, keep, wanted), at most ``budget``
        tokens (None: all). ``wanted`` is False when none of the piece's rows is among the
        call's last ``keep`` (the piece then keeps one row, which is dropped)."""
        n = len(self.tokens)
        if budget is None or n <= budget:
            return self.tokens, self.keep, True
        rest = n - budget
        if self.keep > rest:
            return self.tokens[:budget], self.keep - rest, True
        return self.tokens[:budget], 1, False

    def fed(self, piece: tuple[list[int], int, bool], out: Any) -> bool:
        """Record the output of ``piece``; True when the whole call is done (``result`` set)."""
        toks, _, wanted = piece
        if wanted:
            self.parts.append(out)
        rest = len(self.tokens) - len(toks)
        if rest == 0:
            self.result = _join(self.parts)
            return True
        self.tokens, self.keep = self.tokens[len(toks):], min(self.keep, rest)
        return False


def _join(parts: list):
    """The rows of a forward fed in pieces, in order: logits, or (logits, hidden) tuples."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts)


class BatchGoodput:
    """Realized output tokens per ms of the whole batch, per batch size B and kind of cycle
    (``"plain"``, ``"spec"``): the last ``window`` cycles of each. :meth:`pays` compares them.

    Args:
        window: cycles kept per (B, kind).
        min_cycles: cycles of each kind at B before :meth:`pays` judges.
        max_age_s: a kind whose last cycle at B is older than this (seconds) is stale: judged
            again (the host's load and the traffic move).
        clock: seconds.

    Raises:
        ValueError: ``window`` or ``min_cycles`` not an int >= 1, ``min_cycles`` > ``window``, or
            ``max_age_s`` not > 0.
    """

    def __init__(self, window: int = 48, min_cycles: int = 16, max_age_s: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter):
        for name, v in (("window", window), ("min_cycles", min_cycles)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BatchGoodput: {name}={v!r} must be an int >= 1 (cycles)")
        if min_cycles > window:
            raise ValueError(f"BatchGoodput: min_cycles={min_cycles} must be <= window={window}")
        if not isinstance(max_age_s, (int, float)) or not max_age_s > 0:
            raise ValueError(f"BatchGoodput: max_age_s={max_age_s!r} must be > 0 (seconds)")
        self.window, self.min_cycles, self.max_age_s, self.clock = window, min_cycles, float(max_age_s), clock
        self._cycles: dict[tuple[int, str], deque[tuple[int, float]]] = {}  # (B, kind) -> (tokens, ms)
        self._last: dict[tuple[int, str], float] = {}  # (B, kind) -> clock of its last cycle
        self._lock = threading.Lock()

    def add(self, batch: int, kind: str, tokens: int, ms: float) -> None:
        """One cycle of ``batch`` members and ``kind`` emitted ``tokens`` in ``ms``."""
        if kind not in ("plain", "spec") or not ms > 0 or ms == float("inf"):
            return
        with self._lock:
            now, key = self.clock(), (batch, kind)
            d = self._cycles.setdefault(key, deque(maxlen=self.window))
            if d and now - self._last[key] > self.max_age_s:
                d.clear()  # stale: judged again on min_cycles new cycles, not on one beside the old ones
            d.append((int(tokens), float(ms)))
            self._last[key] = now

    def rate(self, batch: int, kind: str) -> tuple[float | None, int]:
        """(tokens per ms over the kept cycles, or None when stale or fewer than ``min_cycles``;
        how many are kept)."""
        with self._lock:
            d = self._cycles.get((batch, kind))
            if not d:
                return None, 0
            n = len(d)
            fresh = self.clock() - self._last[(batch, kind)] <= self.max_age_s
            ms = sum(m for _, m in d)
            return (sum(t for t, _ in d) / ms if fresh and n >= self.min_cycles and ms > 0 else None), n

    def pays(self, batch: int) -> tuple[bool | None, str]:
        """Whether speculating pays in a batch of ``batch`` (>= 2), and why: False while neither
        kind is measured lately (plain cycles first: plain decoding is the safe side), None (the
        goodput controller's model decides) while only one kind is (speculative cycles going on
        unmeasured plain ones mean a batch mate keeps its own γ), else whether speculative cycles'
        tokens per ms beat plain's."""
        plain, n_plain = self.rate(batch, "plain")
        spec, n_spec = self.rate(batch, "spec")
        if plain is None and spec is None:
            return False, (f"measuring plain steps in batches of {batch} first ({n_plain} of the last "
                           f"{self.min_cycles} within {self.max_age_s:g} s)")
        if plain is None:  # speculative cycles go on while this controller's requests decode plainly:
            # a batch mate keeps its own γ (a client's, a seeded request's), so plain ones cannot be measured
            return None, f"plain steps in batches of {batch} cannot be measured lately (a batch mate keeps its own γ)"
        if spec is None:
            return None, f"speculative steps in batches of {batch} not measured lately ({n_spec} kept)"
        if spec > plain:
            return True, f"in batches of {batch}: speculative steps {spec:.4f} tok/ms vs plain {plain:.4f}"
        return False, f"off in batches of {batch}: speculative steps {spec:.4f} tok/ms vs plain {plain:.4f}"

    def status(self) -> dict[str, Any]:
        """{B: {"plain": tok/ms, "spec": tok/ms, "cycles": {kind: n}, "pays": bool | None}}; JSON-ready."""
        with self._lock:
            sizes = sorted({b for b, _ in self._cycles})
        out: dict[str, Any] = {}
        for b in sizes:
            (p, np_), (sp, ns) = self.rate(b, "plain"), self.rate(b, "spec")
            out[str(b)] = {"plain": None if p is None else round(p, 4), "spec": None if sp is None else round(sp, 4),
                           "cycles": {"plain": np_, "spec": ns}, "pays": self.pays(b)[0] if b > 1 else None}
        return out


class StepCostFit:
    """A fused forward of the target's engine: its wall time as a line in the rows it feeds,
    ``ms ~ a + b * rows`` (Theil-Sen: the median of the pairwise slopes, then the median intercept;
    Sen 1968, so a few stalled calls do not move it), over the last ``window`` such fires; and a lone
    request's step interval (the median of the last ``window`` intervals between two consecutive
    target forwards of a request decoding alone, each feeding at most ``lone_rows`` rows: its draft's
    proposals and its own Python work between them included, what its client sees between tokens).

    Args:
        window: fires (and intervals) kept.
        min_fires: fires before :meth:`line` fits (with at least two distinct row counts).
        lone_rows: the most rows a target forward may feed to count as a decoding or verification
            step (γ + 1).

    Raises:
        ValueError: ``window``, ``min_fires`` or ``lone_rows`` not an int >= 1.
    """

    REFIT_EVERY = 8  # fires between two fits (a fit sorts window^2 / 2 slopes)

    def __init__(self, window: int = 64, min_fires: int = 8, lone_rows: int = 9):
        for name, v in (("window", window), ("min_fires", min_fires), ("lone_rows", lone_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StepCostFit: {name}={v!r} must be an int >= 1")
        self.min_fires, self.lone_rows = min_fires, lone_rows
        self._fires: deque[tuple[int, float]] = deque(maxlen=window)  # (rows, ms)
        self._lone: deque[float] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._stale = True
        self._added = 0
        self._lock = threading.Lock()

    def add(self, rows: int, ms: float) -> None:
        """One forward of the target's engine fed ``rows`` rows in ``ms``."""
        if rows < 1 or not ms > 0 or ms == float("inf"):
            return
        with self._lock:
            self._fires.append((int(rows), float(ms)))
            self._added += 1
            if self._added % self.REFIT_EVERY == 0 or self._fit is None:
                self._stale = True

    def add_lone(self, ms: float) -> None:
        """One interval (ms) between two consecutive steps of a request decoding alone."""
        if ms > 0 and ms != float("inf"):
            with self._lock:
                self._lone.append(float(ms))

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: ms of a forward of ``r`` rows ~ ``a + b * r`` (a >= 0, b > 0); None before
        ``min_fires`` fires, while every kept fire fed the same rows, or where the slope is not
        positive. Refitted every ``REFIT_EVERY`` fires."""
        with self._lock:
            if not self._stale:
                return self._fit
            pts = list(self._fires)
            self._stale = False
        fit = None
        if len(pts) >= self.min_fires and len({r for r, _ in pts}) >= 2:
            b = _median([(m2 - m1) / (r2 - r1) for i, (r1, m1) in enumerate(pts) for r2, m2 in pts[i + 1:] if r2 != r1])
            if b > 0:
                fit = (max(0.0, _median([m - b * r for r, m in pts])), b)
        with self._lock:
            self._fit = fit
        return fit

    def lone_ms(self) -> float | None:
        """Median ms of the kept lone step intervals (None before any)."""
        with self._lock:
            xs = list(self._lone)
        return _median(xs) if xs else None


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    k = len(ys) // 2
    return ys[k] if len(ys) % 2 else (ys[k - 1] + ys[k]) / 2


class Member:
    """One request's thread under a :class:`StepScheduler`."""

    def __init__(self, name: str, payload: Any = None):
        self.name = name
        self.payload = payload  # the caller's (the serving loop's Ticket)
        self.thread: threading.Thread | None = None
        self.go = threading.Event()  # set when the baton reaches this member
        self.done = False
        self.batch_size = 1  # sequences in the fused forward that served this member's last call
        self.fused_rows: int | None = None  # rows of all its sequences in that forward (None: not fused yet)


class StepScheduler:
    """Runs member threads one at a time and fuses their engine forwards (module docstring).

    The driver calls :meth:`spawn` (a new member: it runs once the baton reaches it),
    :meth:`wait_boundary` (blocks until every member waits on a forward or has finished),
    :meth:`fire` (the waiting forwards, one fused call per engine) in a loop.
    ``stats`` counts fused forwards by the number of sequences in them (``by_sequences``), rows
    and decode ms, for status.

    Args:
        clock: seconds, for ``decode_ms``.
        step_token_budget: tokens (rows fed) a member's forward may put into a step that also
            serves a forward of another member no longer than this (module docstring); the rest
            goes into the following steps. None: forwards go in whole (no budget).
        step_ms_target: a step time (ms) the budget's cut steps are kept under (module docstring),
            ``"auto"`` (twice a lone request's median step), or None (the token budget only).

    Raises:
        ValueError: ``step_token_budget`` not None nor an int >= 1; ``step_ms_target`` not None,
            ``"auto"`` nor a number > 0.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, step_token_budget: int | None = None,
                 goodput: BatchGoodput | None = None, step_ms_target: float | str | None = None):
        if step_token_budget is not None and (isinstance(step_token_budget, bool) or not isinstance(step_token_budget, int)
                                              or step_token_budget < 1):
            raise ValueError(f"step_token_budget={step_token_budget!r}: must be an int >= 1 (tokens), or None for no budget")
        check_step_ms_target(step_ms_target)
        self.clock = clock
        self.step_token_budget = step_token_budget
        self.step_ms_target = step_ms_target
        self.costs = StepCostFit()
        self._last_target: tuple[float, set, bool] | None = None  # the last target forward: (clock, members, lone step)
        self.time_cut = 0  # steps where the step time target fed the long forwards fewer tokens than the budget
        self.cut = 0  # forwards' pieces fed under the budget while the rest waited (steps a prefill was held back)
        self._mu = threading.Lock()  # guards the state below; each thread is woken by its own event
        self._idle = threading.Event()  # no member holds the baton and none is ready: a step boundary
        self._idle.set()
        self._current: Member | None = None  # the member holding the baton
        self._ready: deque[Member] = deque()
        self._pending: list[_Call] = []
        self._members: list[Member] = []
        self._local = threading.local()
        self.fired = 0
        self.by_sequences: Counter = Counter()  # fused forwards by sequences in them
        self.rows = 0
        self.decode_ms = 0.0
        # realized goodput per batch size (module docstring): the cycle under way since the last fire
        self.goodput = goodput if goodput is not None else BatchGoodput(clock=clock)
        self._cycle: tuple[float, frozenset, str | None] | None = None  # (its fire's clock, members, kind)
        self._emitted = 0  # tokens the members emitted in it
        self.primary = None  # the target's engine (the serving loop sets it): a forward on another is a draft's
        # a lone member fires its own steps while the driver has nothing to do (:meth:`call`): the serving
        # loop sets ``solo`` (True while nothing waits to be admitted) and ``on_boundary`` (its step-boundary
        # hooks); None: every step goes through the driver
        self.solo: Callable[[], bool] | None = None
        self.on_boundary: Callable[[], Any] | None = None
        self.solo_fired = 0  # steps a lone member fired itself (status)

    # ---- members -----------------------------------------------------------------------------
    @property
    def members(self) -> list[Member]:
        with self._mu:
            return list(self._members)

    def spawn(self, fn: Callable[[], Any], name: str, payload: Any = None) -> Member:
        """Start ``fn()`` as a new member; it runs when the baton reaches it (at once when no
        member runs), with its batched engines' forwards routed here."""
        m = Member(name, payload)

        def run():
            self._local.member = m
            m.go.wait()
            m.go.clear()
            try:
                with route_forwards(self):
                    fn()
            except BaseException:  # noqa: BLE001 - fn reports its own errors; the baton must move on
                log.exception("batch_member_failed", member=name)
            finally:
                with self._mu:
                    m.done = True
                    self._members.remove(m)
                    self._pass()

        m.thread = threading.Thread(target=run, name=f"draftd-batch-{name}", daemon=True)
        with self._mu:
            self._members.append(m)
            self._ready.append(m)
            if self._current is None:
                self._pass()
        m.thread.start()
        return m

    def _pass(self) -> None:
        """Hand the baton to the next ready member, or to nobody (the driver's step boundary);
        called with ``_mu`` held. Wakes exactly the thread that goes on."""
        nxt = self._current = self._ready.popleft() if self._ready else None
        if nxt is None:
            self._idle.set()
        else:
            self._idle.clear()
            nxt.go.set()

    def call(self, engine, seq, tokens: list[int], keep: int, hidden: bool = False):
        """A member's forward (``Sequence.forward``'s arguments): queued for the next
        :meth:`fire`; returns what the engine's forward returns for it."""
        m = getattr(self._local, "member", None)
        if m is None:  # not a member's thread (a routed thread outside spawn): decode at once
            return engine.forward_batch([(seq, tokens, keep)], hidden)[0]
        c = _Call(m, engine, seq, tokens, keep, hidden)
        with self._mu:  # alone with the baton, nothing else waiting: the driver sleeps until it is passed
            alone = (self.solo is not None and self._current is m and not self._ready and not self._pending
                     and len(self._members) == 1)
        if alone and self.solo():
            self._fire_solo(c)
        else:
            with self._mu:
                self._pending.append(c)
                self._pass()
            m.go.wait()
            m.go.clear()
        if c.error is not None:
            raise c.error
        return c.result

    def _fire_solo(self, c: _Call) -> None:
        """A lone member's step, fired on its own thread with the baton kept: the driver's boundary
        hooks, then :meth:`fire`. Two thread hand-offs a token fewer (member -> driver -> member);
        a request queued meanwhile is admitted at the member's next forward, which then goes through
        the driver (``solo()`` false)."""
        if self.on_boundary is not None:
            self.on_boundary()
        with self._mu:
            self._pending.append(c)
        while True:
            self.fire(solo=c.member)
            with self._mu:
                if not self._pending:
                    break
        self.solo_fired += 1

    def last_batch_size(self) -> int:
        """Sequences in the fused forward that served this thread's last call (1 outside a member)."""
        m = getattr(self._local, "member", None)
        return m.batch_size if m is not None else 1

    def emitted(self, n: int) -> None:
        """A member emitted ``n`` tokens (the decoder calls it after each step; counted for the
        cycle under way)."""
        with self._mu:
            self._emitted += int(n)

    def speculation_pays(self, batch: int) -> tuple[bool | None, str]:
        """:meth:`BatchGoodput.pays` at ``batch`` (True where ``batch`` <= 1)."""
        if batch <= 1:
            return True, "alone"
        return self.goodput.pays(batch)

    def last_fused_rows(self) -> int | None:
        """Rows (tokens fed, every sequence's) of the fused forward that served this thread's last
        call; None outside a member or before its first call."""
        m = getattr(self._local, "member", None)
        return m.fused_rows if m is not None else None

    # ---- the driver --------------------------------------------------------------------------
    def wait_boundary(self, timeout: float | None = None) -> bool:
        """Block until no member runs (each waits on a forward, or there are none); True then."""
        return self._idle.wait(timeout)

    @property
    def pending(self) -> int:
        with self._mu:
            return len(self._pending)

    def fire(self, solo: Member | None = None) -> int:
        """Run every waiting forward, one fused call per (engine, hidden), then let the members
        whose forwards are done go on in sequence-id order (a forward cut by the step token
        budget stays waiting for the next call with its rest). Call at a step boundary only
        (``solo``: the lone member firing its own step, which goes on without the baton passing).
        Returns the rows decoded."""
        with self._mu:
            calls, self._pending = self._pending, []
        if not calls:
            return 0
        budget = self.step_token_budget
        if budget is not None and not (len(calls) > 1 and any(len(c.tokens) <= budget for c in calls)):
            budget = None  # nobody's short step waits on a long forward here: all go in whole
        pieces = self._pieces(calls, budget)
        groups: dict[tuple[int, bool], list[_Call]] = {}
        later: list[_Call] = []
        for c in calls:
            if pieces[id(c)] is not None:
                groups.setdefault((id(c.engine), c.hidden), []).append(c)
        rows = 0
        done: list[_Call] = []
        t0 = self.clock()
        self._close_cycle(t0, calls, pieces)
        for group in groups.values():
            eng = group[0].engine
            outs: list[Any] = [None] * len(group)
            errs: list[BaseException | None] = [None] * len(group)
            try:
                outs = eng.forward_batch([(c.seq, *pieces[id(c)][:2]) for c in group], group[0].hidden)
            except BaseException as e:  # noqa: BLE001 - retried alone: only the faulty request fails
                if len(group) == 1:
                    errs[0] = e
                else:
                    for i, c in enumerate(group):
                        try:
                            outs[i] = eng.forward_batch([(c.seq, *pieces[id(c)][:2])], c.hidden)[0]
                        except BaseException as e1:  # noqa: BLE001 - handed to the member
                            errs[i] = e1
            fed = sum(len(pieces[id(c)][0]) for c in group)
            for c, o, e in zip(group, outs, errs):
                c.cut = c.cut or len(pieces[id(c)][0]) < len(c.tokens)
                # a forward fed in pieces spanned several fused forwards: no one forward's rows to key it by
                c.member.batch_size, c.member.fused_rows = len(group), None if c.cut else fed
                if e is not None:
                    c.error = e
                    done.append(c)
                elif c.fed(pieces[id(c)], o):
                    done.append(c)
                else:
                    later.append(c)
            rows += fed
            self.by_sequences[len(group)] += 1
        ms = (self.clock() - t0) * 1e3
        self.decode_ms += ms
        self._note_costs(t0, ms, groups, pieces)
        self.fired += 1
        self.rows += rows
        self.cut += len(later)
        # still to feed, in their order (first come first fed under the step time target): the calls cut
        # by the budget and those that waited this step
        cut = {id(c) for c in later}
        later = [c for c in calls if id(c) in cut or pieces[id(c)] is None]
        with self._mu:
            self._pending[:0] = later  # before any call queued since (none: fire runs at a boundary)
            order = sorted({id(c.member): c for c in done}.values(), key=lambda c: getattr(c.seq, "seq_id", 0))
            self._ready.extend(c.member for c in order if c.member is not solo)
            if self._current is None:
                self._pass()
        return rows

    def _note_costs(self, t0: float, ms: float, groups: dict, pieces: dict) -> None:
        """Feed :attr:`costs`: this fire's ms and rows where it ran the target's engine alone (a
        draft model's rows cost another price), and the interval since the last target forward
        where both were a lone request's steps (module docstring)."""
        on_target = [c for g in groups.values() for c in g
                     if (c.engine is self.primary if self.primary is not None else len(groups) == 1)]
        if not on_target:
            return
        rows = sum(len(pieces[id(c)][0]) for c in on_target)
        if len(on_target) == sum(len(g) for g in groups.values()):
            self.costs.add(rows, ms)
        who = {id(c.member) for c in on_target}
        with self._mu:
            alone = len(who) == 1 and len(self._members) == 1
        step = alone and rows <= self.costs.lone_rows
        prev, self._last_target = self._last_target, (t0, who, step)
        if step and prev is not None and prev[2] and prev[1] == who:
            self.costs.add_lone((t0 - prev[0]) * 1e3)

    def step_target_ms(self) -> float | None:
        """The step time target now (ms): ``step_ms_target``, or for ``"auto"`` twice the median
        lone step measured so far; None without one."""
        t = self.step_ms_target
        if t == "auto":
            lone = self.costs.lone_ms()
            return None if lone is None else 2.0 * lone
        return None if t is None else float(t)

    def _pieces(self, calls: list[_Call], budget: int | None) -> dict[int, tuple | None]:
        """Each call's piece for this step (:meth:`_Call.piece`), or None for a call that waits
        this step: under the step time target the prompt-like calls (longer than ``budget``, or
        feeding rows it does not keep: a prefill, a draft's catch-up, the rest of either) together
        feed at most the rows that keep the step's predicted time under it, in order, each at most
        ``budget`` (module docstring); the others (decoding and verification rows) go whole."""
        if budget is None:
            return {id(c): c.piece(None) for c in calls}
        room = self._room(calls, budget)
        out: dict[int, tuple | None] = {}
        for c in calls:
            if room is None or not _prompt_like(c, budget):
                out[id(c)] = c.piece(budget)
                continue
            take = min(budget, room)
            room -= take
            out[id(c)] = c.piece(take) if take > 0 else None
            self.time_cut += take < min(budget, len(c.tokens))  # fed less than the token budget alone would
        return out

    def _room(self, calls: list[_Call], budget: int) -> int | None:
        """Rows the long calls may feed together under the step time target (at least
        ``MIN_TIMED_PIECE``), or None (no target or no cost line yet: the token budget)."""
        target = self.step_target_ms()
        line = self.costs.line() if target is not None else None
        if line is None:
            return None
        a, b = line
        short = sum(len(c.tokens) for c in calls if not _prompt_like(c, budget))
        room = int((target - a) / b + 1e-6) - short  # + 1e-6: a row that fits exactly is not lost to rounding
        return max(room, MIN_TIMED_PIECE)

    def _close_cycle(self, now: float, calls: list[_Call], pieces: dict) -> None:
        """Count the cycle that ends now (the last fire to this one) into :attr:`goodput`, and
        start the next one with this fire's kind: plain (every call one row), spec (a call keeping
        more than one row, or a second engine's forward: a draft model's), or None (a prefill, a
        draft's catch-up or a piece cut by the budget: neither)."""
        with self._mu:
            emitted, self._emitted = self._emitted, 0
        who = frozenset(c.member for c in calls)  # the objects (hashed by identity): an id is reused once freed
        if self._cycle is not None:
            t, members, kind = self._cycle
            # the same members on both ends (none joined or left, no idle gap between): a clean reading
            if kind is not None and len(members) > 1 and members == who:
                self.goodput.add(len(members), kind, emitted, (now - t) * 1e3)
        kind: str | None = "plain"
        for c in calls:
            if pieces[id(c)] is None:  # a long call waiting this step: a prefill's cycle, neither kind
                kind = None
                break
            toks, keep, _ = pieces[id(c)]
            if len(toks) > keep or len(toks) < len(c.tokens):
                kind = None
                break
            if keep > 1:
                kind = "spec"
        # a draft model's forward in it (a forward on another engine than the target's; the target's
        # forwards with hidden states, a feature-level proposer's, are the target's all the same)
        if kind == "plain" and (any(c.engine is not self.primary for c in calls) if self.primary is not None
                                else len({id(c.engine) for c in calls}) > 1):
            kind = "spec"
        self._cycle = (now, who, kind)

    def status(self) -> dict[str, Any]:
        """Fused forwards, by the sequences in each, rows and ms, the step token budget and how many
        forwards' pieces it held back a rest of (``budget_cut_pieces``), and the realized goodput
        per batch size (``goodput_by_batch``, :meth:`BatchGoodput.status`); JSON-ready."""
        n = sum(self.by_sequences.values())
        return {"fused_forwards": n, "by_sequences": {str(k): v for k, v in sorted(self.by_sequences.items())},
                "mean_sequences": round(sum(k * v for k, v in self.by_sequences.items()) / n, 3) if n else None,
                "rows": self.rows, "decode_ms": round(self.decode_ms, 3),
                "step_token_budget": self.step_token_budget, "budget_cut_pieces": self.cut,
                "step_ms_target": self.step_ms_target, "step_ms_target_now": _r(self.step_target_ms(), 2),
                "step_cost_line_ms": None if (ln := self.costs.line()) is None else {"a": round(ln[0], 3),
                                                                                    "b_per_row": round(ln[1], 3)},
                "time_cut_pieces": self.time_cut,
                "solo_fired": self.solo_fired,
                "goodput_by_batch": self.goodput.status()}


def _prompt_like(c: _Call, budget: int) -> bool:
    """Whether the step time target may cut ``c``: longer than the token budget, or feeding rows
    it does not keep (a prefill or catch-up, whatever its length); a step's decoding and
    verification rows keep every row they feed."""
    return len(c.tokens) > budget or c.keep < len(c.tokens)


def _r(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


__all__ = ["MIN_TIMED_PIECE", "STEP_TOKEN_BUDGET", "BatchGoodput", "Member", "StepCostFit", "StepScheduler", "check_step_ms_target"]
