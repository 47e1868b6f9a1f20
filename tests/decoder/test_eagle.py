"""The feature-level head (decoder/eagle.py): its layer against transformers' own decoder layer,
cached against uncached steps, the training batch's alignment by hand, training that raises
held-out α, and lossless decoding with it (greedy equals plain token for token; T = 1 first-token
chi-square)."""

from __future__ import annotations

import pytest
import torch

from decoder.eagle import EagleHead, score_features
from decoder.proposers.eagle import EagleProposer
from trainer.head import chained_alpha, column_map, head_batch, head_loss
from decoder.sampling import SamplingParams, process_logits
from decoder.speculative import DecodeRequest, SpeculativeDecoder
from test_speculative import _chi2_crit_001, _chi_square
from tiny import reference_greedy

GREEDY = SamplingParams()


def test_head_layer_reproduces_the_targets_last_layer(target):
    """The copied layer on the last layer's input, then the target's final norm, gives the
    target's final hidden states (transformers computes the reference)."""
    x = torch.randint(2, 40, (2, 11))
    with torch.no_grad():
        hs = target(input_ids=x, output_hidden_states=True).hidden_states
        head = EagleHead.from_target(target)
        y, cache = head.layer(hs[-2], 0, None)
        assert torch.allclose(target.model.norm(y), hs[-1], atol=1e-4)
        assert cache.length == 11


def test_cached_rows_match_one_pass_and_refills_see_the_prefix():
    """All rows at once == a prefix then a 3-row refill (bottom-right causal mask) == one row at
    a time."""
    from tiny import tiny_llama

    t = tiny_llama(3, layers=2, hidden=32)
    head = EagleHead.from_target(t).eval()
    f = torch.randn(1, 9, 32)
    x = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        full, g_full, _ = head(f, x)
        a, _, c = head(f[:, :6], x[:, :6])
        b, _, c2 = head(f[:, 6:], x[:, 6:], 6, c)
        assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
        assert c2.length == 9
        c, rows = None, []
        for j in range(9):
            lg, _, c = head(f[:, j : j + 1], x[:, j : j + 1], j, c)
            rows.append(lg)
        assert torch.allclose(torch.cat(rows, 1), full, atol=1e-5)


def test_head_batch_aligns_feature_token_and_next_distribution():
    """Row j is (f_j, x_{j+1}) with the target's distribution at position j + 1 and f_{j+1}; a
    restricted vocabulary maps ids to columns and drops the mass outside it (renormalised)."""
    L, H = 5, 4
    item = {"ids": torch.tensor([10, 11, 12, 13, 14]), "feats": torch.arange(L * H, dtype=torch.float16).view(L, H),
            "topk_ids": torch.tensor([[1, 2]] * L), "topk_probs": torch.tensor([[0.5, 0.3]] * L),
            "tail": torch.full((L,), 0.2)}
    item["topk_ids"][2] = torch.tensor([3, 2])
    b = head_batch([item], None)
    assert b["tokens"].tolist() == [[11, 12, 13]]
    assert torch.equal(b["feats"][0, 1], item["feats"][1].float())
    assert torch.equal(b["next_feats"][0, 1], item["feats"][2].float())
    assert b["topk"][0, 1].tolist() == [3, 2]  # position 2's top-k for row 1
    col = column_map(torch.tensor([0, 2, 5]), 8)  # id 2 -> column 1; ids 1 and 3 are outside
    r = head_batch([item], col)
    assert r["present"][0, 0].tolist() == [False, True]
    assert r["topk"][0, 0].tolist() == [0, 1]
    # p over (id 1, id 2, tail) = (0.5, 0.3, 0.2) -> id 1 outside: (0, 0.3, 0.2) / 0.5
    assert torch.allclose(r["p"][0, 0], torch.tensor([0.0, 0.6, 0.4]), atol=1e-6)


