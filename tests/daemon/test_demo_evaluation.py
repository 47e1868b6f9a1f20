"""The demo's evaluation (daemon.demo.evaluate_phases) on tiny real models: every speculative row's
greedy output is checked against the plain row's, the peer (here plain decoding by full
recomputation, an independent reference) agrees with the plain row, and the Leviathan prediction
carries the adapted draft's own measured α."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoder"))
from serve_helpers import tiny_pair, tokenizer  # noqa: E402
from tiny import reference_greedy  # noqa: E402


class RecomputePeer:
    """The interface of decoder.bench.LlamaCppPeer (the first n - 1 tokens, ms, n), by plain greedy
    decoding with full recomputation (no KV cache, no speculation)."""

    def __init__(self, model):
        self.model = model

    def generate(self, ids, params, n, seed):
        t0 = time.perf_counter()
        out = reference_greedy(self.model, list(ids), n)
        return out[: n - 1], (time.perf_counter() - t0) * 1e3, n


def test_evaluation_rows_are_checked_against_plain_decoding():
    from daemon.demo import DemoConfig, _lossless_summary, evaluate_phases
    from decoder.sampling import SamplingParams
    from decoder.speculative import SpeculativeDecoder

    target, draft = tiny_pair()
    tok = tokenizer()
    sunk = []
    dec = SpeculativeDecoder(target, draft, tok, sink=sunk.append)  # the served decoder streams records
    cfg = DemoConfig.quick(phases=("prose", "extract"), eval_prompts=2, eval_new_tokens=8, per_workload=False,
                            copy_ablation=True)
    rows = evaluate_phases(cfg, {}, {}, [], None, None, dec, frozen_draft=draft, tok=tok, params=SamplingParams(),
                           console=Console(file=io.StringIO()), peer=RecomputePeer(target))
    assert [r["workload"] for r in rows] == ["prose", "extract"]
    assert sunk == [] and dec.sink == sunk.append  # nothing evaluated reached the buffer; the sink is back
    for r in rows:
        for name in ("frozen", "adapted_draft", "adapted_nogate", "frozen_fixedgate"):
            assert r[name]["matches_plain"] == "2/2", (r["workload"], name, r[name])
        assert "matches_plain" not in r["plain"]
        assert r["llamacpp_plain"]["same_tokens_as_plain"] == "2/2"  # our plain == recomputed greedy
        pred = r["adapted_draft"]["prediction"]
        assert pred["alpha"] == round(r["adapted_draft"]["alpha"], 4) and pred["c"] > 0
        assert pred["one_step"]["gamma"] in range(1, 9)
        sp = r["speed_vs_llamacpp_ci"]
        assert set(sp) == {"plain", "adapted"} and sp["adapted"] == sp["plain"]  # no pick: plain is the pick
        assert sp["plain"]["low"] <= sp["plain"]["ratio"] <= sp["plain"]["high"]
    assert _lossless_summary({"phases": rows}) == ("greedy outputs equal to plain decoding: 16 of 16 speculative "
                                                   "evaluation runs")
