"""Distiller on a tiny real Llama draft, distilled from a different tiny Llama target's top-k."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from store.schema import VerifiedSample
from tiny_pair import PAIR, make_samples, tiny_draft
from trainer.distill import (
    BASE,
    AdapterMismatch,
    DistillConfig,
    Distiller,
    autocast_dtype,
    cpu_has_native_bf16,
    position_weights,
    rejected_positions,
)

FAST = dict(lr=3e-3, batch_size=8, max_steps=50, max_epochs=100, max_seconds=300)


def _sample(props, rejs, n, k=2):
    return VerifiedSample(
        request_id="r", workload="w", adapter_version=0, pair=PAIR,
        prompt_ids=np.array([1, 2]), output_ids=np.arange(n) % 8,
        proposal_lens=np.array(props), rejection_pos=np.array(rejs),
        topk_ids=np.tile(np.arange(k), (n, 1)), topk_probs=np.full((n, k), 0.5 / k), tail_mass=np.full(n, 0.5),
    )


def test_rejected_positions_by_hand():
    # Steps (gamma, first rejection): (4, 1) emits 2 tokens, correction at 1; (4, -1) emits 5
    # (bonus at 6); (4, 0) emits 1, correction at 7; (2, -1) truncated after 2 tokens -> N = 10.
    s = _sample([4, 4, 4, 2], [1, -1, 0, -1], 10)
    assert np.flatnonzero(rejected_positions(s)).tolist() == [1, 7]
    assert position_weights(s, "all").tolist() == [1.0] * 10
    assert np.flatnonzero(position_weights(s, "rejected")).tolist() == [1, 7]
    w = position_weights(s, "upweight_rejected", 3.0)
    assert w[1] == w[7] == 3.0 and w.sum() == 8 + 6
    # Plain steps (gamma = 0) never mark a rejection.
    assert not rejected_positions(_sample([0, 0, 0], [-1, -1, -1], 3)).any()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_raises_heldout_alpha(draft, train_samples, heldout_samples, precision):
    dist = Distiller(draft, DistillConfig(**FAST, precision=precision))
    base = dist.evaluate(heldout_samples, adapter=BASE)
    r1 = dist.train_round(train_samples)
    r2 = dist.train_round(train_samples)
    after = dist.evaluate(heldout_samples)
    assert r1.finite and r2.finite and r1.steps == r2.steps == 50
    assert r1.samples == len(train_samples) and r1.tokens == sum(s.num_tokens for s in train_samples)
    assert r2.loss_last < r1.loss_first
    # The untrained draft barely overlaps the target; 100 LoRA steps lift held-out alpha a lot.
    assert base.alpha < 0.15
    assert after.alpha > base.alpha + 0.3, (base.alpha, after.alpha)
    assert after.greedy > base.greedy + 0.3
    for w in ("prose", "code"):
        assert after.per_workload[w].alpha > base.per_workload[w].alpha + 0.2
        assert after.per_workload[w].samples == 16
    assert after.overall.positions == sum(s.num_tokens for s in heldout_samples)
    # The base draft is still reachable with the adapter disabled, unchanged by training.
    again = dist.evaluate(heldout_samples, adapter=BASE)
    assert again.alpha == pytest.approx(base.alpha, abs=1e-6)
    # Optimiser state is carried across rounds: AdamW's step counter kept counting.
    state = dist.optimizer.state[dist._params[0]]
    assert int(state["step"]) == 100


def test_evaluate_with_a_snapshot_restores_current_weights(draft, train_samples, heldout_samples):
    dist = Distiller(draft, DistillConfig(**{**FAST, "max_steps": 20}))
    snap0 = dist.adapter_state()  # LoRA B = 0: same as the base draft
    dist.train_round(train_samples)
    cur = dist.evaluate(heldout_samples)
    old = dist.evaluate(heldout_samples, adapter=snap0)
    assert old.alpha == pytest.approx(dist.evaluate(heldout_samples, adapter=BASE).alpha, abs=1e-6)
    assert dist.evaluate(heldout_samples).alpha == pytest.approx(cur.alpha, abs=1e-7)


@pytest.mark.parametrize("how", ["lr_inf", "nan_teacher"])
def test_non_finite_round_is_rolled_back(draft, train_samples, how):
    cfg = DistillConfig(**{**FAST, "max_steps": 5, "lr": float("inf") if how == "lr_inf" else 1e-3})
    dist = Distiller(draft, cfg)
    samples = list(train_samples[:16])
    if how == "nan_teacher":
        bad = samples[3]
        probs = bad.topk_probs.copy()
        probs[2, 0] = np.nan
        samples[3] = VerifiedSample(**{**bad.__dict__, "topk_probs": probs})
        samples = samples[3:4] + samples  # first batch holds it
    before = dist.adapter_state()
    res = dist.train_round(samples)
    assert not res.finite and "non-finite" in res.reason
    after = dist.adapter_state()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert dist._weights_finite()


def test_time_bound_uses_injected_clock(draft, train_samples):
    t = [0.0]

    def clock():
        t[0] += 1.0
        return t[0]

    dist = Distiller(draft, DistillConfig(**{**FAST, "max_steps": 1000, "max_seconds": 5.0}), clock=clock)
    res = dist.train_round(train_samples)
    assert res.finite and 1 <= res.steps <= 5


def test_rejected_weighting_skips_samples_without_rejections(draft, target):
    plain = make_samples(target, 8, seed=5)  # gamma = 0: no draft was wrong anywhere
    dist = Distiller(draft, DistillConfig(**{**FAST, "weighting": "rejected"}))
    res = dist.train_round(plain)
    assert res.finite and res.steps == 0 and res.tokens == 0


def test_save_and_load_adapter(tmp_path, draft, train_samples, heldout_samples):
    dist = Distiller(draft, DistillConfig(**{**FAST, "max_steps": 20}))
    dist.train_round(train_samples)
    out = dist.save(tmp_path / "a")
    # the copy gate (DistillConfig.copy_gate, on by default) is saved beside peft's files
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "copy_gate.json"]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 16
    fresh = Distiller(tiny_draft(), DistillConfig(**FAST))
    fresh.load_adapter_weights(out)
    np.testing.assert_array_equal(fresh.copy_gate, dist.copy_gate)
    assert fresh.evaluate(heldout_samples).alpha == pytest.approx(dist.evaluate(heldout_samples).alpha, abs=1e-6)
    other = Distiller(tiny_draft(), DistillConfig(**{**FAST, "lora_r": 4}))
    with pytest.raises(AdapterMismatch, match="r=16"):
        other.load_adapter_weights(out)
    with pytest.raises(Exception, match="not empty"):
        dist.save(tmp_path / "a")


def test_bf16_training_keeps_fp32_weights_and_evaluates_in_fp32(train_samples, heldout_samples):
    """Under bf16 autocast the adapter, its gradients and the optimiser stay fp32, the loss is
    computed in fp32, and evaluation ignores the training precision: the same weights evaluate
    bit-identically in an fp32 Distiller."""
    bf = Distiller(tiny_draft(), DistillConfig(**{**FAST, "max_steps": 10}, precision="bf16"))
    r = bf.train_round(train_samples)
    assert r.finite and r.steps == 10
    assert all(p.dtype == torch.float32 for p in bf._params)
    assert all(v.dtype == torch.float32 for st in bf.optimizer.state.values() for v in st.values() if v.dim() > 0)
    fp = Distiller(tiny_draft(), DistillConfig(**FAST, precision="fp32"))
    fp.load_adapter_state(bf.adapter_state())
    a, b = bf.evaluate(heldout_samples), fp.evaluate(heldout_samples)
    assert a.alpha == b.alpha and a.overall.positions == b.overall.positions
    # the two precisions train differently (autocast really ran), but both towards the target
    fp.start_from(BASE)
    r32 = fp.train_round(train_samples)
    assert r32.loss_first == pytest.approx(r.loss_first, rel=0.05) and r32.loss_first != r.loss_first


def test_row_logits_equal_the_full_logits_at_the_distilled_positions(target):
    """The head runs on the union of distilled sequence indices only; the rows equal the full
    forward's logits there, for samples whose prompts (and so output offsets) differ."""
    from trainer.distill import _build_batch

    samples = make_samples(target, 3, "prose", seed=5, prompt_len=20) + make_samples(target, 3, "code", seed=6, prompt_len=9)
    assert len({len(s.prompt_ids) for s in samples}) > 1
    dist = Distiller(tiny_draft(), DistillConfig(**FAST))
    batch = _build_batch(samples, dist.config, dist.device)
    with torch.no_grad():
        full = dist.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        rows = dist._row_logits(batch)
    assert rows.shape == (len(batch.rows_b), full.shape[-1])
    assert torch.allclose(rows, full[batch.rows_b, batch.rows_t], atol=1e-5)


