"""Load benchmark of `daemonctl serve`: N concurrent openai clients over mixed workloads and
sampling policies, against the server with speculation on and the same load with it off, side
by side in one run; prints one JSON object.

Per side: requests/s and output tokens/s (wall clock of the whole load), time to first token and
end-to-end latency p50/p99 (client side, streamed requests: first content chunk), failures, and
the server's own counts (proposed/accepted tokens, adapter versions seen).

Usage::

    .venv/bin/python bench/serve_bench.py --pair tiny --clients 8 --requests 25      # seconds
    .venv/bin/python bench/serve_bench.py --pair smollm2 --clients 4 --requests 8    # the packaged pair, minutes
    .venv/bin/python bench/serve_bench.py --url http://127.0.0.1:8000/v1 --url-off http://127.0.0.1:8001/v1 --model smollm2-135m

Without ``--url`` both servers run in this process, one after the other (the same pair, a fresh
goodput controller each), on the Redis at ``--redis-url`` under a unique ``bench:serve:<hex>:``
prefix deleted at the end. ``--pair tiny`` is a random 4-layer Llama target with a 2-layer draft
(``tests/decoder/tiny.py``): it measures the serving path, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "prose": "The history of the river valley begins with",
    "code": "def parse_config(path):\n    \"\"\"Read a TOML file and",
    "math": "Question: Tom has 3 boxes of 12 apples and eats 5. How many are left?\nAnswer:",
}
POLICIES = [dict(temperature=0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0)]


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)


def run_load(base_url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    import openai

    ttft, e2e, failures, tokens, measures = [], [], [], [0], []
    lock = threading.Lock()

    def client(c: int) -> None:
        oc = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        for i in range(requests):
            w = list(WORKLOADS)[(c + i) % len(WORKLOADS)]
            kw = dict(model=model, prompt=WORKLOADS[w], max_tokens=max_tokens, stream=True,
                      extra_body={"workload": w, "ignore_eos": True}, **POLICIES[(c + 2 * i) % len(POLICIES)])
            t0 = time.perf_counter()
            first = None
            try:
                last = None
                for ch in oc.completions.create(**kw):
                    if first is None and ch.choices and ch.choices[0].text:
                        first = time.perf_counter()
                    last = ch
                t1 = time.perf_counter()
                m = (last.model_extra or {}).get("draftd", {})
                with lock:
                    e2e.append(t1 - t0)
                    if first is not None:
                        ttft.append(first - t0)
                    measures.append(m)
            except Exception as e:  # noqa: BLE001 - counted
                with lock:
                    failures.append(repr(e)[:200])

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out_tokens = sum(int(m.get("output_tokens", 0) or 0) for m in measures)
    n = len(e2e)
    return {
        "requests": n, "failures": len(failures), "failure_examples": failures[:3], "seconds": round(wall, 2),
        "requests_per_s": round(n / wall, 3), "tokens_per_s": round(out_tokens / wall, 2),
        "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
        "e2e_ms_p50": pct(e2e, 0.5), "e2e_ms_p99": pct(e2e, 0.99),
        "proposed_tokens": sum(m.get("proposed_tokens", 0) or 0 for m in measures),
        "accepted_tokens": sum(m.get("accepted_tokens", 0) or 0 for m in measures),
        "adapter_versions": sorted({m.get("adapter_version") for m in measures if m}),
    }


def load_pair(name: str):
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests" / "decoder"))
        from tiny import char_tokenizer, tiny_llama, tiny_target

        return tiny_target(), tiny_llama(7, layers=2, hidden=32, head_scale=20.0), char_tokenizer(), "tiny"
    from decoder.models.loading import load_pair as lp

    p = lp("smollm2-135m", "layers:0-3")
    return p.target, p.draft, p.tokenizer, "smollm2-135m"


@contextmanager
def in_process_server(target, draft, tok, model: str, redis_url: str, prefix: str, speculation: bool):
    from daemon.serve import InferenceService, ServeServer
    from decoder.loop import LoopConfig, build_serving_loop
    from decoder.speculative import DecoderConfig
    from store.client import connect
    from store.config import StoreConfig

    client = connect(redis_url)
    loop = build_serving_loop(target, draft, tok, client=client, store_config=StoreConfig(key_prefix=prefix),
                              decoder_config=DecoderConfig(record_prompt=False), config=LoopConfig(queue_size=256))
    loop.start()
    try:
        service = InferenceService(loop, tok, model, context_len=target.config.max_position_embeddings,
                                   speculation=speculation)
        with ServeServer(service, "127.0.0.1", 0) as server:
            yield f"http://127.0.0.1:{server.port}/v1"
    finally:
        loop.close()
        for k in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(k)
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=25, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--url", help="a running server with speculation on (…/v1); skips the in-process servers")
    ap.add_argument("--url-off", help="the same server with speculation off (`daemonctl serve --no-spec`)")
    ap.add_argument("--model", default=None, help="model id with --url")
    a = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import platform

    result = {"clients": a.clients, "requests_per_client": a.requests, "max_tokens": a.max_tokens,
              "workloads": list(WORKLOADS), "policies": POLICIES, "host": platform.processor() or platform.machine()}
    if a.url:
        result["speculation_on"] = run_load(a.url, a.model, a.clients, a.requests, a.max_tokens)
        if a.url_off:
            result["speculation_off"] = run_load(a.url_off, a.model, a.clients, a.requests, a.max_tokens)
    else:
        import torch

        if a.threads:
            torch.set_num_threads(a.threads)
        target, draft, tok, model = load_pair(a.pair)
        result["pair"] = a.pair
        for side, spec in (("speculation_on", True), ("speculation_off", False)):
            prefix = f"bench:serve:{uuid.uuid4().hex[:8]}:"
            with in_process_server(target, draft, tok, model, a.redis_url, prefix, spec) as url:
                result[side] = run_load(url, model, a.clients, a.requests, a.max_tokens)
    on, off = result.get("speculation_on"), result.get("speculation_off")
    if on and off and off["tokens_per_s"]:
        result["tokens_per_s_ratio_on_vs_off"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
