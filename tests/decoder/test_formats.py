"""The served weight format (decoder/models/formats.py, ``models.format``): the choice from hand-made
cost tables (expected goodput computed by hand from Leviathan et al.'s eq. 1), the measurement's
cache, the pin, a bad value, one real measurement on a tiny GGUF (structure only: nothing here is
timed), records naming the format, and greedy speculation on a served F16 copy equal to plain
decoding of that copy."""

from __future__ import annotations

import json
import os

import pytest

from decoder.engines.llamacpp_lib import llamacpp_available
from decoder.models import formats as F
from decoder.models.formats import FormatCost, FormatMeasurement, choose_format, expected_tokens, speculative_goodput

needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


def table(**ms) -> FormatMeasurement:
    """A measurement from {format: {n: ms}}; ``draft_ms`` and row identity through keywords."""
    draft_ms = ms.pop("draft_ms", None)
    differ = ms.pop("differ", ())
    fm = {f: FormatCost(f, f"{f}.gguf", dict(v), f not in differ, 0.15 if f in differ else 0.0) for f, v in ms.items()}
    return FormatMeasurement({"model": "m"}, fm, draft_ms)


PACKAGED_10 = {n: 10.0 + 8.0 * (n - 1) for n in range(1, 9)}  # a verified row costs 0.8 of a 10 ms step
F16_CHEAP = {n: 12.0 + n for n in range(1, 9)}  # 13 ms a step, 1 ms a row


def test_expected_tokens_is_leviathans_eq_1():
    assert expected_tokens(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / 0.5) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5 and expected_tokens(0.3, 0) == 1
    # the packaged file: α 0.6, nothing beats its plain step (γ = 1: 1.6 / 18 = 0.0889 < 0.1)
    assert speculative_goodput(PACKAGED_10, 0.6) == (pytest.approx(0.1), 0)


