"""Publishing a trained adapter: its metadata, saved artifact, registration, and the gate's
verdict (promote, or mark rejected). The service's rounds and the bootstrap end the same way."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from store.registry import AdapterMeta
from trainer.distill import Distiller, EvalResult


def adapter_meta(parent: int, before: EvalResult, after: EvalResult, samples: int, tokens: int, loss: float,
                 scope: str = "") -> AdapterMeta:
    """What the registry records of a candidate: its parent, training size and loss, and held-out
    alpha before (the parent's) and after. A workload's own adapter (``scope``) is evaluated on that
    workload only; a shared one per workload as well."""
    def by_workload(r: EvalResult) -> dict[str, float]:
        return {scope: r.alpha} if scope else {w: c.alpha for w, c in sorted(r.per_workload.items())}

    extra = {"scope": scope} if scope else {}
    return AdapterMeta(parent=parent, samples_trained=samples, tokens_trained=tokens, loss=loss,
                       alpha_before=before.alpha, alpha_after=after.alpha,
                       alpha_before_by_workload=by_workload(before), alpha_after_by_workload=by_workload(after), **extra)


def publish(registry: Any, distiller: Distiller, meta: AdapterMeta, promote: bool, reason: str,
            work_dir: Path | None = None, store_bytes: bool = False, judged: bool = True) -> int:
    """Save the distiller's adapter (in a temporary directory under ``work_dir``), register it
    with ``meta`` (its files also in Redis with ``store_bytes``, for decoders on other hosts), then
    promote it in its scope, or mark it rejected (``judged``: the gate turned it down) or leave it
    a candidate that can still be promoted (not ``judged``: nobody asked for a promotion), with
    ``reason``. Returns the registered version."""
    out = Path(tempfile.mkdtemp(dir=work_dir, prefix="draftd-publish-"))
    try:
        distiller.save(out / "adapter")
        version = registry.register(out / "adapter", meta, store_bytes=store_bytes)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if promote:
        registry.promote(version, reason)
    else:
        registry.set_state(version, "rejected" if judged else "candidate", reason)
    return version
