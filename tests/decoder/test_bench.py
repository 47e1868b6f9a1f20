"""The side-by-side bench on tiny models: rows, equivalence flag, derived numbers."""

import pytest

from decoder.bench import BenchConfig, run_bench
from decoder.speculative import SpeculativeDecoder
from decoder.workloads import Prompt


def test_bench_rows_and_summary(target, tok):
    dec = SpeculativeDecoder(target, target, tok)  # self-draft: every proposal accepted
    seen = []
    res = run_bench(dec, [Prompt("a", "hello world"), Prompt("b", "def f(x):")],
                    BenchConfig(gammas=(2,), sampling=("greedy",), max_new_tokens=6), on_row=seen.append)
    rows = res["rows"]
    assert seen == rows
    assert [(r["workload"], r["method"], r["gamma"]) for r in rows] == [
        ("a", "plain", 0), ("a", "hf_plain", 0), ("a", "spec", 2), ("a", "hf_assisted", 2),
        ("b", "plain", 0), ("b", "hf_plain", 0), ("b", "spec", 2), ("b", "hf_assisted", 2)]
    spec = rows[2]
    assert spec["tokens"] == 6 and spec["matches_plain"] is True
    assert spec["acceptance_rate"] == 1.0 and spec["alpha"] == 1.0
    # token 0 from the prefill; then 5 tokens in 2 verification steps (γ = 2, then γ = 1 for the 2 left)
    assert spec["tau"] == pytest.approx(2.5)
    assert all(r["tokens"] == 6 for r in rows)  # every method decodes exactly max_new_tokens
    assert spec["speedup_vs_plain"] == pytest.approx(spec["tokens_per_s"] / rows[0]["tokens_per_s"], rel=1e-2)
    s = {x["workload"]: x for x in res["summary"]}
    assert s["a"]["best_gamma"] == 2
    assert s["a"]["speculate"] == (spec["tokens_per_s"] > rows[0]["tokens_per_s"] and spec["predicted_speedup"] > 1)


def _rows(plain_tps, spec_tps, tau, pred):
    return [{"workload": "w", "sampling": "greedy", "method": "plain", "gamma": 0, "tokens_per_s": plain_tps, "tau": 1.0},
            {"workload": "w", "sampling": "greedy", "method": "spec", "gamma": 2, "tokens_per_s": spec_tps, "tau": tau,
             "speedup_vs_plain": spec_tps / plain_tps, "alpha": 0.5, "c": 0.1, "predicted_speedup": pred}]


@pytest.mark.parametrize("plain, spec, tau, pred, on, says", [
    (10.0, 15.0, 1.6, 1.5, True, "γ=2 emits 15.00 tok/s vs plain 10.00"),
    (10.0, 8.0, 1.6, 1.5, False, "vs plain 10.00"),
    (5.6, 22.2, 1.0, 0.9, False, "τ = 1 (no proposal accepted): timing noise"),  # a plain row slowed by the host
    (7.3, 21.4, 1.03, 0.88, False, "Leviathan's bound is 0.88x < 1: timing noise"),
])
def test_summary_speculates_only_within_tau_and_leviathans_bound(plain, spec, tau, pred, on, says):
    from decoder.bench import summarize

    (row,) = summarize(_rows(plain, spec, tau, pred))
    assert row["speculate"] is on and says in row["why"]


def test_bench_pairs_methods_per_prompt(target, other_draft, tok):
    """Each prompt runs plain and every γ back to back; a spec row's per-prompt speedups are each
    prompt's spec tokens/ms over that same prompt's plain tokens/ms."""
    import statistics

    dec = SpeculativeDecoder(target, other_draft, tok)
    calls = []
    real = dec.generate

    def spy(req, policy=None):
        res = real(req, policy)
        calls.append((tuple(req.prompt_ids), policy.gamma() if policy else None, res))
        return res

    dec.generate = spy
    ps = [Prompt("a", "hello world"), Prompt("a", "the cat sat")]
    res = run_bench(dec, ps, BenchConfig(gammas=(1, 3), sampling=("greedy",), max_new_tokens=5, hf=False))
    del dec.generate  # the spy refers to dec: no reference cycle left for a later test's GC pause
    calls = calls[1:]  # the warm-up
    order = [(ids == tuple(ps[0].token_ids(tok)), g) for ids, g, _ in calls]
    assert order == [(True, 0), (True, 1), (True, 3), (False, 0), (False, 1), (False, 3)]
    spec1 = next(r for r in res["rows"] if r["method"] == "spec" and r["gamma"] == 1)
    want = [len(calls[i + 1][2].output_ids) / calls[i + 1][2].latency_ms
            / (len(calls[i][2].output_ids) / calls[i][2].latency_ms) for i in (0, 3)]
    assert spec1["speedup_per_prompt"] == [round(x, 3) for x in want]
    assert spec1["speedup_per_prompt_median"] == round(statistics.median(want), 3)


