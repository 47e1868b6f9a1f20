"""What `daemonctl serve`'s HTTP/streaming path costs per output token, against the same request
submitted straight to the serving loop, paired in one process on the same engines.

One process hosts the serving loop and the OpenAI server as ``daemonctl serve`` wires them (the
settings from the environment: ``DRAFTD_MODELS__FORMAT=packaged`` etc.; Redis under a unique key
prefix deleted at the end). For each prompt, in alternating order, the same request body is served

- ``http``: streamed ``/v1/completions`` through uvicorn, sent by a client in a *separate*
  process (so the client's Python does not share this process's GIL or CPU accounting), and
- ``direct``: parsed by the same :class:`daemon.serve.InferenceService` and submitted to the loop
  with a no-op ``on_tokens`` (the in-process serving loop: no HTTP, no SSE, no detokenisation).

Per side: output tokens, wall seconds and this process's CPU seconds (``time.process_time``:
all its threads: the engine's compute, the loop, uvicorn, the record writer) per request; printed
as milliseconds per output token, medians and the paired difference http - direct with a
bootstrap 95 % interval. CPU time per token is what a loaded host changes least (wall time on
shared cores moves with other people's jobs). The request's ``gamma`` is fixed (default 0: plain
decoding, one token per step, the streaming path's worst case) so the controller's warm-up and
probes do not differ between the two sides.

Usage::

    DRAFTD_MODELS__FORMAT=packaged DRAFTD_MODELS__ENGINE_THREADS=1 .venv/bin/python bench/serve_overhead.py --requests 10 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CLIENT = r"""
import json, sys, time, openai
url, model = sys.argv[1], sys.argv[2]
oc = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
for line in sys.stdin:
    body = json.loads(line)
    extra = {k: v for k, v in body.items() if k not in ("prompt", "max_tokens", "temperature")}
    t0 = time.perf_counter(); chunks = 0; toks = None
    for ch in oc.completions.create(model=model, prompt=body["prompt"], max_tokens=body["max_tokens"], temperature=0,
                                    stream=True, stream_options={"include_usage": True}, extra_body=extra):
        if ch.choices and ch.choices[0].text:
            chunks += 1
        if getattr(ch, "usage", None) is not None:
            toks = ch.usage.completion_tokens
    print(json.dumps({"tokens": toks, "chunks": chunks, "wall_s": time.perf_counter() - t0}), flush=True)
"""


def boot_ci(xs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def own_key_prefix(tag: str) -> str:
    """Sets and returns ``DRAFTD_STORE__KEY_PREFIX`` as a prefix of this run's own under whatever
    the environment sets (``bench:`` if nothing): a bench deletes ``prefix*`` at its end, which must
    never reach a running daemon's keys, or under an empty prefix the whole database."""
    prefix = f"{os.environ.get('DRAFTD_STORE__KEY_PREFIX') or 'bench:'}{tag}:{uuid.uuid4().hex[:8]}:"
    os.environ["DRAFTD_STORE__KEY_PREFIX"] = prefix
    return prefix