def test_training_raises_heldout_alpha(target):
    """EAGLE's loss on the target's own features and distributions: held-out α at depth 1 and 2
    rise from the untrained head's."""
    torch.manual_seed(0)
    wins = [torch.randint(2, 40, (24,)).tolist() for _ in range(40)]
    scored = score_features(target, wins, k=8)
    train, held = scored[:32], scored[32:]
    head = EagleHead.from_target(target)
    hb = head_batch(held, None)
    before = chained_alpha(head, hb, 2)
    opt = torch.optim.AdamW(head.trainable(), lr=3e-4)
    for step in range(300):
        batch = head_batch([train[(step * 4 + i) % 32] for i in range(4)], None)
        loss, _ = head_loss(head, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = chained_alpha(head, hb, 2)
    assert after[0] > before[0] + 0.05, (before, after)
    assert after[1] > before[1], (before, after)


def test_greedy_agreement_at_depth_one_by_hand(target):
    """chained_alpha(greedy=True)[0]: the head's argmax on the target's features equals the
    target's top-1 (a top-1 outside the head's vocabulary never matches), computed here from the
    head's logits and the stored rows."""
    torch.manual_seed(1)
    wins = [torch.randint(2, 40, (16,)).tolist() for _ in range(6)]
    scored = score_features(target, wins, k=8)
    col = column_map(torch.arange(0, 30), target.config.vocab_size)
    head = EagleHead.from_target(target, torch.arange(0, 30)).eval()
    b = head_batch(scored, col)
    with torch.no_grad():
        logits, _, _ = head(b["feats"], b["tokens"])
    match = total = 0
    for it_i, it in enumerate(scored):
        for j in range(b["tokens"].shape[1]):
            ids, probs = it["topk_ids"][j + 1], it["topk_probs"][j + 1]
            top1 = int(ids[int(probs.float().argmax())])
            pred = int(logits[it_i, j].argmax())  # a column: ids 0..29 are their own columns
            match += int(top1 < 30 and pred == top1)
            total += 1
    assert chained_alpha(head, b, 1, greedy=True)[0] == pytest.approx(match / total)


def _decoder(target, tok):
    dec = SpeculativeDecoder(target, target, tok)
    torch.manual_seed(5)
    dec.eagle_head = EagleHead.from_target(target, torch.arange(0, 30)).eval()  # 30 of the 44 ids
    return dec


def test_eagle_greedy_equals_plain(target, tok):
    """Token for token, at γ = 1 and 3, with proposals both accepted (the accepted tokens'
    features refill the head's cache) and rejected."""
    dec = _decoder(target, tok)
    proposed = accepted = 0
    for text in ("the cat sat on the mat", "hello world, hi"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ref = reference_greedy(target, ids, 20)
        for gamma in (1, 3):
            r = dec.generate(DecodeRequest(ids, GREEDY, 20, gamma=gamma, ignore_eos=True, proposer="eagle"))
            assert r.output_ids == ref and r.proposer == "eagle"
            proposed += r.counts.num_draft_tokens
            accepted += r.counts.num_accepted_tokens
    assert 0 < accepted < proposed


def test_eagle_sampling_is_lossless_first_token_chi_square(target, tok):
    """T = 1, γ = 1: the first token is distributed as the target's p, through both the accepted
    draft path and the residual one."""
    dec = _decoder(target, tok)
    ids = tok("hello world, hi", add_special_tokens=False)["input_ids"]
    params = SamplingParams(1.0)
    with torch.inference_mode():
        p = process_logits(target(input_ids=torch.tensor([ids])).logits[0, -1], params)
    n, accepted = 600, 0
    counts = torch.zeros_like(p)
    for s in range(n):
        r = dec.generate(DecodeRequest(ids, SamplingParams(1.0, seed=s), 2, gamma=1, ignore_eos=True, proposer="eagle"))
        assert r.steps[0].proposed == 1
        accepted += r.steps[0].accepted
        counts[r.output_ids[0]] += 1
    chi2, df = _chi_square(counts, p, n)
    assert chi2 < _chi2_crit_001(max(df, 1)), (chi2, df)
    assert 0 < accepted < n


def test_a_one_token_prompt_and_bad_inputs(target, tok):
    """A one-token prompt has no feature for the first step: it proposes nothing there and the
    output still equals plain; mismatched feature rows, a missing head, a head of another width
    and an engine without hidden states are refused with the fix."""
    import pytest

    from tiny import tiny_llama

    prop = EagleProposer(EagleHead.from_target(target), 64)
    assert prop.propose([3], 2, GREEDY, torch.Generator()).tokens == []
    with pytest.raises(ValueError, match="2 feature rows for 1 tokens"):
        prop.features(torch.zeros(2, 48), [5])
    dec = _decoder(target, tok)
    ids = tok("h", add_special_tokens=False)["input_ids"]
    r = dec.generate(DecodeRequest(ids, GREEDY, 12, gamma=2, ignore_eos=True, proposer="eagle"))
    assert r.output_ids == reference_greedy(target, ids, 12)
    assert r.steps[0].proposed == 0 and r.counts.num_draft_tokens > 0
    bare = SpeculativeDecoder(target, target, tok)
    with pytest.raises(ValueError, match="needs a head"):
        bare.generate(DecodeRequest(ids, GREEDY, 4, gamma=2, proposer="eagle"))
    bare.eagle_head = EagleHead.from_target(tiny_llama(3, layers=2, hidden=32))
    with pytest.raises(ValueError, match="32-wide features, the target's are 48"):
        bare.generate(DecodeRequest(ids, GREEDY, 4, gamma=2, proposer="eagle"))


def test_the_layer_and_fc_train_and_the_targets_weights_stay_frozen(target):
    """The head's copies of the target's (frozen) layer are trainable; the embedding and LM head
    are buffers, and training the head leaves the target's own weights unchanged."""
    head = EagleHead.from_target(target)
    names = {n for n, p in head.named_parameters() if p.requires_grad}
    assert {"fc.weight", "layer.q_proj.weight", "layer.down_proj.weight", "layer.input_norm.weight"} <= names
    assert not any(n.startswith(("embed", "lm_weight")) for n in names)
    before = target.model.layers[-1].mlp.down_proj.weight.clone()
    b = head_batch(score_features(target, [list(range(2, 26))], k=8), None)
    loss, _ = head_loss(head, b)
    loss.backward()
    torch.optim.SGD(head.trainable(), lr=1.0).step()
    assert head.layer.down_proj.weight.grad is not None
    assert torch.equal(target.model.layers[-1].mlp.down_proj.weight, before)
    assert not torch.equal(head.layer.down_proj.weight, before)


def test_heads_that_do_not_fit_are_refused(target, tok, tmp_path):
    """Another model's head (other vocabulary; other weights of the same shapes), a damaged or
    missing file, bad vocabulary ids and an unsupported architecture: each a ValueError naming
    the fix, before any decoding."""
    import pytest
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from decoder.eagle import load_head, save_head
    from tiny import tiny_llama

    ids = tok("hello", add_special_tokens=False)["input_ids"]
    dec = SpeculativeDecoder(target, target, tok)
    dec.eagle_head = EagleHead.from_target(tiny_llama(9, layers=1, hidden=48, vocab=128))
    with pytest.raises(ValueError, match="embeds 128 token ids, the target's vocabulary has 64"):
        dec.generate(DecodeRequest(ids, GREEDY, 4, gamma=2, proposer="eagle"))
    head = EagleHead.from_target(target, torch.arange(0, 30))
    save_head(head, tmp_path / "h.safetensors", target)
    again = load_head(target, tmp_path / "h.safetensors")
    x, f = torch.randint(0, 64, (1, 5)), torch.randn(1, 5, 48)
    with torch.no_grad():
        assert torch.equal(again(f, x)[0], head.eval()(f, x)[0])
    other = tiny_llama(77, layers=4, hidden=48, head_scale=20.0)  # same shapes, other weights
    with pytest.raises(ValueError, match="trained for other target weights"):
        load_head(other, tmp_path / "h.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    for path in (tmp_path / "bad.safetensors", tmp_path / "missing.safetensors"):
        with pytest.raises(ValueError, match="cannot be read"):
            load_head(target, path)
    for bad, msg in ((torch.tensor([], dtype=torch.long), "non-empty 1-D"), (torch.tensor([[1, 2]]), "non-empty 1-D"),
                     (torch.tensor([1.0, 2.0]), "integer"), (torch.tensor([True, False]), "integer"),
                     (torch.tensor([3, 3]), "appears twice"), (torch.tensor([0, 64]), "0..63")):
        with pytest.raises(ValueError, match=msg):
            EagleHead.from_target(target, bad)
    qwen = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="model_type 'qwen3' is not supported"):
        EagleHead.from_target(qwen)


def test_the_benches_refuse_bad_eagle_arguments_before_loading(tmp_path, capsys):
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "bench"))
    from proposer_bench import parse_args

    (tmp_path / "h.bin").write_bytes(b"not a safetensors file")
    for argv, msg in ((["--eagle-head", str(tmp_path / "h.bin")], "not a head file"),
                      (["--eagle-head", str(tmp_path / "none")], "not a head file"),
                      (["--eagle-gammas", "1,x"], "comma-separated list of integers")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert msg in capsys.readouterr().err
    for args, msg in ((["--max-steps", "0"], "--max-steps 0: must be >= 1"), (["--unroll", "0"], "--unroll 0"),
                      (["--save", str(tmp_path / "no" / "h.safetensors")], "its directory does not exist")):
        r = subprocess.run([sys.executable, str(repo / "bench" / "eagle_bench.py"), *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr[-500:]


def test_records_carry_the_targets_hidden_states_row_for_row(target, other_draft, tok):
    """DecoderConfig.record_hidden: row j of the decode record is the target's final hidden state
    at sequence index P - 1 + j and row j of the prefill record the one at index j, both against
    a full teacher-forced recomputation (transformers' output_hidden_states), over steps that
    accepted some proposals and rejected others; they survive the
    buffer's encoding; without the flag records stay schema 1."""
    from decoder.models.loading import derive_draft
    from decoder.speculative import DecoderConfig
    from store.schema import PairFingerprint, decode, encode

    got = []
    fp = PairFingerprint("tiny-t", "tiny-d", "chars")
    dec = SpeculativeDecoder(target, derive_draft(target, "0-2"), tok,
                             DecoderConfig(topk_record=4, record_prompt=True, record_hidden=True),
                             sink=got.append, pair_fingerprint=fp)
    ids = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    res = dec.generate(DecodeRequest(ids, max_new_tokens=14, gamma=3, ignore_eos=True, workload="w"))
    assert any(s.rejected_at >= 0 for s in res.steps) and any(s.accepted for s in res.steps)
    pre, rec = got
    assert (pre.source, rec.source) == ("prefill", "decode")
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([ids + res.output_ids]), output_hidden_states=True).hidden_states[-1][0]
    P, N = len(ids), len(res.output_ids)
    assert rec.hidden.shape == (N, 48) and rec.hidden.dtype.name == "float16"
    assert torch.allclose(torch.from_numpy(rec.hidden).float(), hs[P - 1 : P - 1 + N], atol=2e-2, rtol=1e-2)
    assert pre.hidden.shape == (P - 1, 48)
    assert torch.allclose(torch.from_numpy(pre.hidden).float(), hs[: P - 1], atol=2e-2, rtol=1e-2)
    for r in (pre, rec):
        back = decode(encode(r))
        assert back == r and back.schema_version == 2
    got.clear()
    SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=4), sink=got.append,
                       pair_fingerprint=fp).generate(DecodeRequest(ids, max_new_tokens=6, gamma=2, ignore_eos=True))
    assert got[0].hidden is None and got[0].schema_version == 1


