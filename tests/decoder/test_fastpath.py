"""decoder.fastpath: W @ x^T for a few CPU rows, F.linear otherwise; same module, same weights."""

import copy

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from tiny import reference_greedy, tiny_llama

from decoder.fastpath import SmallMLinear, small_m_linear
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder


@pytest.mark.parametrize("rows", [2, 3, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_equal_f_linear(rows, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(40, 24, bias=bias)
    ref_w, ref_b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    assert small_m_linear(lin) == 1 and type(lin) is SmallMLinear
    x = torch.randn(1, rows, 40)
    got = lin(x)
    assert got.shape == (1, rows, 24) and got.is_contiguous()
    assert torch.allclose(got, F.linear(x, ref_w, ref_b), rtol=1e-5, atol=1e-6)


def test_more_rows_and_other_dtypes_take_f_linear_exactly():
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 4)
    small_m_linear(lin, max_rows=4)
    x = torch.randn(5, 8)  # 5 rows > max_rows
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    x1 = torch.randn(1, 1, 8)  # one row: plain decoding stays bit-for-bit F.linear
    assert torch.equal(lin(x1), F.linear(x1, lin.weight, lin.bias))
    lin64 = torch.nn.Linear(8, 4).double()
    small_m_linear(lin64)
    x64 = torch.randn(2, 8, dtype=torch.float64)
    assert torch.equal(lin64(x64), F.linear(x64, lin64.weight, lin64.bias))


def test_gradients_flow_through_the_small_path():
    torch.manual_seed(2)
    lin = torch.nn.Linear(6, 3)
    ref = copy.deepcopy(lin)
    small_m_linear(lin)
    x = torch.randn(2, 6, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    lin(x).square().sum().backward()
    ref(xr).square().sum().backward()
    assert torch.allclose(x.grad, xr.grad, atol=1e-6)
    assert torch.allclose(lin.weight.grad, ref.weight.grad, atol=1e-6)


def test_idempotent_state_dict_unchanged_and_deepcopy_keeps_class():
    m = tiny_llama(3, layers=2)
    keys = list(m.state_dict())
    n_linear = sum(type(x) is torch.nn.Linear for x in m.modules())
    assert small_m_linear(m) == n_linear > 0
    assert small_m_linear(m) == 0  # already switched
    assert list(m.state_dict()) == keys
    c = copy.deepcopy(m)
    assert sum(isinstance(x, SmallMLinear) for x in c.modules()) == n_linear
    with pytest.raises(ValueError, match="max_rows=0"):
        small_m_linear(m, max_rows=0)


def test_model_logits_match_and_peft_wraps_switched_layers():
    m = tiny_llama(4, layers=2)
    ref = copy.deepcopy(m)
    small_m_linear(m)
    x = torch.tensor([[3, 5, 7]])
    with torch.no_grad():
        assert torch.allclose(m(input_ids=x).logits, ref(input_ids=x).logits, atol=1e-5)
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pm, pr = get_peft_model(m, cfg), get_peft_model(ref, copy.deepcopy(cfg))
    pr.load_state_dict(pm.state_dict())
    with torch.no_grad():
        assert torch.allclose(pm(input_ids=x).logits, pr(input_ids=x).logits, atol=1e-5)


def test_decoder_switches_both_models_and_stays_lossless(tok):
    target = tiny_llama(1234, layers=4, hidden=48, head_scale=20.0)
    plain_target = copy.deepcopy(target)
    draft = tiny_llama(7, layers=2, hidden=32, head_scale=20.0)
    dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(small_m_linear=True))
    assert all(type(x) is not torch.nn.Linear for x in list(target.modules()) + list(draft.modules()))
    ids = tok("the quick brown fox", add_special_tokens=False)["input_ids"]
    ref = reference_greedy(plain_target, ids, 20)  # unswitched weights, full recomputation
    for gamma in (1, 3):
        res = dec.generate(DecodeRequest(ids, max_new_tokens=20, gamma=gamma, ignore_eos=True))
        assert res.output_ids == ref
    off = tiny_llama(9, layers=1)
    SpeculativeDecoder(off, off, tok, DecoderConfig(small_m_linear=False))
    assert any(type(x) is torch.nn.Linear for x in off.modules())


@pytest.mark.parametrize("wins", [True, False])
def test_auto_switches_only_where_the_calibration_says_w_at_xt_wins(tok, monkeypatch, wins):
    import decoder.speculative as S

    seen = []

    def fake(model, **kw):
        seen.append(model)
        return {"rows": 2, "f_linear_ms": 2.0, "w_at_xt_ms": 1.0 if wins else 3.0, "use": wins,
                "f_linear_1_ms": 1.0, "padded_1_ms": 1.0, "pad_one_row": False}

    monkeypatch.setattr(S, "calibrate_small_m", fake)
    target, draft = tiny_llama(21, layers=1), tiny_llama(22, layers=1)
    dec = SpeculativeDecoder(target, draft, tok)  # default: "auto"
    assert seen == [target] and dec.small_m_calibration["use"] is wins
    switched = [type(x) is SmallMLinear for x in list(target.modules()) + list(draft.modules())
                if isinstance(x, torch.nn.Linear)]
    assert switched and all(s is wins for s in switched)


def test_calibrate_small_m_times_every_distinct_weight_both_ways():
    from decoder.fastpath import calibrate_small_m

    m = tiny_llama(23, layers=2, hidden=64)
    cal = calibrate_small_m(m, rows=2, reps=2)
    assert cal["rows"] == 2 and cal["f_linear_ms"] > 0 and cal["w_at_xt_ms"] > 0
    assert cal["use"] is (cal["w_at_xt_ms"] < 0.9 * cal["f_linear_ms"])
    assert cal["f_linear_1_ms"] > 0 and cal["padded_1_ms"] > 0
    assert cal["pad_one_row"] is (cal["padded_1_ms"] < 0.9 * cal["f_linear_1_ms"])
    assert "pad_one_row" not in calibrate_small_m(m, reps=1, one_row=False)
    assert calibrate_small_m(torch.nn.Sequential(torch.nn.ReLU()))["use"] is False  # no linear weight
    with pytest.raises(ValueError, match="'sometimes'"):
        DecoderConfig(small_m_linear="sometimes")


def test_int8_quantisation_still_applies_after_the_switch():
    from decoder.fastpath import plain_linear
    from decoder.models.loading import quantize_draft_int8

    m = tiny_llama(5, layers=2)
    small_m_linear(m)
    quantize_draft_int8(m)
    kinds = {type(x).__name__ for x in m.model.layers.modules()}
    assert "SmallMLinear" not in kinds and "Linear" in kinds  # torch.ao's dynamic quantized Linear
    assert all(type(x).__module__.startswith("torch.ao") for x in m.model.layers.modules() if type(x).__name__ == "Linear")
    assert plain_linear(m) == 1  # only the (unquantised) LM head was left switched


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 40), (1, 40), (40,)])
def test_one_padded_row_equals_f_linear(bias, shape):
    torch.manual_seed(3)
    lin = torch.nn.Linear(40, 24, bias=bias)
    ref_w, ref_b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    small_m_linear(lin, pad_one_row=True)
    assert lin.pad_one_row is True
    x = torch.randn(*shape)
    got = lin(x)
    assert got.shape == (*shape[:-1], 24) and got.is_contiguous()
    assert torch.allclose(got, F.linear(x, ref_w, ref_b), rtol=1e-5, atol=1e-6)
    small_m_linear(lin, max_rows=1, pad_one_row=True)  # one row only: 2 rows take F.linear exactly
    x2 = torch.randn(2, 40)
    assert torch.equal(lin(x2), F.linear(x2, lin.weight, lin.bias))


