"""Hot-swapping the draft's LoRA adapter at request boundaries.

The registry (:class:`store.AdapterRegistry`) says which adapter version is active in each
scope (the shared one, and one per workload that has its own adapters); the
:class:`AdapterManager` makes the decoder's draft use, for each request, the version that serves
the request's workload (its scope's, else the shared one: :meth:`AdapterRegistry.resolve`):

1. *learn*: a background thread subscribed to ``P adapter:events`` (promote / rollback, with
   their scope), with :meth:`AdapterRegistry.active_versions` polled every ``poll_interval_s``
   as the fallback (a missed message, a lost subscription, Redis restarting);
2. *prepare*, in that thread, outside the decoder's lock: ``registry.fetch`` (sha256 of every
   file checked), :func:`check_compatible` (peft type, rank, base class, target modules present
   in the draft with matching shapes, finite weights), then peft ``load_adapter`` under a new
   adapter name ``v{N}``. The new adapter is *inactive*: peft's LoRA forward only reads the
   active adapter's tensors, so requests in flight are untouched while it loads;
   Once loaded, the version becomes its scope's *route*.
3. *switch*, in a ``between_requests`` hook of the decoder (which holds the decoder's lock, so
   no request is running): the route of the next request's workload (the shared route when the
   workload has none, or when the decoder is idle) is compared with ``decoder.adapter_version``;
   if they differ, ``set_adapter("v{N}")`` (or, for version 0 = the base draft,
   ``disable_adapter_layers``) and ``decoder.adapter_version = N``. The time the hook holds the
   lock is the *swap pause*, measured per swap. With per-workload adapters and interleaved
   traffic a swap can happen at every request boundary; it costs one ``set_adapter``;
4. *evict*, back in the thread: ``delete_adapter`` of versions no scope routes to, beyond the
   ``keep_loaded - 1`` most recent such (with one scope: the previous version stays loaded, so a
   rollback is a pure switch).

An adapter may carry a copy gate (``store.copy_channel.GATE_FILE``, trained with it:
``trainer.distill.DistillConfig.copy_gate``): *prepare* reads it (a malformed one makes the
version incompatible), *switch* sets ``decoder.copy_gate`` with ``decoder.adapter_version``
(None for an adapter without one and for version 0), and the draft proposer mixes the copy
channel in with it (:mod:`decoder.proposers.draft`).

A separate, unquantised draft proposes through a serving copy
(:class:`decoder.draft_weights.ServingDraft`, in the dtype ``DecoderConfig.draft_precision`` chose), so
the LoRA forward above is what the manager keeps in step, not what proposals run: *prepare* also
merges the version's LoRA into the copy's weights (peft's ``get_delta_weight``), *switch*
reassigns them (before peft's ``set_adapter``, so a version the copy lacks fails the switch with
nothing changed), and *evict* drops them.

The first adapter needs peft's LoRA layers in the draft. They are injected in the thread with
``get_peft_model`` and a *no-op* adapter (LoRA B initialised to zeros, so base + B·A·x adds
exact zeros and the draft's outputs are bit-identical); module replacement therefore never
changes what an in-flight request computes. The decoder keeps calling its own ``draft``
object, whose modules now hold the LoRA layers (peft injects in place).

A failed preparation (sha256 mismatch, missing files, incompatible config, non-finite weights)
never fails a request: the old adapter keeps serving, and the failure is logged and kept in
:attr:`AdapterManager.failures` with its reason. A version that failed is not retried by the
poll loop (it would fail again); a new promote/rollback event naming it retries it.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from decoder.engines.base import supports
from decoder.registry_follow import RegistryFollower
from store import AdapterRegistry, StoreUnavailableError
from store.copy_channel import CopyGateError, load_gate

log = structlog.get_logger("decoder.adapters")

NOOP = "_noop"  # name of the zero adapter that carries peft's layers before the first real one


class AdapterError(Exception):
    """An adapter cannot be used with this draft; the message says why and what to do."""


class IncompatibleAdapterError(AdapterError):
    """The adapter's config or tensors do not fit the draft."""


def adapter_name(version: int) -> str:
    return f"v{version}"


