"""The FR-Spec restricted-vocabulary draft GGUF (decoder.models.gguf_export.restricted_draft_gguf)
on llama.cpp (LlamaCppEngine feeds its inputs as embeddings from the full table and scatters its V'
logits back to the full vocabulary).

On the tiny F32 Llama of test_gguf_export: the file holds exactly the kept rows and tokens; the
engine's logits on the kept ids equal the full draft's (and torch's) and are -inf elsewhere, for
input tokens inside and outside the kept set, one sequence or several; a LoRA adapter of the
blocks moves it as torch's; and the decoder on it is lossless (greedy equals plain decoding,
sampling at T = 1 emits the target's distribution), also with the copy channel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

from decoder.engines.llamacpp_lib import llamacpp_available  # noqa: E402
from decoder.models import gguf_export as ge  # noqa: E402
from decoder.models.gguf_export import derived_draft_gguf, lora_to_gguf, restricted_draft_gguf  # noqa: E402
from decoder.models.loading import derive_draft  # noqa: E402
from test_gguf_export import PROMPT, TOKENS, VOCAB, random_lora, tiny_model, torch_logits, write_tiny_gguf  # noqa: E402

needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")

# kept ids: eos (1) and bos (0) kept; half of PROMPT's tokens are outside (their inputs must still be right)
KEEP = np.array(sorted({0, 1} | set(range(2, VOCAB, 3)) | {256}), dtype=np.int64)[::-1].copy()  # not sorted


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("restricted")
    model = tiny_model()
    src = write_tiny_gguf(model, d / "tiny.gguf")
    draft = derived_draft_gguf(src, [0, 1], d)
    return model, src, draft, restricted_draft_gguf(draft, torch.from_numpy(KEEP))


def test_the_file_holds_the_kept_rows_and_tokens_in_their_order(files):
    _, _, draft, r = files
    full, cut = gguf.GGUFReader(draft, "r"), gguf.GGUFReader(r, "r")
    ft, ct = ({t.name: t for t in x.tensors} for x in (full, cut))
    assert set(ft) == set(ct)
    assert np.array_equal(ct["token_embd.weight"].data, ft["token_embd.weight"].data[KEEP])
    for name in ft:
        if name != "token_embd.weight":
            assert np.array_equal(ct[name].data, ft[name].data), name
    toks = [bytes(cut.get_field("tokenizer.ggml.tokens").parts[i]).decode() for i in cut.get_field("tokenizer.ggml.tokens").data]
    assert toks == [TOKENS[i] for i in KEEP]
    pos = {int(t): r for r, t in enumerate(KEEP)}
    assert cut.get_field("tokenizer.ggml.eos_token_id").contents() == pos[1]
    assert cut.get_field("tokenizer.ggml.bos_token_id").contents() == pos[0]
    assert cut.get_field("llama.vocab_size").contents() == len(KEEP)
    assert cut.get_field(ge.RESTRICTED_FULL_VOCAB_KEY).contents() == VOCAB
    ids_file, embd_file = ge.restricted_sidecars(r)
    assert np.array_equal(np.load(ids_file), KEEP)
    assert np.array_equal(np.load(embd_file), ft["token_embd.weight"].data)
    mtime = r.stat().st_mtime_ns
    assert restricted_draft_gguf(draft, KEEP.tolist()) == r and r.stat().st_mtime_ns == mtime  # cached


def test_a_special_token_outside_the_kept_ids_is_dropped(files, tmp_path):
    _, _, draft, _ = files
    r = restricted_draft_gguf(draft, [5, 6, 7, 200], tmp_path)
    cut = gguf.GGUFReader(r, "r")
    assert cut.get_field("tokenizer.ggml.eos_token_id") is None and cut.get_field("tokenizer.ggml.bos_token_id") is None


@pytest.mark.parametrize("ids, needle", [([], "distinct"), ([3, 3], "repeated"), ([1, VOCAB], "ids up to")])
def test_bad_ids_are_refused(files, tmp_path, ids, needle):
    with pytest.raises(ValueError, match=needle):
        restricted_draft_gguf(files[2], ids, tmp_path)


def _engine(path, **kw):
    """One thread, bf16 V cache: one-sequence engines here are compared with fused ones, which
    ``v_cache="auto"`` would run in another V type (f16 alone, bf16 fused)."""
    from decoder.engines.llamacpp import LlamaCppEngine

    return LlamaCppEngine(path, n_ctx=128, threads=1, v_cache="bf16", **kw)


@needs_llamacpp
def test_its_logits_are_the_full_drafts_on_the_kept_ids_and_minus_inf_elsewhere(files):
    """F32 weights: the restricted head is the same rows, so the kept logits equal the full draft's
    (and the torch derived draft's up to the f16/bf16 KV cache's rounding: max |diff| 0.016 on logits up to 6) at every position, PROMPT's tokens outside the
    kept set included; the engine speaks the full vocabulary (ids, eos)."""
    model, _, draft, r = files
    full, cut = _engine(draft), _engine(r)
    try:
        assert cut.vocab_size == full.vocab_size == VOCAB and cut.n_out == len(KEEP)
        assert torch.equal(cut.out_ids, torch.from_numpy(KEEP)) and cut.eos_ids == full.eos_ids == {1}
        assert cut.describe()["head_rows"] == len(KEEP) and full.describe()["head_rows"] == VOCAB
        assert not set(PROMPT) <= set(KEEP.tolist())
        want = full.start().forward(PROMPT, len(PROMPT))
        got = cut.start().forward(PROMPT, len(PROMPT))
        out = np.setdiff1d(np.arange(VOCAB), KEEP)
        assert torch.isinf(got[:, out]).all() and (got[:, out] < 0).all()
        torch.testing.assert_close(got[:, KEEP], want[:, KEEP], rtol=1e-5, atol=1e-5)
        ref = torch.from_numpy(torch_logits(derive_draft(model, "0-1"), PROMPT))  # the engine's KV cache is
        assert (got[:, KEEP] - ref[:, KEEP]).abs().max() < 1e-2 * max(1.0, float(ref.abs().max()))  # f16/bf16
        s = cut.start()  # token by token after a prefix: the same rows as the batch
        s.forward(PROMPT[:10], 1)
        rows = torch.cat([s.forward([t], 1) for t in PROMPT[10:]])
        torch.testing.assert_close(rows[:, KEEP], got[10:, KEEP], rtol=1e-4, atol=1e-4)
        with pytest.raises(Exception, match="token ids must be in"):
            cut.start().forward([VOCAB], 1)
    finally:
        full.close()
        cut.close()


@needs_llamacpp
def test_several_sequences_in_one_batch_get_their_own_rows(files):
    _, _, _, r = files
    one, two = _engine(r), _engine(r, n_seq=2)
    try:
        a_want = one.start().forward(PROMPT, 3)
        b_want = one.start().forward(PROMPT[::-1], 2)
        a, b = two.start(), two.start()
        a_got, b_got = two.forward_batch([(a, PROMPT, 3), (b, PROMPT[::-1], 2)])
        torch.testing.assert_close(a_got, a_want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b_got, b_want, rtol=1e-5, atol=1e-5)
    finally:
        one.close()
        two.close()


@needs_llamacpp
def test_a_lora_of_the_blocks_moves_it_as_torch(files, tmp_path):
    """The trainer's LoRA targets decoder-layer linears only (lora_to_gguf refuses anything else),
    which the restricted file copies unchanged: the adapter converted against it gives the kept
    logits of the full draft with the same adapter, and moves them by torch's delta (up to the
    KV cache's rounding: measured corr 1 - 4e-6, relative error 0.003)."""
    model, _, draft, r = files
    adapter, want = random_lora(derive_draft(model, "0-1"), tmp_path / "a", target_modules="all-linear",
                                sigma=0.5, seed=1)
    moved = {}
    for name, path in (("full", draft), ("cut", r)):
        eng = _engine(path)
        try:
            base = eng.start().forward(PROMPT, len(PROMPT))
            eng.load_lora("v1", lora_to_gguf(adapter, tmp_path / f"lora-{name}.gguf", path))
            eng.set_lora("v1")
            moved[name] = (eng.start().forward(PROMPT, len(PROMPT)), base)
        finally:
            eng.close()
    torch.testing.assert_close(moved["cut"][0][:, KEEP], moved["full"][0][:, KEEP], rtol=1e-5, atol=1e-5)
    got = (moved["cut"][0] - moved["cut"][1])[:, KEEP].numpy()
    corr = float(np.corrcoef(want[:, KEEP].ravel(), got.ravel())[0, 1])
    rel = float(np.linalg.norm(got - want[:, KEEP]) / np.linalg.norm(want[:, KEEP]))
    assert corr > 0.9999 and rel < 1e-2, (corr, rel)