def test_record_hidden_refuses_what_cannot_record(target, tok):
    import pytest

    from decoder.speculative import DecoderConfig

    with pytest.raises(ValueError, match="record_hidden=True needs topk_record > 0"):
        DecoderConfig(topk_record=0, record_hidden=True)
    with pytest.raises(ValueError, match="record_hidden='yes'"):
        DecoderConfig(record_hidden="yes")

    from decoder.engines.base import Capabilities

    class NoHidden:  # an engine built without hidden-state extraction (LlamaCppEngine(embeddings=False))
        name, embeddings, vocab_size, hidden_size, context_length = "llama.cpp", False, 64, 48, 512
        capabilities = Capabilities(hidden_states=False, lora=True, batch=False, torch_module=False, own_threads=True)

    with pytest.raises(ValueError, match=r"record_hidden needs the target's hidden states.*embeddings=True"):
        SpeculativeDecoder(target, target, tok, DecoderConfig(record_hidden=True), engine=NoHidden())


def test_a_head_distilled_from_records_alone_raises_heldout_alpha(target, other_draft, tok):
    """trainer.head: decoded records (the decoder's own sink, through the buffer's encoding) are
    the only training data; no target forward runs in training. Held-out α (records of other
    prompts) rises at depth 1 and 2, and the windows line up with the records' tokens."""
    from decoder.speculative import DecoderConfig
    from store.schema import PairFingerprint, decode, encode
    from trainer.head import HeadDistiller, column_map, groups, head_batch, heldout_alpha, record_items

    got = []
    dec = SpeculativeDecoder(target, other_draft, tok, DecoderConfig(topk_record=8, record_prompt=True,
                                                                     record_hidden=True),
                             sink=lambda s: got.append(decode(encode(s))),
                             pair_fingerprint=PairFingerprint("tiny-t", "tiny-d", "chars"))
    g = torch.Generator().manual_seed(11)
    for i in range(72):  # 60 requests to train on, 12 held out (a prefill and a decode record each)
        ids = torch.randint(2, 40, (12,), generator=g).tolist()
        dec.generate(DecodeRequest(ids, max_new_tokens=32, gamma=2, ignore_eos=True, workload="w",
                                   params=SamplingParams(temperature=1.0, seed=i)))
    train_recs, held_recs = got[:120], got[120:]
    items = record_items(train_recs, window=16)
    r = train_recs[1]  # a decode record: row 0's input is the prompt's last token, then the outputs
    assert r.source == "decode"
    first, second = record_items([r], window=16)
    assert first["ids"].tolist() == [int(r.prompt_ids[-1])] + r.output_ids[:15].tolist()
    assert second["ids"].tolist() == r.output_ids[15:31].tolist()
    assert torch.equal(first["feats"], torch.from_numpy(r.hidden[:16]))
    assert torch.equal(second["topk_ids"], torch.from_numpy(r.topk_ids[16:32].astype("int64")))
    held = [head_batch(gr, None) for gr in groups(record_items(held_recs, window=16))]
    head = EagleHead.from_target(target)
    before = heldout_alpha(head, held, 2)
    calls = []
    target.register_forward_hook(lambda *a: calls.append(1))
    dist = HeadDistiller(head, items, None, lr=1e-3, batch=4, unroll=2, total_steps=250, min_lr=1.0, warmup=1)
    for _ in range(250):
        dist.step()
    target._forward_hooks.clear()
    assert calls == []  # distilled from the records alone
    after = heldout_alpha(head, held, 2)
    assert after[0] > before[0] + 0.05, (before, after)
    assert after[1] > before[1], (before, after)