def test_a_format_with_cheap_rows_serves_at_its_best_gamma():
    """F16: 13 ms a step, 1 ms per extra row, α 0.6: E/t = 1.6/14, 1.96/15, 2.176/16, 2.3056/17, ...
    -> γ = 3 at 0.136 tokens/ms, 1.36x the packaged file's 10 ms plain step."""
    c = choose_format(table(packaged=PACKAGED_10, F16=F16_CHEAP), alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "F16" and c.path.name == "F16.gguf" and c.setting == "auto"
    row = {r["format"]: r for r in c.costs}
    assert row["F16"]["best"]["gamma"] == 3 and row["F16"]["best"]["tokens_per_ms"] == pytest.approx(2.176 / 16, abs=1e-5)
    assert row["F16"]["best"]["vs_packaged_plain"] == pytest.approx(1.36, abs=1e-3)
    assert row["packaged"]["best"]["gamma"] == 0 and row["packaged"]["best"]["tokens_per_ms"] == pytest.approx(0.1)
    # "x the tokens per ms of plain decoding", not "x the packaged file's plain step" (read as a longer step)
    assert ("F16 expects 0.1360 tokens/ms (ngram γ=3 at α 0.60), 1.36x the tokens per ms of plain decoding of the "
            "packaged file (packaged.gguf, 10.00 ms a step)") in c.reason, c.reason


def test_the_packaged_file_serves_unless_a_format_beats_its_plain_step_by_the_margin():
    """F16 at 12 ms a step, 15.5 ms for 2 rows, α 0.6: 1.6 / 15.5 = 0.1032 tokens/ms, 1.032x the
    packaged plain step: under the 5 % margin the packaged file serves; with no margin F16 does."""
    m = table(packaged={1: 10.0, 2: 18.0}, F16={1: 12.0, 2: 15.5})
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and c.path.name == "packaged.gguf"
    assert "no format beats plain decoding of the packaged file" in c.reason and "best F16: 1.03x" in c.reason
    assert choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",), margin=0.0).format == "F16"
    # slower rows everywhere: plain decoding of the packaged file is the best there is
    slow = choose_format(table(packaged=PACKAGED_10, F16={n: 19.0 + n for n in range(1, 9)}), alphas={"ngram": 0.6},
                         proposers=("ngram",))
    assert slow.format == "packaged" and {r["format"]: r for r in slow.costs}["F16"]["best"]["tokens_per_ms"] == \
        pytest.approx(2.3056 / 24, abs=1e-5)  # γ = 4, 0.961x
    # the reason names what the packaged file's plain decoding was measured at, not 1.00x of itself (a walkthrough
    # read "the packaged file is the best (plain decoding: 1.00x the tokens per ms of its plain decoding)")
    assert ("the packaged file is the best: its plain decoding (0.1000 tokens/ms, 10.00 ms a step) beats every other "
            "format's best (each as a multiple of it): F16 0.96x") in slow.reason, slow.reason
    assert "1.00x" not in slow.reason
    # speculation on the packaged file wins: the others' figures say what they are multiples of, and the step's
    # context is named (a walkthrough read "F16 0.57x; Q8_0 0.94x" of nothing said, at a step 1.36x its live one)
    spec = table(packaged={1: 10.0, 2: 12.0}, F16={1: 20.0, 2: 22.0})
    spec.cached_tokens = 300
    c = choose_format(spec, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and c.reason == (
        "measured: the packaged file is the best, with ngram γ=1 at α 0.60: 1.33x the tokens per ms of its own plain "
        "decoding (10.00 ms a step after 300 cached tokens); the other formats' best, each as a multiple of the packaged "
        "file's plain decoding, not of the 1.33x: F16 0.73x"), \
        c.reason


def test_a_model_proposer_pays_gamma_c_and_formats_whose_rows_differ_are_left_out():
    """Draft at α 0.8 and c = 2 ms on F16_CHEAP: E / (13 + γ + 2γ) = 1.8/16, 2.44/19, 2.952/22,
    3.3616/25, 3.68928/28 -> γ = 4. BF16, cheaper still, is left out: its batched rows differ."""
    m = table(packaged=PACKAGED_10, F16=F16_CHEAP, BF16={n: 5.0 + n for n in range(1, 9)}, draft_ms=2.0, differ=("BF16",))
    c = choose_format(m, alphas={"draft": 0.8}, proposers=("draft", "eagle"))  # no α for eagle: not priced
    row = {r["format"]: r for r in c.costs}
    assert c.format == "F16" and row["F16"]["best"] == {"proposer": "draft", "gamma": 4, "alpha": 0.8,
                                                        "tokens_per_ms": pytest.approx(3.3616 / 25, abs=1e-5),
                                                        "vs_packaged_plain": pytest.approx(1.345, abs=1e-3)}
    assert row["BF16"]["eligible"] is False and "differ from its one-row steps" in row["BF16"]["why_not"]
    assert "BF16 left out" in c.reason
    # without a measured draft step the draft is not priced: F16's plain step alone loses
    m.draft_ms = None
    assert choose_format(m, alphas={"draft": 0.8}, proposers=("draft",)).format == "packaged"


def test_a_noisy_measurement_is_left_out_and_costs_never_fall_with_rows():
    """A busy host: a format whose typical repeat is 1.5x its fastest is left out; a noisy packaged
    measurement keeps the packaged file. A median that falls with n is noise: F16 at 13, 25, 14 ms
    for 1, 2, 3 rows is priced 13, 25, 25 (α 0.6: 1 / 13 = 0.0769 plain, γ = 1 1.6 / 25 = 0.064,
    γ = 2 1.96 / 25 = 0.0784; at 14 ms it would have been 1.96 / 14 = 0.14)."""
    m = table(packaged=PACKAGED_10, F16=F16_CHEAP)
    m.formats["F16"].noise = 0.5
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and "F16 left out (the measurement was noisy: a typical repeat took 1.50x" in c.reason
    m.formats["F16"].noise, m.formats["packaged"].noise = 0.0, 0.8
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and c.reason.startswith("the packaged file's measurement cannot be trusted (the measurement was noisy")
    m.formats["packaged"].noise, m.formats["F16"].repeats, m.reps = 0.0, 1, 5  # the time budget ran out after 1 repeat
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and "F16 left out (only 1 repeat(s) fit in the measurement's time budget" in c.reason
    dips = choose_format(table(packaged=PACKAGED_10, F16={1: 13.0, 2: 25.0, 3: 14.0}), alphas={"ngram": 0.6},
                         proposers=("ngram",), margin=0.0)
    f16 = {r["format"]: r for r in dips.costs}["F16"]
    assert f16["best"]["gamma"] == 2 and f16["best"]["tokens_per_ms"] == pytest.approx(1.96 / 25, abs=1e-5)
    assert dips.format == "packaged" and f16["ms"]["3"] == 14.0  # shown as measured


def test_a_noisy_measurement_with_per_repeat_samples_is_judged_on_its_paired_ratio():
    """The fourteenth session's fresh run: measured as the build's load fell, the packaged file's typical
    repeat 1.49x its fastest, so no format was judged. Samples paired per repeat see a move of load on
    both files alike: Q8_0 at 0.8 of the packaged step in every repeat (10, 14, 14, 15, 10, 14 ms
    against 8, 11.2, 11.2, 12, 8, 11.2; noise 14 / 10 - 1 = 0.4 on both) is 1.25x in each pair, an
    interval [1.25, 1.25]: it serves, and the reason says the times moved. Pairs that do not separate
    (1.25, 1.27, 0.93, 1.25, 0.83, 1.27) keep the packaged file."""
    pk = [10.0, 14.0, 14.0, 15.0, 10.0, 14.0]
    q8 = [0.8 * x for x in pk]

    def noisy(q8_samples):
        fm = {}
        for f, v in (("packaged", pk), ("Q8_0", q8_samples)):
            med = sorted(v)[2:4]
            fm[f] = FormatCost(f, f"{f}.gguf", {1: sum(med) / 2}, True, 0.0, noise=sum(med) / 2 / min(v) - 1.0,
                               repeats=6, samples={1: list(v)})
        # left out for its rows (noisy too): not named among the files judged whose times moved
        fm["F16"] = FormatCost("F16", "F16.gguf", {1: 9.0, 2: 9.5}, False, 0.1, noise=0.9, repeats=6,
                               samples={1: [9.0] * 6, 2: [9.5] * 6})
        return FormatMeasurement({"model": "m"}, fm, None, reps=5)

    c = choose_format(noisy(q8), alphas={}, proposers=())
    assert c.format == "Q8_0", c.reason
    assert c.paired["ratio"] == pytest.approx(1.25) and c.paired["low"] == pytest.approx(1.25) and c.paired["pairs"] == 6
    assert ("Q8_0 serves on its ratio paired per repeat, 1.25x [1.25, 1.25] the tokens per ms of plain decoding of the "
            "packaged file (packaged.gguf, 14.00 ms a step) over 6 repeats, the interval that decided (above 1.00, the "
            "ratio at 1.05x or more); on the medians it expects") in c.reason, c.reason
    assert c.reason.endswith("the step times moved during the measurement (a typical repeat over the fastest: packaged "
                             "1.40x, Q8_0 1.40x): a format is judged on its ratio paired per repeat, which sees the move "
                             "on both files alike, and it is measured again at the next start"), c.reason
    wide = choose_format(noisy([8.0, 11.0, 15.0, 12.0, 12.0, 11.0]), alphas={}, proposers=())
    assert wide.format == "packaged" and wide.paired["low"] < 1.0 and "not surely 5% faster" in wide.reason


def test_a_format_that_failed_to_measure_is_left_out_with_its_error():
    m = table(packaged=PACKAGED_10, F16=F16_CHEAP)
    m.formats["Q8_0"] = FormatCost("Q8_0", "", error="RuntimeError: llama_model_quantize returned 1")
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "F16" and "Q8_0 left out (RuntimeError: llama_model_quantize returned 1)" in c.reason
    with pytest.raises(ValueError, match="no plain step of the packaged file"):
        choose_format(table(F16=F16_CHEAP))


def test_the_prior_alpha_is_documented_and_the_measurement_round_trips_json():
    import inspect

    import decoder.proposers.ngram as ngram

    assert F.prior_alphas() == {"ngram": 0.66, "draft": 0.20}  # eagle: not priced
    assert '"Consequence for the n-gram proposer"' in inspect.getsource(ngram)  # where the n-gram prior comes from
    m = table(packaged=PACKAGED_10, F16=F16_CHEAP, draft_ms=2.0)
    back = FormatMeasurement.from_json(json.loads(json.dumps(m.to_json())))
    assert back.formats["F16"].ms == F16_CHEAP and back.draft_ms == 2.0


# ---- the setting --------------------------------------------------------------------------------


@needs_llamacpp
def test_a_bad_format_names_the_value_and_the_valid_ones():
    from pydantic import ValidationError

    from daemon.settings import ModelSettings
    from decoder.engines.base import EngineError
    from decoder.engines.registry import choose_engine

    assert F.format_setting(" f16") == "F16" and F.format_setting("AUTO") == "auto" and F.format_setting("Packaged") == "packaged"
    with pytest.raises(ValueError, match=r"models.format 'q9' is not a weight format: use 'auto' \(measured\), "
                                         r"'packaged' or one of llama.cpp's: .*F16.*Q8_0"):
        F.format_setting("q9")
    with pytest.raises(ValidationError, match=r"models.format 'q9' is not a weight format"):
        ModelSettings(format="q9")
    assert ModelSettings().format == "auto" and ModelSettings(format="q8_0").format == "Q8_0"
    with pytest.raises(EngineError, match="'q9' is not a weight format"):
        choose_engine("llamacpp", "smollm2-135m", target_format="q9")


@pytest.fixture
def tiny_pkg(tmp_path, monkeypatch):
    """A tiny F32 GGUF registered as the built-in ``tiny-pkg``, the cache under tmp_path."""
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    import decoder.models.loading as M
    import decoder.models.packaged as P
    from decoder.models.packaged import PackagedModel
    from test_gguf_export import tiny_model, write_tiny_gguf

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf", extra=False)
    monkeypatch.setitem(P.PACKAGED, "tiny-pkg", PackagedModel("tiny-pkg", "tiny_pkg", "pip install tiny-pkg"))
    monkeypatch.setattr(M, "packaged_gguf", lambda name: src)
    monkeypatch.setattr(P, "packaged_gguf", lambda name: src)
    return src


def test_a_pinned_format_is_served_without_measuring(tiny_pkg, monkeypatch):
    monkeypatch.setattr(F, "measure_formats", lambda *a, **k: pytest.fail("a pinned format is not measured"))
    c = F.resolve_format("f16", "tiny-pkg")
    assert c.format == "F16" and c.setting == "F16" and c.path.name.endswith("-F16.gguf") and "pinned" in c.reason
    p = F.resolve_format("packaged", "tiny-pkg")
    assert p.format == "packaged" and p.path == tiny_pkg
    named = F.resolve_format("auto", "tiny-pkg@bf16")  # the reference names its format: the setting does not apply
    assert named.format == "BF16" and named.path.name.endswith("-BF16.gguf") and "named in models.target" in named.reason
    assert F.resolve_format("auto", str(tiny_pkg)) is None  # a path: served as given


def test_a_pinned_format_whose_rows_differ_says_it_is_not_lossless_here(tiny_pkg, monkeypatch):
    """A break session pinned BF16 on a Zen 5: a verification's rows differed from one-row steps (the
    measurement's own check had left it out of auto), and served greedy output changed with speculation,
    batching and the prompt cache while the reason read only "pinned". A pinned format's rows are
    checked on the served engine at start: the reason says NOT LOSSLESS with the difference and the fix."""
    import numpy as np
    import torch

    from decoder.engines.llamacpp import LlamaCppEngine

    c = F.resolve_format("f16", "tiny-pkg")
    eng = LlamaCppEngine(c.path, n_ctx=256, threads=1)
    try:
        F.check_pinned_rows(c, eng, rows=4, cached=8)
        # independently: the same 4 rows as one block and one at a time on a fresh sequence
        s = eng.start()
        s.forward([(100 + i) % eng.vocab_size for i in range(8)], 1)
        toks = [(5 + 7 * j) % eng.vocab_size for j in range(4)]
        block = s.forward(toks, 4).numpy()
        s.truncate(8)
        single = np.stack([s.forward([x], 1).numpy()[0] for x in toks])
        s.release()
    finally:
        eng.close()
    want = float(np.abs(block - single).max())
    assert c.row_max_abs_diff == want and c.rows_identical == (want == 0.0)
    assert ("NOT LOSSLESS" in c.reason) == (want != 0.0), c.reason
    assert c.describe()["rows_identical"] == c.rows_identical

    class Seq:  # rows that differ from one-row steps by 0.25 in one logit
        def forward(self, ids, n):
            out = torch.zeros(n, 5)
            if len(ids) > 1:
                out[-1, 2] = 0.25
            return out

        def truncate(self, n):
            pass

        def release(self):
            pass

    eng = type("Eng", (), {"vocab_size": 5, "start": lambda self: Seq()})()
    bf = F.resolve_format("bf16", "tiny-pkg")
    F.check_pinned_rows(bf, eng)
    assert bf.rows_identical is False and bf.row_max_abs_diff == 0.25
    assert ("pinned (models.format=BF16); NOT LOSSLESS on this CPU: a verification of 8 rows gives logits that differ "
            "from the same rows decoded one at a time (max |Δ| 0.25)") in bf.reason and "models.format=auto" in bf.reason
    # the packaged file and a measured choice are not checked again
    pk = F.resolve_format("packaged", "tiny-pkg")
    assert F.check_pinned_rows(pk, eng).rows_identical is None


def test_the_measurement_is_cached_per_file_cpu_and_threads(tiny_pkg, tmp_path, monkeypatch):
    """Timed once per (file, CPU, threads, formats, draft): the second start reads the cache; another
    thread count measures again; a damaged cache file is measured again. ``_time_rows`` is faked:
    no timing in a test."""
    calls = []

    def fake(engines, reps, cached, max_seconds=None, more=None):
        calls.extend((eng.path.name, eng.threads) for eng, _ in engines.values())
        return {name: {"ms": {n: 10.0 + n for n in rows}, "noise": 0.01, "rows_identical": True if max(rows) > 1 else None,
                       "row_max_abs_diff": 0.0 if max(rows) > 1 else None} for name, (_, rows) in engines.items()}

    monkeypatch.setattr(F, "_time_rows", fake)
    cache = tmp_path / "fmt-cache"
    kw = dict(formats=("packaged", "F16"), cache_dir=cache, n_ctx=64, cached=8)
    m = F.measure_formats(tiny_pkg, threads=1, **kw)
    assert not m.from_cache and len(calls) == 2 and m.key["threads"] == 1 and m.key["cpu"]
    assert m.formats["F16"].ms[8] == 18.0 and list(cache.glob("*.json")) == [cache / m.cache_file.split("/")[-1]]
    again = F.measure_formats(tiny_pkg, threads=1, **kw)
    assert again.from_cache and len(calls) == 2 and again.formats["F16"].ms == m.formats["F16"].ms
    F.measure_formats(tiny_pkg, threads=2, **kw)
    assert len(calls) == 4 and len(list(cache.glob("*.json"))) == 2
    (cache / m.cache_file.split("/")[-1]).write_text("{not json")
    assert not F.measure_formats(tiny_pkg, threads=1, **kw).from_cache and len(calls) == 6
    # damaged in ways the JSON parser does not see (a break session's hand edits): measured again, no traceback
    cfile = cache / m.cache_file.split("/")[-1]
    good = json.loads(cfile.read_text())
    for damage in (lambda d: d["formats"]["F16"].update(ms=5), lambda d: d["formats"]["F16"]["ms"].update({"1": 0}),
                   lambda d: d["formats"]["F16"]["ms"].update({"2": -3.0}), lambda d: d["formats"].pop("packaged"),
                   lambda d: d["formats"]["packaged"]["ms"].pop("1")):
        bad = json.loads(json.dumps(good))
        damage(bad)
        cfile.write_text(json.dumps(bad))
        n = len(calls)
        assert not F.measure_formats(tiny_pkg, threads=1, **kw).from_cache and len(calls) == n + 2
        assert F.measure_formats(tiny_pkg, threads=1, **kw).from_cache  # written anew, whole
    calls[:] = calls[:6]
    with_draft = F.measure_formats(tiny_pkg, threads=1, draft_layers="0-0", **kw)  # its own key: the draft's step too
    assert not with_draft.from_cache and with_draft.draft_ms == 11.0 and len(calls) == 9
    noise = 0.5  # a busy host: not cached, measured again at the next start
    real_fake = F._time_rows
    monkeypatch.setattr(F, "_time_rows", lambda *a, **k: {n: dict(v, noise=noise) for n, v in real_fake(*a, **k).items()})
    busy = dict(kw, formats=("packaged", "Q8_0"))
    assert not F.measure_formats(tiny_pkg, threads=1, **busy).from_cache
    assert not F.measure_formats(tiny_pkg, threads=1, **busy).from_cache and len(calls) == 13
    # auto: measured (here: the fake) and chosen; 1 ms a row is cheap, so F16 serves
    monkeypatch.setattr(F, "measure_formats", lambda *a, **k: F.FormatMeasurement(
        {"model": "m"}, {"packaged": FormatCost("packaged", tiny_pkg.name, {n: 10.0 + 8 * (n - 1) for n in range(1, 9)}, True, 0.0),
                         "F16": FormatCost("F16", "x-F16.gguf", dict(F16_CHEAP), True, 0.0)}))
    auto = F.resolve_format("auto", "tiny-pkg", threads=1, proposers=("ngram",))
    assert auto.format == "F16" and auto.path.name.endswith("-F16.gguf") and auto.path.is_file()
    monkeypatch.setattr(F, "measure_formats", lambda *a, **k: F.FormatMeasurement(
        {"model": "m"}, {"packaged": FormatCost("packaged", tiny_pkg.name, {}, None, None, "not measured within 20 s")}))
    busy = F.resolve_format("auto", "tiny-pkg", threads=1)  # the packaged file, with its directory: served as is
    assert busy.format == "packaged" and busy.path == tiny_pkg and "measurement failed" in busy.reason


def test_one_real_measurement_has_every_row_count(tiny_pkg, tmp_path):
    """A real (tiny) measurement: structure only, never its numbers."""
    m = F.measure_formats(tiny_pkg, threads=1, formats=("packaged", "F16"), reps=3, cached=8, n_ctx=64,
                          draft_layers="0-0", cache_dir=tmp_path / "c")
    assert set(m.formats) == {"packaged", "F16"} and m.draft_ms > 0 and m.seconds > 0
    assert F.BUDGET_MIN_S <= m.budget_s <= F.BUDGET_MAX_S  # scaled to this host (no max_seconds given)
    for cost in m.formats.values():
        assert cost.error is None and sorted(cost.ms) == list(range(1, 9)) and all(t > 0 for t in cost.ms.values())
        assert isinstance(cost.rows_identical, bool) and cost.row_max_abs_diff >= 0
        # 3 repeats, or more where the packaged file and its best rival were timed again (an unsure contest)
        assert cost.noise >= 0 and 3 <= cost.repeats <= F.MAX_REPEATS
        assert all(len(v) >= cost.repeats for v in cost.samples.values()) and sorted(cost.samples) == list(range(1, 9))
    assert m.key["threads"] == 1 and (m.cache_file is None or json.loads(open(m.cache_file).read())["key"] == m.key)
    c = choose_format(m)
    assert c.format in ("packaged", "F16") and {r["format"] for r in c.costs} == {"packaged", "F16"}
    pkg, f16 = m.formats["packaged"].repeats, m.formats["F16"].repeats
    if next(r for r in c.costs if r["format"] == "F16").get("eligible"):
        assert pkg == f16  # both in the running: both in every repeat
    else:  # F16 out of the running (its rows not the same bits as one-row steps): only the packaged file is
        assert pkg >= f16  # timed again where the host's load made its repeats noisy (the full suite beside it)


def test_a_measurement_past_its_time_budget_keeps_the_packaged_file_and_is_not_cached(tiny_pkg, tmp_path):
    """A busy host: nothing fits in the budget (0 s here, by construction, not by timing), so every
    format is incomplete, nothing is cached, and the packaged file serves, saying why."""
    m = F.measure_formats(tiny_pkg, threads=1, formats=("packaged", "F16"), reps=3, cached=8, n_ctx=64,
                          cache_dir=tmp_path / "c", max_seconds=0.0)
    assert m.cache_file is None and not (tmp_path / "c").exists() and m.budget_s == 0.0
    for cost in m.formats.values():
        assert cost.error.startswith("did not finish in 0.0 s (the budget: models.format_max_seconds): rows [] of 1-8 "
                                     "timed; CPU load ") and cost.rows_identical is None, cost.error
        assert "host was busy" not in cost.error and "set models.format_max_seconds to give it longer" in cost.error
    c = choose_format(m)
    assert c.format == "packaged" and c.path.name == tiny_pkg.name
    assert c.reason.startswith("the packaged file's measurement failed (did not finish in 0.0 s")


def test_the_time_budget_scales_with_a_measured_plain_step():
    """By hand: 5 repeats of rows 1-8 (Σ n = 36), each timed step after an untimed one of its shape
    (x 2), plus the identity check's 2 x 8 one-row steps per format: 376 plain steps, 18.8 s at
    50 ms (the packaged file) and 15.04 s at 40 ms (F16); the draft's 2 x 5 steps at 10 ms, 0.1 s;
    with 3 s already spent, 2 x 36.94 = 73.88 s. A fast host gets the 20 s floor, a host where a
    step takes seconds the 180 s cap."""
    rows = {"packaged": F.ROWS, "F16": F.ROWS, F.DRAFT: (1,)}
    assert F.SHAPE_WARMUP == 2
    assert F.scaled_budget({"packaged": 50.0, "F16": 40.0, F.DRAFT: 10.0}, rows, 5, 3.0) == pytest.approx(73.88)
    assert F.scaled_budget({"packaged": 5.0, "F16": 4.0, F.DRAFT: 1.0}, rows, 5, 0.5) == F.BUDGET_MIN_S == 20.0
    assert F.scaled_budget({"packaged": 3000.0, "F16": 3000.0, F.DRAFT: 900.0}, rows, 5, 10.0) == F.BUDGET_MAX_S == 180.0


def test_an_incomplete_measurement_says_what_happened(tiny_pkg, tmp_path, monkeypatch):
    """The walkthrough's "not measured within 20.0 s ...: the host was busy" at load 1.1: the message
    now gives the budget and its origin, the rows timed, the load the measurement saw, and what to
    set; it blames other jobs only when the load was above the CPUs. ``_time_rows`` is faked."""
    def fake(load):
        return lambda engines, reps, cached, max_seconds=None, more=None: {
            name: {"ms": {1: 30.0, 2: 40.0}, "noise": 0.0, "rows_identical": None, "row_max_abs_diff": None,
                   "repeats": 1, "budget_s": 41.38, "load": load} for name in engines}

    monkeypatch.setattr(F.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(F, "_time_rows", fake((1.1, 0.9, 0.5)))
    kw = dict(threads=1, formats=("packaged", "F16"), cache_dir=tmp_path / "c", n_ctx=64, cached=8)
    m = F.measure_formats(tiny_pkg, **kw)
    assert m.budget_s == 41.4 and m.cache_file is None  # incomplete: measured again at the next start
    assert m.formats["packaged"].error == (
        "did not finish in 41.4 s (the budget: 2x its time expected from a plain step timed on this CPU, within "
        "20-180 s): rows [1, 2] of 1-8 timed; CPU load 1.1 / 0.9 / 0.5 (1 / 5 / 15 min) on 2 CPUs, its own 1 thread(s) "
        "included; set models.format_max_seconds to give it longer, or models.format=packaged (or a pinned format, "
        "e.g. F16) to serve without measuring")
    monkeypatch.setattr(F, "_time_rows", fake((3.5, 3.0, 2.0)))
    busy = F.measure_formats(tiny_pkg, **kw).formats["F16"].error
    assert "on 2 CPUs, its own 1 thread(s) included; more runnable work than CPUs, so other jobs slowed it;" in busy
    monkeypatch.setattr(F, "_time_rows", fake(None))
    assert "the CPU load is not known on this OS" in F.measure_formats(tiny_pkg, **kw).formats["packaged"].error


def with_samples(m: FormatMeasurement, **per_repeat) -> FormatMeasurement:
    """``m`` with per-repeat samples {format: {n: [ms, ...]}}."""
    for f, by_n in per_repeat.items():
        m.formats[f].samples = {n: list(v) for n, v in by_n.items()}
    return m


def test_a_format_serves_only_where_its_paired_interval_stays_above_one():
    """Q8_0's plain step 1.10x faster by the medians, but per repeat (paired: p_i / t_i) the ratios
    are 10/9, 10/8, 10/11 (log-mean and t-interval by hand below): the interval reaches under 1, so
    the packaged file serves and says why; the same medians with ratios 10/9.1, 10/9.0, 10/8.9 serve
    Q8_0 with their interval in the reason."""
    import math
    m = table(packaged={1: 10.0}, Q8_0={1: 9.0})
    with_samples(m, packaged={1: [10.0, 10.0, 10.0]}, Q8_0={1: [9.0, 8.0, 11.0]})
    c = choose_format(m, alphas={}, proposers=())
    logs = [math.log(10 / 9), math.log(10 / 8), math.log(10 / 11)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 2)
    h = 4.302653 * sd / math.sqrt(3)  # Student's t, 2 degrees of freedom, 97.5 %
    assert c.paired["ratio"] == pytest.approx(math.exp(mean), abs=1e-4) and c.paired["pairs"] == 3
    assert c.paired["low"] == pytest.approx(math.exp(mean - h), abs=1e-3) and c.paired["low"] < 1.0
    assert c.paired["high"] == pytest.approx(math.exp(mean + h), abs=1e-3) and c.paired["unsure"] is True
    assert c.format == "packaged", c.reason
    assert (f"1.11x the tokens per ms of plain decoding of the packaged file (packaged.gguf, 10.00 ms a step), but "
            f"paired per repeat {math.exp(mean):.2f}x [{math.exp(mean - h):.2f}, {math.exp(mean + h):.2f}] over 3 "
            f"repeats (95%): not surely 5% faster") in c.reason, c.reason
    tight = with_samples(table(packaged={1: 10.0}, Q8_0={1: 9.0}), packaged={1: [10.0] * 3}, Q8_0={1: [9.1, 9.0, 8.9]})
    c = choose_format(tight, alphas={}, proposers=())
    assert c.format == "Q8_0" and c.paired["low"] > 1.05 and c.paired["unsure"] is False
    assert "serves on its ratio paired per repeat, 1.11x [1." in c.reason and " over 3 repeats, the interval that decided" in c.reason, c.reason
    # far below the margin even at its interval's top: not unsure (no more repeats would let it serve)
    slow = with_samples(table(packaged={1: 10.0}, Q8_0={1: 9.9}), packaged={1: [10.0] * 3}, Q8_0={1: [9.95, 9.9, 9.85]})
    c = choose_format(slow, alphas={}, proposers=())
    assert c.format == "packaged" and c.paired["high"] < 1.05 and c.paired["unsure"] is False


def _clocked_engines(monkeypatch, reshape_ms: float = 0.0):
    """A fake engine class for ``_time_rows`` on a fake clock (``Eng.clock``, [seconds], patched in as
    ``F.time.perf_counter``): n rows cost 10 x n ms, ``reshape_ms`` more after a step of another shape
    on the same engine (llama.cpp's graph rebuild); logits rows of zeros."""
    import types

    import numpy as np

    clock = [0.0]

    class Seq:
        def __init__(self, eng):
            self.eng = eng

        def forward(self, toks, n):
            clock[0] += (10.0 * len(toks) + (reshape_ms if self.eng.last != len(toks) else 0.0)) / 1e3
            self.eng.last = len(toks)
            return types.SimpleNamespace(numpy=lambda: np.zeros((n, 4)))

        def truncate(self, n):
            pass

    class Eng:
        vocab_size = 32

        def __init__(self):
            self.last = None

        def start(self):
            return Seq(self)

    Eng.clock = clock
    monkeypatch.setattr(F, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return Eng


def test_each_timed_step_follows_a_step_of_its_own_shape(monkeypatch):
    """llama.cpp rebuilds a context's graph when its batch shape changes, and a one-row step right
    after an 8-row one costs more (by more on Q8_0 than on the packaged file, fifteenth session):
    plain decoding's steps follow steps of their own shape, so the measurement times them so. A fake
    engine on a fake clock: n rows cost 10 x n ms, 5 ms more after a step of another shape on the
    same engine. Every median must be the same-shape cost 10 x n (before: 15 ms for one row, after
    the previous repeat's 3 rows)."""
    Eng = _clocked_engines(monkeypatch, reshape_ms=5.0)
    engines = {"packaged": (Eng(), (1, 2, 3)), "Q8_0": (Eng(), (1, 2, 3))}
    out = F._time_rows(engines, 4, 8, max_seconds=600.0)
    for name in engines:
        assert out[name]["ms"] == {1: 10.0, 2: 20.0, 3: 30.0} and out[name]["repeats"] == 4
        assert out[name]["rows_identical"] is True and out[name]["noise"] == 0.0


def test_a_format_whose_rows_differ_is_not_timed_and_is_left_out_on_them(monkeypatch):
    """A format whose verification rows differ from its one-row steps is left out whatever its times
    (greedy speculation on it could leave plain decoding's output), so the first start times only the
    others (F16 and BF16 on an AVX2 EPYC: a third of the measurement's steps). Fake engines on the
    fake clock: "BF16"'s block rows differ by 0.5 in one logit; after the row check it runs no step,
    the others every repeat; the choice says why it is left out, and the measurement stays cacheable."""
    import types

    import numpy as np

    Eng = _clocked_engines(monkeypatch)

    class Skewed(Eng):
        def start(self):
            seq = super().start()
            plain = seq.forward

            def forward(toks, n):
                plain(toks, n)
                self.steps.append(len(toks))
                out = np.zeros((n, 4))
                if len(toks) > 1:
                    out[-1, 2] = 0.5
                return types.SimpleNamespace(numpy=lambda: out)

            seq.forward = forward
            return seq

    bf = Skewed()
    bf.steps = []
    engines = {"packaged": (Eng(), F.ROWS), "Q8_0": (Eng(), F.ROWS), "BF16": (bf, F.ROWS)}
    out = F._time_rows(engines, 4, 8, max_seconds=600.0)
    # the prefill's 8 rows, its warm-up step, then the row check: 8 rows as a block, 8 one at a time
    assert bf.steps == [8, 1, 8] + [1] * 8, bf.steps
    assert out["BF16"]["rows_identical"] is False and out["BF16"]["row_max_abs_diff"] == 0.5 and "ms" not in out["BF16"]
    assert out["Q8_0"]["ms"] == {n: 10.0 * n for n in F.ROWS} and out["Q8_0"]["repeats"] == 4
    costs = {f: FormatCost(f, f"{f}.gguf") for f in engines}
    assert all(F._fill_cost(costs[f], t, None, 600.0, 1) for f, t in out.items())
    assert costs["BF16"].error is None and costs["BF16"].ms == {} and F._noisy(costs["BF16"], 4) is None
    c = choose_format(FormatMeasurement({"model": "m"}, costs, reps=4), alphas={}, proposers=())
    row = {r["format"]: r for r in c.costs}
    assert row["BF16"]["eligible"] is False and row["Q8_0"]["eligible"] is True
    assert row["BF16"]["why_not"] == ("its 8-row verification's logits differ from its one-row steps by up to 0.5, "
                                      "so greedy speculation could leave plain decoding's output")
    assert "BF16 left out (its 8-row verification's logits differ" in c.reason, c.reason


def test_a_measurement_beside_busy_processes_stops_once_that_is_clear(monkeypatch):
    """A busy host's measurement is never judged (``busy``), so it stops at the end of the repeat in
    which BUSY_JUDGE_S seconds of timed steps have passed with other processes above BUSY_MAX of the
    CPUs (a break session's busy host measured for 185 s at every start, then threw it away). Fake
    engines on a fake clock: rows 1-3 at 10 ms a row, 2 files, each timed step after an untimed one:
    240 ms a repeat, so the 9th repeat (2.16 s) is the first past 2 s; with the CPUs all this
    process's own, all 12 repeats run."""
    Eng = _clocked_engines(monkeypatch)
    clock, cpus = Eng.clock, os.cpu_count() or 1
    hz = os.sysconf("SC_CLK_TCK")
    for others, want in ((True, 9), (False, 12)):
        ticks = lambda: int(clock[0] * hz * cpus)  # noqa: E731 - every CPU busy all the time
        monkeypatch.setattr(F, "cpu_jiffies", lambda: (ticks(), 0 if others else ticks()))
        out = F._time_rows({"packaged": (Eng(), (1, 2, 3)), "Q8_0": (Eng(), (1, 2, 3))}, 12, 8, max_seconds=600.0)
        assert out["packaged"]["repeats"] == out["Q8_0"]["repeats"] == want, (others, out["packaged"]["repeats"])
        assert (F._busy(out) is not None) == others
    m = FormatMeasurement({"model": "m"}, {"packaged": FormatCost("packaged", "p.gguf", {1: 10.0}, None, None)},
                          busy=F._busy(dict(out, packaged=dict(out["packaged"], others=0.6))))
    assert choose_format(m).reason.endswith("measured again at the next start (models.format=packaged, or a format "
                                            "named, e.g. Q8_0, serves without measuring)")


def test_an_unsure_format_is_timed_again_until_its_interval_decides():
    """``_time_rows``' ``more``: with Q8_0's per-repeat ratios spread (unsure) the packaged file and
    Q8_0 are timed again, F16 (the worse) not; once the samples settle (Q8_0 at 9.0 ms every
    repeat, the packaged at 10) it names none. Real _time_rows on fake engines (no timing asserted)."""
    class Seq:
        def __init__(self, eng):
            self.eng = eng

        def forward(self, toks, n):
            self.eng.calls.append(n)
            return None

        def truncate(self, n):
            pass

    class Eng:
        vocab_size = 32

        def __init__(self):
            self.calls = []

        def start(self):
            return Seq(self)

    engines = {"packaged": (Eng(), (1,)), "Q8_0": (Eng(), (1,)), "F16": (Eng(), (1,))}
    asked = []

    def more(times, checks):
        asked.append({f: len(v[1]) for f, v in times.items()})
        return ["packaged", "Q8_0"] if len(asked) < 4 else []

    out = F._time_rows(engines, 3, 4, max_seconds=60.0, more=more)
    assert [a["Q8_0"] for a in asked] == [3, 4, 5, 6] and [a["F16"] for a in asked] == [3, 3, 3, 3]
    assert out["Q8_0"]["repeats"] == 6 and out["F16"]["repeats"] == 3 and len(out["packaged"]["samples"][1]) == 6
    # _contest: which engines more() names, from samples alone
    costs = {f: FormatCost(f, f"{f}.gguf") for f in ("packaged", "Q8_0", "F16")}
    checks = {f: {"rows_identical": True, "row_max_abs_diff": 0.0} for f in costs}
    spread = {"packaged": {1: [10.0, 10.0, 10.0]}, "Q8_0": {1: [9.0, 8.0, 11.0]}, "F16": {1: [14.0, 14.0, 14.0]}}
    assert F._contest(spread, checks, costs, ()) == ["packaged", "Q8_0"]
    settled = dict(spread, Q8_0={1: [9.0, 8.0, 11.0] + [9.0] * 12}, packaged={1: [10.0] * 15})
    assert F._contest(settled, checks, costs, ()) == []
    # decided (Q8_0 at 0.8 of the packaged step in every pair) but the step times moved (14 / 10 - 1 = 0.4 over
    # NOISE_MAX): every format still in the running is timed again; one whose rows differ is not (left out anyway)
    moved = {"packaged": {1: [10.0, 14.0, 14.0]}, "Q8_0": {1: [8.0, 11.2, 11.2]}, "F16": {1: [14.0, 14.0, 14.0]}}
    assert F._contest(moved, checks, costs, ()) == ["packaged", "Q8_0", "F16"]
    differ = dict(checks, F16={"rows_identical": False, "row_max_abs_diff": 0.1})
    assert F._contest(moved, differ, costs, ()) == ["packaged", "Q8_0"]
    calm = dict(moved, packaged={1: [10.0, 10.5, 10.5]}, Q8_0={1: [8.0, 8.4, 8.4]})
    assert F._contest(calm, checks, costs, ()) == []


# ---- records, and greedy on the served copy -------------------------------------------------------


def test_records_carry_the_served_format_and_older_records_decode_without_it():
    import numpy as np

    from store.schema import PairFingerprint, SchemaError, VerifiedSample, decode, encode

    def sample(**kw):
        z = np.zeros(0)
        return VerifiedSample("r", "prose", 0, PairFingerprint("smollm2-135m", "layers:0-3", "t"), np.array([1], np.int32),
                              np.array([2], np.int32), z.astype(np.int16), z.astype(np.int16),
                              np.zeros((1, 2), np.int32), np.full((1, 2), 0.4, np.float16), np.array([0.2], np.float32), **kw)

    f16 = encode(sample(target_format="F16"))
    assert decode(f16).target_format == "F16" and f16[b"v"] == b"1"  # no schema bump: an optional body field
    assert decode(encode(sample())).target_format is None
    import msgpack

    body = msgpack.unpackb(f16[b"body"], raw=False)
    body["target_format"] = 3
    with pytest.raises(SchemaError, match="target_format"):
        decode({**f16, b"body": msgpack.packb(body, use_bin_type=True)})


@needs_llamacpp
@pytest.mark.slow
def test_serving_the_chosen_f16_copy_greedy_equals_plain_decoding_of_that_copy():
    """``models.format`` = F16 (what auto picks where its rows are cheap): the engine serves the F16
    copy, the draft stays derived from the packaged file, greedy speculation (n-gram and the draft)
    emits plain decoding's tokens on that copy, and every record names F16."""
    from decoder.engines.registry import choose_engine
    from decoder.models.loading import load_pair
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
    from decoder.models.packaged import packaged_gguf

    real = load_pair("smollm2-135m", "layers:0-3")
    ch = choose_engine("llamacpp", "smollm2-135m", draft="layers:0-3", threads=2, target_format="F16")
    try:
        assert ch.served_format == "F16" and ch.target.path.name.endswith("-F16.gguf") and "serving F16" in ch.reason
        assert packaged_gguf("smollm2-135m").stem in ch.draft.path.name and "F16" not in ch.draft.path.name
        records = []
        dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, DecoderConfig(target_format=ch.served_format),
                                 engine=ch.target, draft_engine=ch.draft, sink=records.append)
        prompt = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
        ids = real.tokenizer(prompt)["input_ids"]
        plain = dec.generate(DecodeRequest(ids, SamplingParams(), 32, gamma=0, ignore_eos=True))
        for proposer, gamma in (("ngram", 3), ("draft", 2)):
            spec = dec.generate(DecodeRequest(ids, SamplingParams(), 32, gamma=gamma, ignore_eos=True, proposer=proposer))
            assert spec.counts.num_draft_tokens > 0 and spec.output_ids == plain.output_ids, proposer
        assert records and {r.target_format for r in records} == {"F16"}
    finally:
        ch.target.close()
        ch.draft.close()


def test_other_processes_share_of_the_cpus_is_read_off_two_snapshots():
    # 2 CPUs for 2 s at 100 ticks/s: 400 ticks in all; the machine busy 500 ticks more, 200 of them ours
    assert F.others_share((1000, 100), (1500, 300), 2.0, 2, hz=100) == pytest.approx(300 / 400)
    assert F.others_share((1000, 100), (1100, 200), 2.0, 2, hz=100) == 0.0  # all ours
    assert F.others_share(None, (1, 1), 2.0, 2) is None and F.others_share((1, 1), (2, 2), 0.0, 2) is None
    # the adversarial helper's: 500 % of the CPUs, a counter that went back read as "not busy", a 1 ns window
    assert F.others_share((0, 0), (1000, 0), 1.0, 2, hz=100) == 1.0
    assert F.others_share((1000, 100), (900, 100), 2.0, 2, hz=100) is None
    assert F.others_share((1000, 100), (1000, 50), 2.0, 2, hz=100) is None
    assert F.others_share((0, 0), (5, 0), 1e-9, 2, hz=100) is None
    j = F.cpu_jiffies()
    assert j is None or (j[0] >= 0 and j[1] >= 0)


def test_a_measurement_beside_other_work_serves_the_packaged_file_and_is_not_cached(tiny_pkg, tmp_path, monkeypatch):
    """Other processes used 60 % of the CPUs during the timed steps (faked: no timing in a test):
    F16's cheap rows are not judged on it, the packaged file serves, saying why, and nothing is cached."""
    def fake(engines, reps, cached, max_seconds=None, more=None):
        return {name: {"ms": dict(PACKAGED_10) if name == "packaged" else {n: F16_CHEAP[n] for n in rows}, "noise": 0.01,
                       "rows_identical": True, "row_max_abs_diff": 0.0, "others": 0.6}
                for name, (_, rows) in engines.items()}

    monkeypatch.setattr(F, "_time_rows", fake)
    m = F.measure_formats(tiny_pkg, threads=1, formats=("packaged", "F16"), cache_dir=tmp_path / "c", n_ctx=64, cached=8)
    assert m.busy == "the measurement ran beside other work: other processes used 60% of the CPUs during its steps " \
                     "(above 25%)"
    assert m.cache_file is None and not list((tmp_path / "c").glob("*.json"))
    c = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert c.format == "packaged" and c.reason == m.busy + ", so no format is judged on it; measured again at the next start (models.format=packaged, or a format named, e.g. Q8_0, serves without measuring)"
    calm = FormatMeasurement.from_json(dict(m.to_json(), busy=None))
    assert choose_format(calm, alphas={"ngram": 0.6}, proposers=("ngram",)).format == "F16"  # the same costs, alone


def test_a_choice_read_from_the_cache_says_so_and_when_it_was_measured():
    # the second walkthrough of the twelfth session read "measured: the packaged file is the best" from a
    # start that measured nothing (the format was read from the first run's cache)
    m = table(packaged=PACKAGED_10, F16=F16_CHEAP)
    fresh = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert fresh.reason.startswith("measured: F16 expects")
    m.from_cache, m.measured_at = True, 1796515200.0  # 2026-12-06 00:00 UTC
    cached = choose_format(m, alphas={"ngram": 0.6}, proposers=("ngram",))
    assert cached.reason.startswith("measured on this host (2026-12-06 00:00 UTC), cached: F16 expects"), cached.reason
    assert cached.format == fresh.format


@needs_llamacpp
@pytest.mark.parametrize("name", [*F.NEEDS_IMATRIX, *F.NOT_WRITTEN])
def test_a_format_llama_cpp_cannot_write_here_is_refused_naming_it_and_the_usable_ones(name):
    """The break helper's: IQ1_S, IQ2_XXS, ... were accepted as models.format, then the first start
    failed in llama_model_quantize (returned 1): they need an importance matrix."""
    from pydantic import ValidationError

    from daemon.settings import ModelSettings

    with pytest.raises(ValueError) as ei:
        F.format_setting(name.lower())
    msg = str(ei.value)
    assert msg.startswith(f"models.format {name.lower()!r}: "), msg
    assert ("importance matrix" if name in F.NEEDS_IMATRIX else "does not write that file type") in msg, msg
    usable = msg.split("formats it can write: ", 1)[1].split(", ")
    assert {"F16", "BF16", "Q8_0", "Q4_0", "IQ4_NL"} <= set(usable) and not set(usable) & {*F.NEEDS_IMATRIX, *F.NOT_WRITTEN}
    with pytest.raises(ValidationError, match=f"models.format {name.lower()!r}: "):
        ModelSettings(format=name.lower())


@needs_llamacpp
def test_the_refused_formats_are_the_ones_llama_cpps_quantiser_refuses(tmp_path):
    """Independently of the lists: llama_model_quantize fails for each refused format on the packaged
    model (at once: before any tensor is written) and writes Q4_0, which stays accepted."""
    from decoder.models.gguf_export import requantised_gguf
    from decoder.models.packaged import packaged_gguf

    src = packaged_gguf("smollm2-135m")
    for name in (*F.NEEDS_IMATRIX, *F.NOT_WRITTEN):
        with pytest.raises(RuntimeError, match=f"-> {name}\\) returned"):
            requantised_gguf(src, name, cache_dir=tmp_path)
    assert requantised_gguf(src, "Q4_0", cache_dir=tmp_path).is_file() and F.format_setting("q4_0") == "Q4_0"


def test_another_llama_cpp_build_or_patch_switch_measures_again(tiny_pkg, tmp_path, monkeypatch):
    """Step costs belong to the llama.cpp build that timed them: a rebuilt (patched) CPU backend, or
    a patch switched off for this process, is measured anew instead of reading the other build's
    costs. ``_time_rows`` is faked: no timing in a test."""
    import decoder.engines.llamacpp_lib as lib

    calls = []

    def fake(engines, reps, cached, max_seconds=None, more=None):
        calls.extend(eng.path.name for eng, _ in engines.values())
        return {name: {"ms": {n: 10.0 + n for n in rows}, "noise": 0.01, "rows_identical": True if max(rows) > 1 else None,
                       "row_max_abs_diff": 0.0 if max(rows) > 1 else None} for name, (_, rows) in engines.items()}

    monkeypatch.setattr(F, "_time_rows", fake)
    for k in lib.PATCH_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    kw = dict(formats=("packaged",), cache_dir=tmp_path / "fmt", n_ctx=64, cached=8)
    first = F.measure_formats(tiny_pkg, threads=1, **kw)
    assert first.key["llama_cpu"] == lib.cpu_backend_identity() and len(calls) == 1
    assert F.measure_formats(tiny_pkg, threads=1, **kw).from_cache
    monkeypatch.setenv("GGML_FA_BF16V_BLOCKED", "0")  # upstream's attention kernel: other costs
    assert not F.measure_formats(tiny_pkg, threads=1, **kw).from_cache and len(calls) == 2
    monkeypatch.delenv("GGML_FA_BF16V_BLOCKED")
    monkeypatch.setattr(lib, "cpu_backend_identity", lambda: "another-build")  # a rebuilt backend
    assert not F.measure_formats(tiny_pkg, threads=1, **kw).from_cache and len(calls) == 3


def test_the_backend_identity_follows_the_library_bytes_and_the_switches(tmp_path, monkeypatch):
    import importlib.util
    import types

    import decoder.engines.llamacpp_lib as lib

    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "lib" / "libggml-cpu.so").write_bytes(b"build one")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(pkg / "__init__.py")) if name == "llama_cpp" else None)
    for k in lib.PATCH_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    import hashlib

    one = lib.cpu_backend_identity()
    assert one == hashlib.sha256(b"build one").hexdigest()[:16]
    monkeypatch.setenv("GGML_AMX_VNNI_MAX_ROWS", "1")
    assert lib.cpu_backend_identity() == one + ";GGML_AMX_VNNI_MAX_ROWS=1"
    monkeypatch.setenv("GGML_AMX_VNNI_MAX_ROWS", "abc")  # atoi: 0, at least 1: the same as "1"
    assert lib.cpu_backend_identity() == one + ";GGML_AMX_VNNI_MAX_ROWS=1"
    monkeypatch.setenv("GGML_AMX_VNNI_MAX_ROWS", "8")  # the default: the same key as unset
    assert lib.cpu_backend_identity() == one
    monkeypatch.setenv("GGML_AMX_VNNI_MAX_ROWS", "5,3")  # per thread count (decoder.engines.amx_rows)
    assert lib.cpu_backend_identity() == one + ";GGML_AMX_VNNI_MAX_ROWS=5,3"
    monkeypatch.delenv("GGML_AMX_VNNI_MAX_ROWS")
    monkeypatch.setenv("GGML_FA_BF16V_BLOCKED", "off")  # on: only a leading 0 turns it off
    assert lib.cpu_backend_identity() == one
    monkeypatch.setenv("GGML_FA_BF16V_BLOCKED", "0")
    assert lib.cpu_backend_identity() == one + ";GGML_FA_BF16V_BLOCKED=0"
    monkeypatch.setenv("GGML_X86_TILED", "0")
    assert lib.cpu_backend_identity() == one + ";GGML_FA_BF16V_BLOCKED=0,GGML_X86_TILED=0"
    monkeypatch.delenv("GGML_FA_BF16V_BLOCKED")
    monkeypatch.delenv("GGML_X86_TILED")
    (pkg / "lib" / "libggml-cpu.so").unlink()
    assert lib.cpu_backend_identity() == ""  # no backend to identify: no constant digest
    (pkg / "lib" / "libggml-cpu.so").write_bytes(b"build two")
    assert lib.cpu_backend_identity().startswith(hashlib.sha256(b"build two").hexdigest()[:16])


