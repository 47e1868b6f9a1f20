"""models.draft_vocab: the FR-Spec ids the trainer trains on are the ones `daemonctl generate
--draft-vocab N` serves (decoder.vocab over its built-in corpus); a size past the tokenizer fails
naming the setting."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

from daemon.settings import ConfigError, draft_vocab_ids, load_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoder"))
from tiny import CHARS, char_tokenizer  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DRAFTD_"):
            monkeypatch.delenv(k)


def test_off_by_default():
    assert draft_vocab_ids(load_settings(), char_tokenizer()) is None


def test_ids_are_the_specials_and_the_most_frequent_characters(monkeypatch):
    from decoder.vocab import corpus_texts

    monkeypatch.setenv("DRAFTD_MODELS__DRAFT_VOCAB", "10")
    tok = char_tokenizer()
    ids = draft_vocab_ids(load_settings(), tok)
    # counted independently: characters, not tokenizer calls; ids 0/1 are <unk>/<eos>
    counts = collections.Counter(c for t in corpus_texts() for c in t if c in CHARS)
    top8 = [c for c, _ in counts.most_common(8)]
    assert ids.tolist() == sorted([0, 1] + [tok.convert_tokens_to_ids(c) for c in top8])


def test_larger_than_the_tokenizer_names_the_setting(monkeypatch):
    monkeypatch.setenv("DRAFTD_MODELS__DRAFT_VOCAB", "65")
    with pytest.raises(ConfigError, match=r"DRAFTD_MODELS__DRAFT_VOCAB.*1\.\.64"):
        draft_vocab_ids(load_settings(), char_tokenizer())
