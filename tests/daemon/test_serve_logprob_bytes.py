"""Logprobs of tokens that hold part of a multi-byte UTF-8 character (the break session's
"Emoji party" prompt): chat's ``bytes`` are the token's own bytes (they were U+FFFD's, 239 191
189), completions' ``text_offset`` stays inside the returned text (each partial token counted as a
character: the offsets ran past it), and distinct alternatives keep distinct ``top_logprobs``
keys (they collapsed onto one U+FFFD key). Checked on a byte-level BPE tokenizer built here (one
token per byte), on a SentencePiece byte-fallback one, and (slow) on the packaged SmolLM2's."""

from __future__ import annotations

import types

import pytest

from serve_helpers import MODEL

TEXT = "Emoji party: 🎉🔥😀 and more emoji:"


def gpt2_table() -> dict[int, str]:
    """GPT-2's byte -> printable character table, from transformers (an implementation other
    than daemon.token_bytes')."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: ids 0/1 are <unk>/<eos>, id 2 + b is byte b."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{c: 2 + b for b, c in gpt2_table().items()}}
    tk = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


def byte_fallback_tokenizer():
    """SentencePiece-style: ASCII letters, ':', '▁' and <0xNN> pieces, byte fallback."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<eos>", "\u2581", ":"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["E"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    tk = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Replace(Regex(" "), "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


def service(tok):
    """An InferenceService on a stand-in loop (only _logprobs and the stream's chunks are used)."""
    from daemon.serve import InferenceService

    loop = types.SimpleNamespace(decoder=types.SimpleNamespace(vocab_p=len(tok.get_vocab())), observers=[],
                                 config=types.SimpleNamespace(queue_size=1), queue_depth=0, busy=False, status=dict)
    return InferenceService(loop, tok, MODEL, context_len=None)


def parsed(kind: str, n: int):
    from daemon.serve import Parsed

    return Parsed(kind=kind, model=MODEL, prompt_ids=[2], max_tokens=64, temperature=0.0, top_p=1.0, top_k=0,
                  seed=None, stop=(), ignore_eos=False, gamma=None, workload="default", stream=False, logprobs=n)


def char_offsets(text: str) -> list[int]:
    """For each UTF-8 byte of ``text``, the index of the character holding it."""
    return [i for i, c in enumerate(text) for _ in c.encode("utf-8")]


def lps_of(ids, tops):
    from decoder.sampling import TokenLogprob

    return [TokenLogprob(t, -0.5, tuple((a, -1.0 - k) for k, a in enumerate(top))) for t, top in zip(ids, tops)]


def test_byte_level_tokens_keep_their_bytes_offsets_and_distinct_alternatives():
    tok = byte_tokenizer()
    ids = tok(TEXT).input_ids
    raw = TEXT.encode("utf-8")
    assert ids == [2 + b for b in raw]  # one token per byte: each token's bytes are known
    party = [2 + b for b in "🎉".encode("utf-8")]  # four partial tokens as every position's alternatives
    svc = service(tok)
    chat = svc._logprobs(parsed("chat", 4), lps_of(ids, [party] * len(ids)))["content"]
    assert [e["bytes"] for e in chat] == [[b] for b in raw]
    assert [e["token"] for e in chat] == [chr(b) if b < 128 else f"bytes:\\x{b:02x}" for b in raw]
    assert [a["bytes"] for a in chat[0]["top_logprobs"]] == [[b] for b in "🎉".encode("utf-8")]
    legacy = svc._logprobs(parsed("completion", 4), lps_of(ids, [party] * len(ids)))
    assert legacy["text_offset"] == char_offsets(TEXT)
    assert max(legacy["text_offset"]) < len(TEXT)
    assert legacy["tokens"] == [e["token"] for e in chat]
    want_keys = [f"bytes:\\x{b:02x}" for b in "🎉".encode("utf-8")]
    assert all(list(top) == want_keys for top in legacy["top_logprobs"])


@pytest.mark.parametrize("step", [1, 3, 5])
def test_streamed_chunks_continue_the_offsets_across_a_split_character(step):
    """Chunks of ``step`` tokens split the emoji's bytes across chunks: the offsets streamed equal
    the non-streamed ones (the partial character is carried from chunk to chunk)."""
    from daemon.serve import _Deltas

    tok = byte_tokenizer()
    ids = tok(TEXT).input_ids
    svc = service(tok)
    p = parsed("completion", 0)
    ticket = types.SimpleNamespace(logprobs=lps_of(ids, [()] * len(ids)))
    d = _Deltas(svc, p, "cmpl-x", 0, ticket)
    chunks = [d.chunk(ids[i:i + step]) for i in range(0, len(ids), step)]
    streamed = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == char_offsets(TEXT)
    assert "".join(c["choices"][0]["text"] for c in chunks) + d.ts.finish() == TEXT


def test_byte_fallback_pieces_are_their_bytes():
    tok = byte_fallback_tokenizer()
    ids = tok(TEXT).input_ids
    assert tok.decode(ids) == TEXT
    svc = service(tok)
    chat = svc._logprobs(parsed("chat", 0), lps_of(ids, [()] * len(ids)))["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat) == TEXT.encode("utf-8")
    assert [239, 191, 189] not in [e["bytes"] for e in chat]
    legacy = svc._logprobs(parsed("completion", 0), lps_of(ids, [()] * len(ids)))
    # one piece per ASCII character, one <0xNN> piece per byte of an emoji: a token per byte here
    # (decoding a prefix is no reference: ByteFallback turns each byte of an unfinished run into U+FFFD)
    assert len(ids) == len(TEXT.encode("utf-8")) and legacy["text_offset"] == char_offsets(TEXT)


@pytest.mark.slow
def test_the_packaged_smollm2_tokens_of_the_emoji_prompt():
    """The break session's prompt on SmolLM2's own tokenizer (no weights loaded): each token's
    bytes are its vocabulary entry's through GPT-2's table, they concatenate to the text, the
    offsets are those of the text decoded up to each token, and the partial tokens of one position
    keep one key each."""
    from transformers import AutoTokenizer

    from decoder.models.loading import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    ids = tok(TEXT).input_ids
    inv = {c: b for b, c in gpt2_table().items()}
    want_bytes = [list(bytes(inv[c] for c in tok.convert_ids_to_tokens(t))) for t in ids]
    partial = list(dict.fromkeys(t for t, b in zip(ids, want_bytes) if not _utf8(bytes(b))))
    assert len(partial) >= 2  # the emoji are split across tokens, or this test checks nothing
    spelled = {t: "bytes:" + "".join(f"\\x{x:02x}" for x in b) for t, b in zip(ids, want_bytes)}
    svc = service(tok)
    chat = svc._logprobs(parsed("chat", 0), lps_of(ids, [()] * len(ids)))["content"]
    assert [e["bytes"] for e in chat] == want_bytes
    assert b"".join(bytes(b) for b in want_bytes) == TEXT.encode("utf-8")
    legacy = svc._logprobs(parsed("completion", 5), lps_of(ids, [partial] * len(ids)))
    assert legacy["text_offset"] == [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    assert all(list(top) == [spelled[t] for t in partial] for top in legacy["top_logprobs"])


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
