"""The engine seam (decoder/engines/): choosing one, the llama.cpp engine against llama-cpp-python's
own high-level API on the packaged GGUF, and the decoder on it (greedy equals plain; T = 1 and
T = 0.7 / top-p 0.9 first-token chi-square with a planted proposal, accepted and rejected)."""


import numpy as np
import pytest
import torch

from decoder.engines.base import EngineError
from decoder.engines.llamacpp import KV_CACHE_TYPES, LlamaCppEngine
from decoder.engines.llamacpp_lib import llama_call, llamacpp_available
from decoder.engines.registry import choose_engine
from decoder.engines.torch_engine import TorchEngine
from decoder.sampling import SamplingParams, process_logits
from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder
from test_proposers import assert_planted_first_token_is_lossless

needs_llamacpp = pytest.mark.skipif(not llamacpp_available(), reason="llama-cpp-python is not installed")


def test_choose_engine_explains_auto_and_refuses_what_cannot_run(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    auto = choose_engine("auto", str(d))
    assert auto.name == "torch" and "not a GGUF" in auto.reason and auto.target is None
    assert choose_engine("torch", "smollm2-135m").reason.startswith("asked for")
    with pytest.raises(EngineError, match="not a GGUF"):
        choose_engine("llamacpp", "HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(EngineError, match="device 'cuda:0'"):
        choose_engine("llamacpp", "smollm2-135m", device="cuda:0")
    with pytest.raises(EngineError, match="use one of"):
        choose_engine("vllm", "smollm2-135m")


def test_ngram_min_n_follows_the_engine_unless_set(target, other_draft, tok):
    from decoder.speculative import DecoderConfig

    assert SpeculativeDecoder(target, other_draft, tok).ngram_min_n == 1  # torch: every match is worth proposing
    assert SpeculativeDecoder(target, other_draft, tok, DecoderConfig(ngram_min_n=3)).ngram_history.min_n == 3
    with pytest.raises(ValueError, match="ngram_min_n"):
        DecoderConfig(ngram_min_n=5, ngram_max_n=4)


def test_torch_engine_truncate_replays_like_a_fresh_sequence(target):
    eng = TorchEngine(target)
    a = eng.start()
    a.forward([1, 2, 3, 4], 1)
    a.truncate(2)
    assert a.length == 2
    got = a.forward([7, 8], 2)
    b = eng.start()
    want = b.forward([1, 2, 7, 8], 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- a tiny F32 GGUF on llama.cpp (fast) -----------------------------------------------------------
@pytest.fixture
def tiny_gguf(tmp_path):
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    from test_gguf_export import tiny_model, write_tiny_gguf

    return write_tiny_gguf(tiny_model(), tmp_path / "tiny.gguf")


def test_extra_buffers_follow_the_amx_probe_and_the_override(monkeypatch):
    """A build with the AMX path is probed (a miscompiled one faults on its first batched matmul);
    one without it is not; DRAFTD_LLAMA_EXTRA_BUFTS overrides both."""
    from decoder.engines.llamacpp_lib import extra_buffer_policy

    monkeypatch.delenv("DRAFTD_LLAMA_EXTRA_BUFTS", raising=False)
    amx = "CPU : SSE3 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
    calls = []

    def probe(result):
        return lambda: calls.append(1) or result

    use, why = extra_buffer_policy(amx, probe((False, "probe killed by signal 11")))
    assert use is False and "signal 11" in why and "-fno-dse" in why
    assert extra_buffer_policy(amx, probe((True, "probe decoded a batch")))[0] is True
    use, why = extra_buffer_policy(amx, probe((None, "probe exited 3")))
    assert use is False and "unprobed" in why
    assert len(calls) == 3
    assert extra_buffer_policy("CPU : SSE3 = 1 | AVX2 = 1 | REPACK = 1 | ", probe((False, "x")))[0] is True
    assert len(calls) == 3  # no AMX path: nothing to probe
    monkeypatch.setenv("DRAFTD_LLAMA_EXTRA_BUFTS", "1")
    assert extra_buffer_policy(amx, probe((False, "x"))) == (True, "DRAFTD_LLAMA_EXTRA_BUFTS=1")
    monkeypatch.setenv("DRAFTD_LLAMA_EXTRA_BUFTS", "0")
    assert extra_buffer_policy("CPU : AVX2 = 1 | ", probe((True, "x")))[0] is False
    assert len(calls) == 3


def test_extra_buffers_refuse_an_unknown_override(monkeypatch):
    from decoder.engines.llamacpp_lib import extra_buffer_policy

    for bad in ("yes", "2", "off", "true"):
        monkeypatch.setenv("DRAFTD_LLAMA_EXTRA_BUFTS", bad)
        with pytest.raises(EngineError, match=f"DRAFTD_LLAMA_EXTRA_BUFTS={bad!r}: use 1"):
            extra_buffer_policy("CPU : AMX_INT8 = 1 | ", lambda: (True, "x"))
    monkeypatch.setenv("DRAFTD_LLAMA_EXTRA_BUFTS", " 1 ")
    assert extra_buffer_policy("CPU : AMX_INT8 = 1 | ", lambda: (False, "x"))[0] is True


@needs_llamacpp
@pytest.mark.parametrize("rc, ok, cached", [(-11, False, True), (-4, False, True), (-2, None, False),
                                            (-9, None, False), (-6, None, False), (3, None, False), (0, True, True)],
                         ids=["segv", "sigill", "sigint", "sigkill", "abort", "no-load", "decoded"])
def test_only_a_fault_or_a_decoded_batch_is_kept_as_the_builds_answer(tmp_path, monkeypatch, rc, ok, cached):
    """A Ctrl-C or an OOM kill of the probe child said nothing about the build but was cached
    forever as "the AMX matmul faults" (QA); only SIGSEGV/SIGILL/SIGBUS or a decoded batch are kept."""
    import json
    import subprocess

    import decoder.engines.llamacpp_lib as E

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, rc, b"", b""))
    from decoder.models.packaged import packaged_gguf

    got, detail = E._probe_extra_buffers(packaged_gguf("smollm2-135m"))
    assert got is ok, detail
    cache = tmp_path / "llama-extra-buffers.json"
    assert cache.exists() is cached
    if cached:
        assert list(json.loads(cache.read_text()).values()) == [[ok, detail]]
        assert E._probe_extra_buffers(packaged_gguf("smollm2-135m")) == (ok, f"{detail}, cached")


@needs_llamacpp
def test_a_probe_on_a_model_other_than_the_packaged_one_proves_nothing(tmp_path, monkeypatch, tiny_gguf):
    """Without the packaged Q4_1 model the probe would run on whatever loads first (an F32 model
    never reaches the AMX matmul): its success is not taken for the build's."""
    import subprocess

    import decoder.engines.llamacpp_lib as E
    import decoder.models.packaged as M

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, b"", b""))
    monkeypatch.setattr(M, "packaged_gguf", lambda name: (_ for _ in ()).throw(M.ModelLoadError("not installed")))
    ok, detail = E._probe_extra_buffers(tiny_gguf)
    assert ok is None and "not installed" in detail and not (tmp_path / "llama-extra-buffers.json").exists()


