"""Small-M linear layers on CPU: ``W @ x^T`` instead of ``x @ W^T`` for a few rows.

Verification feeds γ + 1 rows through every linear layer of the target; plain decoding feeds
one. On CPU, ``F.linear`` (what ``nn.Linear`` calls: ``x @ W^T``) with 2-8 rows costs about
twice one row for SmolLM2's layer shapes, because the GEMM repacks ``W`` for each call, while
``W @ x^T`` streams ``W`` once in its stored layout. Measured on 2 cores over the 210 distinct
weights of SmolLM2-135M's 30 layers (out of cache, as in a real step; ``bench/head_bench.py``
measures the whole step):

==========  ==================  ===============
rows (M)    ``F.linear`` (ms)   ``W @ x^T`` (ms)
==========  ==================  ===============
1           31.0                32.2
2           61.3                32.7
4           56.2                22.2
==========  ==================  ===============

and the whole target step (30 layers and the head, 200 tokens of context) at M = 2 goes from
84-86 ms to 53-65 ms, against 55-69 ms for one row (``bench/head_bench.py --threads 2``),
so a verification step with γ = 1 costs about one plain step instead of 1.5-1.7. One row
keeps ``F.linear`` (a GEMV either way). That ratio
is the c_verify of every speedup estimate (Leviathan et al. 2023, Eq. 1 assumes it is 1).

:func:`small_m_linear` switches a model's ``nn.Linear`` modules to :class:`SmallMLinear` (the
same parameters and state dict; only ``forward`` differs, and only for at most ``max_rows``
rows of float32 on the CPU). The sums run in a different order, so outputs differ from
``F.linear`` by float32 rounding (relative 1e-6), as two BLAS kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_M = 16  # rows up to which W @ x^T is used


class SmallMLinear(nn.Linear):
    """``nn.Linear`` whose forward computes ``(W @ x^T)^T`` for 2..``max_rows`` float32 CPU rows.

    Input (..., in_features), output (..., out_features), as ``nn.Linear``. One row (plain
    decoding, the draft's proposals), more rows, another dtype or device run ``F.linear``
    exactly, so plain decoding is bit-for-bit what it was.
    """

    max_rows: int = SMALL_M

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() >= 1
                and self.in_features > 0 and not torch.is_autocast_enabled("cpu")):
            n = x.numel() // self.in_features
            if 2 <= n <= self.max_rows:
                out = (w @ x.reshape(n, self.in_features).T).T.contiguous()
                if self.bias is not None:
                    out = out + self.bias
                return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, w, self.bias)


def small_m_linear(model: nn.Module, max_rows: int = SMALL_M) -> int:
    """Make every plain ``nn.Linear`` in ``model`` a :class:`SmallMLinear`, in place.

    Idempotent; subclasses of ``nn.Linear`` (quantised or LoRA layers) are left alone, and a
    deep copy (``decoder.models.derive_draft``) keeps the class. Returns the number of modules
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