def test_autocast_dtype_by_setting():
    assert autocast_dtype("fp32", "cpu") is None
    assert autocast_dtype("bf16", "cpu") is torch.bfloat16
    assert autocast_dtype("auto", "cpu") is (torch.bfloat16 if cpu_has_native_bf16() else None)
    with pytest.raises(ValueError, match="'fp16'"):
        autocast_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match="precision='half'"):
        DistillConfig(precision="half")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="'kl'"):
        DistillConfig(loss="kl")
    with pytest.raises(ValueError, match="'some'"):
        DistillConfig(weighting="some")


def test_restricted_vocab_evaluates_the_fr_spec_draft_by_hand(target, heldout_samples):
    """With vocab S, alpha and greedy agreement are the served FR-Spec draft's: q = softmax of
    the full logits' S columns, 0 elsewhere, computed here independently from the full forward."""
    from trainer.distill import _build_batch

    gen = torch.Generator().manual_seed(3)
    vocab = torch.randperm(64, generator=gen)[:24].sort().values
    full_dist = Distiller(tiny_draft(), DistillConfig(**FAST))
    dist = Distiller(tiny_draft(), DistillConfig(**FAST), vocab=vocab)
    got = dist.evaluate(heldout_samples)
    batch = _build_batch(heldout_samples, dist.config, dist.device)
    with torch.no_grad():
        logits = full_dist.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    rows = logits[batch.rows_b, batch.rows_t]  # (M, V)
    q = torch.zeros_like(rows)
    q[:, vocab] = torch.softmax(rows[:, vocab], -1)
    ids, p = batch.topk_ids, batch.p
    q_top = q.gather(-1, ids)  # (M, k)
    q_tail = 1 - q_top.sum(-1)
    alpha = torch.minimum(p[:, :-1], q_top).sum(-1) + torch.minimum(p[:, -1], q_tail)
    top1 = ids.gather(-1, p[:, :-1].argmax(-1, keepdim=True)).squeeze(-1)
    greedy = (vocab[rows[:, vocab].argmax(-1)] == top1).float()
    assert got.alpha == pytest.approx(alpha.mean().item(), abs=1e-5)
    assert got.greedy == pytest.approx(greedy.mean().item(), abs=1e-9)
    # the restriction costs acceptance: ids outside S cannot be proposed
    assert got.alpha < full_dist.evaluate(heldout_samples).alpha


