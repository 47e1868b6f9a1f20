"""`daemonctl serve`: an OpenAI-compatible inference service around :class:`decoder.loop.ServingLoop`.

Endpoints (OpenAI's request and response shapes, as vLLM's and SGLang's servers give them)::

    POST /v1/completions          prompt (text or token ids) -> text; stream: server-sent events
    POST /v1/chat/completions     messages, through the tokenizer's chat template
    GET  /v1/models               the served model
    GET  /health                  200 while serving, 503 while draining
    GET  /metrics                 Prometheus text: vLLM-style spec-decode counters, latency histograms
    GET  /draftd/status           the serving loop's status (what the heartbeat carries)

Extra request fields (``extra_body`` in the openai client): ``top_k``, ``ignore_eos``, ``gamma``
(a fixed γ; default: the goodput controller's), ``workload`` (also the ``X-Draftd-Workload``
header; default ``default``), ``cache_prompt`` (llama-server's: false prefills the whole prompt
instead of keeping cached cells; default true, under ``serve.prompt_cache``); vLLM's chat fields
``add_generation_prompt`` (default true) and ``continue_final_message`` (default false: continue
the final message, e.g. an assistant's prefill, instead of answering it in a new turn) and its
``stream_options.continuous_usage_stats`` (usage in every chunk). Every response carries the request's measurement under
``"draftd"`` (the last chunk when streaming), which OpenAI clients ignore.

Errors are OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``: 400 for a
bad or unsupported parameter (named, with the fix), 404 for an unknown model or route, 429 with
``Retry-After`` when the request queue is full, 503 while draining. Unknown fields are refused
too, so nothing a client asks for is silently ignored.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import re
import secrets
import signal
import sys
import socket
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import structlog
import typer
from rich.markup import escape as rich_escape
from starlette.requests import Request  # a module global: FastAPI resolves the handlers' string annotations here

from daemon.http_timeout import DEFAULT_READ_TIMEOUT_S, read_timeout_protocol
from daemon.token_bytes import TextOffsets, TokenBytes

log = structlog.get_logger("daemon.serve")

WORKLOAD_HEADER = "X-Draftd-Workload"
MAX_STOP = 16
MAX_GAMMA = 64
MAX_GRAMMARS = 16  # compiled grammars an InferenceService keeps (by GBNF text), with their cached masks
MAX_LOGPROBS = 20  # decoder.sampling.MAX_LOGPROBS: top_logprobs at most (OpenAI's bound)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}

# fields accepted (and acted on) besides the prompt; everything else is refused by name
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
           "top_k", "ignore_eos", "gamma", "workload", "presence_penalty", "frequency_penalty", "logit_bias",
           "repetition_penalty", "min_tokens", "metadata", "grammar", "cache_prompt"}
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                   "functions", "function_call", "parallel_tool_calls", "response_format", "store",
                   "add_generation_prompt", "continue_final_message"}


class ApiError(Exception):
    """An OpenAI-shaped error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _j(v: Any, limit: int = 200) -> str:
    """A request's value as the client wrote it, in JSON (``true``, ``null``, ``"x"``), not Python's
    repr (``True``, ``None``, ``'x'``): at most ``limit`` characters (longer ones end in ``...``);
    printable non-ASCII text kept, any other character (a no-break space, a lone surrogate) a
    ``\\uXXXX`` escape, so the message shows it and encodes as UTF-8."""
    try:
        s = json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):  # not a JSON value: Python's spelling is all there is
        s = repr(v)
    s = "".join(c if c.isprintable() else _u_escape(c) for c in s[:limit + 1])  # escaping only lengthens
    return s if len(s) <= limit else s[:limit - 3] + "..."


NAME_LIMIT = 80  # characters of a client's field name an error quotes (in its message and its param)


def _clip(name: str, limit: int = NAME_LIMIT) -> str:
    """A field name the client chose (an unknown key), as an error's ``param`` carries it: at most
    ``limit`` characters, a longer one cut to end in ``...`` (a 100,000-character key is not echoed
    whole)."""
    return name if len(name) <= limit else name[:limit - 3] + "..."


def _u_escape(c: str) -> str:
    """``c`` as JSON's ``\\uXXXX`` escape (a pair of them past U+FFFF)."""
    o = ord(c)
    if o <= 0xFFFF:
        return f"\\u{o:04x}"
    o -= 0x10000
    return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"


# ---- request parsing (pure) ------------------------------------------------------------------------


class ThreadFeed:
    """Hands items from the serving loop's threads to asyncio queues on one event loop, waking the
    loop once for whatever arrived since it last drained, not once per item: every request of a
    batch emits tokens at every step, and each ``call_soon_threadsafe`` wakes the loop through a
    socket write and a GIL hand-off (the woken loop takes the GIL; the writer waits for it back),
    while the batch's other members wait their turn.

    ``put(q, item)`` (any thread): ``q.put_nowait(item)`` runs on the event loop, in the order the
    items were put; ``put(q, item, wake=False)`` leaves the wake to the next :meth:`flush` (the
    serving loop's driver calls it at each step boundary, just before the step's forward releases
    the GIL: the loop then streams while the engine decodes). Raises what
    ``call_soon_threadsafe`` raises (RuntimeError: the loop is closed); the items not yet drained
    then stay for the next wake."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self._items: list = []
        self._lock = threading.Lock()
        self._scheduled = False  # a drain is queued on the loop and has not yet taken the items
        self.wakes = 0

    def put(self, q: asyncio.Queue, item: Any, wake: bool = True) -> None:
        with self._lock:
            self._items.append((q, item))
            if self._scheduled or not wake:
                return
            self._scheduled = True
            self.wakes += 1
        self._wake()

    def flush(self) -> None:
        """Wake the loop if items wait and no drain is queued yet; a closed loop's items are
        dropped (nobody can read them)."""
        with self._lock:
            if self.aloop.is_closed():  # a drain queued before it closed never ran either
                self._items.clear()
                self._scheduled = False
                return
            if self._scheduled or not self._items:
                return
            self._scheduled = True
            self.wakes += 1
        self._wake()

    def _wake(self) -> None:
        try:
            self.aloop.call_soon_threadsafe(self._drain)
        except BaseException:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for q, item in items:
            q.put_nowait(item)


@dataclass
class Parsed:
    """A validated request, ready for the loop."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    gamma: int | None
    workload: str
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage in every chunk
    cache_prompt: bool = True  # llama-server's field: false = no prompt-cache cells for this request
    json_mode: bool = False  # response_format {"type": "json_object"}: the output is one JSON object
    grammar: str | None = None  # GBNF the output follows (response_format json_schema, or the grammar field)
    grammar_param: str | None = None  # the field it came from, for errors
    constraint: Any = None  # the compiled grammar (decoder.grammar.GrammarConstraint), set by InferenceService.parse
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; n: each token's logprob and its n most probable alternatives


def _number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, int) and not isinstance(v, bool):
        try:
            v = float(v)
        except OverflowError:  # an int past a float's range: a 400, not a 500
            raise _bad(name, f"an integer of {v.bit_length()} bits is out of a number's range", "invalid_type")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"{_j(v)} is not a finite number", "invalid_type")
    return float(_in_range(name, v, lo, hi, lo_open))


# A temperature below this is greedy decoding (vLLM's _SAMPLING_EPS): one key, one logprob semantics.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _temperature(body: dict) -> float:
    """``temperature`` (default 1, as OpenAI's); below :data:`GREEDY_BELOW_TEMPERATURE` it is 0, greedy
    decoding, as vLLM serves it: a temperature of 1e-31 was a sampled request of its own controller
    key whose ``top_logprobs`` were its one-hot limit, where 0 gave the target's own log-probabilities."""
    t = _number(body, "temperature", 1.0, lo=0.0)
    return 0.0 if t < GREEDY_BELOW_TEMPERATURE else t


MAX_TOKENS_BOUND = 2 ** 31 - 1  # max_tokens above it: a 400 (int32, as vLLM and llama-server read it)
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # a request's seed and `daemonctl generate --seed`: vLLM's bound (int64)


def seed_problem(seed: int) -> str | None:
    """Why ``seed`` is outside the seeds served (a signed 64-bit integer, :data:`SEED_MIN` to
    :data:`SEED_MAX`: vLLM's bound on ``seed``, taken by the API and ``daemonctl generate --seed``
    alike), as ``"out of range: <the range>"`` for a message that names the value first; None when
    it is inside. A seed in [2^63, 2^64), an unsigned 64-bit one past the signed range, is told
    the signed seed that draws the same stream (``decoder.sampling.seeded_generator`` reads a seed
    modulo 2^64): ``seed - 2^64``."""
    if SEED_MIN <= seed <= SEED_MAX:
        return None
    why = f"out of range: a signed 64-bit integer, {SEED_MIN} to {SEED_MAX}"
    if SEED_MAX < seed < 2 ** 64:
        why += f"; send {seed - 2 ** 64} (the seed minus 2^64), which draws the stream the unsigned {seed} would"
    return why


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None,
         what: str | None = None) -> int | None:
    """``body[name]`` as an int (an integral float accepted), ``default`` when absent; a 400 naming
    ``name`` when not an integer or outside [lo, hi] (``what`` names the range, both ends quoted)."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _bad(name, f"{_j(v)} is not an integer", "invalid_type")
    return _in_range(name, v, lo, hi, what=what)


def _in_range(name: str, v, lo=None, hi=None, lo_open: bool = False, what: str | None = None):
    """The one range check of a request's numbers: ``v``, or a 400 naming ``name`` when it is below
    ``lo`` (at or below it with ``lo_open``) or above ``hi``; ``what`` names a two-sided range, and
    the message then quotes both ends."""
    below = lo is not None and (v <= lo if lo_open else v < lo)
    above = hi is not None and v > hi
    if (below or above) and what is not None:
        raise _bad(name, f"{_j(v)} is out of range: {what}, {_bound(lo)} to {_bound(hi)}")
    if below:
        raise _bad(name, f"{_j(v)} must be {'>' if lo_open else '>='} {_bound(lo)}")
    if above:
        raise _bad(name, f"{_j(v)} must be <= {_bound(hi)}")
    return v


def _bound(x) -> str:
    """A range's end as a message shows it: a float in ``g`` form (1.0 -> 1), an int whole."""
    return f"{x:g}" if isinstance(x, float) else str(x)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"{_j(v)} is not a boolean (true or false)", "invalid_type")
    return v


def _one_of(v, allowed: tuple) -> bool:
    """``v`` equals one of ``allowed`` with the same JSON type (``true`` is not 1, ``0`` is not false)."""
    return any(type(v) is type(x) and v == x for x in allowed)