@dataclass(frozen=True)
class SwapRecord:
    """One switch made by the hook at a request boundary."""

    seq: int  # request boundary at which it happened (0-based count of hook calls)
    ts: float  # wall clock, seconds since the epoch
    from_version: int
    to_version: int
    pause_ms: float  # time the hook held the decoder's lock for this switch
    workload: str | None = None  # the workload of the request it was made for (None: idle boundary)


@dataclass(frozen=True)
class LoadFailure:
    """A version that could not be prepared (the old adapter kept serving)."""

    version: int
    ts: float
    kind: str  # integrity | missing | incompatible | unknown_version | swap | error
    reason: str


def check_compatible(draft: torch.nn.Module, adapter_dir: str | Path, *, max_rank: int = 256,
                     expected_base: str | None = None) -> dict[str, Any]:
    """Check that the peft adapter in ``adapter_dir`` fits ``draft``; returns its config dict.

    Checks: ``peft_type`` is LORA; ``r`` in 1..``max_rank``; the base class in
    ``auto_mapping.base_model_class`` (when recorded) is the draft's class; the recorded
    ``base_model_name_or_path`` equals ``expected_base`` (when both are set); no init that
    rewrites base weights (PiSSA, OLoRA, ...); and every LoRA tensor in
    ``adapter_model.safetensors`` names a linear module of the draft with matching shapes
    (lora_A: (r, in_features), lora_B: (out_features, r)) and is finite.

    Raises:
        IncompatibleAdapterError: naming the first offending field or tensor.
        AdapterError: a file is missing or unreadable.
    """
    d = Path(adapter_dir)
    cfg_path, w_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise AdapterError(f"{d} lacks {p.name}; an adapter directory is peft's save_pretrained layout")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_path} is not readable JSON: {e}") from e
    if cfg.get("peft_type") != "LORA":
        raise IncompatibleAdapterError(f"{cfg_path}: peft_type={cfg.get('peft_type')!r}, only LORA adapters are served")
    r = cfg.get("r")
    if not isinstance(r, int) or not 1 <= r <= max_rank:
        raise IncompatibleAdapterError(f"{cfg_path}: r={r!r}, must be an integer in 1..{max_rank}")
    base_cls = (cfg.get("auto_mapping") or {}).get("base_model_class")
    if base_cls and base_cls != type(draft).__name__:
        raise IncompatibleAdapterError(
            f"{cfg_path}: trained on a {base_cls}, the draft is a {type(draft).__name__}"
        )
    base_name = cfg.get("base_model_name_or_path")
    if expected_base and base_name and base_name != expected_base:
        raise IncompatibleAdapterError(f"{cfg_path}: base_model_name_or_path={base_name!r}, the draft is {expected_base!r}")
    init = cfg.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        raise IncompatibleAdapterError(
            f"{cfg_path}: init_lora_weights={init!r} rewrites the base weights when loaded; save with the default init"
        )
    # peft divides these by r inside load_adapter; a bad one fails there half-way, leaving the
    # adapter's layers in the draft's modules where delete_adapter cannot reach them
    for key, alpha in [("lora_alpha", cfg.get("lora_alpha", 8)),
                       *((f"alpha_pattern[{k!r}]", v) for k, v in (cfg.get("alpha_pattern") or {}).items())]:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
            raise IncompatibleAdapterError(f"{cfg_path}: {key}={alpha!r}, must be a finite number")
    for k, rk in (cfg.get("rank_pattern") or {}).items():
        if isinstance(rk, bool) or not isinstance(rk, int) or not 1 <= rk <= max_rank:
            raise IncompatibleAdapterError(
                f"{cfg_path}: rank_pattern[{k!r}]={rk!r}, must be an integer in 1..{max_rank}")
    if cfg.get("modules_to_save"):
        raise IncompatibleAdapterError(
            f"{cfg_path}: modules_to_save={cfg['modules_to_save']!r}: full-module copies are not hot-swapped; "
            f"train LoRA layers only"
        )
    _check_lora_tensors(draft, w_path, max_rank)
    return cfg