def test_bench_gamma_zero_and_repeated_gammas_keep_their_own_rows(target, tok):
    """γ = 0 in the list next to hf: transformers' plain and its γ = 0 "assisted" rows each count
    their own 2 prompts x 4 tokens (they shared one accumulator: 16 tokens each); a repeated γ
    is measured once."""
    dec = SpeculativeDecoder(target, target, tok)
    res = run_bench(dec, [Prompt("a", "hello world"), Prompt("a", "x")],
                    BenchConfig(gammas=(0, 2, 2), sampling=("greedy",), max_new_tokens=4, hf=True))
    rows = [(r["method"], r["gamma"], r["tokens"]) for r in res["rows"]]
    assert rows == [("plain", 0, 8), ("hf_plain", 0, 8), ("spec", 0, 8), ("hf_assisted", 0, 8),
                    ("spec", 2, 8), ("hf_assisted", 2, 8)]
    spec2 = res["rows"][4]
    assert len(spec2["speedup_per_prompt"]) == 2


def test_bench_without_prompts_names_the_fix(target, tok):
    """No prompts was an IndexError from the warm-up; it is a ValueError that says what to pass."""
    dec = SpeculativeDecoder(target, target, tok)
    with pytest.raises(ValueError, match="no prompts"):
        run_bench(dec, [], BenchConfig(gammas=(1,), sampling=("greedy",), max_new_tokens=4, hf=False))


def test_bench_checks_sampling_names_and_warms_up_within_max_new_tokens(target, tok):
    """An unknown sampling name fails before any row (it was a KeyError after rows went out). The
    warm-up asked for 4 new tokens whatever max_new_tokens was, so a prompt 3 tokens short of
    the 512-position context failed with a value the user never passed; now it runs."""
    dec = SpeculativeDecoder(target, target, tok)
    rows = []
    with pytest.raises(ValueError, match=r"unknown \['t0.5'\]"):
        run_bench(dec, [Prompt("a", "hi")], BenchConfig(gammas=(1,), sampling=("t0.5",), max_new_tokens=4, hf=False),
                  on_row=rows.append)
    assert rows == []
    ids = tok("a" * 509).input_ids
    assert len(ids) == 509
    long = Prompt("a", "a" * 509)
    res = run_bench(dec, [long], BenchConfig(gammas=(1,), sampling=("greedy",), max_new_tokens=3, hf=False))
    assert [r["tokens"] for r in res["rows"]] == [3, 3]


def test_the_llamacpp_peer_gets_the_target_engines_context(tok, monkeypatch):
    """The peer's n_ctx was fixed at 4096: on a target engine of 8192, a prompt of >= 4096 tokens
    raised in llama-cpp-python mid-sweep and a long one had its max_tokens cut silently."""
    from types import SimpleNamespace

    import decoder.bench as bench

    got = {}

    class Stop(Exception):
        pass

    def peer(gguf, threads=None, n_ctx=4096):
        got.update(gguf=gguf, threads=threads, n_ctx=n_ctx)
        raise Stop

    monkeypatch.setattr(bench, "UpstreamLlamaCppPeer", peer)
    dec = SimpleNamespace(tokenizer=tok, engine=SimpleNamespace(threads=3, context_length=8192))
    with pytest.raises(Stop):
        run_bench(dec, [Prompt("prose", "hello")], BenchConfig(gammas=(1,), sampling=("greedy",), llamacpp="x.gguf"))
    assert got == {"gguf": "x.gguf", "threads": 3, "n_ctx": 8192}


def test_the_upstream_peer_generates_in_its_own_process_with_every_patch_off():
    """decoder.bench.UpstreamLlamaCppPeer: the packaged target's greedy tokens equal the in-process
    peer's (the patched kernels give upstream's bits), its child runs with each scripts/patches
    switch at upstream's value, and a closed peer has no process left."""
    import multiprocessing

    from decoder.bench import UPSTREAM_KERNELS, LlamaCppPeer, UpstreamLlamaCppPeer
    from decoder.engines.llamacpp_lib import PATCH_SWITCHES, patch_switches
    from decoder.models.packaged import packaged_gguf
    from decoder.sampling import SamplingParams

    try:
        gguf = str(packaged_gguf("smollm2-135m"))
    except Exception as e:  # noqa: BLE001 - the packaged model is an install-time dependency
        pytest.skip(f"packaged model unavailable: {e}")
    assert set(UPSTREAM_KERNELS) == set(PATCH_SWITCHES)
    off = patch_switches(UPSTREAM_KERNELS)
    assert off == {"GGML_AMX_VNNI_MAX_ROWS": (1,), "GGML_FA_BF16V_BLOCKED": False, "GGML_X86_TILED": False}
    ids = [1, 9690, 314, 253, 1345, 30, 378, 2295, 3160, 260]
    params = SamplingParams()
    here = LlamaCppPeer(gguf, threads=1, n_ctx=256).generate(ids, params, 12, 0)
    with UpstreamLlamaCppPeer(gguf, threads=1, n_ctx=256) as peer:
        child = peer._proc
        assert child.is_alive() and child.pid != multiprocessing.current_process().pid
        out = peer.generate(ids, params, 12, 0)
    assert out[0] == here[0] and out[2] == here[2] == 12 and out[1] > 0
    assert not child.is_alive()


def test_the_upstream_peer_reports_a_file_it_cannot_load(tmp_path):
    from decoder.bench import UpstreamLlamaCppPeer
    from decoder.engines.base import EngineError

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(EngineError, match="did not start"):
        UpstreamLlamaCppPeer(str(bad), threads=1, n_ctx=64)