def test_record_items_and_the_distiller_refuse_what_cannot_train():
    import pytest

    from trainer.head import HeadDistiller, record_items

    with pytest.raises(ValueError, match="window=2"):
        record_items([], window=2)
    with pytest.raises(ValueError, match="no training windows"):
        HeadDistiller(None, [], None)


def test_the_serving_loop_measures_the_eagle_proposer_beside_the_others(target, other_draft, tok):
    """build_serving_loop(eagle_head=...): the goodput controller warms up 'eagle' among its
    proposers and rates it by its measured accepted lengths and step cost; every greedy output
    equals plain decoding; 'eagle' without a head, or a head the target cannot feed, is refused
    when the loop is built."""
    import pytest

    from decoder.loop import build_serving_loop
    from decoder.speculative import DecoderConfig
    from tiny import tiny_llama

    with pytest.raises(ValueError, match="include 'eagle', which needs a head"):
        build_serving_loop(target, other_draft, tok, proposers=("ngram", "eagle"))
    with pytest.raises(ValueError, match="32-wide features, the target's are 48"):
        build_serving_loop(target, other_draft, tok, proposers=("eagle",),
                           eagle_head=EagleHead.from_target(tiny_llama(3, layers=2, hidden=32)))
    torch.manual_seed(5)
    head = EagleHead.from_target(target).eval()
    loop = build_serving_loop(target, other_draft, tok, decoder_config=DecoderConfig(topk_record=0),
                              proposers=("eagle", "ngram"), eagle_head=head)
    served = set()
    with loop:
        for i in range(12):
            ids = tok(["the cat sat on the mat", "hello world, hi", "abc abc abc"][i % 3],
                      add_special_tokens=False)["input_ids"]
            r = loop.generate(DecodeRequest(ids, GREEDY, 12, ignore_eos=True, workload="w"))
            assert r.output_ids == reference_greedy(target, ids, 12)
            served.add(r.proposer)
        dec = loop.controller.status()["w@greedy"]
    assert "eagle" in served and "ngram" in served
    rates = dec["tokens_per_ms_by_proposer"]
    assert set(rates) == {"eagle", "ngram"} and all(r > 0 for r in rates["eagle"].values() if r is not None)


