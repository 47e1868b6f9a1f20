"""Constrained output by grammar: ``response_format: {"type": "json_schema", ...}`` and raw GBNF,
on llama.cpp's own grammar engine, lossless under speculation.

A JSON Schema becomes GBNF with llama-cpp-python's converter (``llama_cpp.llama_grammar``); the
GBNF is compiled and matched by llama.cpp (``llama_sampler_init_grammar``; ``llama_sampler_apply``
masks a token-data array, ``llama_sampler_accept`` advances). :class:`GrammarConstraint` has the
interface the decoder uses for JSON mode (:class:`decoder.constrain.JsonObjectConstraint`): a state
per emitted prefix (:meth:`~GrammarConstraint.start`, :meth:`~GrammarConstraint.advance`) and
:meth:`~GrammarConstraint.constrain`, which masks the target's logits at every verified row along
the proposed path: each proposal is checked against its row's state, then accepted on a clone of
that state's grammar sampler, so a rejected step continues from the accepted prefix's state. The
target's p becomes p restricted to the allowed tokens (renormalised), and speculative sampling
against it emits exactly that distribution: the drafts need no mask, and the records keep the
unmasked rows.

Cost (bench/grammar_cost_bench.py, CPU time on a shared 2-core host): one
``llama_sampler_apply`` over SmolLM2's 49,152 tokens, a full mask, takes 6 ms a row (median; 15
ms at most). So a row is masked in full only where its distribution needs every token: greedy
rows (and top-k rows) need only the best allowed tokens, found by checking the row's candidates
best first, 32 (or 4 x top-k) per apply (exact: every token tied with the last one kept is checked
too): 0.6 ms a greedy row; a top-k 40 row where the grammar allows fewer than 40 tokens (between
keys) still needs the full mask to know there are no more. Full masks (T > 0 without top-k,
logprobs, such top-k rows) are cached per grammar state (the emitted token prefix: the grammar is
deterministic) across the requests that share the grammar.

A grammar sampler is never given a token its apply refused (llama.cpp throws from accept, which
would end the process), nor an end-of-sequence token: end of sequence is allowed once the grammar
is complete (llama.cpp allows its end-of-generation tokens there), or when nothing else is.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch

MAX_GRAMMAR_CHARS = 64 * 1024  # GBNF text, given or generated from a schema
MAX_NESTING = 1024  # parenthesised groups inside one another: llama.cpp's parser recurses (20,000 crash it)
MAX_REPEAT = 1000  # minItems/maxItems/minLength/maxLength and {m,n} counts in schema patterns
MAX_CACHED_MASKS = 64  # full masks per grammar (bool per token: 48 KB each for SmolLM2)
FIRST_CHECK = 32  # a partial row checks its best candidates in chunks from this size (4 x top-k if more), x16 each time
PARTIAL_LIMIT = 512  # past this many candidates a row is masked in full (a state refusing its best 512 allows few)

_DT = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


class GrammarError(ValueError):
    """A JSON schema or GBNF grammar that cannot be served; the message says what and how to fix it."""


# ---- turning requests' schemas and grammars into checked GBNF ------------------------------------
_SIZE_KEYS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def _check_schema_sizes(node: Any, path: str = "") -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _SIZE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_REPEAT:
                raise GrammarError(f"{path}{k} = {v!r}: at most {MAX_REPEAT} (each repetition is written out in "
                                   f"the grammar)")
            if k == "pattern" and isinstance(v, str):
                for m in re.finditer(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", v):
                    if max(int(m.group(1)), int(m.group(2) or 0)) > MAX_REPEAT:
                        raise GrammarError(f"{path}pattern {v!r}: repetition counts at most {MAX_REPEAT}")
            _check_schema_sizes(v, f"{path}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_schema_sizes(v, f"{path}{i}.")


UNBOUNDED_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
"""Number keywords llama-cpp-python's converter drops without a word (its ``TODO``): a schema with
``"minimum": 5, "maximum": 10`` decoded 8738582242312554 under ``"strict": true``. Refused instead."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")  # a schema (or a list of them)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _check_schema_keywords(node: Any, path: str = "") -> None:
    """Refuse the :data:`UNBOUNDED_KEYWORDS` anywhere a subschema can stand (not in property names,
    ``enum``/``const``/``default`` data)."""
    if not isinstance(node, dict):
        return
    for k in UNBOUNDED_KEYWORDS:
        if k in node:
            raise GrammarError(f"{path}{k}: the grammar cannot bound numbers (llama-cpp-python's converter would "
                               f"ignore {', '.join(UNBOUNDED_KEYWORDS)} without a word); remove it, or list the "
                               f"allowed values with enum")
    for k in _SCHEMA_MAPS:
        if isinstance(node.get(k), dict):
            for name, sub in node[k].items():
                _check_schema_keywords(sub, f"{path}{k}.{name}.")
    for k in _SCHEMA_ONE + _SCHEMA_LISTS:
        v = node.get(k)
        for i, sub in enumerate(v if isinstance(v, list) else [v]):
            _check_schema_keywords(sub, f"{path}{k}.{i}." if isinstance(v, list) else f"{path}{k}.")