def _unsupported(body: dict, kind: str) -> None:
    """400 for values this server does not implement (never silently ignored)."""
    allowed = _COMPLETION if kind == "completion" else _CHAT
    unknown = sorted(set(body) - allowed)
    if unknown:  # the name as the client wrote it, in JSON, as every value a message quotes
        raise ApiError(400, f"{_j(unknown[0], NAME_LIMIT)}: unknown or unsupported field; supported fields: "
                            f"{', '.join(sorted(allowed))}", param=_clip(unknown[0]), code="unsupported_parameter")
    checks = [
        ("n", lambda v: _one_of(v, (None, 1, 1.0)), "only n=1 is served; send several requests for several completions"),
        ("best_of", lambda v: _one_of(v, (None, 1, 1.0)), "only best_of=1 is served"),
        ("echo", lambda v: _one_of(v, (None, False)), "echo is not supported; prepend the prompt yourself"),
        ("suffix", lambda v: _one_of(v, (None, "")), "suffix (insertion) is not supported"),
        ("presence_penalty", lambda v: _one_of(v, (None, 0, 0.0)), "penalties are not supported (they would change the "
                                                            "target's distribution); leave it 0"),
        ("frequency_penalty", lambda v: _one_of(v, (None, 0, 0.0)), "penalties are not supported; leave it 0"),
        ("repetition_penalty", lambda v: _one_of(v, (None, 1, 1.0)), "penalties are not supported; leave it 1"),
        ("min_tokens", lambda v: _one_of(v, (None, 0)), "min_tokens is not supported; use ignore_eos"),
        ("logit_bias", lambda v: _one_of(v, (None, {})), "logit_bias is not supported"),
        ("tools", lambda v: _one_of(v, (None, [])), "tool calling is not supported"),
        ("functions", lambda v: _one_of(v, (None, [])), "function calling is not supported"),
        ("function_call", lambda v: _one_of(v, (None, "none")), "function calling is not supported"),
        ("tool_choice", lambda v: _one_of(v, (None, "none")), "tool calling is not supported"),
        ("parallel_tool_calls", lambda v: _one_of(v, (None, False, True)) and not body.get("tools"), "tool calling is not supported"),
        ("store", lambda v: _one_of(v, (None, False)), "stored completions are not supported"),
    ]
    for name, ok, why in checks:
        if name in body and not ok(body[name]):
            raise _bad(name, f"{_j(body[name])}: {why}", "unsupported_parameter")


def _workload(body: dict, header: str | None) -> str:
    w = body.get("workload")
    param = "workload"
    if w is None and header is not None:
        w, param = header, WORKLOAD_HEADER
        try:  # HTTP headers arrive as Latin-1 text: a client's UTF-8 name is those bytes (as the body's would be)
            w = w.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            raise _bad(param, f"{_j(w, 80)} is not UTF-8 text; send the workload's name in UTF-8 or in the body's "
                              f"'workload'")
    if w is None:
        return "default"
    from store.schema import WORKLOAD_RULE, workload_problem  # the store's rule: a served workload is a valid record's

    why = workload_problem(w, untagged_ok=False)
    if why is not None:
        raise _bad(param, f"{_j(w, 80)}: {why}; {WORKLOAD_RULE}")
    return w


def _stop(body: dict) -> tuple[str, ...]:
    s = body.get("stop")
    if s is None:
        return ()
    items = [s] if isinstance(s, str) else s
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise _bad("stop", f"{_j(s)}: give a string or a list of strings", "invalid_type")
    if len(items) > MAX_STOP:
        raise _bad("stop", f"{len(items)} stop strings; at most {MAX_STOP}")
    if any(x == "" for x in items):
        raise _bad("stop", "an empty stop string would end generation at once; drop it")
    return tuple(items)


def _messages_ids(body: dict, tokenizer) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "give a non-empty list of {\"role\", \"content\"} objects", "invalid_type" if msgs is not None else "missing")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise _bad(f"messages[{i}]", "each message is an object with a role and a content", "invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer"):
            raise _bad(f"messages[{i}].role", f"{_j(role)}: use system, user or assistant (tool messages are not supported)")
        if isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise _bad(f"messages[{i}].content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are "
                                                           "supported", "unsupported_parameter")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content", f"{_j(content)}: give a string or a list of text parts", "invalid_type")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise ApiError(400, f"messages[{i}]: {_j(extra[0], NAME_LIMIT)} is an unsupported message field (tool "
                                f"calls are not supported)", param=f"messages[{i}].{_clip(extra[0])}",
                           code="unsupported_parameter")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions with a prompt",
                       param="messages", code="no_chat_template")
    add, cont = _template_flags(body, clean[-1]["content"])
    try:
        ids = tokenizer.apply_chat_template(clean, add_generation_prompt=add, continue_final_message=cont, tokenize=True)
    except ValueError as e:  # transformers: the template dropped or rewrote the final message, so it cannot stay open
        if not cont:
            raise
        raise _bad("continue_final_message", f"this model's chat template does not render the final message's "
                                             f"content as sent ({e}); send continue_final_message: false") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(x) for x in ids]


def _template_flags(body: dict, final_content: str) -> tuple[bool, bool]:
    """``(add_generation_prompt, continue_final_message)`` of a chat request, as vLLM's chat API
    takes them: by default (true, false), a new assistant turn is opened after the messages, the
    last one closed whatever its role; ``continue_final_message: true`` renders the final message
    open (no end-of-turn) for the completion to continue it ("prefill"), and then
    ``add_generation_prompt`` defaults to false.

    Raises:
        ApiError: 400 for a non-boolean, for both true (vLLM refuses that pair: a new turn cannot
            open inside the final message), or for continuing an empty final message.
    """
    cont = _bool(body, "continue_final_message", False)
    add = _bool(body, "add_generation_prompt", not cont)
    if cont and add:
        raise _bad("continue_final_message", "true with add_generation_prompt: true: a new assistant turn cannot "
                                             "start inside the final message; send add_generation_prompt: false to "
                                             "continue the final message, or continue_final_message: false to answer "
                                             "it in a new turn")
    if cont and not final_content.strip():
        raise _bad("continue_final_message", "the final message is empty, so there is nothing to continue; give it "
                                             "the text to continue, or drop it and send continue_final_message: false")
    return add, cont


def _prompt_ids(body: dict, tokenizer, vocab: int) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "empty prompt; give at least one character")
        return list(tokenizer(p).input_ids)
    if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        bad = next((x for x in p if not 0 <= x < vocab), None)
        if bad is not None:
            raise _bad("prompt", f"token id {bad} outside the vocabulary 0..{vocab - 1}")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise _bad("prompt", f"a batch of {len(p)} prompts; this server takes one prompt per request "
                             "(send them concurrently)", "unsupported_parameter")
    if p is None:
        raise _bad("prompt", "missing; give the prompt text (or a list of token ids)", "missing")
    raise _bad("prompt", f"{_j(p)}: give a string or a list of token ids", "invalid_type")


MAX_JSON_DEPTH = 32  # a request body nests a few levels (messages[i].content[j].text); more is refused


def _json_path(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{_clip(str(p))}" if out else _clip(str(p)))
    return out or "body"


class _TooLong(str):
    """An integer literal of the body with more digits than Python converts
    (``sys.get_int_max_str_digits()``): kept as its text until :func:`check_json` names its field."""


def _json_int(text: str) -> int | _TooLong:
    try:
        return int(text)
    except ValueError:  # past the digit limit
        return _TooLong(text)


def check_json(body: Any) -> None:
    """Refuse what no field of a request can hold, before any field is read: a string with a lone
    UTF-16 surrogate (e.g. ``"\\ud800"``: valid JSON, but not text any tokenizer can encode) and
    nesting deeper than :data:`MAX_JSON_DEPTH`, and an integer too long to read (one
    :func:`parse_json_body` kept as text). Iterative: a deep body cannot exhaust the stack.

    Raises:
        ApiError: 400 naming the field (``messages[0].content``).
    """
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        path, v = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise ApiError(400, f"{_json_path(path[:1])}: nested more than {MAX_JSON_DEPTH} levels deep; no request "
                                f"field nests like that", param=_json_path(path[:1]), code="invalid_json")
        if isinstance(v, _TooLong):
            where = _json_path(path)
            raise ApiError(400, f"{where}: an integer of {len(v.lstrip('-'))} digits is too large for any request "
                                f"field", param=where, code="invalid_value")
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                where = _json_path(path)
                raise ApiError(400, f"{where}: character {e.start} is a lone UTF-16 surrogate "
                                    f"({_j(v[e.start])}), which is not text: send valid Unicode (pair a high surrogate "
                                    f"\\ud800-\\udbff with a low one \\udc00-\\udfff)", param=where,
                               code="invalid_value") from None
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, f"{_json_path(path) if path else 'body'}: a key holds a lone UTF-16 "
                                            f"surrogate; send valid Unicode", param=_json_path(path) if path else None,
                                       code="invalid_value") from None
                stack.append(((*path, k), x))
        elif isinstance(v, list):
            stack.extend(((*path, i), x) for i, x in enumerate(v))


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # serve.max_request_bytes


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"the request body is {size}; this server accepts at most {limit} bytes "
                         f"(serve.max_request_bytes): send a shorter prompt, or raise DRAFTD_SERVE__MAX_REQUEST_BYTES",
                    code="request_too_large")


DRAIN_MAX_BYTES = 64 * 1024 * 1024  # an oversized body up to this is read (and dropped) before the 413


