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
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import structlog

from decoder.engines.base import route_forwards

log = structlog.get_logger("decoder.batching")


class _Call:
    __slots__ = ("member", "engine", "seq", "tokens", "keep", "hidden", "result", "error")

    def __init__(self, member, engine, seq, tokens, keep, hidden):
        self.member, self.engine, self.seq = member, engine, seq
        self.tokens, self.keep, self.hidden = list(tokens), int(keep), bool(hidden)
        self.result: Any = None
        self.error: BaseException | None = None


class Member:
    """One request's thread under a :class:`StepScheduler`."""

    def __init__(self, name: str, payload: Any = None):
        self.name = name
        self.payload = payload  # the caller's (the serving loop's Ticket)
        self.thread: threading.Thread | None = None
        self.go = threading.Event()  # set when the baton reaches this member
        self.done = False
        self.batch_size = 1  # sequences in the fused forward that served this member's last call


class StepScheduler:
    """Runs member threads one at a time and fuses their engine forwards (module docstring).

    The driver calls :meth:`spawn` (a new member: it runs once the baton reaches it),
    :meth:`wait_boundary` (blocks until every member waits on a forward or has finished),
    :meth:`fire` (the waiting forwards, one fused call per engine) in a loop.
    ``stats`` counts fused forwards by the number of sequences in them (``by_sequences``), rows
    and decode ms, for status.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
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
        go on in sequence-id order. Call at a step boundary only. Returns the rows decoded."""
        with self._mu:
            calls, self._pending = self._pending, []
        if not calls:
            return 0
        groups: dict[tuple[int, bool], list[_Call]] = {}
        for c in calls:
            groups.setdefault((id(c.engine), c.hidden), []).append(c)
        rows = 0
        t0 = self.clock()
        for group in groups.values():
            eng = group[0].engine
            try:
                outs = eng.forward_batch([(c.seq, c.tokens, c.keep) for c in group], group[0].hidden)
                for c, o in zip(group, outs):
                    c.result = o
            except BaseException as e:  # noqa: BLE001 - retried alone: only the faulty request fails
                if len(group) == 1:
                    group[0].error = e
                else:
                    for c in group:
                        try:
                            c.result = eng.forward_batch([(c.seq, c.tokens, c.keep)], c.hidden)[0]
                        except BaseException as e1:  # noqa: BLE001 - handed to the member
                            c.error = e1
            for c in group:
                c.member.batch_size = len(group)
            rows += sum(len(c.tokens) for c in group)
            self.by_sequences[len(group)] += 1
        self.decode_ms += (self.clock() - t0) * 1e3
        self.fired += 1
        self.rows += rows
        with self._mu:
            order = sorted({id(c.member): c for c in calls}.values(), key=lambda c: getattr(c.seq, "seq_id", 0))
            self._ready.extend(c.member for c in order)
            if self._current is None:
                self._pass()
        return rows

    def status(self) -> dict[str, Any]:
        """Fused forwards, by the sequences in each, rows and ms; JSON-ready."""
        n = sum(self.by_sequences.values())
        return {"fused_forwards": n, "by_sequences": {str(k): v for k, v in sorted(self.by_sequences.items())},
                "mean_sequences": round(sum(k * v for k, v in self.by_sequences.items()) / n, 3) if n else None,
                "rows": self.rows, "decode_ms": round(self.decode_ms, 3)}


__all__ = ["Member", "StepScheduler"]
