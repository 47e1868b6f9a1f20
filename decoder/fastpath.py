"""Small-M linear layers on CPU: ``W @ x^T`` instead of ``x @ W^T`` for a few rows.

Verification feeds γ + 1 rows through every linear layer of the target; plain decoding feeds
one. On CPU, ``F.linear`` (what ``nn.Linear`` calls: ``x @ W^T``) with 2-8 rows can cost about
twice one row, because the GEMM repacks ``W`` for each call, while ``W @ x^T`` streams ``W`` once
in its stored layout. That ratio is the c_verify of every speedup estimate (Leviathan et al.
2023, Eq. 1 assumes it is 1). Which kernel wins depends on the CPU (bench/RESULTS.md has the
measurements), so :func:`calibrate_small_m` times both on the model's own weights and the
decoder switches only where ``W @ x^T`` wins (``DecoderConfig.small_m_linear="auto"``).

One row is a GEMV, and MKL may run its GEMV on one thread while its GEMM uses all of them. The
calibration times that too, and where the padded row ``W @ [x; x]^T`` wins,
:class:`SmallMLinear` pads single rows (``pad_one_row``): plain decoding, the draft's proposals
and transformers' ``generate`` on the same model all get the faster kernel, so the speedups
measured against plain decoding are against its fastest kernel, not a slow one.

:func:`small_m_linear` switches a model's ``nn.Linear`` modules to :class:`SmallMLinear` (the
same parameters and state dict; only ``forward`` differs, and only for at most ``max_rows``
rows of float32 on the CPU). The sums run in a different order, so outputs differ from
``F.linear`` by float32 rounding (relative 1e-6), as two BLAS kernels do.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

SMALL_M = 16  # rows up to which W @ x^T is used


class SmallMLinear(nn.Linear):
    """``nn.Linear`` whose forward computes ``(W @ x^T)^T`` for 2..``max_rows`` float32 CPU rows.

    Input (..., in_features), output (..., out_features), as ``nn.Linear``. One row (plain
    decoding, the draft's proposals) runs ``F.linear`` exactly, or with ``pad_one_row`` the
    row twice as a 2-column GEMM (column 0 kept); more rows than ``max_rows``, another dtype or
    device run ``F.linear`` exactly.
    """

    max_rows: int = SMALL_M
    pad_one_row: bool = False  # one row as a 2-column GEMM (where calibrate_small_m found GEMV slow)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() >= 1
                and self.in_features > 0 and not torch.is_autocast_enabled("cpu")):
            n = x.numel() // self.in_features
            if n == 1 and self.pad_one_row:
                out = padded_row(w, x.reshape(1, self.in_features))
                if self.bias is not None:
                    out = out + self.bias
                return out.reshape(*x.shape[:-1], self.out_features)
            if 2 <= n <= self.max_rows:
                out = (w @ x.reshape(n, self.in_features).T).T.contiguous()
                if self.bias is not None:
                    out = out + self.bias
                return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, w, self.bias)


def padded_row(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``W @ x^T`` for one row ``x`` (1, in) as a 2-column GEMM of the row twice: (out,)."""
    return (w @ torch.cat([x, x]).T)[:, 0].contiguous()


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct float32 CPU ``nn.Linear`` weight of ``model`` (the LM head included,
    tied weights once), detached: what one decoding step streams."""
    seen, weights = set(), []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) and isinstance(w, torch.Tensor) and w.device.type == "cpu" \
                and w.dtype == torch.float32 and w.dim() == 2 and w.data_ptr() not in seen:
            seen.add(w.data_ptr())
            weights.append(w.detach())
    return weights


def calibrate_small_m(model: nn.Module, rows: int = 2, reps: int = 3, margin: float = 0.9,
                      one_row: bool = True) -> dict:
    """Time ``F.linear`` against ``W @ x^T`` for ``rows`` rows over every distinct float32 CPU
    ``nn.Linear`` weight of ``model`` (the LM head included), as a verification step meets them
    (each weight once per pass, out of cache). Takes about 2 x ``reps`` + 2 passes over the
    weights (~0.5 s for SmolLM2-135M on 2 cores).

    Returns ``{"rows", "f_linear_ms", "w_at_xt_ms", "use"}``: the median pass time of each (ms)
    and whether ``W @ x^T`` is faster by the ``margin`` factor (``use``; False when the model
    has no such weight). With ``one_row`` (default) it also times one row (a plain decoding
    step, a draft proposal): ``F.linear`` against ``W @ [x; x]^T`` (the row twice: a 2-column
    GEMM), adding ``"f_linear_1_ms"``, ``"padded_1_ms"`` and ``"pad_one_row"``. Where MKL's
    GEMV runs on one thread and its GEMM on all, the padded GEMM is the faster plain step.
    """
    weights = linear_weights(model)
    if not weights:
        out = {"rows": rows, "f_linear_ms": None, "w_at_xt_ms": None, "use": False}
        return {**out, "f_linear_1_ms": None, "padded_1_ms": None, "pad_one_row": False} if one_row else out
    xs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in weights}}
    x1 = {n: torch.randn(1, n) for n in xs}

    def f_linear() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    def w_at_xt() -> None:
        for w in weights:
            (w @ xs[w.shape[1]].T).T.contiguous()

    def f_linear_1() -> None:
        for w in weights:
            F.linear(x1[w.shape[1]], w)

    def padded_1() -> None:
        for w in weights:
            padded_row(w, x1[w.shape[1]])

    fns = {"f": f_linear, "w": w_at_xt}
    if one_row:
        fns |= {"f1": f_linear_1, "p1": padded_1}
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.inference_mode():
        for fn in fns.values():
            fn()
        for _ in range(reps):
            for key, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[key].append((time.perf_counter() - t0) * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    out = {"rows": rows, "f_linear_ms": round(ms["f"], 3), "w_at_xt_ms": round(ms["w"], 3),
           "use": ms["w"] < margin * ms["f"]}
    if one_row:
        out |= {"f_linear_1_ms": round(ms["f1"], 3), "padded_1_ms": round(ms["p1"], 3),
                "pad_one_row": ms["p1"] < margin * ms["f1"]}
    return out


def small_m_linear(model: nn.Module, max_rows: int = SMALL_M, pad_one_row: bool = False) -> int:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`SmallMLinear`, in place, taking
    ``W @ x^T`` for 2..``max_rows`` rows (``max_rows`` = 1: none) and, with ``pad_one_row``,
    one row as a 2-column GEMM.

    Idempotent; subclasses of ``nn.Linear`` (quantised or LoRA layers) are left alone, and a
    deep copy (``decoder.models.loading.derive_draft``) keeps the class. Returns the number of modules
    switched by this call.

    Raises:
        ValueError: ``max_rows`` < 1.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows={max_rows}: must be >= 1 (rows fed per call)")
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = SmallMLinear
            n += 1
        if isinstance(m, SmallMLinear):
            m.max_rows = max_rows
            m.pad_one_row = pad_one_row
    return n


def plain_linear(model: nn.Module) -> int:
    """Undo :func:`small_m_linear` (e.g. before ``torch.ao`` quantisation, which matches the exact
    ``nn.Linear`` type); returns the number of modules switched back."""
    n = 0
    for m in model.modules():
        if type(m) is SmallMLinear:
            m.__class__ = nn.Linear
            m.__dict__.pop("max_rows", None)
            n += 1
    return n
