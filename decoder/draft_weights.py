"""The draft the decoder proposes with: a copy, each adapter version merged, in the dtype measured faster.

Speculative decoding stays lossless whatever the draft computes, as long as the accept test
``min(1, p(x) / q(x))`` and the residual ``norm(max(0, p - q))`` use the same q the proposal was
drawn from (Leviathan et al. 2023, Theorem 1; Chen et al. 2023, Alg. 2). So the draft may run
in bf16 against a float32 target: only α can change, never the output distribution (and greedy
output stays token-identical to plain decoding).

Two things make a proposal cheaper. First, merging: peft's unmerged LoRA adds two small matmuls
and a Python layer per targeted module to every draft step. Second, bf16: one draft step streams
every weight once (a GEMV per linear layer), and halving the bytes can nearly halve c, the
draft's cost per proposal relative to a target step. Whether bf16 beats the float32 kernel
depends on the CPU: ``calibrate_draft_precision`` decides, and ``bench/head_bench.py`` times the
draft step each way (bench/RESULTS.md has the measurements).

:class:`ServingDraft` holds a copy of the draft's modules and, per adapter version, the merged
weights ``W + ΔW`` (peft's own ``get_delta_weight``: (α / r) · B · A) of the linear layers the
adapter targets. They are built in the adapter manager's background thread. Switching versions
at a request boundary reassigns those parameters (no copy, no arithmetic): tens of
microseconds. Memory: in float32 the copy shares the draft's tensors, in bf16 it is a bf16 copy
of them; each loaded version adds its targeted weights (sizes in bench/RESULTS.md).
"""

from __future__ import annotations

import copy
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from decoder.fastpath import linear_weights, padded_row