async def read_body(request, limit: int | None) -> bytes:
    """The request body, at most ``limit`` bytes, else a 413. The body of a refused request is read
    to its end and dropped (never held), so that its client, still sending, gets the 413 rather
    than a broken pipe; one past :data:`DRAIN_MAX_BYTES` (declared or read) is not read on, and its
    client may see the connection close instead. A body without a Content-Length (chunked) is
    counted as it arrives.

    Raises:
        ApiError: 413 naming the size, the limit and the setting; 400 for a malformed Content-Length.
    """
    if limit is None:
        return await request.body()
    declared = request.headers.get("content-length")
    n_declared = None
    if declared is not None:
        try:
            n_declared = int(declared)
        except ValueError:
            raise ApiError(400, f"Content-Length {declared!r:.40} is not a number of bytes", code="invalid_request") from None
        if n_declared > max(limit, DRAIN_MAX_BYTES):
            raise _too_large(f"{n_declared} bytes (Content-Length)", limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            chunks = []  # too large: drop what was read, drain the rest for the client's sake
            if n > max(limit, DRAIN_MAX_BYTES):
                break
            continue
        chunks.append(chunk)
    if n > limit:
        raise _too_large(f"{n_declared} bytes" if n_declared is not None else f"more than {limit} bytes", limit)
    return b"".join(chunks)


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, checked by :func:`check_json`; 400 for anything else.

    Raises:
        ApiError: not JSON, nested too deeply for the parser, or see :func:`check_json`.
    """
    try:
        body = json.loads(raw or b"null", parse_int=_json_int)
    except RecursionError:
        raise ApiError(400, f"the request body nests too deeply to parse; no request field nests more than "
                            f"{MAX_JSON_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}", code="invalid_json") from e
    check_json(body)
    return body


def _prompt_chars(body: dict, kind: str) -> int:
    """Characters of the prompt text (0 for token ids or malformed input: the parser names those)."""
    if kind == "completion":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        return len(p) if isinstance(p, str) else 0
    n = 0
    msgs = body.get("messages")
    for m in msgs if isinstance(msgs, list) else ():  # messages: 5 raised TypeError here, a 500 before the parser's 400
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(x.get("text")) for x in c if isinstance(x, dict) and isinstance(x.get("text"), str))
    return n


def _prompt_too_long(where: str, n: int, limit: int, what: str = "tokens") -> ApiError:
    return ApiError(400, f"{where}: {n} {what}; this server admits prompts of at most {limit} tokens "
                         f"(serve.max_prompt_tokens): shorten the {where}, or raise DRAFTD_SERVE__MAX_PROMPT_TOKENS",
                    param=where, code="prompt_too_long")


def model_not_found(model: str, models: set[str]) -> ApiError:
    """The 404 for a model id this server does not serve (a request's ``model``, or
    ``GET /v1/models/{id}``), both spelled in JSON as the client wrote them."""
    return ApiError(404, f"the model {_j(model, NAME_LIMIT)} does not exist; this server serves {_j(sorted(models))} "
                         f"(GET /v1/models)", param="model", code="model_not_found")


def parse_request(body: Any, kind: str, tokenizer, *, models: set[str], context_len: int | None, vocab: int,
                  max_tokens_default: int, header_workload: str | None = None, max_prompt_tokens: int | None = None,
                  max_token_chars: int | None = None) -> Parsed:
    """Validate an OpenAI completions (``kind="completion"``) or chat request.

    ``max_prompt_tokens`` caps the prompt (chat: the templated messages); ``max_token_chars``, the
    longest text one token stands for, lets a prompt with more than ``max_prompt_tokens *
    max_token_chars`` characters be refused before it is tokenised (it cannot fit).

    Raises:
        ApiError: 400 naming the first bad parameter and the fix; 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    _unsupported(body, kind)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        what = "missing" if model is None else f"{_j(model, 80)} is not a model name"
        raise _bad("model", f"{what}; this server serves {_j(sorted(models))}", "missing" if model is None else "invalid_type")
    if model not in models:
        raise model_not_found(model, models)
    where = "prompt" if kind == "completion" else "messages"
    if max_prompt_tokens and max_token_chars:
        chars = _prompt_chars(body, kind)
        if chars > max_prompt_tokens * max_token_chars:  # more tokens than admitted, whatever they are: not tokenised
            raise _prompt_too_long(where, chars, max_prompt_tokens, "characters")
    ids = _prompt_ids(body, tokenizer, vocab) if kind == "completion" else _messages_ids(body, tokenizer)
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        raise _prompt_too_long(where, len(ids), max_prompt_tokens)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, lo=1, hi=MAX_TOKENS_BOUND)
    if context_len:
        if len(ids) >= context_len:
            raise ApiError(400, f"{where}: {len(ids)} tokens; this model's maximum context length is {context_len} "
                                f"tokens, and a completion needs at least one: shorten the {where}",
                           param=where, code="context_length_exceeded")
        room = context_len - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"{name}: this model's maximum context length is {context_len} tokens; you requested "
                                f"{len(ids) + max_tokens} ({len(ids)} in the {where}, {max_tokens} in the completion): "
                                f"lower {name} to <= {room} or shorten the {where}",
                           param=name, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(max_tokens_default, room)
    max_tokens = max_tokens or max_tokens_default
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    _user_and_metadata(body)
    top_k = _int(body, "top_k", 0, lo=-1)
    logprobs = _logprobs(body, kind)
    gamma = _int(body, "gamma", None, lo=0, hi=MAX_GAMMA)
    seed = _int(body, "seed", None)
    if seed is not None and (why := seed_problem(seed)) is not None:
        raise _bad("seed", f"{seed} is {why}")
    ignore_eos, constrained = _bool(body, "ignore_eos", False), _constrained(body)
    if ignore_eos and (constrained.get("grammar") or constrained.get("json_mode")):
        # where the grammar completes only EOS is allowed: ignoring it decoded EOS tokens to max_tokens
        raise _bad("ignore_eos", f"true with {constrained.get('grammar_param') or 'response_format'}: the output "
                                 f"ends where the grammar completes; drop ignore_eos")
    return Parsed(
        kind=kind, model=model, prompt_ids=ids, max_tokens=max_tokens,
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0 if top_k == -1 or top_k >= vocab else top_k, seed=seed,  # a k >= the vocabulary cuts nothing: off
        stop=_stop(body), ignore_eos=ignore_eos,
        gamma=gamma, workload=_workload(body, header_workload), stream=stream, include_usage=include_usage,
        continuous_usage=continuous_usage,
        logprobs=logprobs, cache_prompt=_bool(body, "cache_prompt", True),
        **constrained,
    )


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of ``stream_options``, vLLM's fields: usage
    in a last chunk of its own (OpenAI's), and also in every chunk, counted so far (vLLM's
    ``continuous_usage_stats``, which implies ``include_usage`` unless that is sent false: vLLM's
    ``include_usage`` defaults to true inside ``stream_options``). Both false when absent.

    Raises:
        ApiError: 400 without ``stream: true``, for another key or a non-boolean, and for
            ``continuous_usage_stats: true`` with ``include_usage: false`` (vLLM then sends no
            usage at all: what was asked would be silently dropped).
    """
    so = body.get("stream_options")
    if so is None:
        return False, False
    if not stream:
        raise _bad("stream_options", "only allowed with stream: true")
    if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
        raise _bad("stream_options", f"{_j(so)}: only {{\"include_usage\": true|false, \"continuous_usage_stats\": "
                                     f"true|false}} is supported")
    for key in ("include_usage", "continuous_usage_stats"):
        v = so.get(key)
        if v is not None and not isinstance(v, bool):
            raise _bad(f"stream_options.{key}", f"{_j(v)} is not a boolean (true or false)", "invalid_type")
    continuous = bool(so.get("continuous_usage_stats"))
    if continuous and so.get("include_usage") is False:
        raise _bad("stream_options.continuous_usage_stats", "true with include_usage: false: usage in every chunk "
                                                            "is usage; send include_usage: true (or leave it out)")
    return continuous or bool(so.get("include_usage")), continuous


MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds on metadata


def _user_and_metadata(body: dict) -> None:
    """Check OpenAI's ``user`` (a string naming the end user) and ``metadata`` (at most 16 string
    keys of at most 64 characters, each to a string of at most 512), which this server accepts and
    does not act on. Absent or null: nothing to check.

    Raises:
        ApiError: 400 naming the field (``metadata.<key>`` for a bad value) and the fix.
    """
    u = body.get("user")
    if u is not None and not isinstance(u, str):
        raise _bad("user", f"{_j(u)} is not a string; send the end user's id as a string", "invalid_type")
    md = body.get("metadata")
    if md is None:
        return
    if not isinstance(md, dict):
        raise _bad("metadata", f"{_j(md)}: give an object of string keys to string values", "invalid_type")
    if len(md) > MAX_METADATA_KEYS:
        raise _bad("metadata", f"{len(md)} keys; at most {MAX_METADATA_KEYS}")
    for k, v in md.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise ApiError(400, f"metadata: the key {_j(k, NAME_LIMIT)} has {len(k)} characters; at most "
                                f"{MAX_METADATA_KEY_CHARS}", param="metadata", code="invalid_value")
        if not isinstance(v, str):
            raise ApiError(400, f"metadata.{_clip(k)}: {_j(v)} is not a string; metadata values are strings",
                           param=f"metadata.{_clip(k)}", code="invalid_type")
        if len(v) > MAX_METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata.{_clip(k)}: {len(v)} characters; at most {MAX_METADATA_VALUE_CHARS}",
                           param=f"metadata.{_clip(k)}", code="invalid_value")


_RF_HELP = ('use {"type": "text"}, {"type": "json_object"} (JSON mode) or {"type": "json_schema", "json_schema": '
            '{"name": "...", "schema": {...}, "strict": true}}')
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _constrained(body: dict) -> dict[str, Any]:
    """Parsed's constrained-output fields from ``response_format`` (chat) and the ``grammar``
    field (GBNF, as llama-server takes it): ``json_mode``, ``grammar`` (GBNF text, a JSON schema
    converted) and ``grammar_param``.

    Raises:
        ApiError: 400 naming the field (``response_format``, ``response_format.json_schema[.x]``,
            ``grammar``): malformed, a schema the converter refuses, or both a grammar and a JSON format.
    """
    from decoder.grammar import GrammarError, check_gbnf, schema_to_gbnf

    rf, out = body.get("response_format"), {}
    kind = None
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("response_format", f"{_j(rf)}: {_RF_HELP}", "invalid_value")
        kind = rf["type"]
        extra = sorted(set(rf) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
        if extra:
            raise _bad("response_format", f"{_j(extra[0])} is not a field of a {_j(kind)} response_format; {_RF_HELP}")
        out["json_mode"] = kind == "json_object"
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise _bad("response_format.json_schema", f"{_j(js)}: an object {{\"name\": ..., \"schema\": {{...}}}} "
                                                          f"giving the JSON Schema the output must follow",
                           "missing" if js is None else "invalid_type")
            unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
            if unknown:
                raise ApiError(400, f"response_format.json_schema: {_j(unknown[0], NAME_LIMIT)} is an unknown field; "
                                    f"name, schema, strict and description are",
                               param=f"response_format.json_schema.{_clip(unknown[0])}", code="invalid_value")
            if "name" in js and not (isinstance(js["name"], str) and _SCHEMA_NAME.fullmatch(js["name"])):
                raise _bad("response_format.json_schema.name", f"{_j(js['name'])}: 1-64 letters, digits, _ or -")
            if js.get("strict") not in (None, True, False):
                raise _bad("response_format.json_schema.strict", f"{_j(js['strict'])} is not a boolean", "invalid_type")
            if "description" in js and not isinstance(js["description"], str):
                raise _bad("response_format.json_schema.description", "must be a string", "invalid_type")
            if js.get("schema") is None:
                raise _bad("response_format.json_schema.schema", "missing: give the JSON Schema the output must "
                           'follow, e.g. {"type": "object", "properties": {"answer": {"type": "string"}}, '
                           '"required": ["answer"]}', "missing")
            try:
                out["grammar"] = schema_to_gbnf(js["schema"])
            except GrammarError as e:
                raise _bad("response_format.json_schema.schema", f"{e}; fix or simplify the schema, or send a GBNF "
                                                                 f"grammar in the grammar field", "invalid_schema") from None
            out["grammar_param"] = "response_format.json_schema.schema"
    g = body.get("grammar")
    if g is not None:
        if kind in ("json_object", "json_schema"):
            raise _bad("grammar", f"sent with a {_j(kind)} response_format: send one of them")
        try:
            check_gbnf(g)
        except GrammarError as e:
            raise _bad("grammar", f"{e}", "invalid_grammar") from None
        out["grammar"], out["grammar_param"] = g, "grammar"
    return out


def _served_format(engines) -> dict | None:
    """The served format's description (``FormatChoice.describe()``) with the target engine's V
    cache type, which plain decoding must share to give the same greedy output; None off llama.cpp."""
    if engines.served is None:
        return None
    from decoder.engines.llamacpp_lib import amx_rows

    return {**engines.served.describe(), "v_cache": getattr(engines.target, "v_cache", None),
            "amx_rows": amx_rows()}  # None off llama.cpp's AMX path (decoder.engines.amx_rows)


def _grammar_gguf(target: str, engine) -> str | None:
    """The GGUF grammars compile against: the llama.cpp target's own; for a torch target, the
    packaged GGUF it was converted from (the same token ids); None: schemas and grammars get a 400."""
    if getattr(engine, "path", None) is not None:
        return str(engine.path)
    from decoder.models.packaged import PACKAGED, ModelLoadError, packaged_gguf

    base = target.split("@")[0]  # a requantised built-in (name@FORMAT) has the same vocabulary
    if base in PACKAGED:
        try:
            return str(packaged_gguf(base))
        except ModelLoadError:
            return None
    return None


def _logprobs(body: dict, kind: str) -> int | None:
    """The alternatives per position a request asks for, None for no logprobs: completions take
    ``logprobs: n`` (0..5, OpenAI's bound there); chat ``logprobs: true`` with ``top_logprobs: n``
    (0..20; ``top_logprobs`` alone is an error, as OpenAI's)."""
    if kind == "completion":
        if "top_logprobs" in body and body["top_logprobs"] is not None:
            raise _bad("top_logprobs", "is a chat parameter; completions take logprobs: <0..5> instead")
        return _int(body, "logprobs", None, lo=0, hi=5)
    on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise _bad("top_logprobs", f"{top}: needs logprobs: true")
    return (top or 0) if on else None


def _max_token_chars(tokenizer) -> int | None:
    """The most characters one token's text can hold (an upper bound: a vocabulary entry is at least
    as long as the text it decodes to), so ``chars / this`` is a lower bound on a text's tokens."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max(len(t) for t in vocab)) if vocab else None
    except Exception:  # noqa: BLE001 - no vocabulary to read: tokenise and count instead
        return None


# ---- text out --------------------------------------------------------------------------------------


class TextStream:
    """Incremental detokenisation with OpenAI's stop semantics: the stop string itself is never
    sent; text that might begin one, or an incomplete UTF-8 sequence, is held back until the next
    tokens (or the end) decide. The concatenated deltas equal :meth:`text` at the end."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self._hold = max((len(s) for s in stop), default=1) - 1

    def _full(self) -> tuple[str, bool]:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        ends = [text.find(s) for s in self.stop if s in text]
        return (text[: min(ends)], True) if ends else (text, False)

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text, stopped = self._full()
        safe = len(text) if stopped else len(text) - self._hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent: safe], safe
        return out

    def finish(self) -> str:
        text = self.text()
        out, self.sent = text[self.sent:], len(text)
        return out

    def text(self) -> str:
        return self._full()[0]


# ---- bounded client-chosen keys ----------------------------------------------------------------------

OTHER = "other"  # the one key every value past a bound is folded into


class Bounded:
    """A bound on the distinct values of one client-chosen key (``workload``, sampling bucket):
    the first ``limit`` values are kept as they are, every later one is folded into ``"other"``
    and counted. What grows with them (Prometheus series, the controller's keys, the heartbeat,
    ``daemonctl status``, Redis history keys) is bounded by it. Thread-safe."""

    def __init__(self, name: str, limit: int, always: tuple[str, ...] = ()):
        self.name, self.limit = name, limit
        self._always = set(always) | {OTHER}  # never counted against the limit
        self._seen: set[str] = set()
        self._folded_values: set[str] = set()
        self.folded = 0  # requests whose value was folded
        self._lock = threading.Lock()

    def admit(self, value: str) -> str:
        if value in self._always:
            return value
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.limit:
                self._seen.add(value)
                return value
            self.folded += 1
            if len(self._folded_values) < 10 * self.limit:  # how many distinct ones, roughly (bounded too)
                self._folded_values.add(value)
        return OTHER

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"distinct": len(self._seen), "limit": self.limit, "folded_requests": self.folded,
                    "folded_values": len(self._folded_values)}