def _pointer_target(schema: dict, ref: str) -> dict:
    """The subschema the local ``$ref`` ``ref`` (``#`` or a JSON pointer ``#/a/b``, RFC 6901's ``~0``
    / ``~1`` and the fragment's %-escapes decoded) points at in ``schema``.

    Raises:
        GrammarError: a remote or relative reference, a step not in the schema, or a target that
            is not a schema object; the message names the ``$ref``.
    """
    from urllib.parse import unquote

    if not ref.startswith("#"):
        raise GrammarError(f"$ref {ref[:200]!r} is not local: remote schemas are not fetched; put the referenced "
                           f"schema under $defs and refer to it as #/$defs/...")
    if ref != "#" and not ref.startswith("#/"):
        raise GrammarError(f"$ref {ref[:200]!r}: a local $ref is '#' or a JSON pointer such as #/$defs/<name>")
    node: Any = schema
    for step in ref[2:].split("/") if ref != "#" else ():
        key = unquote(step).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise GrammarError(f"$ref {ref[:200]!r}: {key[:80]!r} is not in the schema; refer to a schema under "
                               f"$defs, as #/$defs/<name>")
    if not isinstance(node, dict):
        raise GrammarError(f"$ref {ref[:200]!r} points at a {type(node).__name__}, not a schema object")
    return node


def _flat_refs(schema: dict) -> dict:
    """``schema`` with every local ``$ref`` pointing into one root ``$defs`` of its own (a copy of
    each target, under a name no other target has), so llama-cpp-python's converter resolves
    them all: its resolver does not look inside a node that holds a ``$ref`` (a root ``$ref``
    beside the ``$defs`` it points into, as a self-referring tree node is written, was a
    ``KeyError``), and it names a target's rule by the pointer's last step alone (two targets
    named alike got one rule). Recursive references stay references: the grammar recurses."""
    names: dict[str, str] = {}
    defs: dict[str, Any] = {}

    def name_of(ref: str) -> str:
        if ref not in names:
            target = _pointer_target(schema, ref)
            base = re.sub(r"[^A-Za-z0-9-]+", "-", ref.rsplit("/", 1)[-1]).strip("-")[:40] or "schema"
            name, i = f"ref-{base}", 1
            while name in defs:
                i += 1
                name = f"ref-{base}-{i}"
            names[ref], defs[name] = name, None  # named before its copy: a reference back to it ends here
            defs[name] = rewrite(target)
        return names[ref]

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        return {k: (f"#/$defs/{name_of(v)}" if k == "$ref" and isinstance(v, str) else rewrite(v))
                for k, v in node.items()}

    root = rewrite(schema)
    if not names:
        return schema
    root = {k: v for k, v in root.items() if k not in ("$defs", "definitions")}
    if "$ref" in root:  # the converter reads a $ref before anything beside it, as here
        root = {"anyOf": [{"$ref": root["$ref"]}]}
    return {**root, "$defs": defs}


