"""The second walkthrough's newcomer trip points (docs/walkthroughs.md, "The quick demo at 8690a9e"):
what the demo's closing lines say about the files compared, the ceilings, the alarms, the plot,
the rejections, the live line and the final JSON line."""

import io

from rich.console import Console

from daemon.demo import print_report


def _phase(workload: str) -> dict:
    row = {"proposer": None, "gamma": 0, "alpha": None, "tau": 1.0, "speedup_vs_plain": 1.0, "tokens_per_s": 60.0}
    return {"workload": workload, "heldout_samples": 0, "adapter_at_phase_end": 0, "final_adapter": 0,
            "plain": row, "frozen": {**row, "matches_plain": "8/8"}, "adapted_draft": {**row, "matches_plain": "8/8"},
            "adapted": {**row, "same_run_as": "plain"}, "controller_pick": {"why": "off: plain"},
            "served": {"requests": 10, "repeats": 0}, "live_first_third": {"alpha": None},
            "live_last_third": {"alpha": None},
            "llamacpp_plain": {"tokens_per_s": 50.0, "same_tokens_as_plain": "3/8"},
            "speed_vs_llamacpp_ci": {"adapted": {"ratio": 1.48, "low": 1.45, "high": 1.51, "prompts": 8}}}


def _printed(report: dict) -> str:
    out = io.StringIO()
    print_report({"adapters": [], "recovery": [], "requests": 10, "active_adapter": 1, "seconds": 1.0,
                  "key_prefix": "x:"} | report, Console(file=out, width=400))
    return out.getvalue()


def test_the_peer_line_names_which_file_each_side_decodes():
    """Q8_0 served, llama.cpp's peer on the packaged Q4_1: not "the same file"; the ×llama.cpp column
    says the peer decodes the packaged file and the caption names both files. Served packaged: the same file."""
    q8 = {"format": "Q8_0", "file": "qwen-Q8_0.gguf", "setting": "auto"}
    text = _printed({"phases": [_phase("prose")], "served_format": q8, "llamacpp_peer_file": "qwen-q4_1.gguf"})
    assert "same file" not in text, text
    assert "llama.cpp decodes the packaged file qwen-q4_1.gguf, our plain decoding the served Q8_0 (qwen-Q8_0.gguf)" in text
    assert "compare the format choice and the engine together" in text
    assert "pick ×llama.cpp plain of the packaged file [95 % CI]" in text
    assert "×llama.cpp plain: llama.cpp decodes the packaged file qwen-q4_1.gguf" in text  # the table's caption
    packaged = {"format": "packaged", "file": "qwen-q4_1.gguf", "setting": "packaged"}
    text = _printed({"phases": [_phase("prose")], "served_format": packaged, "llamacpp_peer_file": "qwen-q4_1.gguf"})
    assert "both are plain decoding of the same file, qwen-q4_1.gguf" in text
    assert "of the packaged file [95 % CI]" not in text and "pick ×llama.cpp plain [95 % CI]" in text
    # a report without the files (an older report.json) claims no sameness
    text = _printed({"phases": [_phase("prose")]})
    assert "same file" not in text and "our plain decoding the served format (which may differ" in text