def run_child_ok(script: str, *args) -> None:
    """Run ``script`` in a child Python process (a fault kills only the child) and assert it
    exited 0 after printing "ok"."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-2000:])


_CLOSE_DURING_DECODE = """
import sys, threading
from decoder.engines.base import EngineError
from decoder.engines.llamacpp import LlamaCppEngine
eng = LlamaCppEngine(sys.argv[1], n_ctx=256, threads=1)
seq = eng.start()
errors = []
def decode():
    try:
        for _ in range(200):
            seq.truncate(0)
            seq.forward(list(range(3, 60)), 8)
    except EngineError as e:
        errors.append(e)
t = threading.Thread(target=decode)
t.start()
eng.close()  # from another thread, mid-decode
t.join()
assert errors and "closed" in str(errors[0]), errors
print("ok")
"""


@needs_llamacpp
def test_close_from_another_thread_waits_for_the_running_decode(tiny_gguf):
    """close() during a decode freed the context under it (SIGSEGV, QA); it now waits for the decode,
    and the decoding thread's next call raises EngineError. In a child: a regression kills only it."""
    run_child_ok(_CLOSE_DURING_DECODE, tiny_gguf)


@needs_llamacpp
def test_llama_call_hands_back_errors_and_keeps_serving(monkeypatch):
    import decoder.engines.llamacpp_lib as E

    monkeypatch.setattr(E, "_route", True)
    with pytest.raises(ZeroDivisionError):
        E.llama_call(lambda: 1 / 0)
    assert E.llama_call(lambda a, b: a + b, 2, 3) == 5
    assert E.llama_call(lambda: E.llama_call(lambda: 7)) == 7  # re-entrant: runs in place


@needs_llamacpp
def test_every_llama_cpp_model_in_the_process_follows_the_extra_buffer_decision(tiny_gguf):
    """Ours and llama_cpp.Llama's (the bench peer) load with the one use_extra_bufts decided for
    the process, and a batched forward runs (on a miscompiled AMX build it faulted)."""
    import llama_cpp.llama_cpp as L

    from decoder.engines.llamacpp_lib import llama_extra_buffers

    use, why = llama_extra_buffers(tiny_gguf)
    assert why and bool(L.llama_model_default_params().use_extra_bufts) is use
    eng = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=2)
    assert eng.describe()["extra_buffer_types"] is use
    assert eng.start().forward(list(range(3, 11)), 8).shape == (8, eng.vocab_size)
    eng.close()


@needs_llamacpp
def test_the_llama_cpp_build_is_the_one_scripts_install_makes():
    """scripts/install builds llama.cpp without OpenMP: with it, a decode on any thread but the
    main one (the serving loop's) ran 2.5-5x slower at 2 threads (bench/verify_cost_bench.py
    measures both threads). A failure here means another build is installed: rerun scripts/install."""
    from decoder.engines.llamacpp_lib import bindings

    info = bindings().llama_print_system_info().decode()
    assert "OPENMP = 1" not in info, info


@needs_llamacpp
def test_decoding_on_llama_cpp_runs_torch_single_threaded_and_restores_it(tiny_gguf, target):
    """torch's OpenMP workers spinning after the decoder's small ops took the cores from
    llama.cpp's pool (our plain decoding at half llama.cpp's speed); torch_threads_for sets one
    thread while decoding on llama.cpp, restores the count after (an error included), and leaves
    the transformers engine alone."""
    from decoder.engines.registry import torch_threads_for

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
        with torch_threads_for(eng):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(KeyError), torch_threads_for(eng):
            raise KeyError("a failed request")
        assert torch.get_num_threads() == 2
        with torch_threads_for(TorchEngine(target)):
            assert torch.get_num_threads() == 2
        eng.close()
    finally:
        torch.set_num_threads(before)


_TORCH_BF16_BETWEEN_DECODES = """
import sys, torch
from decoder.engines.llamacpp import LlamaCppEngine
engine = LlamaCppEngine(sys.argv[1], n_ctx=256, threads=2)
seq = engine.start()
first = seq.forward(list(range(10, 40)), 4)
a, b = torch.randn(256, 576, dtype=torch.bfloat16), torch.randn(576, 1536, dtype=torch.bfloat16)
float((a @ b).sum())  # oneDNN: AMX kernels on an AMX CPU, which release the thread's tiles
seq.truncate(0)
again = seq.forward(list(range(10, 40)), 4)
assert torch.equal(first, again), float((first - again).abs().max())
print("ok")
"""


@needs_llamacpp
@pytest.mark.slow
def test_a_torch_bf16_matmul_between_decodes_does_not_kill_the_process(gguf):
    """On a CPU with AMX, a torch bf16 matmul between two batched decodes on one thread killed the
    process with SIGILL (ggml's tiles released by oneDNN); in a child, so a regression fails here
    instead of ending the suite. The packaged Q4_1 model: its weights take the AMX path."""
    run_child_ok(_TORCH_BF16_BETWEEN_DECODES, gguf)


def test_llamacpp_engine_refuses_calls_after_close_instead_of_crashing(tiny_gguf, tmp_path):
    """After close() the context, memory and batch are freed: a call would read freed memory
    (it segfaulted); every entry point raises EngineError, and close() twice is a no-op."""
    e = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
    seq = e.start()
    seq.forward([5, 6, 7], 1)
    e.close()
    e.close()
    calls = {"start": e.start, "forward": lambda: seq.forward([8], 1), "truncate": lambda: seq.truncate(1),
             "set_lora": lambda: e.set_lora(None), "load_lora": lambda: e.load_lora("x", tmp_path / "x.gguf")}
    for name, call in calls.items():
        with pytest.raises(EngineError, match="closed"):
            call()
    assert e.describe()["engine"] == "llamacpp"  # no call into llama.cpp


@pytest.mark.parametrize("n_batch", [512, 4], ids=["one-batch", "chunked"])
def test_llamacpp_engine_with_embeddings_returns_the_last_keep_rows(tiny_gguf, n_batch):
    """embeddings=True makes llama.cpp output every token of a batch whatever the output flags
    say; logits and hidden states are still those of the last ``keep`` positions (they were the
    first ``keep``), equal to the rows of a keep = n call and to the logits without embeddings."""
    ids = [5, 80, 12, 200, 33, 256, 7, 140, 99, 64]
    emb = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1, n_batch=n_batch, embeddings=True)
    plain = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1, n_batch=n_batch)
    try:
        all_logits, all_hidden = emb.start().forward(ids, len(ids), hidden=True)
        logits, hidden = emb.start().forward(ids, 3, hidden=True)
        assert logits.shape == (3, emb.vocab_size) and hidden.shape == (3, emb.hidden_size)
        torch.testing.assert_close(logits, all_logits[-3:], rtol=0, atol=1e-5)
        torch.testing.assert_close(hidden, all_hidden[-3:], rtol=0, atol=1e-5)
        torch.testing.assert_close(emb.start().forward(ids, 3), plain.start().forward(ids, 3), rtol=0, atol=1e-4)
        # extraction is switched per call (llama_set_embeddings): calls with and without hidden
        # states, interleaved on one sequence, give the rows a plain engine and a one-pass call do
        seq, ref = emb.start(), plain.start()
        lg, hs = seq.forward(ids[:5], 2, hidden=True)
        torch.testing.assert_close(lg, ref.forward(ids[:5], 2), rtol=0, atol=1e-4)
        torch.testing.assert_close(hs, all_hidden[3:5], rtol=0, atol=1e-4)
        torch.testing.assert_close(seq.forward(ids[5:8], 3), ref.forward(ids[5:8], 3), rtol=0, atol=1e-4)
        lg, hs = seq.forward(ids[8:], 2, hidden=True)
        torch.testing.assert_close(hs, all_hidden[8:], rtol=0, atol=1e-4)
        torch.testing.assert_close(lg, ref.forward(ids[8:], 2), rtol=0, atol=1e-4)
    finally:
        emb.close()
        plain.close()