@pytest.fixture(scope="module")
def decoder(files):
    """A tiny target on llama.cpp (the full tiny GGUF) with the restricted draft of its blocks 0-1."""
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from tiny import char_tokenizer

    from decoder.speculative import DecoderConfig, SpeculativeDecoder

    model, src, _, r = files
    tgt, dr = _engine(src), _engine(r)
    dec = SpeculativeDecoder(model, derive_draft(model, "0-1"), char_tokenizer(),
                             DecoderConfig(draft_vocab=torch.from_numpy(np.sort(KEEP)), ngram_gate=False),
                             engine=tgt, draft_engine=dr)
    yield dec
    tgt.close()
    dr.close()


@needs_llamacpp
@pytest.mark.parametrize("gate", [None, [6.0, 0, 0, 0, 0, 0]])
def test_greedy_with_the_restricted_draft_equals_plain(decoder, gate):
    from decoder.speculative import DecodeRequest

    decoder.copy_gate = None if gate is None else np.asarray(gate)
    proposed = accepted = 0
    try:
        for prompt in (PROMPT, [7, 140, 7, 140, 7, 140, 7], list(range(3, 60, 4))):
            plain = decoder.generate(DecodeRequest(prompt, max_new_tokens=24, gamma=0, ignore_eos=True))
            spec = decoder.generate(DecodeRequest(prompt, max_new_tokens=24, gamma=3, ignore_eos=True, proposer="draft"))
            assert spec.output_ids == plain.output_ids, prompt
            proposed += sum(s.proposed for s in spec.steps)
            accepted += sum(s.accepted for s in spec.steps)
        assert proposed > 0 and 0 < accepted < proposed  # it speculated, and both outcomes were verified
    finally:
        decoder.copy_gate = None


