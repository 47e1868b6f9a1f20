"""VerifiedSample encode/decode: exact round trips, sizes, and the errors readers dead-letter on."""

from __future__ import annotations

import dataclasses
import re

import msgpack
import numpy as np
import pytest

from store.schema import (
    F_BODY,
    F_FINGERPRINT,
    F_RECORD_ID,
    F_VERSION,
    F_WORKLOAD,
    SCHEMA_VERSION,
    PairFingerprint,
    SchemaError,
    decode,
    encode,
)


def test_round_trip_is_exact(sample_factory):
    s = sample_factory(seed=3)
    d = decode(encode(s))
    assert d == s
    assert d.topk_probs.dtype == np.float16 and d.topk_ids.dtype == np.int32
    np.testing.assert_array_equal(d.topk_probs.view(np.uint16), s.topk_probs.view(np.uint16))  # bit-exact
    assert d.sampling.seed == 3 and d.sampling.temperature == 0.7
    # the teacher distribution still sums to 1 within 1e-3 after float16 rounding
    total = d.topk_probs.astype(np.float32).sum(-1) + d.tail_mass
    assert np.abs(total - 1.0).max() < 1e-3


def test_round_trip_64k_tokens(sample_factory):
    s = sample_factory(n_tokens=65_536, k=32, prompt_len=4096, seed=7)
    fields = encode(s)
    d = decode(fields)
    assert d == s
    assert d.num_tokens == 65_536 and d.topk_ids.shape == (65_536, 32)
    # body carries at least the raw arrays: 65536 * 32 * (4 + 2) bytes of top-k alone
    assert len(fields[F_BODY]) > 65_536 * 32 * 6


def test_non_ascii_workload_round_trips(sample_factory):
    name = "код/編碼—ünïcødé🚀"  # no spaces: a workload name holds none (store.schema.WORKLOAD_PATTERN)
    s = sample_factory(workload=name, n_tokens=16)
    fields = encode(s)
    assert fields[F_WORKLOAD] == name.encode("utf-8")
    assert decode(fields).workload == name


def test_bytes_per_record_close_to_raw_array_size(sample_factory):
    s = sample_factory()  # γ=4, 128 tokens, top-32, 200-token prompt
    n = sum(len(k) + len(v) for k, v in encode(s).items())
    raw = 200 * 4 + 128 * 4 + 128 * 32 * (4 + 2) + 128 * 4 + 2 * 2 * len(s.proposal_lens)
    assert raw <= n <= raw + 600  # framing (msgpack, names, pair, ids) stays small


def test_fields_in_the_clear(sample_factory):
    s = sample_factory()
    f = encode(s)
    assert f[F_VERSION] == b"1"  # no hidden states: what the previous build wrote and reads
    assert encode(sample_factory(hidden_size=8))[F_VERSION] == str(SCHEMA_VERSION).encode() == b"2"
    assert f[F_RECORD_ID] == s.record_id.encode()
    assert f[F_FINGERPRINT] == s.pair.key().encode()


def test_fingerprint_key_differs_per_pair():
    a = PairFingerprint("t", "d", "h")
    assert a.key() == PairFingerprint("t", "d", "h").key()
    assert a.key() != PairFingerprint("t", "d2", "h").key()
    assert len(a.key()) == 16


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda f: f.__setitem__(F_VERSION, b"99"), "unknown schema version 99"),
        (lambda f: f.__setitem__(F_VERSION, b"one"), "is not an integer"),
        (lambda f: f.__setitem__(F_BODY, b"\xc1\xc1garbage"), "body is not decodable"),
        (lambda f: f.__setitem__(F_BODY, msgpack.packb([1, 2])), "expected a map"),
        (lambda f: f.pop(F_BODY), "missing field 'body'"),
    ],
)
def test_decode_errors_name_the_problem(sample_factory, mutate, reason):
    f = encode(sample_factory(n_tokens=8))
    mutate(f)
    with pytest.raises(SchemaError) as ei:
        decode(f)
    assert reason in ei.value.reason