def test_the_head_refuses_mixed_widths_and_wild_rates_and_the_loop_closes_its_writer(target, other_draft, tok):
    """Windows of two top-k widths (decoders with different topk_record share a fingerprint) are
    a ValueError naming them, not a stack error mid-round; so are an infinite learning rate and a
    negative feature weight; a loop refused at build closes the writer thread it started; a
    non-finite hidden row leaves the record without hidden states instead of losing it."""
    import threading

    import pytest

    from decoder.loop import build_serving_loop
    from decoder.speculative import _finite_or_none
    from store.config import StoreConfig
    from adapt_helpers import SHARED_URL
    from store.client import connect
    from tiny import tiny_llama
    from trainer.head import HeadDistiller

    def item(k):
        return {"ids": torch.arange(6), "feats": torch.zeros(6, 48, dtype=torch.float16),
                "topk_ids": torch.zeros(6, k, dtype=torch.long), "topk_probs": torch.full((6, k), 0.1),
                "tail": torch.full((6,), 0.2)}

    head = EagleHead.from_target(target)
    with pytest.raises(ValueError, match=r"2 different \(top-k, hidden\) widths \[\(4, 48\), \(8, 48\)\]"):
        HeadDistiller(head, [item(4), item(8)], None)
    for kw in ({"lr": float("inf")}, {"feature_weight": -1.0}, {"feature_weight": float("nan")}):
        with pytest.raises(ValueError, match="lr="):
            HeadDistiller(head, [item(4)], None, **kw)
    assert _finite_or_none(torch.tensor([[1.0, float("inf")]], dtype=torch.float16)) is None
    assert _finite_or_none(torch.ones(2, 3, dtype=torch.float16)).shape == (2, 3)
    client = connect(SHARED_URL)
    before = sum(t.name == "draftd-sample-writer" for t in threading.enumerate())
    with pytest.raises(ValueError, match="32-wide features"):
        build_serving_loop(target, other_draft, tok, client=client, store_config=StoreConfig(key_prefix="test:eagle:leak:"),
                           proposers=("eagle",), eagle_head=EagleHead.from_target(tiny_llama(3, layers=2, hidden=32)))
    assert sum(t.name == "draftd-sample-writer" for t in threading.enumerate()) == before
    client.close()