def test_a_damaged_cached_lora_gguf_is_converted_again(tiny_gguf, tmp_path, monkeypatch):
    """A LoRA GGUF in the cache that llama.cpp refuses (damaged on disk) is reconverted once, so
    the version loads on the llama.cpp draft instead of failing on every retry for good."""
    from types import SimpleNamespace

    from test_gguf_export import random_lora, tiny_model

    from decoder.models import gguf_export as ge
    from decoder.adapters import AdapterManager

    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "cache"))
    adapter, _ = random_lora(tiny_model(), tmp_path / "a", target_modules=["q_proj", "v_proj"], sigma=0.1, seed=0)
    eng = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
    cached = (tmp_path / "cache" / "gguf" / "lora" /
              f"lora-{ge.adapter_sha256(adapter)[:16]}-{ge.file_digest16(tiny_gguf)}-v{ge.LORA_FORMAT_VERSION}.gguf")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF" + bytes(60))  # what a damaged cache entry looks like to llama.cpp
    dec = SimpleNamespace(draft=tiny_model(), draft_engine=eng, serving=None, adapter_version=0, between_requests=[])
    try:
        AdapterManager(dec, registry=None)._load_on_engine(1, "v1", adapter)
        assert eng.loras == ["v1"] and cached.stat().st_size > 64
        eng.set_lora("v1")
    finally:
        eng.close()


def test_the_draft_cannot_share_the_targets_engine(tiny_gguf, tok):
    """One sequence per engine: a draft on the target's own engine would clear and overwrite the
    target's KV cache at every proposal."""
    from test_gguf_export import tiny_model

    eng = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
    try:
        m = tiny_model()
        with pytest.raises(ValueError, match="draft_engine is the target's engine"):
            SpeculativeDecoder(m, m, tok, engine=eng, draft_engine=eng)
    finally:
        eng.close()


# ---- the packaged GGUF on llama.cpp --------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf():
    from decoder.models.packaged import packaged_gguf

    return packaged_gguf("smollm2-135m")


@pytest.fixture(scope="module")
def engine(gguf):
    if not llamacpp_available():
        pytest.skip("llama-cpp-python is not installed")
    e = LlamaCppEngine(gguf, n_ctx=512, threads=2)
    yield e
    e.close()


@pytest.fixture(scope="module")
def real(gguf):
    from decoder.models.loading import load_pair

    return load_pair("smollm2-135m", "layers:0-3")


PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
# a prompt whose greedy continuation repeats the prompt itself, so the n-gram proposer (no history)
# has proposals accepted whatever float rounding the build's kernels leave: PROMPT's continuation
# is a near-tie ("In other words, the answer..." with the blocked attention patch, "The answer
# is: 2 ... The answer is: 2" without), and only the second repeats
COUNTING = "Count: one, two, three, four, five, six, seven, eight, nine, ten. Again: one, two, three,"


def _mapped_copies(stem: str) -> set[str]:
    """The files of library ``stem`` mapped into this process (each a separate instance)."""
    from pathlib import Path

    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if Path(line.split()[-1]).name.startswith(stem + ".so")}


def test_a_threadpool_refuses_thread_counts_and_polling_levels_ggml_has_not():
    from decoder.engines.llamacpp_lib import attach_threadpool

    with pytest.raises(ValueError, match="n_threads=0"):
        attach_threadpool(None, 0)
    with pytest.raises(ValueError, match="poll=101.*0 \\(none\\) to 100"):
        attach_threadpool(None, 2, poll=101)


@pytest.mark.parametrize("value", ["abc", "50.5", "-1", "101", " 1e2"])
def test_a_bad_polling_level_is_refused_before_a_model_loads(monkeypatch, tiny_gguf, value):
    """DRAFTD_LLAMA_POLL=abc was a 77-line traceback from int() at serve's start, and a bad value
    raised after the context existed, leaking it and the model (the break session)."""
    monkeypatch.setenv("DRAFTD_LLAMA_POLL", value)
    with pytest.raises(EngineError, match=r"DRAFTD_LLAMA_POLL=.*whole number from 0 \(no polling\) to 100"):
        LlamaCppEngine(tiny_gguf, n_ctx=64, threads=2)


def test_the_polling_level_defaults_to_llama_servers_and_takes_a_whole_number(monkeypatch):
    from decoder.engines.llamacpp_lib import poll_level

    monkeypatch.delenv("DRAFTD_LLAMA_POLL", raising=False)
    assert poll_level() == 50
    monkeypatch.setenv("DRAFTD_LLAMA_POLL", "0")
    assert poll_level() == 0
    monkeypatch.setenv("DRAFTD_LLAMA_POLL", "100")
    assert poll_level() == 100


@needs_llamacpp
def test_the_threadpool_is_made_by_the_ggml_copy_llama_cpp_computes_with(tiny_gguf):
    """llama-cpp-python's wheel ships each library as separate files (.so, .so.0, .so.0.x.y): a pool
    made by a second copy of libggml-cpu (its own globals) and run by the first gave NaN logits. The
    engine's pool comes from the copy already mapped: one copy of each, and the same logits as the
    same tokens decoded with llama.cpp's per-call threads."""
    e = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=2)
    try:
        assert e._pool is not None
        for stem in ("libggml-cpu", "libggml-base", "libllama"):
            assert len(_mapped_copies(stem)) == 1, _mapped_copies(stem)
        toks = [5, 6, 7, 8, 9, 10]
        pooled = e.start().forward(toks, 3).clone()
        from decoder.engines.llamacpp_lib import free_threadpool

        free_threadpool(e.ctx, e._pool)  # back to a pool made and joined inside each decode
        e._pool = None
        plain = e.start().forward(toks, 3)
        assert torch.isfinite(pooled).all()
        torch.testing.assert_close(pooled, plain, rtol=0, atol=0)
    finally:
        e.close()