def test_auto_pads_one_row_where_gemv_is_slow_and_stays_lossless(tok, monkeypatch):
    import decoder.speculative as S

    def fake(model, **kw):
        return {"rows": 2, "f_linear_ms": 2.0, "w_at_xt_ms": 3.0, "use": False,
                "f_linear_1_ms": 2.0, "padded_1_ms": 1.0, "pad_one_row": True}

    monkeypatch.setattr(S, "calibrate_small_m", fake)
    target, draft = tiny_llama(24, layers=2, hidden=48), tiny_llama(25, layers=1, hidden=48)
    dec = SpeculativeDecoder(target, draft, tok)
    lins = [x for x in list(target.modules()) + list(draft.modules()) if isinstance(x, torch.nn.Linear)]
    assert lins and all(type(x) is SmallMLinear and x.pad_one_row and x.max_rows == 1 for x in lins)
    ids = tok("the cat").input_ids
    ref = reference_greedy(target, ids, 12)
    for g in (0, 2):
        assert dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=g, ignore_eos=True)).output_ids == ref


def test_padded_fr_spec_head_scores_the_subset_as_the_full_head_does(tok, monkeypatch):
    """With the padded row on, the FR-Spec head (V' rows of the draft's LM head) goes through
    ``padded_row`` too: its logits on the subset equal the draft's full logits there, -inf
    elsewhere, and greedy output stays the target's."""
    import decoder.speculative as S
    from transformers import DynamicCache

    def fake(model, **kw):
        return {"rows": 2, "f_linear_ms": 2.0, "w_at_xt_ms": 3.0, "use": False,
                "f_linear_1_ms": 2.0, "padded_1_ms": 1.0, "pad_one_row": True}

    monkeypatch.setattr(S, "calibrate_small_m", fake)
    calls = []
    real = S.padded_row
    monkeypatch.setattr(S, "padded_row", lambda w, x: calls.append(w.shape) or real(w, x))
    target, draft = tiny_llama(24, layers=2, hidden=48), tiny_llama(25, layers=1, hidden=48)
    subset = torch.tensor([1, 3, 4, 9, 17, 30])
    dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(draft_vocab=subset, draft_precision="fp32"))
    ids = tok("the cat").input_ids
    q = dec._draft_logits(ids, DynamicCache(config=draft.config))
    assert calls == [(6, 48)]
    with torch.no_grad():
        full = draft(input_ids=torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(q[subset], full[subset], rtol=1e-5, atol=1e-5)
    rest = torch.ones_like(q, dtype=torch.bool)
    rest[subset] = False
    assert torch.isinf(q[rest]).all()
    ref = reference_greedy(target, ids, 12)
    assert dec.generate(DecodeRequest(ids, max_new_tokens=12, gamma=2, ignore_eos=True)).output_ids == ref