def test_restricted_vocab_of_every_id_trains_like_the_full_head(train_samples, heldout_samples):
    kw = dict(FAST, max_steps=10)
    full = Distiller(tiny_draft(), DistillConfig(**kw))
    every = Distiller(tiny_draft(), DistillConfig(**kw), vocab=torch.arange(64))
    a, b = full.train_round(train_samples), every.train_round(train_samples)
    assert a.loss_first == pytest.approx(b.loss_first, rel=1e-5) and a.loss_last == pytest.approx(b.loss_last, rel=1e-3)
    assert full.evaluate(heldout_samples).alpha == pytest.approx(every.evaluate(heldout_samples).alpha, abs=1e-4)


def test_restricted_vocab_training_raises_its_alpha(draft, train_samples, heldout_samples):
    vocab = torch.arange(0, 64, 2)  # half the ids
    dist = Distiller(draft, DistillConfig(**FAST), vocab=vocab)
    base = dist.evaluate(heldout_samples, adapter=BASE)
    r = dist.train_round(train_samples)
    after = dist.evaluate(heldout_samples)
    assert r.finite and r.steps == 50
    assert after.alpha > base.alpha + 0.1


@pytest.mark.parametrize("vocab, match", [
    (torch.tensor([0.0, 1.0]), "integer"),
    (torch.tensor([], dtype=torch.long), "non-empty"),
    (torch.tensor([[1, 2]]), "1-D"),
    ([1, 2], "torch tensor"),
    (torch.tensor([3, 64]), r"0\.\.63"),
    (torch.tensor([-1, 3]), r"0\.\.63"),
    (torch.tensor([3, 3, 5]), r"1 duplicate token ids, e.g. \[3\]"),
])
def test_restricted_vocab_errors_name_the_value(vocab, match):
    with pytest.raises(ValueError, match=match):
        Distiller(tiny_draft(), DistillConfig(**FAST), vocab=vocab)