@needs_llamacpp
def test_contexts_of_one_thread_count_share_one_threadpool_and_compute_the_same(tiny_gguf):
    """The target's and the draft's contexts had a pool each, and each pool's workers polled for
    a while after its graphs: the target's spun on the cores while the draft computed and the
    draft's while the target verified (bench/RESULTS.md, "Twenty-fifth session"). Contexts of
    one thread count and polling level now share one pool, freed with the last of them; decodes
    on two engines from two threads at once give the logits each gives alone (the pool's lock
    keeps them apart)."""
    import threading

    a = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=2)
    b = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=2)
    c = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
    try:
        assert a._pool is not None and a._pool is b._pool and a._pool.users >= 2
        assert c._pool is not a._pool
        toks = [[5, 6, 7, 8, 9, 10], [11, 3, 4, 12, 2, 9]]
        alone = [a.start().forward(toks[0], 3).clone(), b.start().forward(toks[1], 3).clone()]
        got: dict[int, list] = {0: [], 1: []}

        def run(i: int, e) -> None:
            for _ in range(20):
                got[i].append(e.start().forward(toks[i], 3).clone())

        ts = [threading.Thread(target=run, args=(0, a)), threading.Thread(target=run, args=(1, b))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for i in (0, 1):
            assert len(got[i]) == 20
            for x in got[i]:
                torch.testing.assert_close(x, alone[i], rtol=0, atol=0)
        users = a._pool.users
        b.close()
        assert a._pool.users == users - 1  # still a's, and still computing
        torch.testing.assert_close(a.start().forward(toks[0], 3), alone[0], rtol=0, atol=0)
    finally:
        for e in (a, b, c):
            e.close()


@needs_llamacpp
@pytest.mark.slow
def test_llamacpp_engine_logits_equal_llama_cpp_pythons_own(engine, gguf, real):
    """Prefill + batched + one-token logits from our low-level calls against ``Llama.eval``'s
    scores (llama-cpp-python's high-level path, logits_all) on the same file."""
    from llama_cpp import Llama

    ids = real.tokenizer(PROMPT)["input_ids"]
    ref = Llama(model_path=str(gguf), n_ctx=512, n_threads=2, logits_all=True, flash_attn=True, verbose=False,
                type_v=KV_CACHE_TYPES[engine.v_cache])  # the V cache type ours runs
    llama_call(ref.eval, ids)  # llama.cpp's own thread (AMX tiles, see llama_call)
    want = np.array(ref.scores[: len(ids)])  # (P, V): row j = logits after ids[: j + 1]
    seq = engine.start()
    first = seq.forward(ids[:-3], 1)  # prefill, last row only
    block = seq.forward(ids[-3:], 3)  # a verification-shaped call: 3 rows
    assert seq.length == len(ids)
    assert first.shape == (1, engine.vocab_size) and block.shape == (3, engine.vocab_size)
    # same argmax everywhere, logits within llama.cpp's batch-split noise
    for got, row in ((first[0], len(ids) - 4), *((block[j], len(ids) - 3 + j) for j in range(3))):
        assert int(got.argmax()) == int(np.argmax(want[row]))
        assert float(np.abs(got.numpy() - want[row]).max()) < 1e-3  # the same kernels, the same settings
    # truncate, then the same tokens again: the same logits as before
    seq.truncate(len(ids) - 3)
    again = seq.forward(ids[-3:], 3)
    torch.testing.assert_close(again, block, rtol=0, atol=1e-4)
    assert engine.eos_ids and all(0 <= t < engine.vocab_size for t in engine.eos_ids)


@needs_llamacpp
@pytest.mark.slow
def test_decoder_on_llamacpp_greedy_equals_plain_and_llama_cpps_own_greedy(engine, gguf, real):
    from llama_cpp import Llama

    dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=engine)
    ids = real.tokenizer(PROMPT)["input_ids"]
    plain = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True))
    spec = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=3, ignore_eos=True, proposer="ngram"))
    assert plain.record()["engine"] == "llamacpp" and spec.proposer == "ngram"
    assert dec.ngram_min_n == 2 and dec.ngram_history.min_n == 2  # llama.cpp: verified rows cost, match n >= 2
    assert spec.counts.num_draft_tokens > 0  # the prompt repeats itself: the n-gram proposer has matches
    assert spec.output_ids == plain.output_ids
    # plain greedy on our engine = argmax of llama-cpp-python's own logits at every step
    ref = Llama(model_path=str(gguf), n_ctx=512, n_threads=2, logits_all=True, flash_attn=True, verbose=False,
                type_v=KV_CACHE_TYPES[engine.v_cache])  # the V cache type ours runs
    llama_call(ref.eval, ids + plain.output_ids[:-1])
    scores = np.array(ref.scores[len(ids) - 1 : len(ids) - 1 + len(plain.output_ids)])
    for j, t in enumerate(plain.output_ids):
        top2 = np.sort(scores[j])[-2:]
        if top2[1] - top2[0] > 0.05:  # above float noise: must be the argmax
            assert t == int(np.argmax(scores[j])), j


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9)], ids=["t1", "t0.7-p0.9"])
def test_decoder_on_llamacpp_sampling_is_lossless_first_token_chi_square(engine, real, params):
    """The first emitted token ~ p (from a fresh llama.cpp forward, processed like plain sampling),
    with a one-hot proposal planted in the n-gram history: accepted with probability p(x),
    else the residual; both paths exercised."""
    dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=engine)
    ids = real.tokenizer("I went to the")["input_ids"]  # p(top) 0.15 at T = 1, 0.48 at T = 0.7 / top-p 0.9
    seq = engine.start()
    p = process_logits(seq.forward(ids, 1)[0], params)
    assert_planted_first_token_is_lossless(dec, ids, p, params)


@needs_llamacpp
@pytest.mark.slow
def test_adapter_versions_hot_swap_on_the_llamacpp_draft(reg, tmp_path):
    """A promoted peft LoRA is converted to GGUF, loaded on the draft's llama.cpp context and set
    at the next request boundary: the record names the version, the draft's logits move by the
    adapter's delta (as the torch draft's do), greedy output stays plain's; a rollback to v0
    restores the base draft's logits exactly."""
    from adapt_helpers import random_lora

    from decoder.adapters import AdapterManager
    from decoder.models.loading import load_pair

    pair = load_pair("smollm2-135m", "layers:0-3")  # its own copy: the manager injects peft layers in place
    choice = choose_engine("llamacpp", "smollm2-135m", "cpu", "layers:0-3", threads=2)
    assert choice.draft is not None and choice.draft.path.name.endswith("layers-0-3.gguf")
    dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, engine=choice.target, draft_engine=choice.draft)
    mods = ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.2.mlp.down_proj")
    x = pair.tokenizer("The capital of France is")["input_ids"]

    def draft_logits():  # (P, V): every position
        return choice.draft.start().forward(x, len(x))

    with torch.inference_mode():
        torch_base = pair.draft(torch.tensor([x])).logits[0]
    base = draft_logits()
    v1 = reg.register(random_lora(pair.draft, tmp_path / "r1", scale=1.5, seed=3, r=4, modules=mods))
    mgr = AdapterManager(dec, reg.registry)
    ids = pair.tokenizer(PROMPT)["input_ids"]
    plain = dec.generate(DecodeRequest(ids, SamplingParams(), 16, gamma=0, ignore_eos=True)).output_ids
    reg.registry.promote(v1, "test")
    mgr.poll_once()
    r = dec.generate(DecodeRequest(ids, SamplingParams(), 16, gamma=2, ignore_eos=True, proposer="draft"))
    assert r.adapter_version == v1 and choice.draft.lora == f"v{v1}"
    assert r.output_ids == plain and r.counts.num_draft_tokens > 0
    adapted = draft_logits()
    with torch.inference_mode():
        torch_adapted = pair.draft(torch.tensor([x])).logits[0]  # peft's v1 is active on the torch draft
    d_llama, d_torch = (adapted - base).double().ravel(), (torch_adapted - torch_base).double().ravel()
    assert float(d_torch.std()) > 1.0  # the adapter moves the logits well above llama.cpp's 8-bit noise (~0.05)
    corr = float(torch.corrcoef(torch.stack([d_llama, d_torch]))[0, 1])
    assert corr > 0.98, (corr, float(d_torch.std()))
    reg.registry.rollback("test")
    mgr.poll_once()
    r0 = dec.generate(DecodeRequest(ids, SamplingParams(), 16, gamma=2, ignore_eos=True, proposer="draft"))
    assert r0.adapter_version == 0 and choice.draft.lora is None and r0.output_ids == plain
    torch.testing.assert_close(draft_logits(), base, rtol=0, atol=0)
    assert len(mgr.pause_ms) == 2 and mgr.status()["pause_ms"]["p99"] is not None