# ---- metrics ---------------------------------------------------------------------------------------


class ServeMetrics:
    """The server's Prometheus metrics (one registry per server, so several can share a process).

    vLLM-compatible spec-decode counters labelled by workload and adapter version (vLLM's
    definitions: a *draft* is a verification step with γ > 0; accepted tokens per position count,
    at position i, the steps whose i-th proposal was accepted), request latency histograms
    (time to first token, inter-token gap between successive emissions, end to end, from
    submission), and queue gauges.
    """

    def __init__(self, loop, bounds: tuple["Bounded", ...] = ()):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        lab = ["workload", "adapter_version"]
        P = "draftd:"
        self.drafts = Counter(P + "spec_decode_num_drafts", "Verification steps with a draft proposal (gamma > 0)", lab, registry=r)
        self.draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Tokens proposed by the draft", lab, registry=r)
        self.accepted = Counter(P + "spec_decode_num_accepted_tokens", "Proposed tokens the target accepted", lab, registry=r)
        self.emitted = Counter(P + "spec_decode_num_emitted_tokens", "Tokens the verification steps emitted (accepted + recovered + "
                               "bonus; a first token taken from the prefill is not one: generation_tokens counts every output token)",
                               lab, registry=r)
        self.per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos", "Steps whose proposal at this position was accepted",
                               lab + ["position"], registry=r)
        self.requests = Counter(P + "request_success", "Finished requests by finish reason", ["workload", "finished_reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", ["workload"], registry=r)
        self.prompt_tokens_cached = Counter(P + "prompt_tokens_cached", "Prompt tokens the prompt cache kept (not prefilled again)",
                                            ["workload"], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", ["workload"], registry=r)
        buckets = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Submission to first token", ["workload"], buckets=buckets, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between successive token emissions of a request",
                             ["workload"], buckets=buckets, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Submission to last token", ["workload"], buckets=buckets, registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Submission to start of decoding", ["workload"],
                                    buckets=buckets, registry=r)
        Gauge(P + "num_requests_waiting", "Requests in the queue", registry=r).set_function(lambda: loop.queue_depth)
        Gauge(P + "num_requests_running", "Requests decoding (0 or 1)", registry=r).set_function(lambda: int(loop.busy))
        Gauge(P + "queue_size", "Capacity of the request queue", registry=r).set(loop.config.queue_size)
        Gauge(P + "buffer_samples_dropped", "Verified samples the buffer writer dropped (Redis down, queue full)",
              registry=r).set_function(lambda: (loop.status().get("buffer") or {}).get("dropped", 0))
        folded = Gauge(P + "folded_requests", "Requests whose workload or sampling bucket was folded into 'other' "
                       "(serve.max_workloads, serve.max_sampling_buckets)", ["key"], registry=r)
        distinct = Gauge(P + "distinct_keys", "Distinct workloads / sampling buckets kept as they are", ["key"], registry=r)
        for b in bounds:
            folded.labels(b.name).set_function(lambda b=b: b.folded)
            distinct.labels(b.name).set_function(lambda b=b: b.status()["distinct"])
        loop.observers.append(self.observe)

    def observe(self, t, res) -> None:
        w, v = res.workload, str(res.adapter_version)
        for s in res.steps:
            if s.proposed:
                self.drafts.labels(w, v).inc()
                self.draft_tokens.labels(w, v).inc(s.proposed)
                self.accepted.labels(w, v).inc(s.accepted)
                for i in range(s.accepted):
                    self.per_pos.labels(w, v, str(i)).inc()
            if not s.prefill:  # as the acceptance history counts them (decoder.tracking)
                self.emitted.labels(w, v).inc(s.emitted)
        self.requests.labels(w, FINISH.get(res.finish_reason, res.finish_reason)).inc()
        self.prompt_tokens.labels(w).inc(res.prompt_len)
        self.prompt_tokens_cached.labels(w).inc(int(getattr(res, "cached_prompt_tokens", 0) or 0))
        self.generation_tokens.labels(w).inc(len(res.output_ids))
        if t.started_at is not None:
            self.queue_time.labels(w).observe(max(0.0, t.started_at - t.submitted_at))
        if t.first_token_at is not None:
            self.ttft.labels(w).observe(max(0.0, t.first_token_at - t.submitted_at))
        for a, b in zip(t.emitted_at, t.emitted_at[1:]):
            self.itl.labels(w).observe(max(0.0, b - a))
        if t.finished_at is not None:
            self.e2e.labels(w).observe(max(0.0, t.finished_at - t.submitted_at))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# ---- the service -----------------------------------------------------------------------------------


def measurement(res, ticket, *, speculation: bool) -> dict[str, Any]:
    """The request's measurement record (the ``draftd`` extension field)."""
    rec = res.record()
    c = res.counts
    d = ticket.decision or {}
    ms = lambda a, b: None if a is None or b is None else round((b - a) * 1e3, 3)  # noqa: E731
    return {
        "request_id": res.request_id, "workload": res.workload, "sampling": res.sampling_bucket,
        "adapter_version": res.adapter_version, "head_version": res.head_version, "proposer": res.proposer,
        "engine": res.engine, "output_tokens": len(res.output_ids), "proposed_tokens": c.num_draft_tokens,
        "accepted_tokens": c.num_accepted_tokens, "steps": c.num_steps, "tau": rec["mean_accepted_length"],
        "alpha": rec["alpha"], "acceptance_rate": rec["acceptance_rate"],
        "gamma_policy": res.policy if speculation else "off (serve.speculation=false)",
        "gamma": d.get("gamma", max((s.proposed for s in res.steps), default=0)), "why": d.get("why"),
        "draft_ms": rec["draft_ms"], "verify_ms": rec["verify_ms"], "prefill_ms": rec["prefill_ms"],
        "queue_ms": ms(ticket.submitted_at, ticket.started_at), "ttft_ms": ms(ticket.submitted_at, ticket.first_token_at),
        "latency_ms": rec["latency_ms"], "matches_plain": res.matches_plain, "finish_reason": res.finish_reason,
    }


class InferenceService:
    """The HTTP face of a :class:`decoder.loop.ServingLoop` (started and closed by its owner).

    Args:
        loop: the serving loop.
        tokenizer: the pair's tokenizer (prompts, chat template, output text).
        model: the model id clients send (``/v1/models`` lists it).
        context_len: the target's context window (None: unchecked).
        max_tokens_default: max_tokens of a request that gives none (capped at the context left).
        speculation: False serves every request with γ = 0 (a plain-decoding baseline).
        api_key: every request but ``GET /health`` must send ``Authorization: Bearer <api_key>``
            (401 otherwise, before its body is read); None = no authentication.
        max_prompt_tokens: longer prompts get a 400 (``prompt_too_long``); None = the context only.
        max_workloads / max_sampling_buckets: distinct workloads / sampling buckets kept as they
            are; later ones are folded into ``"other"`` (:class:`Bounded`).
        max_request_bytes: a larger request body gets a 413 (``request_too_large``), refused on its
            Content-Length before it is read, else as soon as the bytes read pass it; None = no limit.
        request_timeout_s: a request not finished this long after it arrived gets a 408
            (``request_timeout``; streaming: an error event) and is cancelled: dropped from the
            queue, or stopped at its next verification step or prefill chunk; None = no budget.
    """

    def __init__(self, loop, tokenizer, model: str, *, context_len: int | None, max_tokens_default: int = 256,
                 speculation: bool = True, server_id: str | None = None, api_key: str | None = None,
                 max_prompt_tokens: int | None = None, request_timeout_s: float | None = None,
                 max_workloads: int = 64, max_sampling_buckets: int = 32,
                 max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES, served_format: dict | None = None,
                 grammar_gguf: str | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self.loop, self.tokenizer, self.model = loop, tokenizer, model
        self._feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its ThreadFeed
        self.served_format = served_format  # decoder.models.formats.FormatChoice.describe(): the target's format and why
        self.max_prompt_tokens, self.request_timeout_s = max_prompt_tokens, request_timeout_s
        self.max_request_bytes = max_request_bytes
        self.max_token_chars = _max_token_chars(tokenizer)
        # requests are parsed (tokenised: a 1 MB prompt takes seconds) off the event loop, one at a
        # time: /health and streaming stay responsive, and the tokenizer is never used by two
        # parsing threads at once
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="draftd-parse")
        self.api_key = api_key or None  # None: no authentication (serve.api_key unset)
        self._json, self._json_lock = None, threading.Lock()
        self.grammar_gguf = grammar_gguf  # None: the target engine's GGUF (llama.cpp), if any
        self._grammar_vocab = None
        self._grammars: OrderedDict[str, Any] = OrderedDict()  # compiled grammars by GBNF text, most recent last
        self._abandoned = threading.Event()  # shutting down past the drain grace: waiting handlers answer now
        self.drain_grace_s: float | None = None
        self.drain_cut_after_s: float | None = None  # a second stop signal cut the drain short after this long
        self.context_len = context_len
        self.max_tokens_default = max_tokens_default
        self.speculation = speculation
        self.server_id = server_id or f"{socket.gethostname()}-{os.getpid()}"
        self.created = int(time.time())
        self.vocab = loop.decoder.vocab_p
        self.workloads = Bounded("workload", max_workloads, always=("default",))
        self.buckets = Bounded("sampling_bucket", max_sampling_buckets, always=("greedy",))
        self.metrics = ServeMetrics(loop, (self.workloads, self.buckets))
        self.token_bytes = TokenBytes(tokenizer)  # logprobs' token bytes and spellings

    def status(self) -> dict[str, Any]:
        from decoder.loop import speculation_by_batch, speculation_by_workload

        st = self.loop.status()
        return {"server_id": self.server_id, "model": self.model, "served_format": self.served_format,
                "speculation_enabled": self.speculation,
                "speculation_by_workload": speculation_by_workload(st["speculation"]),
                # γ per workload@bucket at each batch size (0: plain decoding in a batch that large)
                "speculation_by_batch": speculation_by_batch(st["speculation"]), **st,
                "cardinality": {b.name: b.status() for b in (self.workloads, self.buckets)}, "ts": time.time()}

    def _shutdown_why(self) -> str:
        """Why a request was cancelled at shutdown: past the drain grace, or a second stop signal
        that cut the drain short (then raising the grace would not have helped)."""
        if self.drain_cut_after_s is not None:
            return (f"when a second stop signal (SIGTERM/SIGINT) cut the drain short after {self.drain_cut_after_s:.0f} s, "
                    f"before the drain grace ran out")
        grace = "" if self.drain_grace_s is None else f" = {self.drain_grace_s:g} s"
        return f"after the drain grace (serve.drain_grace_s{grace}, DRAFTD_SERVE__DRAIN_GRACE_S)"

    def abandon(self, grace_s: float | None = None, cut_after_s: float | None = None) -> None:
        """Shutting down past the drain grace (the loop has cancelled what was left): every handler
        still waiting for a ticket answers at once (503 ``draining``; a stream: an error event)
        instead of waiting for the decoder to reach its next step, so the HTTP server closes its
        connections within its own graceful timeout rather than cancelling the handlers (uvicorn's
        ASGI CancelledError traceback, and a 500 to the client)."""
        self.drain_grace_s = grace_s
        self.drain_cut_after_s = cut_after_s
        self._abandoned.set()

    def _abandoned_error(self, ticket) -> ApiError:
        ticket.cancel()
        return ApiError(503, f"the server shut down before this request finished: it was cancelled "
                             f"{self._shutdown_why()}; retry it on another instance", code="draining",
                        type_="service_unavailable")

    def parse(self, body: Any, kind: str, header_workload: str | None = None) -> Parsed:
        p = parse_request(body, kind, self.tokenizer, models={self.model}, context_len=self.context_len,
                          vocab=self.vocab, max_tokens_default=self.max_tokens_default, header_workload=header_workload,
                          max_prompt_tokens=self.max_prompt_tokens, max_token_chars=self.max_token_chars)
        if p.json_mode:
            self.json_constraint()  # built here, off the event loop, on the first JSON-mode request
        if p.grammar is not None:  # compiled here, off the event loop: a bad grammar is a 400 before queueing
            p.constraint = self.grammar_constraint(p.grammar, p.grammar_param or "grammar")
        return p

    def grammar_constraint(self, gbnf: str, param: str = "grammar"):
        """The compiled :class:`decoder.grammar.GrammarConstraint` of ``gbnf`` on the target's
        vocabulary, shared by the requests that send the same grammar (the most recent
        MAX_GRAMMARS are kept, with their cached masks).

        Raises:
            ApiError: 400 naming ``param``: llama.cpp does not parse the grammar, or the target has no
                GGUF (grammars run on llama.cpp's grammar engine).
        """
        from decoder.grammar import GrammarConstraint, GrammarError

        with self._json_lock:
            c = self._grammars.get(gbnf)
            if c is not None:
                self._grammars.move_to_end(gbnf)
                return c
        vocab = self.grammar_vocab(param)
        try:
            c = GrammarConstraint(vocab, gbnf, width=self.vocab)
        except GrammarError as e:
            raise _bad(param, f"{e}", "invalid_grammar" if param == "grammar" else "invalid_schema") from None
        with self._json_lock:
            self._grammars[gbnf] = c
            while len(self._grammars) > MAX_GRAMMARS:
                self._grammars.popitem(last=False)
        return c

    def grammar_vocab(self, param: str = "grammar"):
        """The target's vocabulary on llama.cpp (:class:`decoder.grammar.GrammarVocab`), loaded once.

        Raises:
            ApiError: 400 naming ``param``'s field (``response_format``, ``grammar``) when the target has
                no GGUF to load it from; 500 when the GGUF does not load.
        """
        if self._grammar_vocab is None:
            from decoder.grammar import GrammarError, GrammarVocab

            path = self.grammar_gguf or getattr(self.loop.decoder.engine, "path", None)
            if path is None:  # the field as a whole (response_format, grammar) is what this server cannot serve
                raise _bad(param.split(".")[0], "JSON schemas and grammars run on llama.cpp's grammar engine, which needs the "
                                  "target as a GGUF: serve with models.engine=llamacpp (DRAFTD_MODELS__ENGINE); "
                                  "response_format {\"type\": \"json_object\"} (JSON mode) works on any engine",
                           "unsupported_parameter")
            try:
                self._grammar_vocab = GrammarVocab(path)
            except GrammarError as e:
                raise ApiError(500, f"{param}: {e}", param=param, code="grammar_unavailable", type_="server_error") from None
        return self._grammar_vocab

    def json_constraint(self):
        """JSON mode's constraint for this tokenizer (decoder.constrain), built once (a pass over the
        vocabulary) and shared by every request: its masks are cached per automaton state."""
        with self._json_lock:
            if self._json is None:
                from decoder.constrain import JsonObjectConstraint

                self._json = JsonObjectConstraint.for_tokenizer(self.tokenizer, self.vocab)
            return self._json

    def request_of(self, p: Parsed):
        from decoder.sampling import SamplingParams
        from decoder.speculative import DecodeRequest

        gamma = 0 if not self.speculation else p.gamma
        params = SamplingParams(p.temperature, p.top_p, p.top_k, p.seed)
        return DecodeRequest(p.prompt_ids, params, p.max_tokens, gamma=gamma, stop=p.stop, ignore_eos=p.ignore_eos,
                             workload=self.workloads.admit(p.workload),
                             sampling_bucket=self.buckets.admit(params.bucket()), logprobs=p.logprobs,
                             cache_prompt=p.cache_prompt, constraint=p.constraint if p.constraint is not None
                             else self.json_constraint() if p.json_mode else None)

    def _logprobs(self, p: Parsed, lps: list, offsets: "TextOffsets | None" = None) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object for tokens' :class:`~decoder.sampling.TokenLogprob`: chat's
        ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or the completions' legacy
        ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``offsets``: the request's
        :class:`~daemon.token_bytes.TextOffsets`, which a stream carries from chunk to chunk; None:
        these tokens start the completion). ``bytes`` are the token's own bytes and a token that
        is not UTF-8 on its own (part of a character) is spelled ``bytes:\\xNN...``
        (:class:`~daemon.token_bytes.TokenBytes`); a completions' ``top_logprobs`` key two tokens
        would share is the second's ``token_id:<id>`` (vLLM's spelling of a token by id). A
        log-probability of -inf (a token a top-k / top-p cut removed) is written -9999.0, as
        OpenAI does: JSON has no infinity."""
        if p.logprobs is None:
            return None
        tb = self.token_bytes

        def num(x: float) -> float:
            return x if math.isfinite(x) else -9999.0

        if p.kind == "chat":
            def entry(t: int, lp: float) -> dict[str, Any]:
                return {"token": tb.spelling(t), "logprob": num(lp), "bytes": list(tb.of(t))}

            return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(a, b) for a, b in x.top]}
                                for x in lps], "refusal": None}
        offsets = offsets or TextOffsets(tb)
        tops = []
        for x in lps:
            top: dict[str, float] = {}
            for a, b in x.top:
                top[f"token_id:{a}" if tb.spelling(a) in top else tb.spelling(a)] = num(b)
            tops.append(top)
        return {"tokens": [tb.spelling(x.token) for x in lps], "token_logprobs": [num(x.logprob) for x in lps],
                "top_logprobs": tops, "text_offset": [offsets.next(x.token) for x in lps]}

    # ---- the app ---------------------------------------------------------------------------
    def app(self):
        """The FastAPI app: the OpenAI routes, health, models, metrics and status, behind the API
        key check, with every error as an OpenAI error body."""
        from fastapi import FastAPI

        app = FastAPI(title="draftd serve", description="OpenAI-compatible completions with adaptive speculative decoding")
        _add_error_handlers(app)
        app.add_middleware(_api_key_before_body(self))
        self._add_routes(app)
        return app

    def _add_routes(self, app) -> None:
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        @app.get("/health")
        def health():
            if self.loop.draining:
                return JSONResponse({"status": "draining"}, status_code=503)
            return {"status": "ok"}

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        def model(model_id: str):
            if model_id != self.model:
                raise model_not_found(model_id, {self.model})
            return self._model_card()

        @app.get("/metrics")
        def metrics():
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/draftd/status")
        def status():
            return self.status()

        async def handle(request: Request, kind: str):
            arrived = time.monotonic()
            raw = await read_body(request, self.max_request_bytes)
            aloop = asyncio.get_running_loop()
            p = await aloop.run_in_executor(self._parse_pool, self._parse_raw, raw, kind,
                                            request.headers.get(WORKLOAD_HEADER))
            return await self._serve(request, p, StreamingResponse, arrived)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, "completion")

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, "chat")

    def _parse_raw(self, raw: bytes, kind: str, header_workload: str | None) -> Parsed:
        return self.parse(parse_json_body(raw), kind, header_workload)

    def _timeout(self, ticket) -> ApiError:
        ticket.cancel()  # dropped from the queue, or stopped at its next verification step
        where = "queued" if ticket.started_at is None else "decoding"
        log.warning("serve_request_timeout", request_id=ticket.request.request_id, where=where,
                    budget_s=self.request_timeout_s)
        return ApiError(408, f"the request ran out of its time budget of {self.request_timeout_s:g} s "
                             f"(serve.request_timeout_s) while {where}; lower max_tokens, shorten the prompt, or "
                             f"retry when the server is less busy", code="request_timeout", type_="timeout_error")

    def _cancelled_error(self, ticket, deadline: float | None) -> ApiError:
        """The error for a non-streamed request the server cancelled mid-decode (its result has
        ``finish_reason == "cancelled"`` and partial text, never served as a 200): past its time
        budget a 408 (:meth:`_timeout`), at shutdown a 503 ``draining``, otherwise a 503
        ``cancelled``."""
        if deadline is not None and time.monotonic() >= deadline:
            return self._timeout(ticket)
        if self.loop.draining or self._abandoned.is_set():
            return ApiError(503, f"the server shut down before this request finished: it was cancelled mid-decode "
                                 f"{self._shutdown_why()}; retry it on another instance", code="draining",
                            type_="service_unavailable")
        return ApiError(503, "the request was cancelled by the server before it finished; retry it",
                        code="cancelled", type_="service_unavailable")

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "draftd",
                "root": self.model, "parent": None, "max_model_len": self.context_len}

    async def _serve(self, request, p: Parsed, StreamingResponse, arrived: float | None = None):
        from decoder.loop import Cancelled, Draining, QueueFull

        aloop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        feed = self._feeds.get(aloop)
        if feed is None:
            feed = self._feeds[aloop] = ThreadFeed(aloop)
            if hasattr(self.loop, "boundary_hooks"):
                self.loop.boundary_hooks.append(feed.flush)
        member = getattr(self.loop, "member_thread", None)
        on_tokens = (lambda ids: feed.put(events, ids, wake=member is None or not member())) if p.stream else None
        try:
            req = self.request_of(p)
        except ValueError as e:  # e.g. a prompt that tokenises to nothing
            where = "prompt" if p.kind == "completion" else "messages"
            raise ApiError(400, f"{where}: {e}", param=where, code="invalid_value") from e
        try:
            ticket = self.loop.submit(req, on_tokens=on_tokens)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", type_="rate_limit_error", headers={"Retry-After": "1"}) from e
        except Draining as e:
            raise ApiError(503, str(e), code="draining", type_="service_unavailable") from e
        fut = asyncio.wrap_future(ticket.future)
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" noise
        rid = ("cmpl-" if p.kind == "completion" else "chatcmpl-") + req.request_id
        created = int(time.time())
        deadline = None if self.request_timeout_s is None else (arrived or time.monotonic()) + self.request_timeout_s
        if not p.stream:
            while not fut.done():
                wait = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
                done, _ = await asyncio.wait({fut}, timeout=wait)
                if not done and deadline is not None and time.monotonic() >= deadline:
                    raise self._timeout(ticket)  # answered now; the ticket stops on its own
                if not done and self._abandoned.is_set():
                    raise self._abandoned_error(ticket)
                if not done and await request.is_disconnected():
                    ticket.cancel()
                    try:
                        await fut
                    except Exception:  # noqa: BLE001 - nobody is listening
                        pass
                    raise ApiError(499, "client disconnected", code="cancelled")
            try:
                res = fut.result()
            except Cancelled as e:
                raise ApiError(503, str(e), code="cancelled", type_="service_unavailable") from e
            except ValueError as e:
                raise ApiError(400, str(e), code="invalid_request") from e
            if res.finish_reason == "cancelled":  # stopped mid-decode by the server: its text is not a completion
                raise self._cancelled_error(ticket, deadline)
            ts = TextStream(self.tokenizer, p.stop)
            ts.feed(res.output_ids)
            return self._full_response(p, rid, created, ts.text(), res, ticket)
        return StreamingResponse(self._stream(p, rid, created, ticket, fut, events, deadline), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _usage(self, res) -> dict[str, int]:
        n = len(res.output_ids)
        # prompt_tokens_details.cached_tokens: OpenAI's field (vLLM's with prefix caching on) for the
        # prompt tokens the prompt cache kept (DecoderConfig.prompt_cache)
        return {"prompt_tokens": res.prompt_len, "completion_tokens": n, "total_tokens": res.prompt_len + n,
                "prompt_tokens_details": {"cached_tokens": int(getattr(res, "cached_prompt_tokens", 0) or 0)}}

    def _full_response(self, p: Parsed, rid: str, created: int, text: str, res, ticket) -> dict[str, Any]:
        fr = FINISH.get(res.finish_reason, res.finish_reason)
        lp = self._logprobs(p, res.logprobs or [])
        if p.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": fr, "stop_reason": None}
            obj = "text_completion"
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                      "finish_reason": fr, "stop_reason": None}
            obj = "chat.completion"
        return {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice],
                "usage": self._usage(res), "draftd": measurement(res, ticket, speculation=self.speculation)}

    def _chunk(self, p: Parsed, rid: str, created: int, delta: str | None, finish: str | None = None,
               role: bool = False, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if p.kind == "completion":
            choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        else:
            d: dict[str, Any] = {}
            if role:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        return {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}

    async def _stream(self, p: Parsed, rid: str, created: int, ticket, fut, events: asyncio.Queue,
                      deadline: float | None = None):
        """The server-sent events of a streamed request: a chunk per batch of queued tokens, then
        the final chunk (or an error event: out of time, abandoned, cancelled, failed) and [DONE]."""
        deltas = _Deltas(self, p, rid, created, ticket)
        getter = None
        try:
            if p.kind == "chat":
                yield _sse(deltas.with_usage(self._chunk(p, rid, created, "", role=True)))
            while True:
                if not events.empty():  # tokens already queued (several steps while this stream was
                    # busy, or another's): one chunk for all of them, without a waiter task per step
                    c = deltas.chunk(_drain(events, []))
                    if c is not None:
                        yield _sse(c)
                    continue
                if fut.done():
                    break
                getter = asyncio.ensure_future(events.get())
                done, ending = await self._next_event(getter, fut, ticket, deadline)
                if ending is not None:  # the headers are sent, so the error is an event
                    yield _sse(ending)
                    yield "data: [DONE]\n\n"
                    return
                if getter in done:
                    c = deltas.chunk(_drain(events, list(getter.result())))
                    if c is not None:
                        yield _sse(c)
                    continue
                getter.cancel()
                break
            if not events.empty():  # tokens queued before the result (FIFO callbacks)
                c = deltas.chunk(_drain(events, []))
                if c is not None:
                    yield _sse(c)
            for event in self._stream_end(p, rid, created, ticket, fut, deadline, deltas.ts):
                yield event
        finally:
            if getter is not None and not getter.done():
                getter.cancel()  # a client gone mid-wait: no pending Queue.get() task left to be destroyed
            if not fut.done():
                ticket.cancel()  # the client went away: stop at the next step

    async def _next_event(self, getter, fut, ticket, deadline: float | None):
        """Wait for queued tokens (``getter``) or the result (``fut``), polled every 0.25 s: a
        shutdown past the drain grace must end the stream too. Returns (the finished set, None),
        or (None, the error body that ends the stream: out of time, abandoned) with ``getter``
        cancelled."""
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = await asyncio.wait({getter, fut}, timeout=0.25 if left is None else min(0.25, left),
                                         return_when=asyncio.FIRST_COMPLETED)
            if done:
                return done, None
            if deadline is not None and time.monotonic() >= deadline:
                getter.cancel()  # out of time: the 408 as an error event
                return None, self._timeout(ticket).body()
            if self._abandoned.is_set():
                getter.cancel()
                return None, self._abandoned_error(ticket).body()

    def _stream_end(self, p: Parsed, rid: str, created: int, ticket, fut, deadline: float | None,
                    ts: TextStream) -> list[str]:
        """The events after the last token: the final chunk (the text's rest, the finish reason,
        the measurement), the usage chunk when asked, [DONE]; or the error event of a request
        that failed or was cancelled mid-decode, and [DONE]."""
        from decoder.loop import Cancelled

        try:
            res = fut.result()
        except (Cancelled, ValueError) as e:
            err = ApiError(400 if isinstance(e, ValueError) else 503, str(e))
            return [_sse(err.body()), "data: [DONE]\n\n"]
        if res.finish_reason == "cancelled":  # the text sent so far is not a completion: an error event ends it
            return [_sse(self._cancelled_error(ticket, deadline).body()), "data: [DONE]\n\n"]
        rest = ts.finish()
        final = self._chunk(p, rid, created, rest if rest or p.kind == "completion" else None,
                            finish=FINISH.get(res.finish_reason, res.finish_reason))
        final["draftd"] = measurement(res, ticket, speculation=self.speculation)
        if p.continuous_usage:  # vLLM's continuous_usage_stats: the final chunk's usage is the request's
            final["usage"] = self._usage(res)
        events = [_sse(final)]
        if p.include_usage:
            events.append(_sse({"id": rid, "object": final["object"], "created": created, "model": self.model,
                                "choices": [], "usage": self._usage(res)}))
        return events + ["data: [DONE]\n\n"]


def _sse(obj) -> str:
    """One server-sent event of a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Deltas:
    """A streamed request's chunks of newly emitted tokens: their text delta (cut at the stop
    strings) and, when asked, their logprobs."""

    def __init__(self, service: "InferenceService", p: Parsed, rid: str, created: int, ticket):
        self.service, self.p, self.rid, self.created, self.ticket = service, p, rid, created, ticket
        self.ts = TextStream(service.tokenizer, p.stop)
        self.seen = 0  # tokens whose logprobs went out
        self.offsets = TextOffsets(service.token_bytes)  # completions' text_offset, counted across chunks
        self.tokens = 0  # tokens emitted so far (continuous usage), whether or not a chunk carried them

    def chunk(self, ids: list[int]):
        """The chunk for newly emitted ``ids``: their text delta and, when asked, their logprobs
        (ticket.logprobs was extended before the ids were queued); None when there is nothing."""
        p = self.p
        delta = self.ts.feed(ids)
        lp = None
        if p.logprobs is not None and ids:
            mine = self.ticket.logprobs[self.seen: self.seen + len(ids)]
            lp = self.service._logprobs(p, mine, self.offsets)
            self.seen += len(ids)
        self.tokens += len(ids)
        if not delta and lp is None:
            return None
        return self.with_usage(self.service._chunk(p, self.rid, self.created, delta or "", logprobs=lp))

    def with_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """``chunk`` with the usage so far under ``"usage"`` when the request asked for
        ``stream_options.continuous_usage_stats`` (vLLM's: prompt tokens, completion tokens
        emitted up to and including this chunk's, their total), else as it is."""
        if self.p.continuous_usage:
            n, k = len(self.p.prompt_ids), self.tokens
            chunk["usage"] = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
        return chunk


