"""The eighteenth session's second walkthrough (docs/walkthroughs.md, "The quick demo at 5623da1"): the speed
table showed the pick against llama.cpp's plain (1.464x for a plain pick) but never plain decoding against it, nor
that the peer runs upstream's kernels, so the reader could not tell the engine's share from speculation's."""

import io

from rich.console import Console

from daemon.demo import print_report


def _phase(workload: str, plain_ratio: dict, pick_ratio: dict) -> dict:
    row = {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
    pick = {**row, "proposer": "ngram", "gamma": 2, "alpha": 0.85, "tau": 1.88, "speedup_vs_plain": 1.231}
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": row, "frozen": {**row, "matches_plain": "8/8"}, "adapted_draft": {**row, "matches_plain": "8/8"},
            "adapted": pick, "controller_pick": {"why": "ngram γ=2"},
            "served": {"requests": 10, "repeats": 0}, "live_first_third": {"alpha": None},
            "live_last_third": {"alpha": None},
            "llamacpp_plain": {"tokens_per_s": 40.0, "same_tokens_as_plain": "1/8"},
            "speed_vs_llamacpp_ci": {"plain": plain_ratio, "adapted": pick_ratio}}


def _printed(report: dict) -> str:
    out = io.StringIO()
    print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                  "key_prefix": "x:", "llamacpp_peer_file": "q4_1.gguf",
                  "served_format": {"format": "packaged", "file": "q4_1.gguf", "setting": "auto"}} | report,
                 Console(file=out, width=600))
    return out.getvalue()


def test_the_speed_table_shows_plain_against_llama_cpp_and_the_peers_kernels():
    plain = {"ratio": 1.486, "low": 1.41, "high": 1.57, "prompts": 8}
    pick = {"ratio": 1.829, "low": 1.71, "high": 1.98, "prompts": 8}
    text = _printed({"phases": [_phase("extract", plain, pick)],
                     "llamacpp_peer_kernels": "upstream (scripts/patches switched off, a process of its own)"})
    assert "plain ×llama.cpp [95 % CI]" in text
    row = next(line for line in text.splitlines() if "extract" in line and "1.829" in line)
    assert "1.486 [1.41, 1.57]" in row, row
    assert "llama.cpp plain: upstream (scripts/patches switched off, a process of its own)" in text
    assert "what this engine and its kernels buy before speculation" in text


def test_an_older_report_without_the_peer_kernels_names_none():
    plain = {"ratio": 1.0, "low": 0.97, "high": 1.03, "prompts": 8}
    text = _printed({"phases": [_phase("prose", plain, plain)]})
    assert "upstream" not in text and "plain ×llama.cpp [95 % CI]" in text
    # a report with only the pick's ratio (before this column) gets no column of dashes
    row = _phase("prose", plain, plain)
    del row["speed_vs_llamacpp_ci"]["plain"]
    assert "plain ×llama.cpp [95 % CI]" not in _printed({"phases": [row]})
