"""The draft's copy channel: a pointer-generator mixture over the draft's distribution.

    q_mix(x) = (1 - λ) q_draft(x) + λ · 1[x = c]

(See, Liu & Manning 2017, "Get To The Point", eq. 9, with the attention distribution replaced by
a single pointer: the copy candidate c; cf. CopySpec and SuffixDecoding, which propose the same
continuation of a context match for speculative decoding.) ``c`` is the token that followed the
most recent earlier occurrence of the longest suffix of the context (prompt + output so far) up
to ``MAX_MATCH`` tokens long; without such an occurrence there is no candidate and λ = 0.
λ = sigmoid(w · f) with the features ``FEATURES`` of :func:`copy_features`; ``w`` belongs to an
adapter version (``GATE_FILE`` beside its peft files).

This module is numpy-only and sits in ``store`` so that both the trainer (every position of a
record) and the decoder (at proposal time) compute the candidate and the features with the
very same functions, without either importing the other.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

MAX_MATCH = 8  # longest context suffix matched, tokens
FEATURES = ("bias", "match_len_over_8", "match_len_ge_2", "match_len_ge_4", "q_draft_c", "q_draft_max")
GATE_FILE = "copy_gate.json"  # written beside an adapter's peft files when it carries a gate
GATE_FORMAT = 1


class CopyGateError(ValueError):
    """A copy gate file that cannot be used: the message names the file and the field."""


def copy_candidate(ids, end: int | None = None, max_n: int = MAX_MATCH) -> tuple[int, int]:
    """The copy candidate after ``ids[: end + 1]`` (the context; ``end`` defaults to its last index).

    The longest suffix of the context, up to ``max_n`` tokens, that also ends at an earlier index
    j < end (occurrences may overlap the suffix); of the occurrences of that longest length the
    most recent (largest j); the candidate is ``ids[j + 1]``, the token that followed it.

    Args:
        ids: (T,) token ids (a list or a 1-D integer array); only ``ids[: end + 1]`` is read.
        end: index of the context's last token, 0 <= end < T.
        max_n: longest suffix matched, >= 1.

    Returns:
        (c, ℓ): the candidate token id and the matched length ℓ in 1..max_n, or (-1, 0) when no
        suffix of the context occurred before (always for a context of one token).

    Raises:
        ValueError: ``end`` outside 0..T-1 or ``max_n`` < 1.
    """
    arr = np.asarray(ids)
    t = len(arr) - 1 if end is None else int(end)
    if not 0 <= t < len(arr):
        raise ValueError(f"end={end!r}: need 0 <= end < {len(arr)} (the context's last index)")
    if max_n < 1:
        raise ValueError(f"max_n={max_n!r}: need >= 1")
    if t == 0:
        return -1, 0
    # run[j]: the suffix of length i + 1 ending at t also ends at j (j = 0..t-1)
    run = arr[:t] == arr[t]
    length = run.astype(np.int64)
    for i in range(1, min(max_n, t)):  # a suffix ending at j < t has at most t tokens
        eq = np.zeros(t, dtype=bool)
        eq[i:] = arr[: t - i] == arr[t - i]
        run &= eq
        if not run.any():
            break
        length += run
    best = int(length.max())
    if best == 0:
        return -1, 0
    j = int(np.flatnonzero(length == best)[-1])
    return int(arr[j + 1]), best


def copy_candidates(ids, ends, max_n: int = MAX_MATCH) -> tuple[np.ndarray, np.ndarray]:
    """:func:`copy_candidate` at each index of ``ends``: candidates (E,) int64 (-1: none) and
    matched lengths (E,) int64 (0: none)."""
    out = [copy_candidate(ids, int(e), max_n) for e in ends]
    if not out:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    c, n = zip(*out)
    return np.asarray(c, dtype=np.int64), np.asarray(n, dtype=np.int64)


def copy_features(match_len, q_c, q_max, max_n: int = MAX_MATCH) -> np.ndarray:
    """The gate's features f, one row per position, in the order of ``FEATURES``:
    1, min(ℓ, max_n) / max_n, 1[ℓ >= 2], 1[ℓ >= 4], q_draft(c), max_x q_draft(x).

    Args:
        match_len: (N,) matched lengths ℓ (0: no candidate).
        q_c: (N,) the draft's probability of the candidate (temperature 1, over its served
            vocabulary: 0 for a candidate outside it).
        q_max: (N,) the draft's largest probability.

    Returns:
        (N, 6) float64.
    """
    n = np.asarray(match_len, dtype=np.float64).reshape(-1)
    qc = np.asarray(q_c, dtype=np.float64).reshape(-1)
    qm = np.asarray(q_max, dtype=np.float64).reshape(-1)
    return np.stack([np.ones_like(n), np.minimum(n, max_n) / max_n, (n >= 2).astype(np.float64),
                     (n >= 4).astype(np.float64), qc, qm], axis=-1)


def copy_lambda(w, features, match_len) -> np.ndarray:
    """λ = sigmoid(f · w) per row, 0 where there is no candidate (ℓ = 0).

    Args:
        w: (6,) gate weights.
        features: (N, 6) from :func:`copy_features`.
        match_len: (N,) matched lengths.

    Returns:
        (N,) float64 in [0, 1).
    """
    z = np.asarray(features, dtype=np.float64) @ np.asarray(w, dtype=np.float64)
    lam = np.where(z >= 0, 1.0 / (1.0 + np.exp(-np.abs(z))), np.exp(-np.abs(z)) / (1.0 + np.exp(-np.abs(z))))
    return np.where(np.asarray(match_len).reshape(-1) > 0, lam, 0.0)


def mix_argmax(top: int, q_max: float, c: int, q_c: float, lam: float) -> int:
    """argmax_x q_mix(x) for q_mix = (1 - λ) q + λ 1[x = c], from q's argmax ``top`` (its
    probability ``q_max``) and the candidate's q(c): c when (1 - λ) q(c) + λ > (1 - λ) q_max or c
    is ``top`` itself; on an exact tie the lower id (torch's and numpy's argmax). Without a
    candidate (c < 0) or λ = 0: ``top``."""
    if c < 0 or lam <= 0.0 or c == top:
        return top
    a, b = (1.0 - lam) * q_c + lam, (1.0 - lam) * q_max
    if a > b or (a == b and c < top):
        return c
    return top


def save_gate(directory: str | Path, w) -> Path:
    """Write ``GATE_FILE`` in ``directory`` with the weights ``w`` (6,); returns its path.

    Raises:
        CopyGateError: ``w`` is not 6 finite numbers.
    """
    arr = np.asarray(w, dtype=np.float64).reshape(-1)
    if arr.shape != (len(FEATURES),) or not np.isfinite(arr).all():
        raise CopyGateError(f"copy gate weights: need {len(FEATURES)} finite numbers, got {arr.tolist()}")
    path = Path(directory) / GATE_FILE
    path.write_text(json.dumps({"format": GATE_FORMAT, "max_match": MAX_MATCH, "features": list(FEATURES),
                                "w": [float(x) for x in arr]}))
    return path


def load_gate(directory: str | Path) -> np.ndarray | None:
    """The gate weights (6,) float64 in ``directory`` (an adapter's), or None when it has no
    ``GATE_FILE`` (an adapter trained without the copy channel: λ = 0).

    Raises:
        CopyGateError: the file is unreadable, of another format, names other features or match
            length, or its weights are not 6 finite numbers.
    """
    path = Path(directory) / GATE_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CopyGateError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(d, dict) or d.get("format") != GATE_FORMAT:
        raise CopyGateError(f"{path}: format {d.get('format') if isinstance(d, dict) else d!r}, this build reads "
                            f"format {GATE_FORMAT}")
    if d.get("features") != list(FEATURES) or d.get("max_match") != MAX_MATCH:
        raise CopyGateError(f"{path}: features {d.get('features')} / max_match {d.get('max_match')}, this build "
                            f"computes {list(FEATURES)} / {MAX_MATCH}")
    w = d.get("w")
    if (not isinstance(w, list) or len(w) != len(FEATURES)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in w)):
        raise CopyGateError(f"{path}: w={w!r}, need {len(FEATURES)} finite numbers")
    return np.asarray(w, dtype=np.float64)
