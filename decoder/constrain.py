"""Constrained output: JSON mode (``response_format: {"type": "json_object"}``), lossless under speculation.

A constraint is a prefix automaton over the output text plus, per automaton state, the mask of
the tokens that keep the text a prefix of a valid JSON object. The decoder applies the mask to the
target's logits at every verified row (:meth:`SpeculativeDecoder._generate`): the target's
distribution becomes p' = p restricted to the allowed tokens and renormalised (greedy: the argmax
among them), and speculative sampling against p' emits exactly p''s distribution, whatever the
proposer proposed: a proposal outside the mask has p'(t) = 0 and is rejected, so the drafts need
no mask for the output to stay lossless (masking them too would only raise acceptance). The
records keep the target's own, unmasked rows: the draft learns the model, not the constraint.

States are small tuples, so a state's mask is computed once (one pass over the vocabulary's
decoded token strings) and cached: a JSON output visits few distinct states.
"""

from __future__ import annotations

import threading
from typing import Iterable

import torch

# modes of the automaton
VALUE, OBJ_FIRST, OBJ_KEY, COLON, AFTER, ARR_FIRST, STR, ESC, UHEX, LIT, DONE, ROOT = (
    "value", "obj_first", "obj_key", "colon", "after", "arr_first", "str", "esc", "uhex", "lit", "done", "root")
NUM_MINUS, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_E, NUM_ESIGN, NUM_EXP = (
    "n-", "n0", "ni", "n.", "nf", "ne", "ne+", "nx")
_NUM_END = {NUM_ZERO, NUM_INT, NUM_FRAC, NUM_EXP}  # a number may end in these
_WS = " \t\n\r"
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

State = tuple  # (stack: str of 'o'/'a', mode: str, extra: str|int|bool)
MAX_CACHED_MASKS = 256  # per constraint; a mask is one float per token (196 KB for SmolLM2), the oldest goes first


def _after_value(stack: str) -> State:
    return (stack, AFTER, "") if stack else ("", DONE, "")


def _start_value(stack: str, ch: str) -> State | None:
    """The state after ``ch`` begins a value (``ch`` is its first character), or None."""
    if ch == "{":
        return (stack + "o", OBJ_FIRST, "")
    if ch == "[":
        return (stack + "a", ARR_FIRST, "")
    if ch == '"':
        return (stack, STR, False)  # extra: is it a key
    if ch == "-":
        return (stack, NUM_MINUS, "")
    if ch == "0":
        return (stack, NUM_ZERO, "")
    if ch.isdigit() and ch.isascii():
        return (stack, NUM_INT, "")
    if ch in _LITERALS:
        return (stack, LIT, _LITERALS[ch])
    return None


def step(state: State, ch: str) -> State | None:
    """The automaton's state after ``ch``, or None when ``ch`` cannot continue a JSON object."""
    stack, mode, extra = state
    if mode in (STR, ESC, UHEX):
        if mode == STR:
            if ch == '"':
                return (stack, COLON, "") if extra else _after_value(stack)
            if ch == "\\":
                return (stack, ESC, extra)
            return None if ord(ch) < 0x20 else state
        if mode == ESC:
            if ch in '"\\/bfnrt':
                return (stack, STR, extra)
            return (stack, UHEX, (extra, 4)) if ch == "u" else None
        key, n = extra
        if ch in "0123456789abcdefABCDEF":
            return (stack, UHEX, (key, n - 1)) if n > 1 else (stack, STR, key)
        return None
    if mode in (NUM_MINUS, NUM_ZERO, NUM_INT, NUM_DOT, NUM_FRAC, NUM_E, NUM_ESIGN, NUM_EXP):
        digit = ch.isascii() and ch.isdigit()
        nxt = None
        if mode == NUM_MINUS:
            nxt = NUM_ZERO if ch == "0" else NUM_INT if digit else None
        elif mode in (NUM_ZERO, NUM_INT):
            nxt = NUM_INT if digit and mode == NUM_INT else NUM_DOT if ch == "." else NUM_E if ch in "eE" else None
        elif mode in (NUM_DOT, NUM_FRAC):
            nxt = NUM_FRAC if digit else (NUM_E if ch in "eE" and mode == NUM_FRAC else None)
        elif mode == NUM_E:
            nxt = NUM_ESIGN if ch in "+-" else NUM_EXP if digit else None
        else:
            nxt = NUM_EXP if digit else None
        if nxt is not None:
            return (stack, nxt, "")
        if mode in _NUM_END:  # the number ended: the character goes to what follows a value
            return step(_after_value(stack), ch)
        return None
    if mode == LIT:
        if ch != extra[0]:
            return None
        return (stack, LIT, extra[1:]) if len(extra) > 1 else _after_value(stack)
    if mode == DONE:  # the object closed: only the end of sequence (OpenAI's JSON mode stops there; with
        return None   # whitespace allowed a model emitted newlines up to max_tokens: finish_reason "length")
    if ch in _WS:
        return state
    if mode == ROOT:  # JSON mode: the output is one object
        return ("o", OBJ_FIRST, "") if ch == "{" else None
    if mode == VALUE:
        return _start_value(stack, ch)
    if mode == ARR_FIRST:
        return _after_value(stack[:-1]) if ch == "]" else _start_value(stack, ch)
    if mode in (OBJ_FIRST, OBJ_KEY):
        if ch == '"':
            return (stack, STR, True)
        if ch == "}" and mode == OBJ_FIRST:
            return _after_value(stack[:-1])
        return None
    if mode == COLON:
        return (stack, VALUE, "") if ch == ":" else None
    if mode == AFTER:
        top = stack[-1]
        if ch == ",":
            return (stack, OBJ_KEY, "") if top == "o" else (stack, VALUE, "")
        if (ch == "}" and top == "o") or (ch == "]" and top == "a"):
            return _after_value(stack[:-1])
        return None
    return None