def _error_response(e: ApiError):
    """An :class:`ApiError` as the OpenAI error body with its status and headers."""
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _add_error_handlers(app) -> None:
    """Every error as an OpenAI error body: ours, Starlette's (404, 405, ...) and any other (500)."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(e.status_code, str(e.detail), code=kind))

    app.add_middleware(_InternalErrors)


def _server_error(e: Exception):
    """The OpenAI error body for an exception no handler took (a 500; a client gone mid-body: 400)."""
    from starlette.requests import ClientDisconnect

    if isinstance(e, ClientDisconnect):  # the client left before its body was read: no fault of ours,
        # and a traceback at error level a request would let any client flood the log with
        log.info("serve_client_left_mid_body")
        return _error_response(ApiError(400, "the client closed the connection before its request body was read",
                                        code="client_disconnected"))
    log.exception("serve_internal_error", error=str(e))
    return _error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error",
                                    code="internal_error"))


class _InternalErrors:
    """Any exception no handler took becomes its OpenAI error body here, and goes no further. As an
    ``exception_handler(Exception)`` Starlette's outermost middleware answered it and then raised it
    again, so uvicorn logged it twice and closed the keep-alive connection: the client's next request
    on it failed (``APIConnectionError`` with retries off). After a response has started (a stream)
    nothing can be sent but its end: logged, and the connection left to the server."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # noqa: BLE001 - every error answered
            if started:
                log.exception("serve_internal_error_mid_response", error=str(e))
                raise
            await _server_error(e)(scope, receive, send)


