"""Keeping the decoder's feature-level head on the registry's promoted one.

The trainer registers heads (``decoder.eagle.save_head`` files) in a registry of kind ``"head"``
(:class:`store.AdapterRegistry`, keys ``P head:...``) and promotes one when its held-out
acceptance beats the serving one (``trainer.heads``). :class:`HeadManager` does for heads what
:class:`decoder.adapters.AdapterManager` does for LoRA adapters, with the same watcher
(:func:`watch_registry`: subscribe to the events channel, poll the active versions, retry while
Redis is away):

- preparation runs on the watcher thread, outside the decoder's lock: fetch the version (every
  file's sha256 checked), rebuild it on the target (``decoder.eagle.load_head``: the file must be
  this target's), make its serving copy, check the decoder can feed it
  (``SpeculativeDecoder.check_eagle_head``) and that a probe step gives finite logits. A head that
  fails any of these never serves; the failure is recorded and the route keeps the head that
  serves.
- the switch is a reference swap at a request boundary (the decoder's ``between_requests``
  hook): ``decoder.eagle_head`` and ``decoder.head_version`` change together, never inside a
  request, so a request runs with one head from its first proposal to its last.
- per-workload scopes route as adapters do: a request of workload ``w`` gets ``w``'s own
  promoted head, else the shared one; version 0 means no head (the controller then does not
  offer the ``"eagle"`` proposer: ``GoodputController(proposer_available=...)``).

A rollback in the registry (``registry.rollback(reason, scope)``) is an event like a
promotion: the previous head is prepared (kept loaded, so it is a pure switch) and served from
the next request on.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog

from decoder.registry_follow import RegistryFollower
from store import StoreUnavailableError
from store.registry import HEAD_FILE

log = structlog.get_logger(__name__)

PROBE_DEPTH = 4  # proposal steps a head must survive on its own features before it serves


@dataclass(frozen=True)
class HeadSwap:
    """One switch of the serving head at a request boundary."""

    boundary: int  # the boundary's sequence number (requests and idle boundaries)
    at: float  # seconds since the epoch
    from_version: int
    to_version: int
    pause_ms: float
    workload: str | None


@dataclass(frozen=True)
class HeadFailure:
    """A head version that could not be prepared (it never served)."""

    version: int
    at: float  # seconds since the epoch
    reason: str


def serving_head_loader(decoder, dtype) -> Callable[[Path], Any]:
    """``load(dir)``: the head in ``dir/head.safetensors`` rebuilt on ``decoder.target`` as it
    serves: a frozen copy in ``dtype`` (``torch.bfloat16`` where the CPU multiplies it natively,
    as ``daemon.serve`` chooses, else ``torch.float32``).

    Raises (from the returned callable): ValueError, the file is unreadable, another target's,
    or of another shape (``decoder.eagle.load_head``)."""
    from decoder.eagle import load_head

    def load(path: Path):
        return load_head(decoder.target, Path(path) / HEAD_FILE).serving_copy(dtype)

    return load


class HeadManager(RegistryFollower):
    """Keeps ``decoder.eagle_head`` on the head registry's promoted head (module docstring);
    start / stop / close, ``route`` and ``wait_prepared`` are :class:`RegistryFollower`'s.

    Args:
        decoder: a :class:`decoder.speculative.SpeculativeDecoder`; a hook is appended to its
            ``between_requests``. Its ``eagle_head`` / ``head_version`` (a head given at build,
            version 0) is the shared scope's starting route.
        registry: a :class:`store.AdapterRegistry` of kind ``"head"``.
        load: ``load(dir) -> head`` (:func:`serving_head_loader`); raises for a head that must
            not serve.
        poll_interval_s: how often the active versions are polled when no event arrives, and
            the retry delay while Redis is unreachable (s).
        keep_loaded: head versions kept in memory besides routed ones (>= 1); 2 keeps the
            previous shared head, so a rollback is a pure switch. A 135M target's bf16 head is
            about 12 MB (its layer and fc; embedding and LM head are the target's, shared).
    """

    _thread_name, _watch_name = "head-manager", "head"

    def __init__(self, decoder, registry, *, load: Callable[[Path], Any], poll_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.perf_counter, wall_clock: Callable[[], float] = time.time,
                 keep_loaded: int = 2, history: int = 1000):
        if getattr(registry, "kind", "head") != "head":
            raise ValueError(f"HeadManager needs a registry of kind 'head', got {registry.kind!r}: "
                             f"AdapterRegistry(client, dir, config, kind='head')")
        if keep_loaded < 1:
            raise ValueError(f"keep_loaded={keep_loaded}: must be >= 1 (the serving head)")
        self._init_follower(decoder, registry, poll_interval_s, clock)
        self.load = load
        self.wall_clock = wall_clock
        self.keep_loaded = keep_loaded
        self.swaps: deque[HeadSwap] = deque(maxlen=history)
        self.failures: deque[HeadFailure] = deque(maxlen=history)
        self.prepare_ms: deque[float] = deque(maxlen=history)
        self._heads: dict[int, Any] = {}  # version -> serving head (insertion order = load order)
        v0 = int(getattr(decoder, "head_version", 0))
        if v0 and decoder.eagle_head is not None:
            self._heads[v0] = decoder.eagle_head
        self._initial = decoder.eagle_head if not v0 else None  # a head given at build serves as version 0
        self._routes: dict[str, int] = {"": v0}
        self._boundaries = 0
        self._lock = threading.Lock()  # _heads and _routes changes
        self._hook_in()

    # ---- preparation (watcher thread) --------------------------------------------------------
    def _prepare_version(self, version: int, source: str, scope: str, t0: float) -> None:
        """Load and check ``version`` (under RegistryFollower._prepare's lock) and route ``scope`` to it."""
        if version and version not in self._heads:
            try:
                head = self.load(self.registry.fetch(version))
                self._check(head)
            except StoreUnavailableError:
                raise  # transient: the watcher retries
            except Exception as e:  # noqa: BLE001 - a bad head must never reach a request
                self._fail(version, f"{type(e).__name__}: {e}", scope)
                return
            with self._lock:
                self._heads[version] = head
            self.prepare_ms.append((self.clock() - t0) * 1e3)
        self._failed.pop(version, None)
        with self._lock:
            self._routes = {**self._routes, scope: version}  # replaced whole: the hook reads it unlocked
        log.info("head_prepared", version=version, scope=scope, source=source,
                 prepare_ms=round((self.clock() - t0) * 1e3, 3))
        with self._changed:
            self._changed.notify_all()

    def _check(self, head) -> None:
        """Raises ValueError when the decoder cannot feed ``head`` (its width or vocabulary) or a
        probe step gives logits that are not finite or no distribution (finite but huge weights
        pass the registry's check and would fail every sampled request). Touches nothing the
        decoder reads: it runs on the watcher thread while requests decode."""
        import torch

        self.decoder.check_eagle_head(head=head)
        p = next(head.parameters())
        g = torch.Generator().manual_seed(0)
        feats = torch.randn(1, 2, head.hidden_size, generator=g).to(device=p.device, dtype=p.dtype)
        tokens = torch.zeros(1, 2, dtype=torch.long, device=p.device)
        with torch.inference_mode():  # a refill, then proposals fed the head's own features (γ > 1)
            logits, g, cache = head(feats, tokens)
            outs = [logits]
            for _ in range(PROBE_DEPTH):
                logits, g, cache = head(g[:, -1:], tokens[:, :1], cache.length, cache)
                outs.append(logits)
        for depth, lg in enumerate(outs):
            if not (torch.isfinite(lg).all() and torch.isfinite(torch.softmax(lg.float(), dim=-1)).all()):
                raise ValueError(f"a probe step of the head gives logits that are not finite at proposal depth {depth} "
                                 f"(weights too large or corrupt): it would fail sampled requests")

    def _fail(self, version: int, reason: str, scope: str) -> None:
        self.failures.append(HeadFailure(version, self.wall_clock(), reason))
        self._failed[version] = reason
        log.error("head_load_failed", version=version, scope=scope, reason=reason, serving=self._routes.get(scope, 0))
        with self._changed:
            self._changed.notify_all()

    def _evict(self) -> None:
        """Forget loaded heads beyond ``keep_loaded`` plus the routed ones, oldest first; never a
        routed head or the one serving."""
        with self._lock:
            routed = set(self._routes.values()) | {int(getattr(self.decoder, "head_version", 0))}
            spare = [v for v in self._heads if v not in routed]
            for v in spare[: max(0, len(spare) - (self.keep_loaded - 1))]:
                del self._heads[v]

    # ---- the switch (decoder's lock held) ----------------------------------------------------
    def wants_switch(self, dec, req=None) -> bool:
        """Whether the hook would swap the head for ``req`` (a batched loop admits such a request
        only into an empty batch)."""
        return self.route(getattr(req, "workload", None)) != int(getattr(dec, "head_version", 0))

    def _between_requests(self, dec, req=None) -> None:
        seq = self._boundaries
        self._boundaries += 1
        workload = getattr(req, "workload", None)
        want = self.route(workload)
        old = int(getattr(dec, "head_version", 0))
        if want == old:
            return
        t0 = self.clock()
        with self._lock:
            head = self._heads.get(want) if want else self._initial
            if want and head is None:
                return  # evicted by a newer route between reading it and now: keep what serves
            dec.eagle_head, dec.head_version = head, want
        pause = (self.clock() - t0) * 1e3
        self.swaps.append(HeadSwap(seq, self.wall_clock(), old, want, pause, workload))
        log.info("head_swapped", from_version=old, to_version=want, workload=workload, pause_ms=round(pause, 3))

    # ---- observation -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """Serving head, routes, loaded versions, swaps and failures; JSON-ready."""
        last = self.failures[-1] if self.failures else None
        return {
            "serving_version": int(getattr(self.decoder, "head_version", 0)),
            "routes": dict(sorted(self._routes.items())),
            "loaded": sorted(self._heads),
            "swaps": len(self.swaps),
            "failures": len(self.failures),
            "last_failure": asdict(last) if last else None,
            "prepare_ms_last": round(self.prepare_ms[-1], 3) if self.prepare_ms else None,
            "watching": self._thread is not None and self._thread.is_alive(),
        }
