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
them whole, as without a budget. Cancellation is unchanged: the decoder polls between its own
prefill chunks (``decoder.speculative.PREFILL_CHUNK``), which now take several steps each.
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

# The default step token budget (LoopConfig.step_token_budget, serve.step_token_budget), in tokens:
# bench/RESULTS.md "A short request behind a long prompt" measures it against none.
STEP_TOKEN_BUDGET = 64


class _Call:
    __slots__ = ("member", "engine", "seq", "tokens", "keep", "hidden", "result", "error", "parts")

    def __init__(self, member, engine, seq, tokens, keep, hidden):
        self.member, self.engine, self.seq = member, engine, seq
        self.tokens, self.keep, self.hidden = list(tokens), int(keep), bool(hidden)  # what is still to feed
        self.result: Any = None
        self.error: BaseException | None = None
        self.parts: list = []  # the wanted rows of the pieces already fed (a forward cut by the budget)

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

    Raises:
        ValueError: ``step_token_budget`` not None nor an int >= 1.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, step_token_budget: int | None = None):
        if step_token_budget is not None and (isinstance(step_token_budget, bool) or not isinstance(step_token_budget, int)
                                              or step_token_budget < 1):
            raise ValueError(f"step_token_budget={step_token_budget!r}: must be an int >= 1 (tokens), or None for no budget")
        self.clock = clock
        self.step_token_budget = step_token_budget
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
        with self._mu:
            self._pending.append(c)
            self._pass()
        m.go.wait()
        m.go.clear()
        if c.error is not None:
            raise c.error
        return c.result

    def last_batch_size(self) -> int:
        """Sequences in the fused forward that served this thread's last call (1 outside a member)."""
        m = getattr(self._local, "member", None)
        return m.batch_size if m is not None else 1

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

    def fire(self) -> int:
        """Run every waiting forward, one fused call per (engine, hidden), then let the members
        whose forwards are done go on in sequence-id order (a forward cut by the step token
        budget stays waiting for the next call with its rest). Call at a step boundary only.
        Returns the rows decoded."""
        with self._mu:
            calls, self._pending = self._pending, []
        if not calls:
            return 0
        budget = self.step_token_budget
        if budget is not None and not (len(calls) > 1 and any(len(c.tokens) <= budget for c in calls)):
            budget = None  # nobody's short step waits on a long forward here: all go in whole
        pieces = {id(c): c.piece(budget) for c in calls}
        groups: dict[tuple[int, bool], list[_Call]] = {}
        for c in calls:
            groups.setdefault((id(c.engine), c.hidden), []).append(c)
        rows = 0
        done: list[_Call] = []
        later: list[_Call] = []
        t0 = self.clock()
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
                c.member.batch_size, c.member.fused_rows = len(group), fed
                if e is not None:
                    c.error = e
                    done.append(c)
                elif c.fed(pieces[id(c)], o):
                    done.append(c)
                else:
                    later.append(c)
            rows += fed
            self.by_sequences[len(group)] += 1
        self.decode_ms += (self.clock() - t0) * 1e3
        self.fired += 1
        self.rows += rows
        self.cut += len(later)
        with self._mu:
            self._pending[:0] = later  # before any call queued since (none: fire runs at a boundary)
            order = sorted({id(c.member): c for c in done}.values(), key=lambda c: getattr(c.seq, "seq_id", 0))
            self._ready.extend(c.member for c in order)
            if self._current is None:
                self._pass()
        return rows

    def status(self) -> dict[str, Any]:
        """Fused forwards, by the sequences in each, rows and ms, the step token budget and how many
        forwards' pieces it held back a rest of (``budget_cut_pieces``); JSON-ready."""
        n = sum(self.by_sequences.values())
        return {"fused_forwards": n, "by_sequences": {str(k): v for k, v in sorted(self.by_sequences.items())},
                "mean_sequences": round(sum(k * v for k, v in self.by_sequences.items()) / n, 3) if n else None,
                "rows": self.rows, "decode_ms": round(self.decode_ms, 3),
                "step_token_budget": self.step_token_budget, "budget_cut_pieces": self.cut}


__all__ = ["STEP_TOKEN_BUDGET", "Member", "StepScheduler"]