def _api_key_before_body(service: "InferenceService"):
    """The ASGI middleware class that checks ``service.api_key`` before a body is read."""

    class ApiKeyBeforeBody:
        """With serve.api_key every route but /health needs the bearer token, checked before the body
        is read: an unauthenticated request is neither parsed nor served nor recorded. A plain ASGI
        middleware, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware wraps ``receive``
        so that ``request.is_disconnected()`` never sees a client that went away, and a non-streamed
        request would decode to its end for nobody."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http" and service.api_key is not None and scope.get("path") != "/health":
                from starlette.datastructures import Headers

                scheme, _, cred = Headers(scope=scope).get("authorization", "").partition(" ")
                if scheme.lower() != "bearer" or not secrets.compare_digest(cred.strip().encode(),
                                                                             service.api_key.encode()):
                    log.warning("serve_unauthorized", has_credentials=bool(cred), path=scope.get("path"))
                    resp = _error_response(ApiError(
                        401, "missing or wrong API key: send 'Authorization: Bearer <key>' (the OpenAI client's "
                             "api_key) with the key in the server's serve.api_key", code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"}))
                    await resp(scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    return ApiKeyBeforeBody


def _drain(events: asyncio.Queue, ids: list[int]) -> list[int]:
    """``ids`` extended by every id list already in ``events`` (emission order), without waiting."""
    while not events.empty():
        ids.extend(events.get_nowait())
    return ids


# ---- running it --------------------------------------------------------------------------------------


def event_loop_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP implementation for serving: ``("uvloop", "httptools")``
    where both import (draftd's dependencies), else uvicorn's pure-Python ``"asyncio"`` / ``"h11"``
    for whichever does not. Each streamed token is a chunk written by the event loop, beside the
    next forward on a small CPU: the C implementations take less of the cores llama.cpp decodes
    on (bench/RESULTS.md, "Tenth session")."""
    import importlib.util

    have = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    return ("uvloop" if have("uvloop") else "asyncio"), ("httptools" if have("httptools") else "h11")