@needs_llamacpp
@pytest.mark.slow
def test_bench_on_llamacpp_puts_llama_cpps_own_generation_beside_ours(engine, gguf, real):
    from decoder.bench import BenchConfig, run_bench
    from decoder.workloads import Prompt

    dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=engine)
    res = run_bench(dec, [Prompt("prose", PROMPT)], BenchConfig(gammas=(2,), sampling=("greedy",), max_new_tokens=12,
                                                                hf=False, proposers=("ngram",), llamacpp=str(gguf)))
    rows = {(r["method"], r.get("proposer")): r for r in res["rows"]}
    assert set(rows) == {("plain", None), ("llamacpp_plain", None), ("spec", "ngram")}
    peer, plain, spec = rows[("llamacpp_plain", None)], rows[("plain", None)], rows[("spec", "ngram")]
    assert peer["tokens"] == 12 and peer["tokens_per_s"] > 0 and peer["ours_plain_vs_peer_median"] > 0
    assert peer["matches_ours_plain_share"] in (0.0, 1.0)
    for m in peer["mismatches"]:  # our plain vs llama.cpp's: only ever at a near-tie
        assert m["top2_margin"] is not None and m["top2_margin"] < 1.0
    assert spec["matches_plain"] is True and spec["matches_plain_share"] == 1.0 and spec["mismatches"] == []
    assert spec["verify_cost_vs_plain_step"] > 0 and plain["batched_vs_one_token_max_logit_diff"] is not None
    assert res["kernels"]["engine"]["engine"] == "llamacpp"


@needs_llamacpp
@pytest.mark.slow
def test_teacher_scoring_on_llamacpp_matches_the_torch_copy_and_its_records(engine, real):
    """Bootstrap scoring on the served GGUF (decoder.teacher.score_windows_engine) gives the records
    score_windows gives on the dequantised torch target: the same ids, and distributions within the
    two implementations' numerics: top-1 equal almost everywhere, top-k mass within 0.02 on average
    and 0.1 at worst (llama.cpp multiplies Q4_1 weights by activations it quantises to 8 bits, the
    torch copy multiplies the same dequantised weights in fp32; single positions differ by 0.05-0.06
    on some CPUs, 0.011 on average)."""
    from decoder.teacher import corpus_windows, score_windows, score_windows_engine
    from decoder.workloads import bootstrap_documents
    from store.schema import PairFingerprint

    fp = PairFingerprint("t", "d", "h")
    items = corpus_windows(real.tokenizer, bootstrap_documents("prose")[:2], 64, max_tokens=192)
    a = list(score_windows_engine(engine, items, "prose", fp, k=8, request_prefix="b"))
    b = list(score_windows(real.target, items, "prose", fp, k=8, request_prefix="b"))
    assert len(a) == len(b) == len(items)
    by_text = {tuple(y.output_ids.tolist()): y for y in b}  # score_windows batches by length: another order
    for x, (key, w) in zip(a, items):  # score_windows_engine keeps the items' order
        y = by_text[tuple(w[1:])]
        assert x.request_id == y.request_id == f"b:prose:{key}" and x.source == "prefill"
        assert x.prompt_ids.tolist() == [w[0]] and x.output_ids.tolist() == w[1:] == y.output_ids.tolist()
        assert x.topk_ids.shape == y.topk_ids.shape == (len(w) - 1, 8)
        assert (x.topk_ids[:, 0] == y.topk_ids[:, 0]).mean() >= 0.9
        np.testing.assert_allclose(x.topk_probs.astype(float).sum(1) + x.tail_mass, 1.0, atol=1e-3)  # stored as fp16
        gap = np.abs((1 - x.tail_mass) - (1 - y.tail_mass))
        assert gap.mean() < 0.02 and gap.max() < 0.1, (gap.mean(), gap.max())  # 0.011 and 0.04-0.06 seen


@needs_llamacpp
@pytest.mark.slow
def test_eagle_head_on_llamacpp_features_greedy_equals_plain(engine, gguf, real):
    """The feature-level proposer on llama.cpp's hidden states (embeddings=True, switched on per
    call): greedy output equals plain decoding on the same engine, with proposals accepted and
    rejected; an engine built without hidden states is refused with the fix."""
    from decoder.eagle import EagleHead
    from decoder.vocab import frequent_token_ids

    head = EagleHead.from_target(real.target, frequent_token_ids(real.tokenizer, 8192)).serving_copy(torch.float32)
    ids = real.tokenizer(PROMPT)["input_ids"]
    no_hidden = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=engine)
    no_hidden.eagle_head = head
    with pytest.raises(ValueError, match="embeddings=True"):
        no_hidden.generate(DecodeRequest(ids, SamplingParams(), 4, gamma=2, proposer="eagle"))
    emb = LlamaCppEngine(gguf, n_ctx=512, threads=2, embeddings=True)
    try:
        dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=emb)
        dec.eagle_head = head
        plain = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True))
        spec = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=2, ignore_eos=True, proposer="eagle"))
        assert spec.output_ids == plain.output_ids and spec.proposer == "eagle"
        # the head is untrained (from_target): its proposals are verified (drafted, counted), and
        # what it gets accepted is chance (0 of 45 to 2 of 41 on this prompt, by build); the accepted
        # path is the n-gram test's below and the head's own tests'
        assert spec.counts.num_draft_tokens > 0 and 0 <= spec.counts.num_accepted_tokens < spec.counts.num_draft_tokens
    finally:
        emb.close()


