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
    # issue 37 item 5: rows that are no distribution's top k (the probe's sums of 32 and of 0)
    "rows sum to 4": (dict(topk_probs=_arr(np.full((N, K), 1.0, np.float16))), "row 0 sums to 4"),
    "rows sum to 0": (dict(topk_probs=_arr(np.zeros((N, K), np.float16))), "row 0 sums to 0"),
    "one row sums to 1.5": (dict(topk_probs=_arr(np.vstack([np.full((N - 1, K), 0.2), np.full((1, K), 0.375)])
                                                 .astype(np.float16))), f"row {N - 1} sums to 1.5"),
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


# issue 37 item 5: the workload names serve refuses are refused in the store too (one rule, store.schema)
BAD_WORKLOADS = {"a@b": "'@'", " padded": "surrounding spaces", "x" * 65: "longer than 64", "tab\there": "control"}


@pytest.mark.parametrize("tag", sorted(BAD_WORKLOADS))
def test_decode_refuses_a_workload_serve_refuses(sample_factory, tag):
    from daemon.serve import ApiError, _workload

    f = encode(sample_factory(n_tokens=N, k=K))
    with pytest.raises(SchemaError) as ei:
        decode({**f, F_WORKLOAD: tag.encode()})
    assert BAD_WORKLOADS[tag] in ei.value.reason and "workload" in ei.value.reason
    with pytest.raises(ApiError) as ae:
        _workload({"workload": tag}, None)
    assert BAD_WORKLOADS[tag] in ae.value.message


def test_the_reader_dead_letters_impossible_distributions_and_workloads(client, cfg, sample_factory):
    """80 records (sums of 32 and of 0, and a workload of 'a@b') beside 20 good ones: the 20 are
    delivered, the 80 dead-lettered with their reason."""
    k = 32
    good = [sample_factory(n_tokens=N, k=k, seed=i) for i in range(20)]
    ids = {client.xadd(cfg.keys.stream, encode(s)): "good" for s in good}
    for i in range(80):
        f = encode(sample_factory(n_tokens=N, k=k, seed=100 + i))
        if i % 3 == 0:
            f, why = _with(f, topk_probs=_arr(np.full((N, k), 1.0, np.float16))), "sums to 32"
        elif i % 3 == 1:
            f, why = _with(f, topk_probs=_arr(np.zeros((N, k), np.float16))), "sums to 0"
        else:
            f, why = {**f, F_WORKLOAD: b"a@b"}, "'@'"
        ids[client.xadd(cfg.keys.stream, f)] = why
    r = SampleReader(client, cfg, "g", "c1")
    got = []
    while batch := r.read(200, block_ms=None):
        got += batch
    assert len(got) == 20 and all(ids[e.entry_id] == "good" for e in got)
    dead = list_dead_letters(client, cfg, count=1000)
    assert len(dead) == 80
    for d in dead:
        assert ids[d.source_id] in d.reason, d.reason