def test_the_patch_switches_read_as_the_patched_ggml_reads_them():
    from decoder.engines.llamacpp_lib import patch_switches

    rows = lambda v: patch_switches({} if v is None else {"GGML_AMX_VNNI_MAX_ROWS": v})["GGML_AMX_VNNI_MAX_ROWS"]
    # C's atoi: leading digits after an optional sign and blanks, else 0; the patch takes max(1, .)
    assert [rows(v) for v in (None, "8", "3", " 12x", "0x10", "abc", "", "-5", "99999")] == [
        (8,), (8,), (3,), (12,), (1,), (1,), (1,), (1,), (99999,)]
    # a comma list: one field per thread count, each read by atoi (strchr to the next comma), at most 16
    assert [rows(v) for v in ("5,3", "5, 3", "5,,3", "5,x", "4,3,", ",2")] == [
        (5, 3), (5, 3), (5, 1, 3), (5, 1), (4, 3, 1), (1, 2)]
    assert rows(",".join(["2"] * 20)) == (2,) * 16
    # glibc's atoi is (int) strtol: past 2^31 it wraps, and only C-locale blanks and ASCII digits count
    assert [rows(v) for v in ("2147483648", "4294967304", "\x1c5", "\u00a05", "\uff15")] == [(1,), (8,), (1,), (1,), (1,)]
    fa = lambda v: patch_switches({} if v is None else {"GGML_FA_BF16V_BLOCKED": v})["GGML_FA_BF16V_BLOCKED"]
    assert [fa(v) for v in (None, "1", "0", "0x10", "off", "", " 0")] == [True, True, False, False, True, True, True]
    tiled = lambda v: patch_switches({} if v is None else {"GGML_X86_TILED": v})["GGML_X86_TILED"]
    assert [tiled(v) for v in (None, "1", "0", "00", "no", "")] == [True, True, False, False, True, True]