@needs_llamacpp
def test_its_proposals_carry_zero_probability_outside_the_kept_ids(decoder):
    from decoder.proposers.draft import build
    from decoder.sampling import SamplingParams

    p = build(decoder, None).propose(PROMPT, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    out = np.setdiff1d(np.arange(VOCAB), KEEP)
    assert p.q.shape == (3, VOCAB) and float(p.q[:, out].abs().max()) == 0.0
    assert all(t in set(KEEP.tolist()) for t in p.tokens)
    torch.testing.assert_close(p.q.sum(-1), torch.ones(3), rtol=1e-5, atol=1e-5)


@needs_llamacpp
def test_sampling_with_the_restricted_draft_emits_the_targets_distribution(decoder):
    """T = 1: the first emitted token fits the target's p (chi-square), the draft's q being 0 on
    two thirds of the vocabulary."""
    from test_speculative import first_token_chi_square

    chi2, crit = first_token_chi_square(decoder, PROMPT[:8], 800, gamma=2)
    assert chi2 < crit, (chi2, crit)


@needs_llamacpp
def test_a_decoder_refuses_a_restricted_draft_with_other_ids(files):
    from tiny import char_tokenizer

    from decoder.speculative import DecoderConfig, SpeculativeDecoder

    model, src, _, r = files
    tgt, dr = _engine(src), _engine(r)
    try:
        for cfg in (DecoderConfig(), DecoderConfig(draft_vocab=torch.arange(0, 40))):
            with pytest.raises(ValueError, match="restricted vocabulary"):
                SpeculativeDecoder(model, derive_draft(model, "0-1"), char_tokenizer(), cfg, engine=tgt, draft_engine=dr)
    finally:
        tgt.close()
        dr.close()


@needs_llamacpp
@pytest.mark.parametrize("which, cut", [(0, 8), (1, 40), (1, None)])  # bytes cut from the end; None: emptied
def test_a_truncated_sidecar_is_named_with_its_fix_and_the_fix_works(files, tmp_path, which, cut):
    """An interrupted write or copy of the draft cache leaves a short .npy: numpy's ValueError ("Failed
    to read all data for array", "mmap length is greater than file size") or EOFError went up raw
    through `serve`'s start. It is an EngineError naming the file and saying to delete it, and
    deleting it is enough: the cache writes the three files again."""
    import shutil

    from decoder.engines.base import EngineError

    _, _, draft, r = files
    for f in (r, *ge.restricted_sidecars(r)):
        shutil.copy(f, tmp_path / f.name)
    copy = tmp_path / r.name
    bad = ge.restricted_sidecars(copy)[which]
    data = bad.read_bytes()
    bad.write_bytes(b"" if cut is None else data[:len(data) - cut])
    with pytest.raises(EngineError) as e:
        _engine(copy)
    assert bad.name in str(e.value) and f"delete {bad} so it is written again" in str(e.value)
    bad.unlink()
    assert restricted_draft_gguf(draft, torch.from_numpy(KEEP), tmp_path) == copy
    eng = _engine(copy)
    try:
        assert torch.equal(eng.out_ids, torch.from_numpy(KEEP))
    finally:
        eng.close()


def test_q8_0_input_rows_are_ggmls_dequantisation():
    """The engine's own Q8_0 path (the packaged draft's token_embd) gives gguf-py's dequantised rows
    bit for bit (x = f32(d) * q per 32-weight block)."""
    from types import SimpleNamespace

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from decoder.engines.llamacpp import LlamaCppEngine

    w = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32)
    table = quantize(w, GGMLQuantizationType.Q8_0)
    eng = SimpleNamespace(_in_table=table, _in_type=GGMLQuantizationType.Q8_0, vocab_size=50, hidden_size=64)
    got = LlamaCppEngine.input_embeddings(eng, [3, 49, 3, 0])
    assert got.dtype == np.float32 and got.shape == (4, 64)
    assert np.array_equal(got, dequantize(table[[3, 49, 3, 0]], GGMLQuantizationType.Q8_0).reshape(4, 64))
    assert np.abs(got[0] - w[3]).max() < 0.02