class ServePortError(RuntimeError):
    """The inference API cannot listen on its address; the message names it and the fix."""


def bind_serve_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` and not yet listening, as uvicorn binds one
    (``uvicorn.Config.bind_socket``: IPv6 where the host holds ':', SO_REUSEADDR), for
    :class:`ServeServer` to listen on: `serve` binds it before it loads the models, so a port in
    use is told in a second instead of after the load (a connection meanwhile is refused, as before).

    Raises:
        ServePortError: the address cannot be bound (in use, not this host's, a privileged port);
            names ``host:port`` and the option that changes it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            fix = "another process listens there (another `daemonctl serve`?): stop it, or pick a free port with --port"
        elif e.errno == errno.EACCES:
            fix = "a port below 1024 needs privileges: pick one above 1023 with --port"
        else:
            fix = "is the address one of this host's? Set --host (e.g. 127.0.0.1)"
        raise ServePortError(f"the inference API cannot listen on {host}:{port} ({e.strerror or e}): {fix} "
                             f"(or DRAFTD_SERVE__PORT / DRAFTD_SERVE__HOST)") from e
    return sock


DEFAULT_KEEP_ALIVE_S = 30.0  # serve.keep_alive_s's default


class ServeServer:
    """uvicorn serving an :class:`InferenceService` in a background thread (no signal handlers
    there: the owner drains on SIGTERM), on :func:`event_loop_stack` (``.loop``, ``.http``).
    ``port`` 0 picks a free one (see ``.port`` after entry). A connection must send each request
    whole within ``read_timeout_s`` (serve.read_timeout_s; :mod:`daemon.http_timeout`), and an idle
    kept-alive one is closed ``keep_alive_s`` seconds after its last response (serve.keep_alive_s,
    uvicorn's ``timeout_keep_alive``: above the clients' own 5 s idle expiry, so they let an idle
    connection go before the server closes it). ``sock``: a socket already bound to
    ``host``:``port`` (:func:`bind_serve_socket`) to listen on, closed on exit; None = uvicorn
    binds one on entry.

    Raises:
        ValueError: ``read_timeout_s`` or ``keep_alive_s`` not a finite number of seconds above 0.
    """

    def __init__(self, service: InferenceService, host: str = "127.0.0.1", port: int = 8000,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, sock: socket.socket | None = None,
                 keep_alive_s: float = DEFAULT_KEEP_ALIVE_S):
        import uvicorn

        if not (isinstance(keep_alive_s, (int, float)) and math.isfinite(keep_alive_s) and keep_alive_s > 0):
            raise ValueError(f"keep_alive_s={keep_alive_s!r}: give a finite number of seconds above 0 "
                             f"(serve.keep_alive_s; default {DEFAULT_KEEP_ALIVE_S:g})")
        self.service = service
        self.loop, self.http = event_loop_stack()
        protocol = read_timeout_protocol(self.http, read_timeout_s)
        self.server = uvicorn.Server(uvicorn.Config(service.app(), host=host, port=port, log_config=None,
                                                    loop=self.loop, http=protocol, timeout_keep_alive=keep_alive_s,
                                                    lifespan="off", access_log=False, timeout_graceful_shutdown=5))
        run = self.server.run if sock is None else (lambda: self.server.run(sockets=[sock]))
        self.thread = threading.Thread(target=run, name="draftd-serve", daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServeServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive():
                raise ServePortError(f"the inference API could not listen on {self.host}:{self.port} (in use?); "
                                     f"set --port or DRAFTD_SERVE__PORT")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the inference API did not start on {self.host}:{self.port} within 30 s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        log.info("serve_listening", host=self.host, port=self.port, loop=self.loop, http=self.http)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


class Heartbeat:
    """Writes the service's status to Redis every ``interval_s`` (TTL 3 intervals); Redis errors
    are counted, never raised. Removed on close."""

    def __init__(self, service: InferenceService, client, store_config, interval_s: float = 5.0):
        self.service, self.client, self.store_config, self.interval_s = service, client, store_config, interval_s
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftd-heartbeat", daemon=True)

    def beat(self) -> bool:
        from store.heartbeat import write_heartbeat

        st = self.service.status()
        keep = ("server_id", "model", "adapter_version", "adapter_by_workload", "requests_served", "requests_failed",
                "queue_depth", "queue_size", "draining", "speculation_enabled", "speculation_by_workload",
                "speculation_by_batch", "cardinality", "batch", "proposers_offered", "buffer", "ts")
        hb = {k: st.get(k) for k in keep}
        if st.get("served_format"):  # the format, file and why; the cost table stays in serve's own status
            hb["served_format"] = {k: st["served_format"][k] for k in ("format", "file", "setting", "reason", "v_cache")
                                   if k in st["served_format"]}
            amx = st["served_format"].get("amx_rows")
            if amx:  # where llama.cpp's AMX tiles take over (decoder.engines.amx_rows): the setting and its source
                hb["served_format"]["amx_rows"] = {k: amx.get(k) for k in ("setting", "source")}
        try:
            write_heartbeat(self.client, self.store_config, self.service.server_id, hb,
                            ttl_s=3 * self.interval_s)
            return True
        except Exception as e:  # noqa: BLE001 - Redis down: serving goes on
            self.errors += 1
            log.warning("heartbeat_failed", error=str(e))
            return False

    def _run(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        from store.heartbeat import clear_heartbeat

        self._stop.set()
        self._thread.join(5)
        try:
            clear_heartbeat(self.client, self.store_config, self.service.server_id)
        except Exception:  # noqa: BLE001
            pass


def head_dtype():
    """The dtype a head serves in: bf16 where the CPU multiplies it natively (or on CUDA), else float32."""
    import torch

    from trainer.distill import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() or torch.cuda.is_available() else torch.float32


def _eagle_head(path, target):
    """The feature-level head in ``path`` (``serve.eagle_head``), as it serves: a frozen bf16 copy
    where the CPU multiplies bf16 natively, else float32; None without a path.

    Raises:
        ModelLoadError: the file cannot be read or does not fit ``target`` (serve exits 2 naming it).
    """
    if path is None:
        return None
    from decoder.eagle import load_head
    from decoder.models.packaged import ModelLoadError

    try:
        return load_head(target, Path(path).expanduser()).serving_copy(head_dtype())
    except ValueError as e:  # unreadable, another target's, or another shape: say so, no traceback
        raise ModelLoadError(f"serve.eagle_head: {e}") from e


def _cached_v0(settings, fp, registry, tokenizer) -> None:
    """An empty registry gets this pair's cached bootstrap as v0 (daemon.warm_start.promote_cached_v0):
    serve started alone serves v0 once the loop has swapped it in, never waiting for a bootstrap."""
    from daemon.settings import distill_config, draft_vocab_ids, warm_start_config
    from daemon.warm_start import promote_cached_v0

    try:
        ws = promote_cached_v0(fp, registry, warm_start_config(settings), distill_config(settings),
                               draft_vocab_ids(settings, tokenizer))
    except Exception as e:  # noqa: BLE001 - serving goes on from what the registry serves
        log.warning("serve_cached_v0_failed", error=f"{type(e).__name__}: {e}")
        return
    if ws is not None:
        log.info("serve_promoted_cached_v0", version=ws.version, reason=ws.reason)


def run_serve(settings, console=None) -> int:
    """``daemonctl serve``: load the pair, wire the loop, serve until SIGTERM/SIGINT, drain."""
    from contextlib import ExitStack

    from daemon.redis_embed import open_redis
    from daemon.settings import store_config
    from decoder.engines.registry import torch_threads_for
    from decoder.models.loading import load_pair

    sv, m = settings.serve, settings.models
    sock = bind_serve_socket(sv.host, sv.port)  # before the models load: a port in use is told at once
    # Each decoding step hands the GIL between threads (the batch's members, its driver, uvicorn,
    # the record writer): at CPython's default 5 ms switch interval a waiting thread sat up to 5 ms
    # per hand-off while another ran Python, and a batched step took 10-18 ms against 5 ms of
    # decoding (bench/RESULTS.md, "draftd serve against llama-server").
    sys.setswitchinterval(sv.gil_switch_interval_ms / 1e3)
    stop, cut = _stop_signals()
    with ExitStack() as stack:
        stack.enter_context(sock)  # closed on exit, whether or not the server got to listen on it
        rh = stack.enter_context(open_redis(settings.redis, settings.redis_dir))
        scfg = store_config(settings)
        if m.torch_threads:
            import torch

            torch.set_num_threads(m.torch_threads)
        pair = load_pair(m.target, m.draft, device=m.device)
        if _stopped_while_loading(stop, "the model pair"):
            return 0
        engines = _engines(settings, pair)
        if _stopped_while_loading(stop, "the engines"):
            return 0
        if not m.torch_threads:  # on llama.cpp the decoder's torch work is per-row vector math: one thread
            stack.enter_context(torch_threads_for(engines.target))
        loop, heads = _serving_loop(settings, rh.client, scfg, pair, engines)
        loop.start()
        stack.callback(loop.close)
        service = _service(settings, loop, pair.tokenizer, engines)
        if _stopped_while_loading(stop, "the serving loop"):
            return 0
        stack.enter_context(Heartbeat(service, rh.client, scfg, sv.heartbeat_s))
        server = stack.enter_context(ServeServer(service, sv.host, sv.port, read_timeout_s=sv.read_timeout_s,
                                                 sock=sock, keep_alive_s=sv.keep_alive_s))
        _announce(settings, server, service, rh.mode, loop, heads, console)
        while not stop.wait(0.5):
            pass
        _drain_loop(sv, loop, service, cut)
    return 0


def _stop_signals() -> tuple[threading.Event, threading.Event]:
    """SIGTERM/SIGINT handlers: the first sets ``stop`` (drain for serve.drain_grace_s), a second
    also ``cut`` (cut the grace short). Returns (stop, cut)."""
    stop, cut = threading.Event(), threading.Event()

    def on_signal(*_) -> None:
        if stop.is_set():
            cut.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop, cut


def _engines(settings, pair):
    """The target's and the draft's engines (``decoder.engines.registry.choose_engine``) for the
    served proposers, batch and format."""
    from daemon.settings import draft_vocab_ids
    from decoder.engines.registry import choose_engine
    from decoder.proposers.registry import spec as proposer_spec

    sv, m = settings.serve, settings.models
    engines = choose_engine(m.engine, m.target, m.device, m.draft, m.engine_threads,
                            embeddings=sv.record_hidden or any(proposer_spec(n).needs_features for n in sv.proposers),
                            target_format=m.format, proposers=tuple(sv.proposers),
                            progress=lambda msg: log.info("served_format_measuring", what=msg), n_seq=sv.max_batch,
                            draft_vocab=draft_vocab_ids(settings, pair.tokenizer), v_cache=m.v_cache,
                            format_max_seconds=m.format_max_seconds)
    log.info("engine", engine=engines.name, reason=engines.reason, served_format=engines.served_format,
             v_cache=getattr(engines.target, "v_cache", None))
    return engines


def _serving_loop(settings, client, scfg, pair, engines):
    """The serving loop over the pair's engines, following the adapter registry (v0 from the
    cache when it is empty) and the head registry where asked. Returns (loop, the head registry
    or None)."""
    from daemon.settings import draft_vocab_ids
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.proposers.registry import versioned_by
    from decoder.speculative import DecoderConfig
    from store import AdapterRegistry
    from store.schema import PairFingerprint

    sv = settings.serve
    fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
    registry = AdapterRegistry(client, settings.adapter_dir, scfg) if sv.follow_adapters else None
    if registry is not None:
        _cached_v0(settings, fp, registry, pair.tokenizer)
    follow_heads = versioned_by("head") in sv.proposers and sv.eagle_head is None and sv.follow_heads
    heads = AdapterRegistry(client, settings.head_dir, scfg, kind="head") if follow_heads else None
    loop = build_serving_loop(
        pair.target, pair.draft, pair.tokenizer, client=client, store_config=scfg, registry=registry,
        decoder_config=DecoderConfig(record_prompt=sv.record_prompt, prompt_cache=sv.prompt_cache, draft_vocab=draft_vocab_ids(settings, pair.tokenizer),
                                     ngram_gate=sv.ngram_gate, record_hidden=sv.record_hidden,
                                     target_format=engines.served_format),
        pair_fingerprint=fp, config=LoopConfig(queue_size=sv.queue_size, check_plain_every=sv.check_plain_every,
                                               max_batch=sv.max_batch, step_token_budget=sv.step_token_budget,
                                               step_ms_target=sv.itl_target_ms),
        proposers=tuple(sv.proposers), engine=engines.target, draft_engine=engines.draft,
        eagle_head=_eagle_head(sv.eagle_head, pair.target), head_registry=heads, head_dtype=head_dtype(),
        hold_base_draft=holds_base_draft(settings))
    return loop, heads


def _registry_has_version(manager) -> bool:
    """Whether the adapter registry holds an active version in any scope (unreadable: assumed so)."""
    try:
        return any(manager.registry.active_versions().values())
    except Exception:  # noqa: BLE001 - a log line's condition, never the server's start
        return True


def holds_base_draft(settings) -> bool:
    """``serve.base_draft`` resolved: hold (True) or offer the draft before its first adapter
    version; ``auto`` holds a draft derived from the target's layers (``models.draft`` =
    ``'layers:...'``)."""
    mode = settings.serve.base_draft
    return mode == "hold" or (mode == "auto" and settings.models.draft.startswith("layers:"))


def _service(settings, loop, tokenizer, engines) -> InferenceService:
    """The OpenAI face of ``loop`` as ``serve.*`` configures it."""
    sv, m = settings.serve, settings.models
    return InferenceService(loop, tokenizer, sv.model_name or m.target, context_len=loop.decoder.engine.context_length,
                            max_tokens_default=sv.max_tokens_default, speculation=sv.speculation,
                            server_id=sv.server_id,
                            api_key=sv.api_key.get_secret_value() if sv.api_key is not None else None,
                            max_prompt_tokens=sv.max_prompt_tokens, request_timeout_s=sv.request_timeout_s,
                            max_workloads=sv.max_workloads, max_sampling_buckets=sv.max_sampling_buckets,
                            max_request_bytes=sv.max_request_bytes,
                            served_format=_served_format(engines),
                            grammar_gguf=_grammar_gguf(m.target, engines.target))


def _announce(settings, server, service, redis_mode: str, loop, heads, console) -> None:
    """Log that serving started (and what to fix: an exposed port without a key, an eagle
    proposer still waiting for its first head); print the URL to ``console``."""
    sv = settings.serve
    log.info("serve_started", url=server.url, model=service.model, redis=redis_mode, speculation=sv.speculation,
             authenticated=sv.api_key is not None,
             streams_steps=loop.streams_steps, proposers=list(sv.proposers),
             eagle_head=str(sv.eagle_head) if sv.eagle_head else ("registry" if heads is not None else None),
             record_hidden=sv.record_hidden)
    if sv.remote and sv.api_key is None:
        log.warning("serve_exposed_unauthenticated", host=sv.host,
                    why="serve.allow_remote without serve.api_key: anyone who reaches the port is served and their "
                        "requests go into the training buffer; set DRAFTD_SERVE__API_KEY")
    if heads is not None and not heads.active_versions().get(""):
        log.warning("eagle_waits_for_a_head", head_dir=str(settings.head_dir),
                    why="'eagle' is offered only once the trainer promotes a head (trainer.heads=true on the daemon, "
                        "serve.record_hidden=true here); `daemonctl heads list` shows them")
    manager = getattr(loop, "manager", None)
    if "draft" in sv.proposers and holds_base_draft(settings) and manager is not None and not _registry_has_version(manager):
        log.info("draft_waits_for_v0", base_draft=sv.base_draft,
                 why="the controller offers the draft once its first adapter version is ready (`run` bootstraps v0, "
                     "`serve` alone loads a cached one); until then the other proposers and plain decoding serve; "
                     "serve.base_draft=offer serves the base draft at once")
    if console is not None:
        console.print(f"serving {service.model} at {server.url}/v1 (redis {redis_mode}); SIGTERM drains, a second one cuts the grace short")


def _drain_loop(sv, loop, service: InferenceService, cut: threading.Event) -> None:
    """Drain for ``sv.drain_grace_s`` (``cut``: a second signal cuts it short); past it what is
    left is cancelled and whoever still waits is answered."""
    log.info("serve_draining", grace_s=sv.drain_grace_s, queued=loop.queue_depth)
    service.drain_grace_s = sv.drain_grace_s  # named in the 503 of a request cancelled past it
    t0 = time.monotonic()
    drained = loop.drain(sv.drain_grace_s, cut)  # past the grace (or a second signal) it cancels what is left
    if not drained:
        # a second signal: its 503s and error events say so, not "after the drain grace"
        elapsed = time.monotonic() - t0
        cut_after = elapsed if cut.is_set() and elapsed < sv.drain_grace_s else None
        service.drain_cut_after_s = cut_after
        _settle(loop, 1.0)  # a cancelled request usually stops within a step: its client gets its 503
        service.abandon(sv.drain_grace_s, cut_after)  # whoever still waits is answered now, not cancelled by uvicorn
        if not _settle(loop, 30.0):
            log.warning("serve_decoder_still_busy", waited_s=30.0)
    log.info("serve_drained", complete=drained)


def _stopped_while_loading(stop: threading.Event, loaded: str) -> bool:
    """True when SIGTERM/SIGINT came while ``serve`` was still loading (it loaded ``loaded`` last):
    it stops there, never listening nor serving (a signal used to wait for the whole load, then
    bind the port, announce serving and drain at once)."""
    if stop.is_set():
        log.info("serve_stopped_while_loading", loaded=loaded)
        return True
    return False


def _settle(loop, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for ``loop`` to finish its current request; True when idle."""
    deadline = time.monotonic() + timeout_s
    while loop.busy and time.monotonic() < deadline:
        time.sleep(0.02)
    return not loop.busy


def register(app) -> None:
    """Add ``serve`` to the ``daemonctl`` Typer app."""
    @app.command("serve")
    def serve(
        host: Annotated[str | None, typer.Option(help="bind address (overrides serve.host; default 127.0.0.1)")] = None,
        port: Annotated[int | None, typer.Option(help="TCP port (overrides serve.port; default 8000)")] = None,
        no_spec: Annotated[bool, typer.Option("--no-spec", help="plain decoding for every request (baseline)")] = False,
        api_key: Annotated[str | None, typer.Option("--api-key", help="bearer token clients must send (overrides "
                                                    "serve.api_key / DRAFTD_SERVE__API_KEY; prefer the variable: "
                                                    "a command line is visible to other users)")] = None,
        config: Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config file (else $DRAFTD_CONFIG)")] = None,
    ) -> None:
        """Serve the configured pair over an OpenAI-compatible API (/v1/completions, /v1/chat/completions,
        /v1/models, /health, /metrics) with the adaptive loop on: verified samples to Redis, adapter
        hot-swaps per workload, goodput control, rollback. SIGTERM drains."""
        from rich.console import Console

        from daemon.logging import configure
        from daemon.settings import ConfigError, ensure_state_dir, load_settings

        console = Console(stderr=True)
        try:
            s = load_settings(config)
            ensure_state_dir(s)
            upd = {}
            if host is not None:
                upd["host"] = host
            if port is not None:
                upd["port"] = port
            if no_spec:
                upd["speculation"] = False
            if api_key is not None:
                upd["api_key"] = api_key
            if upd:  # validated again: --host 0.0.0.0 without a key is refused like DRAFTD_SERVE__HOST
                from pydantic import ValidationError

                from daemon.settings import ServeSettings, validation_text

                try:
                    sv = ServeSettings.model_validate({**s.serve.model_dump(), **upd})
                except ValidationError as e:
                    raise ConfigError(f"invalid serve options:\n{validation_text(e, group='serve')}") from None
                s = s.model_copy(update={"serve": sv})
        except ConfigError as e:
            console.print(f"[red]config error:[/] {rich_escape(str(e))}")
            raise typer.Exit(2) from e
        configure(s.log_format, s.log_level)
        from decoder.engines.base import EngineError
        from decoder.models.packaged import ModelLoadError

        from daemon.redis_embed import EmbeddedRedisError
        from store.errors import StoreError

        try:
            rc = run_serve(s, console)
        except (ModelLoadError, EngineError, ServePortError) as e:  # the pair, engine or port cannot serve: one line
            console.print(f"[red]error:[/] {rich_escape(str(e))}", soft_wrap=True)
            raise typer.Exit(2) from e
        except (StoreError, EmbeddedRedisError) as e:  # no Redis (or too old): one line, the URL's password masked
            console.print(f"[red]error:[/] {rich_escape(str(e))}; set DRAFTD_REDIS__URL to a reachable Redis >= 6.2 (or "
                          f"unset it for the embedded one)", soft_wrap=True)
            raise typer.Exit(2) from e
        raise typer.Exit(rc)