def schema_to_gbnf(schema: Any) -> str:
    """The GBNF grammar of the JSON documents ``schema`` (a JSON Schema, as a dict) accepts, by
    llama-cpp-python's converter (``json_schema_to_gbnf``: types, properties and ``required``,
    ``enum``/``const``, ``anyOf``/``oneOf``, ``items``, ``minItems``/``maxItems``, string
    ``pattern``/``format``; extra properties are refused unless ``additionalProperties`` allows
    them), its local ``$ref`` resolved first (:func:`_flat_refs`; recursive ones included).

    Raises:
        GrammarError: not a JSON object, a keyword the converter refuses, a ``$ref`` that is remote
            or points at nothing (named), a number bound it would ignore (:data:`UNBOUNDED_KEYWORDS`),
            sizes over :data:`MAX_REPEAT`, or a grammar over the limits of :func:`check_gbnf`.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"{type(schema).__name__}: a JSON Schema is a JSON object, e.g. "
                           f'{{"type": "object", "properties": {{"name": {{"type": "string"}}}}, "required": ["name"]}}')
    _check_schema_sizes(schema)
    _check_schema_keywords(schema)
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = json_schema_to_gbnf(json.dumps(_flat_refs(schema)))
    except GrammarError:  # a $ref _flat_refs refuses, named
        raise
    except RecursionError:
        raise GrammarError("the schema nests too deeply (or its $refs loop) for the converter") from None
    except Exception as e:  # noqa: BLE001 - the converter raises AssertionError / ValueError / KeyError ...
        if "remote schemas" in str(e):
            raise GrammarError("a $ref to a remote schema: remote schemas are not fetched; put the referenced "
                               "schema under $defs and refer to it as #/$defs/...") from None
        raise GrammarError(f"the schema cannot be converted to a grammar: {type(e).__name__}: {e}") from None
    check_gbnf(text)
    return text


def check_gbnf(text: Any) -> None:
    """Refuse a GBNF text llama.cpp should not be given: not a string, empty, over
    :data:`MAX_GRAMMAR_CHARS` characters, or groups nested over :data:`MAX_NESTING` deep (its
    recursive parser would overflow the stack). Parse errors are found by compiling
    (:meth:`GrammarConstraint.__init__`).

    Raises:
        GrammarError: as above.
    """
    if not isinstance(text, str):
        raise GrammarError(f"{type(text).__name__}: a grammar is a string of GBNF rules, e.g. "
                           f'root ::= ("yes" | "no")')
    if not text.strip():
        raise GrammarError('empty: give GBNF rules with a root rule, e.g. root ::= ("yes" | "no")')
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{len(text)} characters: at most {MAX_GRAMMAR_CHARS}")
    if "\x00" in text:
        raise GrammarError("holds a NUL character")
    depth = top = 0
    i, n = 0, len(text)
    while i < n:  # skip strings, character classes and comments; count parentheses
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            top = max(top, depth)
        elif c == ")":
            depth -= 1
        i += 1
    if top > MAX_NESTING:
        raise GrammarError(f"groups nest {top} deep: at most {MAX_NESTING}; name the inner groups as rules")


# ---- llama.cpp's vocabulary and the grammar sampler -----------------------------------------------
class GrammarVocab:
    """A GGUF's vocabulary on llama.cpp (loaded vocabulary-only: no weights), which grammars are
    compiled against. Token ids must be the decoder's (the target's GGUF, or one converted from
    the same tokenizer).

    Args:
        gguf: the GGUF file.

    Raises:
        GrammarError: the file does not load.
    """

    def __init__(self, gguf: str | Path):
        from decoder.engines.llamacpp_lib import bindings

        L = self.L = bindings()
        mp = L.llama_model_default_params()
        mp.vocab_only = True
        self.path = Path(gguf)
        self.model = L.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self.model:
            raise GrammarError(f"{self.path}: llama.cpp could not load its vocabulary")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_tokens = int(L.llama_vocab_n_tokens(self.vocab))
        eog = [i for i in range(self.n_tokens) if L.llama_vocab_is_eog(self.vocab, i)]
        never = set(eog) | {i for i in range(self.n_tokens) if L.llama_vocab_is_control(self.vocab, i)}
        self.eog_ids = np.array(eog, dtype=np.int32)
        # the ids a grammar may allow as text: control tokens never (their pieces are markup)
        self.text_ids = np.array([i for i in range(self.n_tokens) if i not in never], dtype=np.int64)
        self.is_text = np.zeros(self.n_tokens, bool)
        self.is_text[self.text_ids] = True
        self._finalizer = weakref.finalize(self, L.llama_model_free, self.model)

    def close(self) -> None:
        """Free the vocabulary (samplers compiled against it must be gone: their apply reads it)."""
        self._finalizer()


_stderr_lock = threading.Lock()


def _compile(vocab: GrammarVocab, text: str, root: str):
    """``llama_sampler_init_grammar`` with llama.cpp's parse error captured (it prints to stderr):
    (sampler or None, error line). Other threads' writes to stderr meanwhile are passed on."""
    L = vocab.L
    try:
        os.fstat(2)
    except OSError:  # no stderr to capture (a detached process): compile, without the reason
        smpl = L.llama_sampler_init_grammar(vocab.vocab, text.encode(), root.encode())
        return (smpl or None), ""
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            smpl = L.llama_sampler_init_grammar(vocab.vocab, text.encode(), root.encode())
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        captured = tmp.read().decode("utf-8", "replace")
    mine = [ln for ln in captured.splitlines() if "grammar" in ln]
    others = [ln for ln in captured.splitlines() if ln.strip() and "grammar" not in ln]
    if others:  # not ours (and not the parser's echo of the grammar text, which follows its error line)
        if smpl:
            os.write(2, ("\n".join(others) + "\n").encode())
    why = next((ln.split("error parsing grammar:", 1)[-1].strip() for ln in mine if "error" in ln), "")
    if not why and mine:
        why = mine[0].strip()
    return (smpl or None), why