def _check_lora_tensors(draft: torch.nn.Module, w_path: Path, max_rank: int) -> None:
    """Every tensor of ``w_path`` is a LoRA A/B weight of one of ``draft``'s linear modules, of
    the shape that module needs and finite; IncompatibleAdapterError / AdapterError otherwise."""
    try:
        tensors = load_file(str(w_path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise AdapterError(f"{w_path} is not a readable safetensors file: {e}") from e
    modules = dict(draft.named_modules())
    n_lora = 0
    for key, t in tensors.items():
        m = re.match(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$", key)
        if m is None:
            raise IncompatibleAdapterError(f"{w_path}: tensor {key!r} is not a LoRA A/B weight")
        path, part = m.group(1), m.group(2)
        mod = modules.get(path)
        if mod is None:
            raise IncompatibleAdapterError(f"{w_path}: tensor {key!r} targets {path!r}, which the draft has no module named")
        base = getattr(mod, "base_layer", mod)
        fin, fout = getattr(base, "in_features", None), getattr(base, "out_features", None)
        if fin is None or fout is None:
            raise IncompatibleAdapterError(f"{w_path}: {path!r} is a {type(base).__name__}, not a linear layer")
        want = (t.shape[0], fin) if part == "lora_A" else (fout, t.shape[1])
        if t.dim() != 2 or tuple(t.shape) != want or not 1 <= min(t.shape) <= max(max_rank, 1):
            raise IncompatibleAdapterError(
                f"{w_path}: {key} has shape {tuple(t.shape)}, {path} needs {part} of shape {want} with rank <= {max_rank}"
            )
        if not bool(torch.isfinite(t).all()):
            raise IncompatibleAdapterError(f"{w_path}: {key} has non-finite values")
        n_lora += 1
    if n_lora == 0:
        raise IncompatibleAdapterError(f"{w_path}: no LoRA tensors")


def summarize_ms(values) -> dict[str, float | int | None]:
    """count, mean, p50, p99, max of a list of milliseconds (None when empty)."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        return {"count": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {
        "count": int(v.size),
        "mean": round(float(v.mean()), 3),
        "p50": round(float(np.percentile(v, 50)), 3),
        "p99": round(float(np.percentile(v, 99)), 3),
        "max": round(float(v.max()), 3),
    }


class AdapterManager(RegistryFollower):
    """Keeps the decoder's draft on the registry's active adapter (see the module docstring);
    start / stop / close, ``route`` and ``wait_prepared`` are :class:`RegistryFollower`'s.

    Args:
        decoder: a :class:`decoder.speculative.SpeculativeDecoder`; a hook is appended to its
            ``between_requests``. Create the manager before serving. Its ``adapter_version`` is
            taken as the shared scope's starting route.
        registry: the :class:`store.AdapterRegistry` adapters are fetched from.
        poll_interval_s: how often ``active_version()`` is polled when no event arrives, and the
            retry delay while Redis is unreachable.
        clock: monotonic seconds, for pause and preparation times.
        wall_clock: seconds since the epoch, for ``since`` and records.
        keep_loaded: adapter versions kept in memory besides the ones other scopes route to
            (so with only the shared scope: active included), >= 1; 2 keeps the previous version
            so that a rollback is a pure switch.
        max_rank: largest LoRA rank accepted.
        expected_base: the draft's model id, checked against ``base_model_name_or_path``.
        history: swaps, failures and boundary versions kept (most recent).
    """

    _thread_name, _watch_name = "adapter-manager", "adapter"

    def __init__(
        self,
        decoder,
        registry: AdapterRegistry,
        *,
        poll_interval_s: float = 2.0,
        clock: Callable[[], float] = time.perf_counter,
        wall_clock: Callable[[], float] = time.time,
        keep_loaded: int = 2,
        max_rank: int = 256,
        expected_base: str | None = None,
        history: int = 10_000,
    ):
        if keep_loaded < 1:
            raise ValueError(f"keep_loaded={keep_loaded}: must be >= 1 (the active adapter)")
        self._init_follower(decoder, registry, poll_interval_s, clock)
        self.draft: torch.nn.Module = decoder.draft
        self.wall_clock = wall_clock
        self.keep_loaded = keep_loaded
        self.max_rank = max_rank
        self.expected_base = expected_base
        self.swaps: deque[SwapRecord] = deque(maxlen=history)
        self.failures: deque[LoadFailure] = deque(maxlen=history)
        self.boundary_log: deque[int] = deque(maxlen=history)  # adapter_version at each request start
        self.prepare_ms: deque[float] = deque(maxlen=history)
        self.active_since = wall_clock()
        self.last_source: str | None = None  # "event" | "poll" | "manual": how the last target was learnt
        self._peft: PeftModel | None = None
        self._loaded: list[tuple[int, str]] = []  # (version, name), oldest first
        self._gates: dict[int, Any] = {}  # version -> its copy gate's weights (store.copy_channel), None: none
        self._disabled = False  # adapter layers disabled (version 0 after an adapter)
        # scope -> version prepared for it ("" = shared; a workload's 0 = use the shared route)
        self._routes: dict[str, int] = {"": decoder.adapter_version}
        self._previous: dict[str, int] = {}  # scope -> its route before the last change (swap-failure fallback)
        self._boundaries = 0
        self._swaps_total = 0
        self._failures_total = 0
        self._model_lock = threading.Lock()  # peft structure changes: load/delete vs switch
        self._hook_in()

    def _watch(self) -> None:
        """The watcher thread: first the draft engine's LoRA conversion made ready (the base's
        shapes parsed: :func:`decoder.models.gguf_export.warm_lora_base`), so the first promotion
        this replica follows is not the slow one; then :meth:`RegistryFollower._watch`."""
        eng = getattr(self.decoder, "draft_engine", None)
        if supports(eng, "lora"):
            from decoder.models.gguf_export import warm_lora_base

            try:
                warm_lora_base(eng.path)
            except Exception as e:  # noqa: BLE001 - the conversion says it again, per version, when it matters
                log.warning("lora_base_warm_up_failed", base=str(eng.path), error=str(e))
        super()._watch()

    # ---- preparation (background, outside the decoder's lock) ------------------------------
    def _prepare_version(self, version: int, source: str, scope: str, t0: float) -> None:
        """Load ``version`` (under RegistryFollower._prepare's lock) and route ``scope`` to it."""
        try:
            if version != 0:
                self._load(version)
        except StoreUnavailableError:
            raise  # transient: the watcher retries
        except Exception as e:  # noqa: BLE001 - a bad adapter must never reach a request
            self._fail(version, _kind(e), str(e), scope)
            return
        ms = (self.clock() - t0) * 1e3
        self._failed.pop(version, None)
        self._previous[scope] = self._routes.get(scope, 0)
        self._routes = {**self._routes, scope: version}  # replaced whole: the hook reads it unlocked
        self.last_source = source
        if version != 0:
            self.prepare_ms.append(ms)
        log.info("adapter_prepared", version=version, scope=scope, source=source, prepare_ms=round(ms, 3))
        with self._changed:
            self._changed.notify_all()

    def _load(self, version: int) -> str:
        name = adapter_name(version)
        if any(n == name for _, n in self._loaded):
            serving = self.decoder.serving
            if serving is not None and version not in serving.versions:
                self._merge(version, name)
            return name
        path = self.registry.fetch(version)  # sha256 of every file checked
        cfg = check_compatible(self.draft, path, max_rank=self.max_rank, expected_base=self.expected_base)
        try:  # the copy gate it was trained with (store.copy_channel.GATE_FILE), switched in with it
            self._gates[version] = load_gate(path)
        except CopyGateError as e:
            raise IncompatibleAdapterError(str(e)) from e
        with self._model_lock:
            if self._peft is None:
                # peft's layers, carrying a zero adapter: bit-identical outputs (B = 0).
                noop = LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=cfg["target_modules"],
                                  init_lora_weights=True, task_type=cfg.get("task_type"))
                self._peft = get_peft_model(self.draft, noop, adapter_name=NOOP)
                self._peft.eval()
                self._loaded.append((0, NOOP))
            self._peft.load_adapter(str(path), adapter_name=name, is_trainable=False)
            self._loaded.append((version, name))
        if self.decoder.serving is not None:  # the serving copy: this version's merged weights
            self._merge(version, name)
        self._load_on_engine(version, name, path)
        return name

    def _load_on_engine(self, version: int, name: str, path) -> None:
        """A draft on llama.cpp (``decoder.draft_engine``): the version as a GGUF LoRA
        (:func:`decoder.models.gguf_export.lora_gguf_cached`, converted once per artifact), loaded on
        the draft's context, not yet applied. On failure peft's copy is unloaded too.

        Raises:
            IncompatibleAdapterError: the conversion or llama.cpp refused the adapter.
        """
        eng = getattr(self.decoder, "draft_engine", None)
        if not supports(eng, "lora") or name in eng.loras:
            return
        try:
            from decoder.engines.base import EngineError
            from decoder.models.gguf_export import lora_gguf_cached
            from decoder.models.packaged import cache_root

            t0 = self.clock()
            cache = cache_root() / "gguf" / "lora"
            gguf = lora_gguf_cached(Path(path), cache, eng.path)
            try:
                eng.load_lora(name, gguf)
            except EngineError:
                # a cached file llama.cpp cannot read (damaged on disk) would refuse this version
                # forever, whatever retries: convert it again once
                gguf.unlink(missing_ok=True)
                gguf = lora_gguf_cached(Path(path), cache, eng.path)
                eng.load_lora(name, gguf)
            log.info("adapter_gguf_loaded", version=version, gguf=str(gguf), ms=round((self.clock() - t0) * 1e3, 1))
        except Exception as e:
            with self._model_lock:
                if name not in self._peft.active_adapters:
                    self._peft.delete_adapter(name)
                    self._loaded = [(v, m) for v, m in self._loaded if m != name]
                if self.decoder.serving is not None and version in self.decoder.serving.versions:
                    self.decoder.serving.drop(version)
            raise IncompatibleAdapterError(f"v{version} cannot run on the llama.cpp draft: {e}") from e

    def _merge(self, version: int, name: str) -> None:
        """Add ``version``'s merged weights to the decoder's serving copy. On failure peft's copy
        is unloaded too, so no route can point at a version the copy cannot serve, and a retry
        starts from the artifact.

        Raises:
            IncompatibleAdapterError: the adapter does not fit the serving copy.
        """
        try:
            self.decoder.serving.add(version, self._peft, name)
        except Exception as e:
            with self._model_lock:
                if name not in self._peft.active_adapters:
                    self._peft.delete_adapter(name)
                    self._loaded = [(v, m) for v, m in self._loaded if m != name]
            if isinstance(e, ValueError):
                raise IncompatibleAdapterError(f"v{version} does not fit the serving copy: {e}") from e
            raise

    def _fail(self, version: int, kind: str, reason: str, scope: str = "") -> None:
        f = LoadFailure(version, self.wall_clock(), kind, reason)
        self.failures.append(f)
        self._failures_total += 1
        self._failed[version] = reason
        log.error("adapter_load_failed", version=version, scope=scope, kind=kind, reason=reason,
                  serving=self._routes.get(scope, 0))
        with self._changed:
            self._changed.notify_all()

    def _evict(self) -> None:
        """delete_adapter the versions beyond ``keep_loaded`` plus the routed ones, oldest first,
        and the no-op adapter once a real one is loaded; never the active or a routed one."""
        if self._peft is None:
            return
        with self._model_lock:
            protected = set(self._peft.active_adapters)
            routed = {adapter_name(v) for v in self._routes.values() if v}
            protected |= routed
            real = [n for v, n in self._loaded if n != NOOP]
            drop = real[: max(0, len(real) - (self.keep_loaded + max(0, len(routed) - 1)))]
            if real:
                drop.append(NOOP)
            for n in drop:
                if n in protected or all(m != n for _, m in self._loaded):
                    continue
                self._peft.delete_adapter(n)
                if self.decoder.serving is not None:
                    self.decoder.serving.drop(next(v for v, m in self._loaded if m == n))
                eng = getattr(self.decoder, "draft_engine", None)
                if eng is not None and n in getattr(eng, "loras", ()) and eng.lora != n:
                    eng.drop_lora(n)
                self._gates.pop(next((v for v, m in self._loaded if m == n), -1), None)
                self._loaded = [(v, m) for v, m in self._loaded if m != n]

    # ---- the switch (under the decoder's lock) -------------------------------------------
    def wants_switch(self, dec, req=None) -> bool:
        """Whether the hook would swap the adapter for ``req`` (its workload's route is not the
        version serving now): a batched loop admits such a request only into an empty batch."""
        return self.route(getattr(req, "workload", None)) != dec.adapter_version

    def _between_requests(self, dec, req=None) -> None:
        seq = self._boundaries
        self._boundaries += 1
        workload = getattr(req, "workload", None)
        want = self.route(workload)
        if want != dec.adapter_version and self._model_lock.acquire(blocking=False):
            t0 = self.clock()
            old = dec.adapter_version
            if want and all(n != adapter_name(want) for _, n in self._loaded):
                # evicted between reading the route and taking the lock (a newer route replaced
                # it): keep serving what serves; the watcher brings the routes up to date
                self._model_lock.release()
                self.boundary_log.append(dec.adapter_version)
                return
            try:
                eng = getattr(dec, "draft_engine", None)
                if supports(eng, "lora"):  # the draft on llama.cpp
                    eng.set_lora(adapter_name(want) if want else None)
                if dec.serving is not None:  # first: a version it lacks fails before peft moves
                    dec.serving.use(want)
                if want == 0:
                    if self._peft is not None:
                        self._peft.base_model.disable_adapter_layers()
                        self._disabled = True
                else:
                    self._peft.set_adapter(adapter_name(want), inference_mode=True)
                    if self._disabled:
                        self._peft.base_model.enable_adapter_layers()
                        self._disabled = False
                dec.adapter_version = want
                dec.copy_gate = self._gates.get(want) if want else None
                ok = True
            except Exception as e:  # noqa: BLE001 - keep serving the old adapter
                ok = False
                err = e
                if dec.serving is not None and dec.serving.version != old:
                    try:
                        dec.serving.use(old)
                    except KeyError:
                        pass  # old's weights are gone: the fallback below routes to a loaded one
                eng = getattr(dec, "draft_engine", None)
                if supports(eng, "lora"):
                    try:
                        eng.set_lora(adapter_name(old) if old and adapter_name(old) in eng.loras else None)
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                self._model_lock.release()
            pause = (self.clock() - t0) * 1e3
            if ok:
                self.active_since = self.wall_clock()
                self._swaps_total += 1
                self.swaps.append(SwapRecord(seq, self.active_since, old, want, pause, workload))
                log.info("adapter_swapped", from_version=old, to_version=want, workload=workload,
                         pause_ms=round(pause, 3))
            else:
                # unroute it: its scopes go back to what they routed to before if that is still
                # loaded; else the shared scope keeps what is serving (unless that is a workload's
                # own adapter) and a workload scope the shared route; the base draft last. The
                # next poll, seeing the registry still name it, prepares it again and the switch
                # is retried then.
                loaded = {v for v, _ in self._loaded}
                own = {v for sc, v in self._routes.items() if sc}

                def fallback(sc: str) -> int:
                    prev = self._previous.get(sc, 0)
                    if prev in loaded:
                        return prev
                    return old if sc == "" and old in loaded and old not in own else 0

                self._routes = {sc: (fallback(sc) if v == want else v) for sc, v in self._routes.items()}
                self._fail(want, "swap", f"switching to v{want} failed: {err!r}")
                self._failed.pop(want, None)  # a failed switch is retried (a bad artifact is not)
            with self._changed:
                self._changed.notify_all()
        self.boundary_log.append(dec.adapter_version)

    # ---- observation -----------------------------------------------------------------------
    @property
    def pause_ms(self) -> list[float]:
        """Swap pauses (ms), oldest first."""
        return [s.pause_ms for s in self.swaps]

    def status(self) -> dict[str, Any]:
        """Active version and since when, pending switch, swaps, failures, pause stats; JSON-ready."""
        last = self.failures[-1] if self.failures else None
        shared = self._routes.get("", 0)
        return {
            "active_version": self.decoder.adapter_version,
            "active_since": self.active_since,
            "pending_version": shared if shared != self.decoder.adapter_version else None,
            "target_version": shared,
            "routes": dict(sorted(self._routes.items())),
            "learnt_via": self.last_source,
            "loaded": [v for v, n in self._loaded if n != NOOP],
            "swaps": self._swaps_total,
            "failures": self._failures_total,
            "last_failure": asdict(last) if last else None,
            "pause_ms": summarize_ms(self.pause_ms),
            "prepare_ms": summarize_ms(self.prepare_ms),
            "draft_precision": getattr(self.decoder, "draft_precision", "fp32"),
            "watching": self._thread is not None and self._thread.is_alive(),
        }


def _kind(e: Exception) -> str:
    from store import ArtifactMissingError, IntegrityError, UnknownVersionError

    if isinstance(e, IntegrityError):
        return "integrity"
    if isinstance(e, ArtifactMissingError):
        return "missing"
    if isinstance(e, UnknownVersionError):
        return "unknown_version"
    if isinstance(e, IncompatibleAdapterError):
        return "incompatible"
    if isinstance(e, AdapterError):
        return "missing"
    return "error"

