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
    assert spec["tau"] == pytest.approx(3.0)  # 6 tokens in 2 steps of γ + 1
    assert all(r["tokens"] == 6 for r in rows)  # every method decodes exactly max_new_tokens
    assert spec["speedup_vs_plain"] == pytest.approx(spec["tokens_per_s"] / rows[0]["tokens_per_s"], rel=1e-2)
    s = {x["workload"]: x for x in res["summary"]}
    assert s["a"]["best_gamma"] == 2 and s["a"]["speculate"] == (spec["tokens_per_s"] > rows[0]["tokens_per_s"])