@needs_llamacpp
@pytest.mark.slow
def test_records_carry_llama_cpps_hidden_states_on_the_real_model(engine, gguf, real):
    """DecoderConfig.record_hidden on llama.cpp: the decode record's rows are llama.cpp's own
    hidden states of the prompt + output taken in one teacher-forced pass (row j at index
    P - 1 + j), within float16 rounding, while speculation (n-gram, proposals accepted) runs; the
    output equals plain decoding; an engine built without hidden states is refused at
    construction with the fix."""
    from decoder.speculative import DecoderConfig

    with pytest.raises(ValueError, match="embeddings=True"):
        SpeculativeDecoder(real.target, real.draft, real.tokenizer, DecoderConfig(record_hidden=True), engine=engine)
    emb = LlamaCppEngine(gguf, n_ctx=512, threads=2, embeddings=True)
    got = []
    try:
        dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer,
                                 DecoderConfig(record_hidden=True, record_prompt=True), sink=got.append, engine=emb)
        ids = real.tokenizer(COUNTING)["input_ids"]
        spec = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=3, ignore_eos=True, proposer="ngram"))
        plain = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True))
        assert spec.output_ids == plain.output_ids and spec.counts.num_accepted_tokens > 0
        pre, rec = got[0], got[1]
        _, hs = emb.start().forward(ids + spec.output_ids, len(ids) + len(spec.output_ids), hidden=True)
        P, N = len(ids), len(spec.output_ids)
        assert rec.hidden.shape == (N, emb.hidden_size) and pre.hidden.shape == (P - 1, emb.hidden_size)
        ref = hs.float()
        # one pass against step by step: llama.cpp's batched and one-row kernels round apart
        for got_rows, want in ((rec.hidden, ref[P - 1 : P - 1 + N]), (pre.hidden, ref[: P - 1])):
            g = torch.from_numpy(got_rows).float()
            cos = torch.nn.functional.cosine_similarity(g, want, dim=-1)
            assert float(cos.min()) > 0.999, cos
            assert float((g - want).abs().max()) < 0.05 * float(want.abs().max())
    finally:
        emb.close()


def _long_ids(real, n: int) -> list[int]:
    from decoder.workloads import prose_prompts

    ids: list[int] = []
    for p in prose_prompts(12, chars=2000):
        ids += real.tokenizer(p.text)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("v_cache, threads", [
    ("bf16", 2), ("f16", 1),
    pytest.param("f16", 2, marks=pytest.mark.xfail(strict=True, reason=(
        "llama.cpp's one-row flash attention over f16 K and f16 V splits a KV view of >= 512 cells across threads")))])
def test_a_verified_row_equals_the_same_row_decoded_alone_at_every_cache_length(gguf, real, v_cache, threads):
    """Losslessness rests on this: the target's logits for a position are the same bits whether the
    position is verified inside a block of γ + 1 rows or decoded alone (plain decoding), from short
    caches to caches past the 256 and 512-cell KV views, for γ = 1, 3, 5 and 8 (serve's largest).
    bf16 V at any thread count; f16 V (so ``auto`` there) for one sequence at one thread."""
    e = LlamaCppEngine(gguf, n_ctx=1024, threads=threads, v_cache=v_cache)
    try:
        ids = _long_ids(real, 960)
        for cached in (100, 300, 600, 940):
            seq = e.start()
            seq.forward(ids[:cached], 1)
            for gamma in (1, 3, 5, 8):  # rolled back after each, as speculation does after a rejection
                block_in = ids[cached : cached + gamma + 1]
                block = seq.forward(block_in, gamma + 1)  # (γ + 1, V): verification
                seq.truncate(cached)
                alone = torch.cat([seq.forward([t], 1) for t in block_in])  # (γ + 1, V): plain steps
                seq.truncate(cached)
                assert torch.equal(block, alone), (cached, gamma, float((block - alone).abs().max()))
    finally:
        e.close()


def test_the_v_cache_type_is_checked_before_loading(tmp_path):
    with pytest.raises(ValueError, match="v_cache='q4'"):
        LlamaCppEngine(tmp_path / "missing.gguf", v_cache="q4")


def test_auto_v_cache_takes_f16_only_for_one_sequence_at_one_thread_where_bf16_attention_is_slow():
    from decoder.engines.llamacpp import auto_v_cache

    assert auto_v_cache(1, 1, fast_bf16=False) == "f16"
    assert [auto_v_cache(n, t, fast_bf16=False) for n, t in ((1, 2), (2, 1), (4, 2), (8, 1))] == ["bf16"] * 4
    # bf16 in hardware or the blocked attention kernel: bf16 everywhere (faster there, and exact at any shape)
    assert [auto_v_cache(n, t, fast_bf16=True) for n, t in ((1, 1), (1, 2), (4, 2))] == ["bf16"] * 3


def _flags() -> list[str]:
    return next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])


def test_native_bf16_is_read_from_the_cpu_flags():
    from decoder.engines.llamacpp import cpu_native_bf16

    flags = _flags()
    assert cpu_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_fast_bf16_attention_where_the_blocked_kernel_is_compiled_and_not_switched_off():
    from decoder.engines.llamacpp import cpu_fast_bf16_attention

    flags = _flags()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    blocked = {"avx2", "fma", "f16c"} <= set(flags)
    assert cpu_fast_bf16_attention({}) == (native or blocked)
    assert cpu_fast_bf16_attention({"GGML_FA_BF16V_BLOCKED": "1"}) == (native or blocked)
    assert cpu_fast_bf16_attention({"GGML_FA_BF16V_BLOCKED": "0"}) == native  # upstream's kernel


@needs_llamacpp
def test_auto_v_cache_is_what_the_engine_runs(tiny_gguf):
    from decoder.engines.llamacpp import cpu_fast_bf16_attention

    one = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1)
    fused = LlamaCppEngine(tiny_gguf, n_ctx=64, threads=1, n_seq=2)
    try:
        assert (one.v_cache, fused.v_cache) == ("bf16" if cpu_fast_bf16_attention() else "f16", "bf16")
    finally:
        one.close(), fused.close()


@needs_llamacpp
@pytest.mark.slow
def test_long_served_prompts_greedy_equals_plain_whatever_is_proposed(gguf, real):
    """The class of inputs a held-out check found lossy (issue 35: a ~230-token chat prompt served
    twice with the n-gram proposer and the workload's history differed from plain decoding): chat
    prompts of 250-450 tokens, each served with the n-gram proposer at γ 3 twice (the second time
    its history holds the first answer, so most of it is proposed and accepted) and the draft at
    γ 3; every output equals plain greedy decoding token for token. The served decoder's n-gram
    gate decides from measured step costs how much to propose (on a fast host it may propose little),
    so the history's proposals are also forced through verification by a decoder without the gate."""
    from decoder.workloads import chat_format, prose_prompts

    e = LlamaCppEngine(gguf, n_ctx=1024, threads=2)
    try:
        dec = SpeculativeDecoder(real.target, real.draft, real.tokenizer, engine=e)
        ungated = SpeculativeDecoder(real.target, real.draft, real.tokenizer, DecoderConfig(ngram_gate=False), engine=e)
        prompts = [chat_format(real.tokenizer, p.text) for p in prose_prompts(40, chars=1500)]
        prompts = [ids for ids in prompts if 250 <= len(ids) <= 450][:2]
        assert len(prompts) == 2
        history_accepted = 0
        for i, ids in enumerate(prompts):
            def run(d=dec, **kw):
                return d.generate(DecodeRequest(ids, SamplingParams(), 32, ignore_eos=True, workload=f"w{i}", **kw))

            plain = run(gamma=0)
            for kw in (dict(gamma=3, proposer="ngram"), dict(gamma=3, proposer="ngram"), dict(gamma=3, proposer="draft"),
                       dict(d=ungated, gamma=3, proposer="ngram"), dict(d=ungated, gamma=3, proposer="ngram")):
                out = run(**kw)
                assert out.output_ids == plain.output_ids, (len(ids), kw)
                if kw.get("d") is ungated:
                    history_accepted += out.counts.num_accepted_tokens
        # the second ungated run finds the whole answer in its workload's history: the history's
        # proposals were verified and accepted, not only plain steps (32 tokens a prompt at most)
        assert history_accepted >= 32
    finally:
        e.close()