def test_set_lr_changes_the_step_and_keeps_adam_moments(draft, train_samples):
    dist = Distiller(draft, DistillConfig(**dict(FAST, max_steps=3)))
    dist.train_round(train_samples)
    moments = {id(p): dist.optimizer.state[p]["exp_avg"].clone() for p in dist._params}
    dist.set_lr(1e-4)
    lora, gate = dist.optimizer.param_groups  # the copy gate trains at its own rate (DistillConfig.copy_gate_lr)
    assert dist.config.lr == 1e-4 and lora["lr"] == 1e-4 and gate["lr"] == dist.config.copy_gate_lr == 0.1
    assert all(torch.equal(dist.optimizer.state[p]["exp_avg"], moments[id(p)]) for p in dist._params)
    # a step at lr 1e-4 moves the weights about 1e-4 per entry (Adam's update is ~lr * sign)
    before = dist.adapter_state()
    dist.train_round(train_samples[:8])
    delta = max((dist.adapter_state()[n] - before[n]).abs().max().item() for n in before if not n.startswith("copy_gate"))
    assert 0 < delta < 5e-4
    for bad in (0.0, -1e-3, float("nan"), float("inf"), True, "1e-3", torch.tensor(1e-3)):
        with pytest.raises(ValueError, match="lr="):
            dist.set_lr(bad)
    dist.set_lr(np.float32(2e-4))
    assert dist.config.lr == pytest.approx(2e-4)


def test_the_config_lr_rules_each_round(draft, train_samples):
    """A restored training context (whose optimiser state carries its own lr) or a replaced config
    trains at config.lr, not at whatever lr the optimiser last had."""
    import dataclasses

    dist = Distiller(draft, DistillConfig(**dict(FAST, max_steps=1)))
    dist.set_lr(1e-5)
    ctx = dist.training_context()
    dist.set_lr(1e-3)
    dist.load_training_context(ctx)
    dist.train_round(train_samples[:8])
    assert [g["lr"] for g in dist.optimizer.param_groups] == [1e-3, 0.1]  # LoRA, copy gate
    dist.config = dataclasses.replace(dist.config, lr=3e-3, copy_gate_lr=0.2)
    dist.train_round(train_samples[:8])
    assert [g["lr"] for g in dist.optimizer.param_groups] == [3e-3, 0.2]


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd", "tv"])
def test_restricted_vocab_skips_positions_with_all_mass_outside_it(loss):
    """Top-k ids 40, 41 hold all the target's mass (tail 0) and S = 0..31: p(. | S) does not exist,
    so those positions teach nothing and the adapter does not move."""
    n = 6
    s = VerifiedSample(
        request_id="r", workload="w", adapter_version=0, pair=PAIR, prompt_ids=np.array([1, 2]),
        output_ids=np.arange(n) % 8, proposal_lens=np.array([0] * n), rejection_pos=np.array([-1] * n),
        topk_ids=np.tile([40, 41], (n, 1)), topk_probs=np.tile([0.6, 0.4], (n, 1)).astype(np.float16),
        tail_mass=np.zeros(n, dtype=np.float32),
    )
    dist = Distiller(tiny_draft(), DistillConfig(**dict(FAST, loss=loss, lr=1e-2, max_steps=3)), vocab=torch.arange(32))
    before = dist.adapter_state()
    r = dist.train_round([s] * 8)
    assert r.finite and r.loss_last == 0.0
    after = dist.adapter_state()
    assert all(torch.equal(before[k], v) for k, v in after.items() if not k.startswith("copy_gate"))
    # the round gave the adapter a copy gate (it had none), and nothing moved it from its init
    assert after["copy_gate.on"] == 1 and after["copy_gate.w"].tolist() == [-3.0, 0, 0, 0, 0, 0]