def test_decode_error_on_truncated_array(sample_factory):
    f = encode(sample_factory(n_tokens=8))
    body = msgpack.unpackb(f[F_BODY], raw=False)
    body["topk_ids"][2] = body["topk_ids"][2][:-3]
    f[F_BODY] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(SchemaError, match="topk_ids"):
        decode(f)


def _body_edit(f, **kw):
    body = msgpack.unpackb(f[F_BODY], raw=False)
    for k, v in kw.items():
        if v is None:
            body.pop(k)
        else:
            body[k] = v
    f[F_BODY] = msgpack.packb(body, use_bin_type=True)
    return f


def test_source_round_trips_and_defaults_to_decode(sample_factory):
    import dataclasses

    s = sample_factory(n_tokens=8)
    assert s.source == "decode"
    pre = dataclasses.replace(s, proposal_lens=np.zeros(0), rejection_pos=np.zeros(0), source="prefill")
    assert decode(encode(pre)).source == "prefill" and decode(encode(pre)) == pre
    # a record written before the field existed (no "source" in the body) is a decode record
    assert decode(_body_edit(encode(s), source=None)).source == "decode"


def test_bad_source_is_a_schema_error(sample_factory):
    import dataclasses

    with pytest.raises(SchemaError, match="'sampled'"):
        decode(_body_edit(encode(sample_factory(n_tokens=8)), source="sampled"))
    with pytest.raises(SchemaError, match="a prefill record has no steps"):
        dataclasses.replace(sample_factory(n_tokens=8), source="prefill")


def test_hidden_states_round_trip_as_float16(sample_factory):
    s = sample_factory(n_tokens=40, hidden_size=576, seed=3)
    assert s.hidden.dtype == np.float16 and s.hidden.shape == (40, 576)
    d = decode(encode(s))
    assert d == s and d.schema_version == 2
    np.testing.assert_array_equal(d.hidden, s.hidden)
    # the cost of carrying them: 576 x 2 bytes a row on top of the schema 1 record
    plain = sum(len(k) + len(v) for k, v in encode(sample_factory(n_tokens=40, seed=3)).items())
    full = sum(len(k) + len(v) for k, v in encode(s).items())
    assert 40 * 576 * 2 <= full - plain <= 40 * 576 * 2 + 64


def test_schema_1_record_decodes_without_hidden(sample_factory):
    """A record the previous build wrote (version 1, no 'hidden' field) still decodes."""
    s = sample_factory(n_tokens=16, seed=4)
    f = encode(s)
    assert f[F_VERSION] == b"1" and b"hidden" not in f[F_BODY]
    d = decode(f)
    assert d.hidden is None and d == s


def _with_body(fields, **changes):
    body = msgpack.unpackb(fields[F_BODY], raw=False)
    body.update(changes)
    out = dict(fields)
    out[F_BODY] = msgpack.packb(body, use_bin_type=True)
    return out


@pytest.mark.parametrize("make, reason", [
    (lambda h: h[:-1], "expected (12, H)"),
    (lambda h: h.reshape(-1), "expected (12, H)"),
    (lambda h: h.astype(np.int16), "expected a float array"),
    (lambda h: np.where(np.arange(h.size).reshape(h.shape) == 5, np.float16(np.nan), h), "NaN or infinity"),
])
def test_bad_hidden_states_are_schema_errors(sample_factory, make, reason):
    from store.schema import _pack_array

    f = encode(sample_factory(n_tokens=12, hidden_size=6, seed=5))
    bad = _with_body(f, hidden=_pack_array(make(decode(f).hidden)))
    with pytest.raises(SchemaError, match=re.escape(reason)):
        decode(bad)


def test_hidden_in_a_schema_1_record_is_refused(sample_factory):
    f = encode(sample_factory(n_tokens=12, hidden_size=6, seed=6))
    f[F_VERSION] = b"1"
    with pytest.raises(SchemaError, match="schema 1 record"):
        decode(f)