def feed(state: State, text: str) -> State | None:
    for ch in text:
        state = step(state, ch)
        if state is None:
            return None
    return state


class JsonObjectConstraint:
    """JSON mode for one tokenizer: the output is one JSON object (whitespace allowed before it and
    inside it), then end of sequence at once.

    Shared by every request of a server (the token strings and the masks are per tokenizer);
    a request's progress is its own state (:meth:`start`, :meth:`advance`). Thread-safe.

    Args:
        token_texts: the decoded text of each token id (index = id); None (or "") for tokens that
            never appear in JSON text (special tokens).
        vocab: the logits' width (>= len(token_texts): padded ids are never allowed).
    """

    def __init__(self, token_texts: list[str | None], vocab: int | None = None):
        self.texts = token_texts
        self.vocab = max(vocab or 0, len(token_texts))
        # token ids by their text's first character: a state rejects most first characters at once
        self._by_first: dict[str, list[tuple[int, str]]] = {}
        for i, text in enumerate(token_texts):
            if text:
                self._by_first.setdefault(text[0], []).append((i, text[1:]))
        self._masks: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab: int | None = None) -> "JsonObjectConstraint":
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        n = len(tokenizer)
        texts: list[str | None] = [None if i in special else tokenizer.decode([i]) or None for i in range(n)]
        return cls(texts, vocab)

    def start(self) -> State:
        return ("", ROOT, "")

    @staticmethod
    def done(state: State) -> bool:
        return state[1] == DONE

    def advance(self, state: State, token: int, eos_ids: Iterable[int] = ()) -> State | None:
        """``state`` after ``token`` (an end-of-sequence token leaves it as it is), or None."""
        if token in eos_ids:
            return state if self.done(state) else None
        text = self.texts[token] if token < len(self.texts) else None
        return feed(state, text) if text else None

    def allowed(self, state: State, eos_ids: Iterable[int] = ()) -> list[int]:
        """The token ids allowed next. End of sequence only once the object is closed."""
        ok = []
        for first, toks in self._by_first.items():
            s1 = step(state, first)
            if s1 is None:
                continue
            ok.extend(i for i, rest in toks if not rest or feed(s1, rest) is not None)
        if self.done(state) or not ok:  # closed (or, in theory, stuck): end of sequence
            ok.extend(e for e in eos_ids if e < self.vocab)
        return ok

    def mask(self, state: State, eos_ids: Iterable[int] = ()) -> torch.Tensor:
        """(vocab,) float32: 0 where a token is allowed next, -inf elsewhere (an additive mask: bool
        kernels are slow on some CPU builds of torch). Cached per state."""
        key = (state, frozenset(eos_ids))
        with self._lock:
            m = self._masks.get(key)
        if m is not None:
            return m
        m = torch.full((self.vocab,), float("-inf"))
        m[torch.tensor(self.allowed(state, key[1]), dtype=torch.long)] = 0.0
        with self._lock:
            if len(self._masks) >= MAX_CACHED_MASKS:  # bounded: a deeply nested output visits new states
                self._masks.pop(next(iter(self._masks)))
            self._masks[key] = m
        return m

    def constrain(self, logits: torch.Tensor, state: State, proposals: list[int], eos_ids: Iterable[int],
                  top_k: int | None = None) -> torch.Tensor:
        """``logits`` (g + 1, V) with row i masked at the state after ``proposals[:i]`` (after an
        invalid proposal the rows keep the last valid state's mask: they are never used, the
        invalid proposal being rejected). ``top_k`` (how many of a row's best tokens are used) is
        ignored: the masks are cached per state and cheap."""
        eos = frozenset(eos_ids)
        rows, s = [], state
        for i in range(logits.shape[0]):
            rows.append(self.mask(s, eos))
            if i < len(proposals):
                nxt = self.advance(s, proposals[i], eos)
                if nxt is None:  # rejected at row i: the rows after it are never used
                    rows.extend([rows[-1]] * (logits.shape[0] - i - 1))
                    break
                s = nxt
        out = logits.float().clone()
        n = min(out.shape[1], self.vocab)
        for i, m in enumerate(rows):
            out[i, :n] += m[:n].to(out.device)
            if out.shape[1] > n:  # padded ids beyond the tokenizer: never
                out[i, n:] = float("-inf")
        return out