def test_restricted_vocab_is_copied_from_the_caller():
    v = torch.arange(0, 64, 2)
    dist = Distiller(tiny_draft(), DistillConfig(**FAST), vocab=v)
    v.copy_(torch.arange(1, 64, 2))
    assert dist._vocab.tolist() == list(range(0, 64, 2))


def test_an_adapter_remembers_its_draft_vocabulary(tmp_path, train_samples, heldout_samples):
    """Saved with S, an adapter loads back into a Distiller on S (same alpha) and is refused by a
    full-vocabulary one or one on other ids; a full-vocabulary adapter may start a restricted one."""
    import json as _json

    from trainer.distill import VOCAB_FILE

    s_even = torch.arange(0, 64, 2)
    dist = Distiller(tiny_draft(), DistillConfig(**dict(FAST, max_steps=10)), vocab=s_even)
    dist.train_round(train_samples)
    path = dist.save(tmp_path / "even")
    saved = _json.loads((path / VOCAB_FILE).read_text())
    assert saved["size"] == 32 and saved["ids"] == list(range(0, 64, 2))
    same = Distiller(tiny_draft(), DistillConfig(**FAST), vocab=s_even.clone())
    same.load_adapter_weights(path)
    assert same.evaluate(heldout_samples).alpha == pytest.approx(dist.evaluate(heldout_samples).alpha, abs=1e-6)
    with pytest.raises(AdapterMismatch, match="32 ids .*the full vocabulary"):
        Distiller(tiny_draft(), DistillConfig(**FAST)).load_adapter_weights(path)
    with pytest.raises(AdapterMismatch, match="32 ids .*32 other ids"):
        Distiller(tiny_draft(), DistillConfig(**FAST), vocab=torch.arange(1, 64, 2)).load_adapter_weights(path)
    full = Distiller(tiny_draft(), DistillConfig(**FAST))
    full_path = full.save(tmp_path / "full")
    assert not (full_path / VOCAB_FILE).exists()
    Distiller(tiny_draft(), DistillConfig(**FAST), vocab=s_even).load_adapter_weights(full_path)


