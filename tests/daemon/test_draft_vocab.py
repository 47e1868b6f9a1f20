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


def test_unset_is_the_full_vocabulary_for_a_small_tokenizer_and_8192_for_a_large_one(monkeypatch):
    from daemon.settings import AUTO_DRAFT_VOCAB, effective_draft_vocab

    assert draft_vocab_ids(load_settings(), char_tokenizer()) is None  # 64 tokens: the full head
    assert AUTO_DRAFT_VOCAB == 8192

    class Sized:  # only its size is read
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    s = load_settings()
    assert s.models.draft_vocab is None
    assert effective_draft_vocab(s, Sized(49152)) == 8192  # SmolLM2's vocabulary
    assert effective_draft_vocab(s, Sized(16385)) == 8192
    assert effective_draft_vocab(s, Sized(16384)) == 0  # not more than twice 8192
    monkeypatch.setenv("DRAFTD_MODELS__DRAFT_VOCAB", "0")  # set: 0 is the full vocabulary, whatever the size
    assert effective_draft_vocab(load_settings(), Sized(49152)) == 0
    monkeypatch.setenv("DRAFTD_MODELS__DRAFT_VOCAB", "4096")
    assert effective_draft_vocab(load_settings(), Sized(49152)) == 4096


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
