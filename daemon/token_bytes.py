"""A token's own bytes and its spelling in OpenAI's logprobs (``daemonctl serve``).

A byte-level BPE token (GPT-2's scheme: SmolLM2, Llama 3, Qwen) or a SentencePiece byte-fallback
token (``<0xF0>``) may hold part of a multi-byte UTF-8 character: decoded alone it is U+FFFD, and
its ``bytes`` were those of U+FFFD, distinct alternatives collapsed onto one ``top_logprobs``
key, and a text offset counted the U+FFFD as a character of the completion. Here a token's bytes
are read from the vocabulary itself (byte-level BPE: the inverse of GPT-2's ``bytes_to_unicode``
map), and a token that is not UTF-8 on its own is spelled ``bytes:\\xf0\\x9f`` (every byte
escaped, as OpenAI's legacy completions spell such tokens), so no two tokens share a spelling.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: one raw byte
_SP_SPACE = "\u2581"  # SentencePiece's word boundary, a space in the text


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the printable character each byte is written as in a
    byte-level BPE vocabulary -> the byte (Radford et al. 2019, ``encoder.py``; the table
    ``tokenizers``' ByteLevel pre-tokenizer uses, from gguf-py's copy of it)."""
    from gguf.vocab import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_types(tokenizer) -> set[str]:
    """The types of a fast tokenizer's decoder and of the decoders of a ``Sequence`` decoder
    (``{"ByteLevel"}``, ``{"Sequence", "Replace", "ByteFallback", "Fuse", ...}``); empty for a slow
    tokenizer."""
    try:
        root = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no Rust decoder to read: the text fallback applies
        return set()
    out, stack = set(), [root]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            out.add(d.get("type"))
            stack.extend(d.get("decoders") or [])
    return out


class TokenBytes:
    """A tokenizer's tokens as bytes and as OpenAI's logprobs spell them.

    Byte-level BPE vocabularies give each token's bytes exactly; SentencePiece byte fallback
    gives ``<0xNN>`` pieces one byte each and other pieces their text (``▁`` a space); any other
    tokenizer (a word- or character-level one, whose tokens are whole characters) its decoded text
    as UTF-8. Special tokens are their content; :meth:`is_special` says which ids the served text
    skips (``decode(..., skip_special_tokens=True)``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        types = _decoder_types(tokenizer)
        self.kind = "byte_level" if "ByteLevel" in types else "byte_fallback" if "ByteFallback" in types else "text"
        self.special = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): t.content for i, t in added.items()}  # their content is text, not byte-level
        self._cache: dict[int, bytes] = {}

    def of(self, t: int) -> bytes:
        """Token ``t``'s own bytes (for a partial UTF-8 character, only the bytes it holds)."""
        b = self._cache.get(t)
        if b is None:
            b = self._cache[t] = self._bytes(t)
        return b

    def _bytes(self, t: int) -> bytes:
        if t in self.added:
            return self.added[t].encode("utf-8")
        if self.kind != "text":
            piece = self.tokenizer.convert_ids_to_tokens(t)
            if isinstance(piece, str):
                if self.kind == "byte_level":
                    table = _byte_decoder()
                    if all(c in table for c in piece):
                        return bytes(table[c] for c in piece)
                else:
                    m = _BYTE_PIECE.fullmatch(piece)
                    return bytes([int(m.group(1), 16)]) if m else piece.replace(_SP_SPACE, " ").encode("utf-8")
        return self.tokenizer.decode([t]).encode("utf-8")

    def spelling(self, t: int) -> str:
        """Token ``t`` as logprobs' ``token`` string: its text when its bytes are UTF-8, else
        ``bytes:`` and every byte as ``\\xNN`` (``bytes:\\xf0\\x9f`` for the first half of 🎉)."""
        b = self.of(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)

    def is_special(self, t: int) -> bool:
        return t in self.special


class TextOffsets:
    """Completions' ``text_offset``: for each token, the characters of the completion's text before
    it, counted on the tokens' bytes as the served text decodes them (special tokens add none;
    a character split across tokens is counted once it is complete, so every token of it gets
    the offset of that character). Feed the tokens in order; one per request (streamed chunks
    continue the count)."""

    def __init__(self, tb: TokenBytes, start: int = 0):
        self.tb, self.chars = tb, start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # U+FFFD for bad bytes, as decode

    def next(self, t: int) -> int:
        """The offset of token ``t`` (the next token of the completion), then count its bytes."""
        at = self.chars
        if not self.tb.is_special(t):
            self.chars += len(self._utf8.decode(self.tb.of(t)))
        return at