def test_acceptance_as_served_is_greedy_agreement_or_alpha_at_the_requests_temperature(target, heldout_samples):
    """EvalCounts.served per record: greedy agreement for a greedy record, α between p and q both
    sharpened to the record's temperature for a sampled one; computed here from the full forward."""
    import dataclasses as dc

    from store.schema import SamplingSettings
    from trainer import losses as Lo
    from trainer.distill import _build_batch

    dist = Distiller(tiny_draft(), DistillConfig(**FAST))
    temps = [0.0, 0.5, 1.0]
    samples = [dc.replace(s, sampling=SamplingSettings(temperature=temps[i % 3])) for i, s in enumerate(heldout_samples)]
    got = dist.evaluate(samples)
    batch = _build_batch(samples, dist.config, dist.device)
    with torch.no_grad():
        rows = dist.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[batch.rows_b, batch.rows_t]
    ids, p = batch.topk_ids, batch.p
    top1 = ids.gather(-1, p[:, :-1].argmax(-1, keepdim=True)).squeeze(-1)
    want = 0.0
    for b, s in enumerate(samples):
        m = torch.from_numpy(batch.row_sample == b)
        t = s.sampling.temperature
        if t == 0:
            want += (rows[m].argmax(-1) == top1[m]).float().sum().item()
        else:
            q = torch.softmax(rows[m] / t, -1)
            q_top = q.gather(-1, ids[m])
            pt = Lo.at_temperature(p[m], t)
            want += (torch.minimum(pt[:, :-1], q_top).sum(-1) + torch.minimum(pt[:, -1], 1 - q_top.sum(-1))).sum().item()
    assert got.overall.served_sum == pytest.approx(want, abs=1e-3)
    assert got.served == pytest.approx(want / got.overall.positions, abs=1e-6)
    greedy_only = dist.evaluate([dc.replace(s, sampling=SamplingSettings()) for s in heldout_samples])
    assert greedy_only.served == pytest.approx(greedy_only.greedy)
    t1 = dist.evaluate([dc.replace(s, sampling=SamplingSettings(temperature=1.0)) for s in heldout_samples])
    assert t1.served == pytest.approx(t1.alpha)


def test_distilling_the_greedy_target_raises_greedy_agreement(train_samples, heldout_samples):
    """teacher_temperature = 0 distils the target's top-1 (cross-entropy), the target of greedy
    acceptance: it must learn it; a bad temperature is refused."""
    dist = Distiller(tiny_draft(), DistillConfig(**dict(FAST, max_steps=40), teacher_temperature=0.0))
    base = dist.evaluate(heldout_samples)
    dist.train_round(train_samples)
    assert dist.evaluate(heldout_samples).greedy > base.greedy + 0.2
    with pytest.raises(ValueError, match="teacher_temperature=-1"):
        DistillConfig(teacher_temperature=-1)


def test_served_teacher_temperature_distils_each_record_at_its_own(train_samples):
    """'served': a greedy record's loss is forward KL to its top-1, a T = 1 record's to p itself;
    a batch mixing them equals the per-record losses computed at fixed temperatures."""
    import dataclasses as dc

    from store.schema import SamplingSettings

    greedy = [dc.replace(s, sampling=SamplingSettings(temperature=0.0)) for s in train_samples[:2]]
    sampled = [dc.replace(s, sampling=SamplingSettings(temperature=1.0)) for s in train_samples[2:4]]
    draft = tiny_draft()
    served = Distiller(draft, DistillConfig(**FAST, teacher_temperature="served"))
    from trainer.distill import _build_batch

    def loss(d, samples):
        with torch.no_grad():
            return d._batch_loss(_build_batch(samples, d.config, d.device)).item()

    at0 = dc.replace(served.config, teacher_temperature=0.0)
    at1 = dc.replace(served.config, teacher_temperature=1.0)
    n0 = sum(s.num_tokens for s in greedy)
    n1 = sum(s.num_tokens for s in sampled)
    served.config = at0
    l0 = loss(served, greedy)
    served.config = at1
    l1 = loss(served, sampled)
    served.config = dc.replace(at1, teacher_temperature="served")
    assert loss(served, greedy + sampled) == pytest.approx((l0 * n0 + l1 * n1) / (n0 + n1), rel=1e-4)
    assert l0 != pytest.approx(l1)
    with pytest.raises(ValueError, match="'hot'"):
        DistillConfig(teacher_temperature="hot")


def test_warmup_scales_the_first_steps_of_each_new_optimiser(train_samples):
    """warmup_steps = 4: the lr of steps 1..4 is lr/4, 2 lr/4, 3 lr/4, lr, then lr; a new
    optimiser (start_from) warms up again; a rolled-back round restores the count."""
    seen = []
    dist = Distiller(tiny_draft(), DistillConfig(**dict(FAST, max_steps=6), warmup_steps=4))
    orig = dist.optimizer.step

    def spy(*a, **kw):
        seen.append(dist.optimizer.param_groups[0]["lr"])
        return orig(*a, **kw)

    dist.optimizer.step = spy
    dist.train_round(train_samples)
    lr = FAST["lr"]
    assert seen == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr, lr]) and dist.optimizer_steps == 6
    dist.start_from(dist.adapter_state())
    assert dist.optimizer_steps == 0
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        DistillConfig(warmup_steps=-1)


