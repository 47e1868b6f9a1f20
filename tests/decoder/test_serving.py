"""decoder.draft_weights: the bf16 serving copy of the draft, adapters merged per version."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_speculative import first_token_chi_square

from adapt_helpers import fixing_lora, random_lora
from decoder.adapters import AdapterManager
from decoder.draft_weights import ServingDraft, calibrate_draft_precision
from decoder.speculative import DecodeRequest, DecoderConfig, FixedGamma, SpeculativeDecoder
from tiny import reference_greedy, tiny_llama

PROMPTS = ["def add(a, b):", "the quick brown fox", "x = [1, 2, 3]"]
Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def enc(tok, s):
    return tok(s).input_ids


def _lora(draft, weights: dict[str, tuple], name: str, pm=None, r: int = 2, alpha: int = 4):
    """Put a LoRA adapter ``name`` with B, A = weights[module] on a copy of ``draft`` (or on ``pm``)."""
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(weights), lora_dropout=0.0)
    if pm is None:
        pm = get_peft_model(copy.deepcopy(draft), cfg, adapter_name=name)
    else:
        pm.add_adapter(name, cfg)
    mods = dict(pm.base_model.model.named_modules())
    with torch.no_grad():
        for mod, (b, a) in weights.items():
            mods[mod].lora_B[name].weight.copy_(b)
            mods[mod].lora_A[name].weight.copy_(a)
    return pm


def _ba(draft, mod: str, seed: int, r: int = 2):
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = dict(draft.named_modules())[mod].weight.shape
    return torch.randn(out_f, r, generator=g), torch.randn(r, in_f, generator=g)


def test_each_version_serves_its_merged_weights_computed_by_hand():
    draft = tiny_llama(31, layers=2, hidden=32, head_scale=20.0)
    base = {n: m.weight.detach().clone() for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)}
    wa, wb = {Q: _ba(draft, Q, 1)}, {DOWN: _ba(draft, DOWN, 2), Q: _ba(draft, Q, 3)}
    pm = _lora(draft, wa, "one")
    _lora(draft, wb, "two", pm=pm)
    sd = ServingDraft(draft, torch.bfloat16)
    assert sd.add(1, pm, "one") >= 0 and sd.add(2, pm, "two") >= 0
    assert sd.versions == [0, 1, 2]
    lin = dict(sd.module.named_modules())
    scaling = 4 / 2  # lora_alpha / r

    def expect(version_weights, name):
        if name in version_weights:
            b, a = version_weights[name]
            return (base[name] + (b @ a) * scaling).to(torch.bfloat16)  # W + (α/r)·B·A (Hu et al. 2021, Eq. 3)
        return base[name].to(torch.bfloat16)

    for v, ws in ((1, wa), (2, wb)):
        sd.use(v)
        assert sd.version == v
        for name in (Q, DOWN, "model.layers.0.mlp.up_proj", "lm_head"):
            assert lin[name].weight.dtype == torch.bfloat16
            assert torch.allclose(lin[name].weight.float(), expect(ws, name).float(), rtol=0, atol=0), (v, name)
    sd.use(0)
    assert all(torch.equal(lin[n].weight, expect({}, n)) for n in (Q, DOWN))
    # the copy is the draft's, not the draft: the original stays float32 and unmerged
    assert all(m.weight.dtype == torch.float32 for m in draft.modules() if isinstance(m, torch.nn.Linear))
    assert torch.equal(dict(draft.named_modules())[Q].weight, base[Q])
    # its logits are the merged float32 model's, to bf16 precision
    sd.use(2)
    merged = copy.deepcopy(pm)
    merged.set_adapter("two")
    ref = merged.merge_and_unload()(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    got = sd.module(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.float()
    assert (got - ref).abs().max() / ref.abs().max() < 0.03
    # drop frees a version; the one serving and version 0 are kept
    sd.drop(2)
    assert sd.versions == [0, 1, 2] and sd.version == 2
    sd.use(1)
    sd.drop(2)
    assert sd.versions == [0, 1]
    with pytest.raises(KeyError):
        sd.use(2)
    with pytest.raises(ValueError, match="version=0"):
        sd.add(0, pm, "one")


def test_a_peft_wrapped_draft_is_copied_with_its_active_adapter_merged():
    draft = tiny_llama(32, layers=2, hidden=32)
    w = {Q: _ba(draft, Q, 4)}
    pm = _lora(draft, w, "one")
    sd = ServingDraft(pm, torch.bfloat16)
    assert not any(hasattr(m, "lora_A") for m in sd.module.modules())  # plain layers, no peft
    b, a = w[Q]
    want = (dict(draft.named_modules())[Q].weight + (b @ a) * 2.0).to(torch.bfloat16)
    assert torch.equal(sd.module.get_submodule(Q).weight, want)
    # RoPE's inv_freq (a buffer) keeps float32: positions are not rounded to bf16
    assert all(b.dtype == torch.float32 for n, b in sd.module.named_buffers() if "inv_freq" in n)


def test_an_fp32_serving_view_shares_the_drafts_tensors_and_merges_in_the_copy_only():
    draft = tiny_llama(35, layers=2, hidden=32)
    w = {Q: _ba(draft, Q, 5)}
    pm = _lora(draft, w, "one")
    base_q = draft.get_submodule(Q).weight
    sd = ServingDraft(draft, torch.float32)
    assert sd.module.get_submodule(DOWN).weight is draft.get_submodule(DOWN).weight  # shared: no memory
    assert sd.module.get_submodule(Q).weight is base_q
    sd.add(1, pm, "one")
    sd.use(1)
    b, a = w[Q]
    assert torch.equal(sd.module.get_submodule(Q).weight, base_q + (b @ a) * 2.0)
    assert draft.get_submodule(Q).weight is base_q and torch.equal(base_q, pm.base_model.model.get_submodule(Q).base_layer.weight)
    sd.use(0)
    assert sd.module.get_submodule(Q).weight is base_q
    # peft injecting layers into the draft afterwards leaves the copy's modules plain
    get_peft_model(draft, LoraConfig(r=2, target_modules=[DOWN]))
    assert type(sd.module.get_submodule(DOWN)) is not type(draft.get_submodule(DOWN))
    assert not any(hasattr(m, "lora_A") for m in sd.module.modules())


@pytest.mark.parametrize("gamma", [1, 4])
def test_bf16_proposals_keep_greedy_output_identical_to_plain(target, other_draft, tok, gamma):
    from decoder.models.loading import derive_draft

    for draft in (derive_draft(target, "0-1"), other_draft):
        dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(draft_precision="bf16"))
        assert dec.draft_precision == "bf16" and next(dec.proposer.parameters()).dtype == torch.bfloat16
        assert next(dec.draft.parameters()).dtype == torch.float32
        for s in PROMPTS:
            ids = enc(tok, s)
            res = dec.generate(DecodeRequest(ids, max_new_tokens=20, gamma=gamma, ignore_eos=True))
            assert res.output_ids == reference_greedy(target, ids, 20), (s, gamma)


def test_bf16_proposals_keep_the_target_distribution(target, other_draft, tok):
    """First emitted token of γ=1 steps whose proposals come from the bf16 copy vs the target's
    distribution (chi-square at 0.1 %): the accept test and residual use the bf16 q."""
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(draft_precision="bf16"))
    assert dec.proposer.dtype == torch.bfloat16
    chi2, crit = first_token_chi_square(dec, enc(tok, "the "), 1200)
    assert chi2 < crit, (chi2, crit)


@pytest.mark.parametrize("faster", [True, False])
def test_auto_takes_bf16_only_where_the_calibration_says_it_is_faster(target, other_draft, tok, monkeypatch, faster):
    import decoder.speculative as S

    seen = []

    def fake(model, **kw):
        seen.append(model)
        return {"fp32_ms": 2.0, "bf16_ms": 1.0 if faster else 3.0, "use_bf16": faster}

    monkeypatch.setattr(S, "calibrate_draft_precision", fake)
    dec = SpeculativeDecoder(target, other_draft, tok)  # default: "auto"
    assert seen == [other_draft] and dec.draft_precision == ("bf16" if faster else "fp32")
    assert dec.serving.dtype == (torch.bfloat16 if faster else torch.float32)
    assert dec.draft_precision_calibration["use_bf16"] is faster
    assert SpeculativeDecoder(target, target, tok).draft_precision == "fp32"  # self-drafting: never copied
    assert len(seen) == 1
    assert SpeculativeDecoder(target, other_draft, tok, DecoderConfig(draft_precision="fp32")).serving.dtype == torch.float32
    assert SpeculativeDecoder(target, target, tok).serving is None  # the target proposes for itself, as it is
    assert len(seen) == 1


def test_int8_draft_and_bad_values_are_refused_with_the_fix(target, tok):
    from decoder.models.loading import quantize_draft_int8

    q = quantize_draft_int8(tiny_llama(33, layers=1, hidden=32))
    dq = SpeculativeDecoder(target, q, tok)
    assert dq.draft_precision == "fp32" and dq.serving is None and dq.proposer is q  # auto: not calibrated, not copied
    with pytest.raises(ValueError, match="int8-quantised draft"):
        SpeculativeDecoder(target, q, tok, DecoderConfig(draft_precision="bf16"))
    with pytest.raises(ValueError, match="'fp16'.*'auto', 'fp32', 'bf16'"):
        DecoderConfig(draft_precision="fp16")


def test_calibration_is_consistent_and_never_picks_bf16_for_cache_resident_weights():
    m = tiny_llama(34, layers=2, hidden=64)
    cal = calibrate_draft_precision(m, reps=2)
    assert cal["fp32_ms"] > 0 and cal["bf16_ms"] > 0
    assert cal["use_bf16"] is (cal["fp32_ms"] >= 1.0 and cal["bf16_ms"] < 0.9 * cal["fp32_ms"])
    forced = calibrate_draft_precision(m, reps=2, min_ms=0.0, pad_one_row=True)
    assert forced["use_bf16"] is (forced["bf16_ms"] < 0.9 * forced["fp32_ms"])
    assert calibrate_draft_precision(torch.nn.Sequential(torch.nn.ReLU()))["use_bf16"] is False


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adapter_versions_are_merged_into_the_serving_copy_and_swapped(tok, pair, reg, tmp_path, precision):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(draft_precision=precision))
    mgr = AdapterManager(dec, reg.registry, keep_loaded=1)
    ids = enc(tok, PROMPTS[1])
    ref = reference_greedy(target, ids, 12)
    frozen = dec.generate(DecodeRequest(ids, max_new_tokens=12, ignore_eos=True), FixedGamma(3))
    reg.registry.promote(v1, "test")
    mgr.poll_once()
    assert dec.serving.versions == [0, v1] and dec.serving.version == 0  # prepared, not yet switched
    adapted = dec.generate(DecodeRequest(ids, max_new_tokens=12, ignore_eos=True), FixedGamma(3))
    assert adapted.adapter_version == v1 and dec.serving.version == v1
    assert frozen.output_ids == adapted.output_ids == ref
    # the fix cancels the noise: the bf16 draft is the target's first layer again
    assert frozen.counts.alpha < 0.3 < 0.9 < adapted.counts.alpha
    reg.registry.rollback("test")
    mgr.poll_once()
    back = dec.generate(DecodeRequest(ids, max_new_tokens=12, ignore_eos=True), FixedGamma(3))
    assert back.adapter_version == 0 and dec.serving.version == 0
    assert back.counts.alpha == pytest.approx(frozen.counts.alpha)
    v2 = reg.register(random_lora(draft, tmp_path / "r2", scale=2.0, seed=2))
    reg.registry.promote(v2, "test")
    mgr.poll_once()
    assert dec.generate(DecodeRequest(ids, max_new_tokens=4, ignore_eos=True), FixedGamma(2)).adapter_version == v2
    mgr.poll_once()  # evicts v1 (keep_loaded=1, no longer active): its merged weights go too
    assert dec.serving.versions == [0, v2] and dec.serving.version == v2
    assert mgr.status()["draft_precision"] == precision


def test_a_version_that_cannot_be_merged_is_unloaded_failed_and_retried_cleanly(tok, pair, reg, tmp_path, monkeypatch):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(draft_precision="fp32"))
    mgr = AdapterManager(dec, reg.registry, keep_loaded=2)
    real_add = ServingDraft.add

    def no_room(self, version, peft_model, adapter):
        raise ValueError("adapter targets 'model.layers.9.mlp.up_proj', which the serving draft has no linear layer for")

    monkeypatch.setattr(ServingDraft, "add", no_room)
    reg.registry.promote(v1, "test")
    mgr.poll_once()
    assert [(f.version, f.kind) for f in mgr.failures] == [(v1, "incompatible")]
    assert "serving copy" in mgr.failures[-1].reason and mgr.status()["loaded"] == []
    ids = enc(tok, PROMPTS[0])
    for _ in range(3):  # nothing routes to it: no switch is attempted, no swap failure piles up
        assert dec.generate(DecodeRequest(ids, max_new_tokens=6, ignore_eos=True), FixedGamma(2)).adapter_version == 0
    assert len(mgr.failures) == 1 and dec.serving.version == 0
    monkeypatch.setattr(ServingDraft, "add", real_add)
    mgr.poll_once(v1)  # an explicit retry (as a new promote event would) loads it from the artifact
    assert dec.generate(DecodeRequest(ids, max_new_tokens=6, ignore_eos=True), FixedGamma(2)).adapter_version == v1
    assert dec.serving.version == v1 and dec.serving.versions == [0, v1]


def test_a_failing_switch_never_leaves_a_mix_of_two_versions():
    draft = tiny_llama(36, layers=2, hidden=32)
    pm = _lora(draft, {Q: _ba(draft, Q, 6), DOWN: _ba(draft, DOWN, 7)}, "one")
    sd = ServingDraft(draft, torch.bfloat16)
    sd.add(1, pm, "one")
    before = {n: m.weight for n, m in sd.module.named_modules() if isinstance(m, torch.nn.Linear)}
    bad = dict(sd._versions[1])
    bad[DOWN] = bad[DOWN].detach().clone()  # a plain tensor: nn.Module refuses it as a parameter
    sd._versions = {**sd._versions, 1: bad}
    with pytest.raises(TypeError):
        sd.use(1)
    after = {n: m.weight for n, m in sd.module.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(after[n] is before[n] for n in before) and sd.version == 0
    with pytest.raises(ValueError, match="'bf16'.*torch.bfloat16"):
        ServingDraft(draft, "bf16")


def test_bf16_self_drafting_proposes_with_a_bf16_copy_of_the_target(target, tok):
    dec = SpeculativeDecoder(target, target, tok, DecoderConfig(draft_precision="bf16"))
    assert dec.draft_precision == "bf16" and dec.proposer.dtype == torch.bfloat16
    assert next(target.parameters()).dtype == torch.float32
    for s in PROMPTS:
        ids = enc(tok, s)
        res = dec.generate(DecodeRequest(ids, max_new_tokens=16, gamma=3, ignore_eos=True))
        assert res.output_ids == reference_greedy(target, ids, 16)
        assert res.counts.alpha > 0.8  # the target in bf16: nearly every proposal survives
