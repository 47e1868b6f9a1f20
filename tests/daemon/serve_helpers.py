"""A real `serve` stack on tiny models: ServingLoop + InferenceService + uvicorn on a free loopback
port, the real openai client, a real Redis (the shared one under a test prefix, or one of the
test's own)."""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoder"))

import torch  # noqa: E402

from tiny import char_tokenizer, tiny_llama, tiny_target  # noqa: E402

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
MODEL = "tiny"


def tokenizer(chars=None):
    tok = char_tokenizer(chars) if chars else char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


_MODELS: dict[str, object] = {}


def tiny_pair():
    """(target, draft): the decoder tests' tiny target and an independent 2-layer draft (shared
    across tests: the models are read-only while serving)."""
    if not _MODELS:
        torch.set_num_threads(1)
        _MODELS["target"] = tiny_target()
        _MODELS["draft"] = tiny_llama(7, layers=2, hidden=32, head_scale=20.0)
    return _MODELS["target"], _MODELS["draft"]


@dataclass
class Served:
    loop: object
    service: object
    server: object
    tokenizer: object
    client: object  # redis
    store_config: object

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}/v1"

    def openai(self, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        kw.setdefault("api_key", getattr(self.service, "api_key", None) or "unused")
        return openai.OpenAI(base_url=self.base_url, **kw)


@contextmanager
def serving(redis_client, key_prefix: str, *, target=None, draft=None, registry=None, queue_size: int = 64,
            record_prompt: bool = False, speculation: bool = True, heartbeat_s: float | None = None,
            api_key: str | None = None, chars=None, read_timeout_s: float | None = None, **service_kw):
    from daemon.serve import Heartbeat, InferenceService, ServeServer
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.speculative import DecoderConfig
    from store.config import StoreConfig
    from store.schema import PairFingerprint

    t, d = tiny_pair()
    target, draft = target or t, draft or d
    tok = tokenizer(chars)
    scfg = StoreConfig(key_prefix=key_prefix)
    loop = build_serving_loop(
        target, draft, tok, client=redis_client, store_config=scfg, registry=registry,
        decoder_config=DecoderConfig(topk_record=8, record_prompt=record_prompt, small_m_linear=False, draft_precision="fp32"),
        pair_fingerprint=PairFingerprint("tiny-target", "tiny-draft", "char-64"),
        config=LoopConfig(queue_size=queue_size), poll_interval_s=0.2, history_flush_s=0.5)
    loop.start()
    service = InferenceService(loop, tok, MODEL, context_len=target.config.max_position_embeddings,
                               max_tokens_default=16, speculation=speculation, server_id=f"test-{os.getpid()}-{id(loop)}",
                               api_key=api_key, **service_kw)
    hb = Heartbeat(service, redis_client, scfg, heartbeat_s) if heartbeat_s else None
    try:
        if hb:
            hb.__enter__()
        server_kw = {} if read_timeout_s is None else {"read_timeout_s": read_timeout_s}
        with ServeServer(service, "127.0.0.1", 0, **server_kw) as server:
            yield Served(loop, service, server, tok, redis_client, scfg)
    finally:
        if hb:
            hb.__exit__(None, None, None)
        loop.close()


def plain_text(tok, target, draft, prompt_ids, max_tokens, stop=()):
    """Plain decoding (γ = 0) of the same request through a decoder of its own, as served text."""
    from daemon.serve import TextStream
    from decoder.sampling import SamplingParams
    from decoder.speculative import DecodeRequest, DecoderConfig, SpeculativeDecoder

    dec = SpeculativeDecoder(target, draft, tok, DecoderConfig(small_m_linear=False, draft_precision="fp32"))
    res = dec.generate(DecodeRequest(prompt_ids, SamplingParams(), max_tokens, gamma=0, stop=tuple(stop)))
    ts = TextStream(tok, tuple(stop))
    ts.feed(res.output_ids)
    return ts.text(), res


class Blocker:
    """A between-requests hook that holds the decoder until released (fills the queue on purpose)."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, dec, req=None):
        if req is not None:
            self.entered.set()
            self.release.wait(60)


def invoke_serve(app, *args: str):
    """``daemonctl serve *args`` through typer's CliRunner, this process's SIGTERM / SIGINT handlers
    restored afterwards (run_serve installs its own)."""
    import signal

    from typer.testing import CliRunner

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return CliRunner().invoke(app, ["serve", *args])
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


class HealthApp:
    """The least a ServeServer serves: an ASGI app answering every request 200 {"ok": true}."""

    def app(self):
        async def asgi(scope, receive, send):
            if scope["type"] != "http":
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")]})
            await send({"type": "http.response.body", "body": b'{"ok": true}'})
        return asgi