def build(settings, prefix: str):
    """The serving loop and service as ``run_serve`` builds them (no signals, no heartbeat)."""
    from daemon.serve import InferenceService, _grammar_gguf
    from daemon.settings import draft_vocab_ids, store_config
    from decoder.engines.registry import choose_engine, torch_threads_for
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.models.loading import load_pair
    from decoder.speculative import DecoderConfig
    from store.client import connect
    from store.schema import PairFingerprint

    sv, m = settings.serve, settings.models
    sys.setswitchinterval(sv.gil_switch_interval_ms / 1e3)
    scfg = store_config(settings)
    client = connect(settings.redis.url or "redis://127.0.0.1:6379/0")
    pair = load_pair(m.target, m.draft, device=m.device)
    engines = choose_engine(m.engine, m.target, m.device, m.draft, m.engine_threads, target_format=m.format,
                            proposers=tuple(sv.proposers), n_seq=sv.max_batch, format_max_seconds=m.format_max_seconds)
    torch_threads_for(engines.target).__enter__()
    loop = build_serving_loop(
        pair.target, pair.draft, pair.tokenizer, client=client, store_config=scfg, registry=None,
        pair_fingerprint=PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash),
        decoder_config=DecoderConfig(record_prompt=sv.record_prompt, prompt_cache=False, draft_vocab=draft_vocab_ids(settings, pair.tokenizer),
                                     ngram_gate=sv.ngram_gate, target_format=engines.served_format),
        config=LoopConfig(queue_size=sv.queue_size, check_plain_every=sv.check_plain_every, max_batch=sv.max_batch,
                          step_token_budget=sv.step_token_budget, step_ms_target=sv.itl_target_ms),
        proposers=tuple(sv.proposers), engine=engines.target, draft_engine=engines.draft)
    loop.start()
    service = InferenceService(loop, pair.tokenizer, m.target, context_len=loop.decoder.engine.context_length,
                               speculation=sv.speculation, request_timeout_s=sv.request_timeout_s,
                               grammar_gguf=_grammar_gguf(m.target, engines.target))
    return client, pair, loop, service


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10, help="prompts; each is served once per side")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=0, help="the requests' fixed γ (0: plain decoding; -1: none, the "
                    "goodput controller decides, from a cold start: its warm-up included)")
    ap.add_argument("--sides", default="http,direct", help="which sides run (e.g. direct: the loop alone)")
    ap.add_argument("--workloads", default="prose,code,math")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    own_key_prefix("overhead")
    from daemon.serve import ServeServer
    from daemon.settings import load_settings
    from serve_bench import peer_prompts

    settings = load_settings()
    prefix = settings.store.key_prefix
    client, pair, loop, service = build(settings, prefix)
    workloads = [w for w in a.workloads.split(",") if w]
    prompts = peer_prompts(pair.tokenizer, workloads, -(-a.requests // len(workloads)))[: a.requests]
    rows: dict[str, list[dict]] = {"http": [], "direct": []}
    try:
        with ServeServer(service, "127.0.0.1", 0) as server:
            url = f"http://127.0.0.1:{server.port}/v1"
            cl = subprocess.Popen([sys.executable, "-c", CLIENT, url, service.model], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

            def body(w: str, ids: list[int]) -> dict:
                return {"prompt": ids, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True,
                        "workload": w, **({"gamma": a.gamma} if a.gamma >= 0 else {})}

            def http(b: dict) -> dict:
                c0 = time.process_time()
                cl.stdin.write(json.dumps(b) + "\n")
                cl.stdin.flush()
                r = json.loads(cl.stdout.readline())
                r["cpu_s"] = time.process_time() - c0
                return r

            def direct(b: dict) -> dict:
                c0, t0 = time.process_time(), time.perf_counter()
                p = service.parse(dict(b, stream=True, model=service.model), "completion")
                ticket = loop.submit(service.request_of(p), on_tokens=lambda ids: None)
                res = ticket.result(timeout=600)
                return {"tokens": len(res.output_ids), "wall_s": time.perf_counter() - t0,
                        "cpu_s": time.process_time() - c0, "proposer": res.proposer,
                        "proposed": sum(st.proposed for st in res.steps), "steps": len(res.steps),
                        "why": (ticket.decision or {}).get("why")}

            sides = [x for x in a.sides.split(",") if x]
            if "http" in sides:  # first-request allocations, both sides: not measured
                http(body("default", [1, 2, 3, 4]))
            direct(body("default", [1, 2, 3, 4]))
            for i, (w, ids) in enumerate(prompts):
                order = [("http", http), ("direct", direct)] if i % 2 == 0 else [("direct", direct), ("http", http)]
                for name, fn in [o for o in order if o[0] in sides]:
                    r = fn(body(w, ids))
                    r["load1"] = os.getloadavg()[0]
                    rows[name].append(r)
                    print(name, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}),
                          file=sys.stderr, flush=True)
            cl.stdin.close()
            cl.wait(30)
    finally:
        loop.close()
        for k in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(k)
    out = {"requests": a.requests, "max_tokens": a.max_tokens, "gamma": a.gamma,
           "engine_threads": settings.models.engine_threads, "format": settings.models.format,
           "loadavg_1m": [round(min(r["load1"] for v in rows.values() for r in v), 2),
                          round(max(r["load1"] for v in rows.values() for r in v), 2)], "sides": {}}
    for name, rs in [(k, v) for k, v in rows.items() if v]:
        out["sides"][name] = {"cpu_ms_per_token_all": round(1e3 * sum(r["cpu_s"] for r in rs) / sum(r["tokens"] for r in rs), 3),
                              "tokens_per_s_all": round(sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs), 2),"cpu_ms_per_token_median": round(statistics.median(1e3 * r["cpu_s"] / r["tokens"] for r in rs), 3),
                              "wall_ms_per_token_median": round(statistics.median(1e3 * r["wall_s"] / r["tokens"] for r in rs), 3),
                              "tokens_per_s_median": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 1)}
    for k in ("cpu_s", "wall_s") if rows["http"] and rows["direct"] else ():
        d = [1e3 * (h[k] / h["tokens"] - g[k] / g["tokens"]) for h, g in zip(rows["http"], rows["direct"])]
        lo, hi = boot_ci(d)
        out[f"http_minus_direct_{k[:-2]}_ms_per_token"] = {"mean": round(statistics.fmean(d), 3),
                                                            "ci95": [round(lo, 3), round(hi, 3)]}
    out["rows"] = rows
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