def test_constructor_refuses_misaligned_hidden(sample_factory):
    s = sample_factory(n_tokens=10, seed=7)
    with pytest.raises(SchemaError, match=r"hidden has shape \(9, 4\), expected \(10, H\)"):
        dataclasses.replace(s, hidden=np.zeros((9, 4)))


def test_hidden_states_beyond_float16_are_refused_where_they_would_turn_infinite(sample_factory):
    """Checked as the record holds them (float16): a float32 70000 decodes to inf, so it is a
    SchemaError at decode (the reader dead-letters it) and at construction (the writer never
    sends a record the reader would refuse)."""
    from store.schema import _pack_array

    f = encode(sample_factory(n_tokens=12, hidden_size=6, seed=8))
    h = decode(f).hidden.astype(np.float32)
    h[5, 3] = 70000.0
    with pytest.raises(SchemaError, match="beyond float16's range"):
        decode(_with_body(f, hidden=_pack_array(h)))
    s = sample_factory(n_tokens=12, seed=8)
    for bad in (h, np.full((12, 6), np.nan)):
        with pytest.raises(SchemaError, match="NaN or infinity"):
            dataclasses.replace(s, hidden=bad)


def test_record_with_no_output_tokens_round_trips(sample_factory):
    """A request cut before its first token (N = 0) is a valid, empty record: it used to crash
    in the top-k reshape ("cannot reshape array of size 0")."""
    s = sample_factory(n_tokens=0, seed=5)
    assert s.topk_ids.shape == (0, s.topk_ids.shape[1]) and s.tail_mass.shape == (0,)
    d = decode(encode(s))
    assert d == s and d.output_ids.size == 0 and d.topk_probs.shape == s.topk_probs.shape
    flat = dataclasses.replace(s, topk_ids=np.zeros(0, np.int32), topk_probs=np.zeros(0, np.float16))
    assert flat.topk_ids.shape == (0, 0)
    with pytest.raises(SchemaError, match="no output tokens"):
        dataclasses.replace(s, topk_ids=np.zeros(4, np.int32), topk_probs=np.zeros(4, np.float16))


def test_topk_that_does_not_divide_into_rows_is_refused(sample_factory):
    s = sample_factory(n_tokens=3, k=4, seed=6)
    with pytest.raises(SchemaError, match="whole number of rows for 3"):
        dataclasses.replace(s, topk_ids=np.zeros(10, np.int32), topk_probs=np.zeros(10, np.float16))


def test_a_big_endian_array_is_read_in_its_own_byte_order(sample_factory):
    """A writer on a big-endian host (or numpy asked for '>f2') packs its bytes big-endian and
    says so; the reader used to force little-endian and read garbage probabilities."""
    s = sample_factory(n_tokens=6, k=4, seed=7)
    f = encode(s)
    body = msgpack.unpackb(f[F_BODY], raw=False)
    assert body["topk_probs"][0] == "<f2" and body["output_ids"][0] == "<i4"  # what we write
    be_probs = s.topk_probs.astype(">f2")
    be_ids = s.output_ids.astype(">i4")
    d = decode(_with_body(f, topk_probs=[">f2", list(be_probs.shape), be_probs.tobytes()],
                          output_ids=[">i4", list(be_ids.shape), be_ids.tobytes()]))
    np.testing.assert_array_equal(d.topk_probs, s.topk_probs)
    np.testing.assert_array_equal(d.output_ids, s.output_ids)
    assert d.topk_probs.dtype == np.float16 and d.topk_probs.dtype.isnative
    # and a big-endian array handed to the constructor is written little-endian, saying so
    s2 = dataclasses.replace(s, topk_probs=be_probs)
    assert msgpack.unpackb(encode(s2)[F_BODY], raw=False)["topk_probs"][0] == "<f2"
    assert decode(encode(s2)) == s