@needs_llamacpp
def test_fr_spec_on_the_gguf_draft_masks_its_full_head_to_the_restricted_vocabulary():
    """DecoderConfig.draft_vocab with the draft on llama.cpp (its GGUF holds the full head): q is
    the full head's logits on the restricted ids and -inf elsewhere, the q the trainer fits; the
    draft proposes only those ids and greedy output stays plain decoding's."""
    from decoder.models.loading import load_pair
    from decoder.vocab import frequent_token_ids

    pair = load_pair("smollm2-135m", "layers:0-3")
    choice = choose_engine("llamacpp", "smollm2-135m", "cpu", "layers:0-3", threads=2)
    subset = frequent_token_ids(pair.tokenizer, 2048)
    try:
        dec = SpeculativeDecoder(pair.target, pair.draft, pair.tokenizer, DecoderConfig(draft_vocab=subset),
                                 engine=choice.target, draft_engine=choice.draft)
        x = pair.tokenizer("The capital of France is")["input_ids"]
        full = choice.draft.start().forward(x, 1)[0]  # (V,) the GGUF draft's own head
        q = dec._engine_draft_logits(x, choice.draft.start())
        inside = torch.zeros(q.shape[0], dtype=torch.bool)
        inside[subset] = True
        assert torch.isinf(q[~inside]).all()
        torch.testing.assert_close(q[inside], full[: q.shape[0]][inside], rtol=0, atol=0)
        ids = pair.tokenizer(PROMPT)["input_ids"]
        plain = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True)).output_ids
        proposed = []
        orig = dec._engine_draft_logits

        def spy(tokens, seq):
            out = orig(tokens, seq)
            proposed.append(int(out.argmax()))
            return out

        dec._engine_draft_logits = spy
        r = dec.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=3, ignore_eos=True, proposer="draft"))
        assert r.output_ids == plain and r.counts.num_draft_tokens > 0
        assert proposed and all(inside[t] for t in proposed)
    finally:
        choice.target.close()
        choice.draft.close()


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("v_cache, threads", [("bf16", 1), ("bf16", 2), ("f16", 1)])
def test_which_cells_are_the_same_bits_whatever_call_computed_them(gguf, real, v_cache, threads):
    """What the prompt cache rests on (``LlamaCppEngine.shape_invariant_cells``): with a bf16 V cache
    the cells of a prompt are the same bits whether it was prefilled in one call, in two halves, in
    verification-sized blocks or one token at a time (the logits after them equal); with f16 they
    are not, so only an identical earlier prefill may be kept there."""
    ids = _long_ids(real, 310)
    e = LlamaCppEngine(gguf, n_ctx=1024, threads=threads, v_cache=v_cache)
    try:
        def after(calls):
            s = e.start()
            for c in calls:
                s.forward(c, 1)
            return torch.cat([s.forward([t], 1) for t in ids[300:304]])

        whole = after([ids[:300]])
        shapes = {"halves": [ids[:150], ids[150:300]], "blocks": [ids[:280]] + [ids[i:i + 4] for i in range(280, 300, 4)],
                  "steps": [ids[:290]] + [[t] for t in ids[290:300]]}
        same = {k: torch.equal(after(v), whole) for k, v in shapes.items()}
        assert torch.equal(after([ids[:300]]), whole)  # the same calls again: always the same bits
        assert e.shape_invariant_cells == (v_cache == "bf16")
        # bf16: every shape the same bits; f16: not all (here the blocks and the steps differ; whether a
        # split into two halves does depends on the sizes)
        assert all(same.values()) if e.shape_invariant_cells else not all(same.values()), same
    finally:
        e.close()


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("v_cache, threads, n_seq", [("f16", 1, 1), ("bf16", 2, 4)])
def test_the_prompt_cache_keeps_only_cells_a_fresh_prefill_computes(gguf, real, v_cache, threads, n_seq):
    """``start(prefix=...)`` keeps a common prefix of what the slot last held only where a fresh
    prefill computes the same bits (bf16: any common prefix, a conversation's earlier reply
    included; f16: an identical earlier prefill), and the logits that follow equal those after a
    fresh prefill in another engine; a rollback, a diverging prompt and other adapters are honoured."""
    ids = _long_ids(real, 700)
    other = [t + 1 for t in ids[300:600]]  # shares ids[:300], then diverges
    e = LlamaCppEngine(gguf, n_ctx=1024, threads=threads, v_cache=v_cache, n_seq=n_seq)
    ref = LlamaCppEngine(gguf, n_ctx=1024, threads=threads, v_cache=v_cache, n_seq=n_seq)
    inv = e.shape_invariant_cells
    done = (lambda s: s.release()) if n_seq > 1 else (lambda s: None)
    try:
        assert e.capabilities.prompt_cache and inv == (v_cache == "bf16")

        def fresh(prompt, steps):  # a fresh prefill, then one-token steps
            s = ref.start()
            rows = [s.forward(prompt, 1)] + [s.forward([t], 1) for t in steps]
            done(s)
            return torch.cat(rows)

        def served(prefix, steps, kept):
            s = e.start(prefix=prefix)
            assert s.length == kept
            rows = ([s.forward(prefix[kept:], 1)] if kept < len(prefix) else []) + [s.forward([t], 1) for t in steps]
            got = torch.cat(rows)[-len(steps):]
            assert torch.equal(got, fresh(prefix, steps)[-len(steps):])
            return s

        done(served(ids[:400], ids[400:420], 0))  # a prefill of 400, then its reply one token at a time
        # the same prompt again: its prefill's 400 cells kept, on either cache
        done(served(ids[:400], ids[400:404], 400))
        # the conversation so far and more: the reply's cells too with bf16, nothing with f16
        s = served(ids[:600], ids[600:605], 404 if inv else 0)  # the last request held 400 + 4
        s.truncate(500)  # a rollback shortens what is kept
        done(s)
        done(served(ids[:300] + other, ids[:3], 300 if inv else 0))  # shares only 300 tokens
        e.set_lora(None, 0.5)  # other adapters: no cell is kept
        s = e.start(prefix=ids[:300])
        assert s.length == 0
        done(s)
        s = e.start()
        assert s.length == 0  # no prefix: an empty cache, as before
        done(s)
    finally:
        e.close()
        ref.close()