class GrammarState:
    """One request's progress under a grammar: its own grammar sampler (a clone, advanced by the
    emitted tokens), and what is known of its allowed tokens. Freed with the object."""

    __slots__ = ("smpl", "prefix", "children", "checked", "full", "complete", "__weakref__")

    def __init__(self, L, smpl, prefix: tuple):
        self.smpl, self.prefix = smpl, prefix
        self.children: dict[int, GrammarState] = {}
        self.checked: dict[int, bool] = {}  # token id -> allowed
        self.full: np.ndarray | None = None  # (n_tokens,) bool over text ids, once masked in full
        self.complete: bool | None = None
        weakref.finalize(self, L.llama_sampler_free, smpl)


class GrammarConstraint:
    """Output constrained by a GBNF grammar, for one vocabulary; shared by the requests that send
    the same grammar (its full masks are cached per state); thread-safe (a state is one request's).

    Args:
        vocab: the :class:`GrammarVocab` the decoder's token ids index.
        gbnf: the grammar (checked by :func:`check_gbnf`).
        root: its start rule.
        width: the logits' width (>= the vocabulary; ids past it are never allowed).

    Raises:
        GrammarError: refused by :func:`check_gbnf`, or llama.cpp does not parse it (the message
            carries llama.cpp's parse error: an undefined rule, left recursion, no root rule, ...).
    """

    def __init__(self, vocab: GrammarVocab, gbnf: str, root: str = "root", width: int | None = None):
        check_gbnf(gbnf)
        self.vocab, self.L, self.gbnf, self.root_name = vocab, vocab.L, gbnf, root
        self.width = max(width or 0, vocab.n_tokens)
        smpl, why = _compile(vocab, gbnf, root)
        if smpl is None:
            raise GrammarError(f"llama.cpp does not parse it: {why or 'see its GBNF reference'} (GBNF: rules "
                               f"`name ::= ...`, a `{root}` rule, every rule used defined, no left recursion)")
        self._root = GrammarState(self.L, smpl, ())
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._cands: dict[frozenset, np.ndarray] = {}
        self._lock = threading.Lock()
        self.applies = 0  # llama_sampler_apply calls (full + partial), for measurement
        self.full_applies = 0

    # -- states --
    def start(self) -> GrammarState:
        """A new request's state: the grammar before any output."""
        return GrammarState(self.L, self.L.llama_sampler_clone(self._root.smpl), ())

    def done(self, state: GrammarState) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        return self._complete(state)

    def advance(self, state: GrammarState, token: int, eos_ids: Iterable[int] = ()) -> GrammarState | None:
        """The state after ``token``, or None when the grammar does not allow it there (a control
        token never). An end-of-sequence token leaves the state as it is (allowed once the grammar
        is complete, or when nothing else is)."""
        token = int(token)
        if token in eos_ids:
            return state if self._complete(state) or not self._any_text(state) else None
        child = state.children.get(token)
        if child is not None:
            return child
        if not (0 <= token < self.vocab.n_tokens and self.vocab.is_text[token]) or not self._check(state, np.array([token]))[0]:
            return None
        smpl = self.L.llama_sampler_clone(state.smpl)
        self.L.llama_sampler_accept(smpl, token)  # allowed by apply: accept cannot throw
        child = GrammarState(self.L, smpl, state.prefix + (token,))
        state.children[token] = child
        return child

    # -- what a state allows --
    def _apply(self, state: GrammarState, ids: np.ndarray) -> np.ndarray:
        arr = np.zeros(len(ids), _DT)
        arr["id"] = ids
        ta = self.L.llama_token_data_array(arr.ctypes.data_as(self.L.llama_token_data_p), len(ids), -1, False)
        self.L.llama_sampler_apply(state.smpl, ctypes.byref(ta))
        self.applies += 1
        return np.isfinite(arr["logit"])

    def _complete(self, state: GrammarState) -> bool:
        if state.complete is None:
            state.complete = bool(len(self.vocab.eog_ids) and self._apply(state, self.vocab.eog_ids).any())
        return state.complete

    def _check(self, state: GrammarState, ids: np.ndarray) -> np.ndarray:
        """(len(ids),) bool: which of these text ids the state allows."""
        if state.full is not None:
            return state.full[ids]
        out = np.zeros(len(ids), bool)
        todo = []
        for j, t in enumerate(ids.tolist()):
            known = state.checked.get(t)
            if known is None:
                todo.append(j)
            else:
                out[j] = known
        if todo:
            sub = ids[todo]
            ok = self._apply(state, sub)
            out[todo] = ok
            state.checked.update(zip(sub.tolist(), ok.tolist()))
        return out

    def _full(self, state: GrammarState) -> np.ndarray:
        """(n_tokens,) bool: the text tokens the state allows (one apply over the vocabulary),
        cached on the state and, by the emitted prefix, for other requests."""
        if state.full is None:
            with self._lock:
                m = self._masks.get(state.prefix)
                if m is not None:
                    self._masks.move_to_end(state.prefix)
            if m is None:
                m = np.zeros(self.vocab.n_tokens, bool)
                m[self.vocab.text_ids[self._apply(state, self.vocab.text_ids)]] = True
                self.full_applies += 1
                with self._lock:
                    self._masks[state.prefix] = m
                    while len(self._masks) > MAX_CACHED_MASKS:
                        self._masks.popitem(last=False)
            state.full = m
        return state.full

    def _any_text(self, state: GrammarState) -> bool:
        return bool(self._full(state).any())

    def _candidates(self, eos: frozenset) -> np.ndarray:
        c = self._cands.get(eos)
        if c is None:
            ids = self.vocab.text_ids
            c = ids[~np.isin(ids, np.fromiter(eos, np.int64, len(eos)))] if eos else ids
            self._cands[eos] = c
        return c

    def allowed(self, state: GrammarState, row: torch.Tensor | None, eos: frozenset, top_k: int | None) -> np.ndarray:
        """The token ids the row keeps: with ``top_k`` = k, at least the k best allowed (by the
        row's logits) and every allowed token tied with the k-th; with None, every allowed token.
        End of sequence is allowed once the grammar is complete, or when no text token is."""
        cands = self._candidates(eos)
        keep = None
        if top_k is not None and row is not None:
            vals = row[torch.from_numpy(cands)].float()
            c = max(FIRST_CHECK, 4 * top_k)
            while c <= PARTIAL_LIMIT:
                c_ = min(c, len(cands))
                top = torch.topk(vals, c_).indices.numpy()  # best first
                ok = self._check(state, cands[top])
                found = top[ok]
                if len(found) >= top_k or c_ == len(cands):
                    if len(found) >= top_k:  # every candidate tied with the k-th must be checked too
                        w = vals[int(found[top_k - 1])]
                        tied = torch.nonzero(vals >= w).flatten().numpy()
                        found = tied[self._check(state, cands[tied])]
                    keep = cands[found]
                    break
                c *= 16
        if keep is None:  # every token needed (or the best are mostly refused): the full mask
            keep = np.nonzero(self._full(state))[0]
            if eos:
                keep = keep[~np.isin(keep, np.fromiter(eos, np.int64, len(eos)))]
        eos_ok = self._complete(state) or (len(keep) == 0 and not self._any_text(state))
        if eos_ok and eos:
            keep = np.concatenate([keep, np.fromiter(eos, np.int64, len(eos))])
        return keep

    def constrain(self, logits: torch.Tensor, state: GrammarState, proposals: list[int], eos_ids: Iterable[int],
                  top_k: int | None = None) -> torch.Tensor:
        """``logits`` (g + 1, V) with row i restricted to what the grammar allows after
        ``proposals[:i]`` (refused tokens -inf). ``top_k``: the rows are used only through their
        ``top_k`` best tokens (1 = greedy), so only those need checking (exact); None = masked in
        full (sampling without top-k, logprobs). After a refused proposal the rows keep the last
        allowed state (they are never used: that proposal is rejected)."""
        eos = frozenset(int(e) for e in eos_ids)
        out = torch.full(logits.shape, float("-inf"), dtype=torch.float32)
        src = logits.detach().float().cpu()
        s = state
        for i in range(logits.shape[0]):
            keep = self.allowed(s, src[i], eos, top_k)
            keep = keep[keep < logits.shape[1]]
            if len(keep):
                idx = torch.from_numpy(keep)
                out[i, idx] = src[i, idx]
            if i < len(proposals):
                nxt = self.advance(s, proposals[i], eos)
                if nxt is not None:
                    s = nxt
                else:  # never used after this row: keep masking with the last state, nothing to accept
                    proposals = proposals[:i]
        return out.to(logits.device)
