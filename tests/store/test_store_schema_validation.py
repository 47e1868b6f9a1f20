"""Entries that msgpack-decode but carry data the trainer must not use (NaN or out-of-range
probabilities, rows not lined up with the output, negative or float token ids, wrong scalar
types) raise SchemaError naming the field, so the reader dead-letters them instead of
delivering them."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from store.buffer import SampleReader, list_dead_letters
from store.schema import F_BODY, F_RECORD_ID, F_WORKLOAD, SchemaError, decode, encode


def _arr(a: np.ndarray) -> list:
    return [a.dtype.str, list(a.shape), a.tobytes()]


def _with(fields: dict, **changes) -> dict:
    body = msgpack.unpackb(fields[F_BODY], raw=False)
    body.update(changes)
    return {**fields, F_BODY: msgpack.packb(body, use_bin_type=True)}


N, K = 8, 4

BAD = {
    "nan probs": (dict(topk_probs=_arr(np.full((N, K), np.nan, np.float16))), "NaN"),
    "probs > 1": (dict(topk_probs=_arr(np.full((N, K), 2.0, np.float16))), "outside [0, 1]"),
    "rows misaligned": (
        dict(topk_ids=_arr(np.zeros((1, N * K), np.int32)), topk_probs=_arr(np.full((1, N * K), 0.01, np.float16))),
        "one row per output token",
    ),
    "negative ids": (dict(output_ids=_arr(np.full(N, -5, np.int32))), "outside 0.."),
    "float prompt ids": (dict(prompt_ids=_arr(np.array([1.7, 2.2, 1e12]))), "expected an integer array"),
    "2-D prompt": (dict(prompt_ids=_arr(np.zeros((2, 3), np.int32))), "expected 1-D"),
    "request_id int": (dict(request_id=123), "'request_id'"),
    "started_at str": (dict(started_at="yesterday"), "'started_at'"),
    "pair ints": (dict(pair=[1, 2, 3]), "'pair'"),
    "adapter_version -1": (dict(adapter_version=-1), "'adapter_version'"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_decode_refuses(sample_factory, name):
    changes, needle = BAD[name]
    f = _with(encode(sample_factory(n_tokens=N, k=K)), **changes)
    with pytest.raises(SchemaError) as ei:
        decode(f)
    assert needle in ei.value.reason


def test_rid_and_workload_encoding_named(sample_factory):
    f = encode(sample_factory(n_tokens=N, k=K))
    with pytest.raises(SchemaError, match="'rid'"):
        decode({**f, F_RECORD_ID: b"\xff\xfe"})
    with pytest.raises(SchemaError, match="'w'"):
        decode({**f, F_WORKLOAD: b"\xff\xfe"})


def test_valid_sample_still_round_trips(sample_factory):
    s = sample_factory(n_tokens=N, k=K)
    assert decode(encode(s)) == s
    empty_k = sample_factory(n_tokens=N, k=0)
    assert decode(encode(empty_k)) == empty_k


def test_reader_dead_letters_them(client, cfg, sample_factory):
    good = encode(sample_factory(n_tokens=N, k=K))
    ids = {}
    for name, (changes, _) in BAD.items():
        ids[client.xadd(cfg.keys.stream, _with({**good, F_RECORD_ID: name.replace(" ", "-").encode()}, **changes))] = name
    ids[client.xadd(cfg.keys.stream, good)] = "good"
    r = SampleReader(client, cfg, "g", "c1")
    got = r.read(100)
    assert [ids[e.entry_id] for e in got] == ["good"]
    dead = {ids[d.source_id]: d.reason for d in list_dead_letters(client, cfg)}
    assert set(dead) == set(BAD)
    for name, (_, needle) in BAD.items():
        assert needle in dead[name]