PRECISIONS = ("auto", "fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_PEFT_PREFIX = "base_model.model."


def calibrate_draft_precision(model: nn.Module, reps: int = 3, margin: float = 0.9, pad_one_row: bool = False,
                              min_ms: float = 1.0) -> dict:
    """Time one row (a draft step's GEMVs) through every distinct float32 CPU ``nn.Linear``
    weight of ``model`` (the LM head included) in float32 and in bf16, each weight once per
    pass, out of cache as in a real step. The float32 side takes the kernel the decoder serves
    it with: ``F.linear``, or with ``pad_one_row`` the 2-column GEMM
    (``decoder.fastpath.SmallMLinear``). About 2 x ``reps`` + 2 passes (~0.2 s for the 8-layer
    SmolLM2 draft on 2 cores).

    Returns ``{"fp32_ms", "bf16_ms", "use_bf16"}``: the median pass time of each (ms) and
    whether bf16 is faster by the ``margin`` factor. A one-row pass is memory-bound, so bf16
    (half the bytes) can win even where the CPU emulates bf16 arithmetic. False where it does not,
    where the model has no such weight, and where the float32 pass takes under ``min_ms``: weights
    that stay in cache (a toy model) gain nothing from half the bytes, and the choice would
    follow timing noise.
    """
    weights = linear_weights(model)
    if not weights:
        return {"fp32_ms": None, "bf16_ms": None, "use_bf16": False}
    half = [w.to(torch.bfloat16) for w in weights]
    xs = {(n, dt): torch.randn(1, n, dtype=dt) for n in {w.shape[1] for w in weights}
          for dt in (torch.float32, torch.bfloat16)}

    def run(ws) -> None:
        for w in ws:
            x = xs[(w.shape[1], w.dtype)]
            if pad_one_row and w.dtype == torch.float32:
                padded_row(w, x)
            else:
                F.linear(x, w)

    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    with torch.inference_mode():
        run(weights)
        run(half)
        for _ in range(reps):
            for key, ws in (("fp32", weights), ("bf16", half)):
                t0 = time.perf_counter()
                run(ws)
                times[key].append((time.perf_counter() - t0) * 1e3)
    f32, b16 = statistics.median(times["fp32"]), statistics.median(times["bf16"])
    return {"fp32_ms": round(f32, 3), "bf16_ms": round(b16, 3), "use_bf16": f32 >= min_ms and b16 < margin * f32}


def _unwrap(model: nn.Module) -> nn.Module:
    """The plain transformers model under a peft wrapper (its LoRA layers still injected)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class ServingDraft:
    """A copy of ``draft`` in ``dtype`` that serves proposals, one adapter version at a time,
    each version's LoRA merged into its linear weights.

    Args:
        draft: the draft model (plain, or with peft's LoRA layers injected: those are merged with
            the active adapter's weights, as peft's ``merge_and_unload`` would). Later changes
            to ``draft``'s modules (peft injecting layers) never reach the copy. In the draft's
            own dtype the copy shares its parameter objects: an in-place edit of a base weight
            reaches the proposals of version 0 and of layers the served adapter does not
            target, as it reached them when the decoder ran the draft itself; a bf16 copy is a
            snapshot. Adapters are trained against fixed base weights, so neither is a way to
            update a served draft: register and promote an adapter instead.
        dtype: the serving dtype: the draft's own (float32: a merged view, no memory but the
            merged weights per version, no peft overhead per step) or ``torch.bfloat16``.

    ``module`` is what the decoder calls. Version 0 is the draft as given; :meth:`add` registers
    an adapter version's merged weights and :meth:`use` switches to one. ``add`` may run in
    another thread than ``use`` (they share only a dict, replaced whole).

    Raises:
        ValueError: ``dtype`` is not floating point.
    """

    def __init__(self, draft: nn.Module, dtype: torch.dtype):
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype!r}: the serving draft needs a floating-point torch.dtype, e.g. torch.bfloat16")
        self.dtype = dtype
        src = _unwrap(draft)
        merged = _merged_linear_weights(draft, None)
        # Same dtype: the copy's modules hold the draft's own parameter tensors (no memory; a
        # version's merged weights replace them in the copy only). Another dtype: new tensors.
        share = all(p.dtype == dtype for p in src.parameters())
        module = copy.deepcopy(src, {id(p): p for p in src.parameters()} if share else {})
        if merged:  # peft layers inside: take the merged plain model instead
            module = _strip_lora(module)
            for name, w in merged.items():
                module.get_submodule(name).weight = nn.Parameter(w.detach().to(dtype), requires_grad=False)
        if not share:
            for p in module.parameters():  # parameters only: buffers (RoPE's inv_freq) keep their precision
                p.data = p.data.to(dtype)
                p.requires_grad_(False)
        module.eval()
        self.module: nn.Module = module
        self._linears = {n: m for n, m in self.module.named_modules() if isinstance(m, nn.Linear)}
        self._base = {n: m.weight for n, m in self._linears.items()}  # version 0's parameters
        self._versions: dict[int, dict[str, nn.Parameter]] = {0: {}}
        self._lock = threading.Lock()
        self.version = 0

    @property
    def versions(self) -> list[int]:
        """Versions with weights held, ascending (0 always)."""
        return sorted(self._versions)

    def add(self, version: int, peft_model: nn.Module, adapter: str) -> float:
        """Merge ``adapter`` (a LoRA adapter loaded in ``peft_model``, peft's injected layers
        over this draft's base weights) into weights of the copy's dtype held as ``version``. Returns the time
        taken (ms).

        Raises:
            ValueError: the adapter targets a module this copy has no linear layer for, or
                ``version`` < 1.
        """
        if version < 1:
            raise ValueError(f"version={version}: adapter versions start at 1 (0 is the base draft)")
        t0 = time.perf_counter()
        merged = _merged_linear_weights(peft_model, adapter)
        if not merged:
            raise ValueError(f"adapter {adapter!r} targets no linear layer of the draft")
        params: dict[str, nn.Parameter] = {}
        for name, w in merged.items():
            if name not in self._linears:
                raise ValueError(f"adapter {adapter!r} targets {name!r}, which the serving draft has no linear layer for")
            params[name] = nn.Parameter(w.to(self.dtype), requires_grad=False)
        with self._lock:
            self._versions = {**self._versions, version: params}
        return (time.perf_counter() - t0) * 1e3

    def use(self, version: int) -> None:
        """Serve ``version`` (0 = the base draft): reassigns the targeted layers' weights.

        Raises:
            KeyError: ``version`` was never added or has been dropped.
        """
        params = self._versions[version]
        before = {name: mod.weight for name, mod in self._linears.items()}
        try:
            for name, mod in self._linears.items():
                mod.weight = params.get(name, self._base[name])
        except BaseException:
            for name, mod in self._linears.items():  # never serve a mix of two versions
                mod.weight = before[name]
            raise
        self.version = version

    def drop(self, version: int) -> None:
        """Free ``version``'s weights (not the one serving, not 0)."""
        if version in (0, self.version):
            return
        with self._lock:
            self._versions = {v: p for v, p in self._versions.items() if v != version}


def _merged_linear_weights(model: nn.Module, adapter: str | None) -> dict[str, torch.Tensor]:
    """``{module name in the plain model: W + ΔW}`` (float32) for every peft LoRA layer of
    ``model`` carrying ``adapter`` (None: the layer's active adapters, skipping disabled
    layers and zero-rank no-ops). Empty when ``model`` has no LoRA layers."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            base = getattr(mod, "base_layer", None)
            if base is None or not hasattr(mod, "get_delta_weight") or not hasattr(mod, "lora_A"):
                continue
            key = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
            if adapter is None:
                names = [] if getattr(mod, "disable_adapters", False) else \
                    [a for a in getattr(mod, "active_adapters", []) if a in mod.lora_A]
            else:
                names = [adapter] if adapter in mod.lora_A else []
            w = base.weight.detach().float()
            for a in names:
                w = w + mod.get_delta_weight(a).float()
            out[key] = w
    return out


def _strip_lora(module: nn.Module) -> nn.Module:
    """Replace every peft LoRA layer in ``module`` by its base layer (in place; returns it)."""
    for name, mod in list(module.named_modules()):
        base = getattr(mod, "base_layer", None)
        if base is None or not hasattr(mod, "lora_A") or not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, base)
    return module