@needs_llamacpp
@pytest.mark.slow
def test_a_batched_engine_gives_a_prompt_the_free_slot_holding_its_prefix(gguf, real):
    ids = _long_ids(real, 300)
    e = LlamaCppEngine(gguf, n_ctx=512, threads=2, n_seq=3)
    try:
        s0, s1 = e.start(prefix=ids[:100]), e.start(prefix=ids[100:200])
        assert (s0.seq_id, s1.seq_id, s0.length, s1.length) == (0, 1, 0, 0)
        e.forward_batch([(s0, ids[:100], 1), (s1, ids[100:200], 1)])
        s1.release()
        s0.release()
        again = e.start(prefix=ids[100:250])  # slot 1 holds its first 100 tokens
        assert (again.seq_id, again.length) == (1, 100)
        busy = e.start(prefix=ids[:50])  # slot 0 holds these
        assert (busy.seq_id, busy.length) == (0, 50)
        third = e.start(prefix=ids[100:120])  # slot 1 is taken: the free one, empty
        assert (third.seq_id, third.length) == (2, 0)
    finally:
        e.close()


def _chat(tok, turns: list[tuple[str, str]]) -> list[int]:
    ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@needs_llamacpp
@pytest.mark.slow
@pytest.mark.parametrize("threads", [2, 1])
def test_a_conversation_through_the_prompt_cache_equals_plain_decoding_without_it(gguf, real, threads):
    """Two turns of a chat and a second conversation sharing only the system prompt, served greedy
    (plain, n-gram γ 3 and the draft γ 2) by a decoder with the prompt cache, each equal to plain
    decoding by a decoder without it; ``cached_prompt_tokens`` is the common prefix with the
    previous request's cells where they are the same bits as a fresh prefill (bf16 at 2 threads),
    the whole prompt again only for an identical prompt with f16 (``auto`` at 1 thread here), and 0
    when the prompt rows are recorded."""
    from decoder.workloads import prose_prompts

    e = LlamaCppEngine(gguf, n_ctx=1024, threads=threads)
    tok = real.tokenizer
    try:
        cached = SpeculativeDecoder(real.target, real.draft, tok, engine=e)
        plain = SpeculativeDecoder(real.target, real.draft, tok, DecoderConfig(prompt_cache=False), engine=e)
        texts = [p.text for p in prose_prompts(3, chars=600)]
        last: list[int] = []  # the tokens whose cells the engine holds after the last request
        first: list[int] = []
        shared = []
        for turn in range(3):
            turns = ([("user", texts[0])], [("user", texts[0]), ("assistant", tok.decode(first, skip_special_tokens=True)),
                                            ("user", texts[1])], [("user", texts[2])])[turn]
            ids = _chat(tok, turns)
            outs = []
            for kw in (dict(gamma=0), dict(gamma=3, proposer="ngram"), dict(gamma=2, proposer="draft")):
                out = cached.generate(DecodeRequest(ids, SamplingParams(), 24, ignore_eos=True, **kw))
                # the first run of a turn finds the last turn's cells: kept where a fresh prefill computes the
                # same bits (bf16: the common prefix; f16: none); the next ones find this very prompt's prefill
                keep = len(ids) - 1 if outs else _lcp(last, ids[:-1]) if e.shape_invariant_cells else 0
                assert out.cached_prompt_tokens == keep, (turn, kw, len(ids))
                shared.append(keep if not outs else None)
                outs.append(out.output_ids)
                last = ids + out.output_ids[:-1]
            want = plain.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True)).output_ids
            assert outs == [want] * 3, turn
            last = ids + want[:-1]
            first = first or want
        if e.shape_invariant_cells:  # the earlier turn and then the system prompt were kept
            assert shared[3] > len(_chat(tok, [("user", texts[0])])) // 2 and 0 < shared[6] < 40, shared
        # a request that asks for no cached cells (llama-server's cache_prompt false) prefills in full
        again = cached.generate(DecodeRequest(ids, SamplingParams(), 24, gamma=0, ignore_eos=True, cache_prompt=False))
        assert again.cached_prompt_tokens == 0 and again.output_ids == want
        recorded = SpeculativeDecoder(real.target, real.draft, tok, DecoderConfig(record_prompt=True, topk_record=4),
                                      engine=e, sink=lambda s: None)
        assert recorded.generate(DecodeRequest(ids, SamplingParams(), 4, gamma=0)).cached_prompt_tokens == 0
    finally:
        e.close()


@needs_llamacpp
@pytest.mark.slow
def test_with_an_f16_v_cache_the_prompt_cache_keeps_the_prefill_that_stops_before_the_last_token(gguf, real):
    """With an f16 V cache a cell depends on the call that computed it, so the prompt cache keeps
    only what a fresh prefill of the prompt but its last token computes alike. A prefill that
    also fed the last token (the first token from its last row) let a prompt P + [x] keep P's 81
    cells from a call that ended at P, and its greedy output differed from decoding it without the
    cache (the adversarial check, 1 of 5 x). There the first token still comes from a step, the
    prompt P + [x] keeps nothing (its prefix is no earlier prefill's end), and P again keeps
    len(P) - 1 cells; every output equals decoding without the cache, logprobs too."""
    tok = real.tokenizer
    P = tok.encode("The history of the printing press begins in the fifteenth century, when a goldsmith in "
                   "Mainz combined " * 4)
    e = LlamaCppEngine(gguf, n_ctx=1024, threads=1, v_cache="f16")
    fresh = LlamaCppEngine(gguf, n_ctx=1024, threads=1, v_cache="f16")
    try:
        assert not e.shape_invariant_cells
        d = SpeculativeDecoder(real.target, real.draft, tok, engine=e)
        # the same calls without the cache (f16 logits depend on the call's shape, so the reference
        # prefills as the cached decoder does: all but the last token)
        f = SpeculativeDecoder(real.target, real.draft, tok, DecoderConfig(prompt_cache=False,
                                                                           first_token_from_prefill=False), engine=fresh)
        r1 = d.generate(DecodeRequest(P, SamplingParams(), 4, gamma=0, ignore_eos=True))
        assert not r1.steps[0].prefill  # the old prefill: the cache's cells end where a fresh one's would
        for i, x in enumerate((r1.output_ids[0], 11, 300, 1000, 5000)):
            again = d.generate(DecodeRequest(P, SamplingParams(), 4, gamma=0, ignore_eos=True))  # the slot holds P
            # after r1 the slot's cells of P[:-1] came from an 80-token call, as a fresh prefill's: kept;
            # after a request for P + [x] they came from its 81-token call: other bits, none kept
            assert again.cached_prompt_tokens == (len(P) - 1 if i == 0 else 0) and again.output_ids == r1.output_ids
            a = d.generate(DecodeRequest(P + [x], SamplingParams(), 16, gamma=0, ignore_eos=True, logprobs=5))
            b = f.generate(DecodeRequest(P + [x], SamplingParams(), 16, gamma=0, ignore_eos=True, logprobs=5))
            assert a.cached_prompt_tokens == 0 and a.output_ids == b.output_ids, x
            assert [u.logprob for u in a.logprobs] == [v.logprob for v in b.logprobs], x
        # without the prompt cache the first token comes from the prefill on f16 too
        nocache = SpeculativeDecoder(real.target, real.draft, tok, DecoderConfig(prompt_cache=False), engine=fresh)
        assert nocache.generate(DecodeRequest(P, SamplingParams(), 2, gamma=0, ignore_eos=True)).steps[0].prefill
    finally:
        e.close()
        fresh.close()
