"""The demo serves under `daemonctl serve`'s GIL switch interval (serve.gil_switch_interval_ms),
restored when it returns or fails: at CPython's default 5 ms the decoding thread waited behind the
API's, the client's and the trainer's threads, and the served steps the controller priced cost
more than the evaluation's."""

from __future__ import annotations

import sys

import pytest

import daemon.demo as demo
from daemon.settings import load_settings


@pytest.mark.parametrize("fail", [False, True])
def test_the_demo_runs_at_the_serving_switch_interval_and_restores_the_one_before(monkeypatch, tmp_path, fail):
    monkeypatch.setenv("DRAFTD_SERVE__GIL_SWITCH_INTERVAL_MS", "0.7")
    seen = []

    def body(settings, cfg, console):
        seen.append(sys.getswitchinterval())
        if fail:
            raise RuntimeError("boom")
        return {"ok": True}

    monkeypatch.setattr(demo, "_run_demo", body)
    before = sys.getswitchinterval()
    assert abs(before - 0.0007) > 1e-6
    cfg = demo.DemoConfig.quick(out_dir=tmp_path)
    if fail:
        with pytest.raises(RuntimeError, match="boom"):
            demo.run_demo(load_settings(), cfg, None)
    else:
        assert demo.run_demo(load_settings(), cfg, None) == {"ok": True}
    assert seen == [pytest.approx(0.0007)]
    assert sys.getswitchinterval() == before


def test_the_re_measurement_names_each_workloads_pick_as_the_evaluation_will_read_it():
    """A walkthrough read "speculation off" on the phases' live lines, then n-gram picks in the
    evaluation's table, and nothing between: the re-measurement's console line now names them."""
    from decoder.sampling import SamplingParams

    bucket = SamplingParams().bucket()
    seen = []

    class Ctl:
        def decision(self, key):
            seen.append(key)
            return {("prose", bucket): {"gamma": 8, "proposer": "ngram"},
                    ("code", bucket): {"gamma": 0, "proposer": None},
                    ("math", bucket): {"gamma": 1, "proposer": "draft"}}.get(key, {})

    assert demo._picks_now(Ctl(), ["prose", "code", "math", "extract"]) == {
        "prose": "ngram γ=8", "code": "plain", "math": "draft γ=1", "extract": "plain"}
    assert seen == [(w, bucket) for w in ("prose", "code", "math", "extract")]
