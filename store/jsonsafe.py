"""JSON-safe numbers and reports: rates are NaN on a zero denominator (see store.history), and
JSON has no NaN, so every report that leaves a process writes them as null through these two."""

from __future__ import annotations

from typing import Any


def nan_none(x: Any, nd: int | None = None) -> Any:
    """None for None, NaN or ±inf (JSON has neither), else ``x`` (rounded to ``nd`` digits when given)."""
    if x is None or x != x or (isinstance(x, float) and x in (float("inf"), float("-inf"))):
        return None
    return x if nd is None else round(x, nd)


def jsonable(x: Any) -> Any:
    """``x`` made JSON-ready: NaN -> None, tuples -> lists, dict keys -> str, objects -> their
    ``__dict__``, anything else not JSON -> ``str(x)``."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "__dict__"):
        return jsonable(x.__dict__)
    return str(x)