@needs_llamacpp
@pytest.mark.slow
def test_packaged_restricted_draft_equals_the_full_one_on_its_ids(tmp_path):
    """SmolLM2-135M's 4-layer draft (Q4_1 blocks, Q8_0 tied head), V' = 8192: the restricted file's
    logits on the kept ids are the full draft's, bit for bit, over a prompt whose tokens are partly
    outside V'."""
    from decoder.engines.llamacpp import LlamaCppEngine
    from decoder.models.loading import load_pair
    from decoder.models.packaged import packaged_gguf
    from decoder.vocab import frequent_token_ids

    tok = load_pair("smollm2-135m", "layers:0-3").tokenizer
    ids = frequent_token_ids(tok, 8192)
    full_path = derived_draft_gguf(packaged_gguf("smollm2-135m"), [0, 1, 2, 3], tmp_path)
    x = tok("Zygomorphic flowers: the quaternion's eigendecomposition, said Xochitl.")["input_ids"]
    assert not torch.isin(torch.tensor(x), ids).all()
    full = LlamaCppEngine(full_path, n_ctx=256, threads=1)
    cut = LlamaCppEngine(restricted_draft_gguf(full_path, ids), n_ctx=256, threads=1)
    try:
        want, got = full.start().forward(x, len(x)), cut.start().forward(x, len(x))
    finally:
        full.close()
        cut.close()
    assert torch.equal(got[:, ids], want[:, ids])
    assert torch.isinf(got[:, ~torch.isin(torch.arange(got.shape[1]), ids)]).all()
