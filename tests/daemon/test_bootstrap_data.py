"""daemonctl bootstrap's data pipeline on a tiny pair: both sources hand samples to the sink."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoder"))

from tiny import char_tokenizer, tiny_llama  # noqa: E402

from daemon.bootstrap_data import decode_prompts, score_corpora  # noqa: E402
from store.schema import PairFingerprint  # noqa: E402


def _pair():
    return SimpleNamespace(target=tiny_llama(0), draft=tiny_llama(1, layers=1), tokenizer=char_tokenizer())


def _progress(seen):
    def progress(description, total):
        seen.append([description, total, 0])
        return lambda n: seen[-1].__setitem__(2, seen[-1][2] + n)
    return progress


def test_score_corpora_and_decode_prompts_feed_the_sink():
    pair, fp = _pair(), PairFingerprint(target="t", draft="d", tokenizer_hash="h")
    got, seen, empty = [], [], []
    corpora = {"prose": [("doc1", "abc abc abc " * 30)], "code": []}
    score_corpora(pair, fp, corpora, 200, "fp32", got.append, _progress(seen), empty.append)
    assert got and all(s.source == "prefill" and s.workload == "prose" for s in got)
    assert empty == ["code"]
    assert seen[0][1] == seen[0][2] > 0  # every position counted
    prompt = SimpleNamespace(workload="prose", token_ids=lambda tok: tok("abc ab", add_special_tokens=False)["input_ids"])
    got2: list = []
    decode_prompts(pair, fp, [prompt, prompt], 4, got2.append, _progress(seen))
    assert len(got2) == 2 and all(s.workload == "prose" for s in got2)
    assert seen[-1][1:] == [2, 2]
