"""The copy channel's shared functions (store/copy_channel.py) on hand-worked token sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from store.copy_channel import (FEATURES, CopyGateError, copy_candidate, copy_candidates, copy_features, copy_lambda,
                                load_gate, mix_argmax, save_gate)


def test_candidate_follows_the_longest_earlier_suffix():
    # (9, 6, 7) never occurred before; (6, 7) ends at index 2 -> it was followed by ids[3] = 8
    assert copy_candidate([5, 6, 7, 8, 9, 6, 7]) == (8, 2)
    # (1,) ends at 0 and at 3, (4, 1) never before: the most recent occurrence (3) -> ids[4] = 4
    assert copy_candidate([1, 2, 3, 1, 4, 1]) == (4, 1)
    # an overlapping occurrence counts: (7, 7) ends at 1 -> ids[2] = 7
    assert copy_candidate([7, 7, 7]) == (7, 2)
    # a longer match beats a more recent shorter one: (2, 3) ends at 2 (-> 9); (3,) also ends at 4 (-> 5)
    assert copy_candidate([1, 2, 3, 9, 3, 5, 2, 3]) == (9, 2)
    # no earlier occurrence, and a single-token context
    assert copy_candidate([1, 2, 3]) == (-1, 0)
    assert copy_candidate([4]) == (-1, 0)


def test_candidate_match_is_capped_at_max_n():
    seq = list(range(10)) + list(range(10))  # the second half repeats the first
    # the context up to index 18 ends with 0..8, a 9-token repeat: capped at 8, followed by 9
    assert copy_candidate(seq, 18) == (9, 8)
    assert copy_candidate(seq, 18, max_n=3) == (9, 3)
    # end=10 (context 0..9, 0): (0,) ended at index 0 -> ids[1] = 1
    assert copy_candidate(seq, 10) == (1, 1)
    with pytest.raises(ValueError, match="end"):
        copy_candidate(seq, 20)


def test_candidates_at_every_position_match_one_by_one():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1]
    c, n = copy_candidates(seq, range(len(seq)))
    assert [(int(a), int(b)) for a, b in zip(c, n)] == [copy_candidate(seq[: e + 1]) for e in range(len(seq))]
    # by hand: position 3 (…4, 1): (1,) ended at 1 -> 4; position 13 (…1, 4, 1): (1, 4, 1) ended at 3 -> 5
    assert (c[3], n[3]) == (4, 1) and (c[13], n[13]) == (5, 3)
    assert (c[0], n[0]) == (-1, 0)


def test_features_and_lambda_hand_worked():
    f = copy_features([0, 1, 3, 12], [0.1, 0.2, 0.0, 0.5], [0.9, 0.6, 0.3, 0.5])
    assert f.shape == (4, len(FEATURES))
    np.testing.assert_allclose(f, [[1, 0, 0, 0, 0.1, 0.9],
                                   [1, 1 / 8, 0, 0, 0.2, 0.6],
                                   [1, 3 / 8, 1, 0, 0.0, 0.3],
                                   [1, 1.0, 1, 1, 0.5, 0.5]])
    w = [-1.0, 0.0, 1.0, 2.0, 0.0, 0.0]
    lam = copy_lambda(w, f, [0, 1, 3, 12])
    # z = -1, -1, 0, 2; no candidate at row 0 -> 0
    np.testing.assert_allclose(lam, [0.0, 1 / (1 + math.e), 0.5, 1 / (1 + math.exp(-2))])
    # a very negative or positive z stays finite
    big = copy_lambda([1000.0, 0, 0, 0, 0, 0], f[:2], [1, 1])
    np.testing.assert_allclose(big, [1.0, 1.0])
    assert copy_lambda([-1000.0, 0, 0, 0, 0, 0], f[1:2], [1])[0] == 0.0


def test_mix_argmax_hand_worked():
    # q: top id 5 at 0.6, candidate 2 at 0.1; λ = 0.5: 0.5 * 0.1 + 0.5 = 0.55 > 0.30 = 0.5 * 0.6 -> 2
    assert mix_argmax(5, 0.6, 2, 0.1, 0.5) == 2
    # λ = 0.3: 0.7 * 0.1 + 0.3 = 0.37 < 0.42 = 0.7 * 0.6 -> 5
    assert mix_argmax(5, 0.6, 2, 0.1, 0.3) == 5
    # an exact tie, λ = 0.5, q_max = 1, q(c) = 0: 0.5 * 0 + 0.5 == 0.5 * 1 -> the lower id
    assert mix_argmax(5, 1.0, 2, 0.0, 0.5) == 2 and mix_argmax(1, 1.0, 2, 0.0, 0.5) == 1
    assert mix_argmax(5, 0.6, -1, 0.0, 0.9) == 5 and mix_argmax(5, 0.6, 2, 0.1, 0.0) == 5


def test_gate_file_roundtrip_and_refusals(tmp_path):
    assert load_gate(tmp_path) is None
    save_gate(tmp_path, [0.5, 1, 2, 3, -1, -2])
    np.testing.assert_array_equal(load_gate(tmp_path), [0.5, 1, 2, 3, -1, -2])
    with pytest.raises(CopyGateError, match="finite"):
        save_gate(tmp_path, [float("nan")] * 6)
    (tmp_path / "copy_gate.json").write_text('{"format": 1, "max_match": 8, "features": %s, "w": [1, 2]}'
                                             % str(list(FEATURES)).replace("'", '"'))
    with pytest.raises(CopyGateError, match="w="):
        load_gate(tmp_path)
    (tmp_path / "copy_gate.json").write_text('{"format": 2}')
    with pytest.raises(CopyGateError, match="format"):
        load_gate(tmp_path)
    (tmp_path / "copy_gate.json").write_text("not json")
    with pytest.raises(CopyGateError, match="JSON"):
        load_gate(tmp_path)