def _copy_samples(n: int, seed: int, passage: int = 12) -> list[VerifiedSample]:
    """Records of a copy task: the prompt is a random passage of ids 0..59 and a marker (63), the
    output the passage again; the target puts 0.9 on the passage's next token, 0.05 on id 60 and
    0.05 in its tail."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(0, 60, passage)
        topk = np.stack([p, np.full(passage, 60)], axis=-1)
        out.append(VerifiedSample(
            request_id=f"copy-{seed}-{i}", workload="extract", adapter_version=0, pair=PAIR,
            prompt_ids=np.concatenate([p, [63]]), output_ids=p, proposal_lens=np.zeros(passage, dtype=int),
            rejection_pos=np.full(passage, -1), topk_ids=topk,
            topk_probs=np.tile([0.9, 0.05], (passage, 1)).astype(np.float16), tail_mass=np.full(passage, 0.05, np.float32)))
    return out


def test_copy_gate_learns_to_copy_what_the_lora_cannot_in_a_few_steps():
    """On a copy task the gate (trained jointly, DistillConfig.copy_gate) lifts held-out greedy
    agreement far above the same LoRA round without it; the base draft and an adapter without a
    gate are evaluated without the mixture (λ = 0), so both Distillers agree on them."""
    train, held = _copy_samples(32, 0), _copy_samples(16, 1)
    cfg = dict(FAST, max_steps=30, lr=5e-3)
    gated = Distiller(tiny_draft(), DistillConfig(**cfg))
    plain = Distiller(tiny_draft(), DistillConfig(**cfg, copy_gate=False))
    assert gated.evaluate(held, adapter=BASE).greedy == plain.evaluate(held, adapter=BASE).greedy
    assert gated.copy_gate is None  # no gate before a round trains one
    gated.train_round(train)
    plain.train_round(train)
    g, p = gated.evaluate(held), plain.evaluate(held)
    # position 0 has no candidate (the marker never occurred before), positions 1..11 copy the
    # passage with ℓ = min(j, 8) (a random repeat inside a passage can only shorten a match)
    assert g.greedy > 0.8 and p.greedy < 0.3, (g.greedy, p.greedy)
    assert g.alpha > p.alpha + 0.4
    w = gated.copy_gate
    assert w is not None and w.shape == (6,)
    from store.copy_channel import copy_features, copy_lambda
    lam = copy_lambda(w, copy_features([8], [0.0], [0.5]), [8])[0]
    assert lam > 0.5  # a long match is trusted
    assert plain.copy_gate is None and plain.adapter_state()["copy_gate.on"] == 0


def test_record_candidates_are_the_decoders_at_every_output_position():
    """The trainer's candidate for output position j is ``copy_candidate`` of prompt + output[:j],
    the context the decoder proposes output[j] from: hand-worked on prompt (5, 6, 7), output (5, 6, 9)."""
    from trainer.distill import _record_candidates

    s = VerifiedSample(request_id="cand", workload="w", adapter_version=0, pair=PAIR, prompt_ids=np.array([5, 6, 7]),
                       output_ids=np.array([5, 6, 9]), proposal_lens=np.zeros(3, dtype=int), rejection_pos=np.full(3, -1),
                       topk_ids=np.zeros((3, 2), dtype=int), topk_probs=np.full((3, 2), 0.5, np.float16),
                       tail_mass=np.zeros(3, np.float32))
    c, n = _record_candidates(s)
    # j=0: context (5, 6, 7): no earlier 7 -> none; j=1: (…, 7, 5): 5 ended at 0 -> 6 (ℓ 1);
    # j=2: (…, 5, 6): (5, 6) ended at 1 -> 7 (ℓ 2)
    assert c.tolist() == [-1, 6, 7] and n.tolist() == [0, 1, 2]
