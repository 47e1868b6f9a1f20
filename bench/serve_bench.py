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

``--peer``: draftd against llama-server, side by side in one run (``bench/peers.py`` builds
llama-server once from the pinned llama-cpp-python sdist's vendored llama.cpp and caches it)::

    .venv/bin/python bench/serve_bench.py --peer --peer-clients 1,2,4,8 --requests 2 --max-tokens 64

Same GGUF (the packaged SmolLM2-135M Q4_1; ``--format`` another llama.cpp format of it, on both
sides), same prompts (token ids, so both servers see the same tokens: the first prompts of the
built-in workloads, which no bootstrap corpus holds, ``decoder.workloads.EVAL_RESERVED_PROMPTS``;
disjoint sets per client count, the same set for every configuration at one count, so draftd's
n-gram history never holds a prompt it is measured on), greedy (temperature 0), ``ignore_eos``
with a fixed ``max_tokens``, streamed ``/v1/completions``, a closed loop of N clients on loopback
(each sends its next request when the last one ended: at most N in flight). Configurations:

- ``draftd``: ``daemonctl serve`` as a subprocess with its defaults (speculation on, proposers
  n-gram and draft, continuous batching up to ``serve.max_batch``; ``--draftd-max-batch`` sets
  it), a fresh state directory and a unique Redis key prefix (deleted at the end), one process
  for the whole run;
- ``llama_plain``: ``llama-server -np N -c N*ctx`` (N = the client count), no speculation;
- ``llama_<type>``: the same with its own speculation ``--spec-type <type>`` for each n-gram type
  this llama.cpp lists (``--ngram-types``), llama.cpp's default parameters;
- ``llama_draft``: the same with ``-md`` (and ``--spec-type draft-simple``: ``-md`` alone does not turn
  speculation on in this llama.cpp) the 4-layer draft GGUF draftd derives from the packaged
  file (``decoder.models.gguf_export.derived_draft_gguf``: the base draft, without draftd's
  adapters), when it is cached (serve writes it at its start); else skipped, with the reason.

``--paired``: every server up at once: draftd and each llama-server configuration above that
``--configs`` names (``llama_plain``, each ``llama_<type>``, ``llama_draft``: the same list and the
same skips as the sequential cells, :func:`llama_runs`), llama-server with as many slots as
clients, and, in rounds of N concurrent prompts (N = the first ``--peer-clients`` count, one
prompt per client), each round streamed to each server in turn, the order rotating, half a second
of quiet before each round; per round draftd's aggregate tokens/s over each peer's, their
geometric mean with a bootstrap interval (:func:`paired_ratio`); per server TTFT, TPOT and ITL
(p50/p90/p99/max, pooled over every successful request's chunk gaps, as the sequential cells) in
``paired.servers.<name>`` (:func:`paired_summary`). Sequential cells compare
minutes apart, and on a shared VM the host's speed drifts between them (llama-server plain at 1
client read 106 and 135 tokens/s half an hour apart); pairs per round do not::

    .venv/bin/python bench/serve_bench.py --peer --paired --peer-clients 1 --requests 24 --warmup 2 --max-tokens 64
    .venv/bin/python bench/serve_bench.py --peer --paired --peer-clients 4 --requests 8 --warmup 2 --max-tokens 64

``--check-paired``: issue 35's targets from such runs' JSON files, one per client count, the
1-client one included (:func:`paired_checks`; starts nothing)::

    .venv/bin/python bench/serve_bench.py --check-paired bench/results/a_c1.json bench/results/a_c4.json bench/results/a_c8.json

A llama-server configuration that fails (its server exits at its start, never answers /health, or
refuses requests) does not stop the run: it is left out with its reason (``failed`` in the paired
JSON, an ``error`` cell in the sequential table), ending with the server log's tail where it did not
start; the other configurations are measured. A configuration asked for that cannot run here
(``--ngram-types`` naming a type this llama-server does not list, no draft GGUF) is in ``skipped``.

Client counts run in order; at each, draftd first, then every llama-server configuration (a
fresh process per configuration and count, warmed by one short request, and by `--warmup` unmeasured
prompts per workload: every server process alike, draftd once). Per configuration and
count: output tokens/s (all requests' output tokens over the wall time of the load), time to
first token, inter-token latency (ITL: gaps between consecutive streamed chunks with text, as
vLLM's benchmark_serving: a chunk of k speculated tokens is one gap) and time per output token
(TPOT: (last chunk - first chunk) / (tokens - 1) per request), p50 and p99 in milliseconds,
failed requests, proposed and accepted draft tokens, and the host's 1-minute load average
around the cell. The summary checks issue 35's targets.

What the server itself spent per cell (``server``; the measure that survives a shared host, where
wall-clock tokens/s moves with the other jobs): the server process's CPU seconds over the measured
load (``/proc/<pid>/stat`` utime + stime, its children included; ``bench/peers.py``
``process_cpu_seconds``), per output token (``cpu_ms_per_token``), and its decode counts: draftd's
fused forwards and rows (``/draftd/status``), llama-server's ``llama_decode`` calls, busy slots per
call and prompt / predicted tokens (``/metrics``, started with ``--metrics``). At ``--threads 1`` no
engine thread spins in a barrier, so CPU ms per token compares the two sides' work per token even
under load; the table of them is printed (stderr) at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "prose": "The history of the river valley begins with",
    "code": "def parse_config(path):\n    \"\"\"Read a TOML file and",
    "math": "Question: Tom has 3 boxes of 12 apples and eats 5. How many are left?\nAnswer:",
}
POLICIES = [dict(temperature=0), dict(temperature=0.7, top_p=0.9), dict(temperature=1.0)]


def pct(xs, q, scale: float = 1e3):
    """The ``q`` quantile of ``xs`` times ``scale`` (seconds to milliseconds by default), rounded to
    2 places: the sorted sample's element at index ``int(q * len(xs))`` (capped at the last), i.e.
    the smallest value with at least ``floor(q * n)`` values below it; None for no sample."""
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * scale, 2)


def quantiles(xs, qs=(0.5, 0.99), scale: float = 1e3, with_max: bool = False) -> dict:
    """``{"p50": ..., "p99": ...}`` (one ``p<100 q>`` key per ``qs``) of ``xs`` by :func:`pct`,
    times ``scale``; ``with_max`` adds ``"max"``. Values None without a sample."""
    out = {f"p{round(q * 100)}": pct(xs, q, scale) for q in qs}
    if with_max:
        out["max"] = round(max(xs) * scale, 2) if xs else None
    return out


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


# ---- --peer: draftd serve against llama-server ----------------------------------------------------


def peer_prompts(tokenizer, workloads: list[str], per_workload: int) -> list[tuple[str, list[int]]]:
    """``(workload, token ids)`` of the first ``per_workload`` prompts of each workload, interleaved
    (prose, code, math, prose, ...); chat prompts in the tokenizer's chat template."""
    from decoder.workloads import get_workload

    lists = [get_workload(w, per_workload) for w in workloads]
    out = []
    for i in range(per_workload):
        for w, ps in zip(workloads, lists):
            if i < len(ps):
                out.append((w, list(ps[i].token_ids(tokenizer))))
    return out


def cell_prompts(prompts: list, clients_list: list[int], requests: int) -> dict[int, list[list]]:
    """Per client count N, N lists (one per client) of ``requests`` prompts: disjoint sets for
    different N (N * requests consecutive prompts each), so a server that learns from what it
    served (draftd's n-gram history) never meets a prompt twice.

    Raises:
        ValueError: fewer prompts than sum(N) * requests.
    """
    need = sum(clients_list) * requests
    if need > len(prompts):
        raise ValueError(f"{need} prompts needed ({sum(clients_list)} clients x {requests} requests) but "
                         f"{len(prompts)} available: lower --requests or add workloads")
    out, k = {}, 0
    for n in clients_list:
        out[n] = [prompts[k + c * requests: k + (c + 1) * requests] for c in range(n)]
        k += n * requests
    return out


def timeline_stats(timelines: list[dict], wall_s: float) -> dict:
    """Aggregate client-side measurements of one load.

    Args:
        timelines: one per request: ``t0`` (send time, s), ``chunks`` (arrival times, s, of the
            streamed chunks that carried text, in order), ``tokens`` (output tokens), ``error``
            (None, or a text when the request failed); optional ``proposed``/``accepted`` draft tokens.
        wall_s: seconds from the first request sent to the last one ended.

    Returns:
        ``tokens_per_s`` (output tokens of successful requests / ``wall_s``); ``ttft_ms``,
        ``itl_ms`` (gaps between consecutive text chunks of a request, pooled), ``tpot_ms``
        ((last chunk - first chunk) / (tokens - 1) per request), each ``{"p50", "p99"}`` in
        milliseconds (None without samples); counts of requests, failures and tokens.
    """
    ok = [t for t in timelines if t.get("error") is None]
    ttft = [t["chunks"][0] - t["t0"] for t in ok if t["chunks"]]
    itl = [b - a for t in ok for a, b in zip(t["chunks"], t["chunks"][1:])]
    tpot = [(t["chunks"][-1] - t["chunks"][0]) / (t["tokens"] - 1) for t in ok if t["chunks"] and t["tokens"] > 1]
    tokens = sum(t["tokens"] for t in ok)
    fails = [t["error"] for t in timelines if t.get("error") is not None]
    return {"requests": len(ok), "failures": len(fails), "failure_examples": fails[:3], "output_tokens": tokens,
            "seconds": round(wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
            "ttft_ms": quantiles(ttft), "itl_ms": quantiles(itl), "tpot_ms": quantiles(tpot),
            "chunks_per_request": round(sum(len(t["chunks"]) for t in ok) / len(ok), 2) if ok else None,
            "proposed_tokens": sum(t.get("proposed") or 0 for t in ok),
            "accepted_tokens": sum(t.get("accepted") or 0 for t in ok)}


def stream_once(oc, model: str, ids: list[int], max_tokens: int, extra_body: dict) -> dict:
    """One streamed greedy completion of prompt ``ids``; its timeline (see :func:`timeline_stats`)."""
    tl = {"t0": time.perf_counter(), "chunks": [], "tokens": 0, "error": None, "proposed": None, "accepted": None}
    usage = last = None
    try:
        for ch in oc.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body=extra_body):
            now = time.perf_counter()
            if ch.choices and ch.choices[0].text:
                tl["chunks"].append(now)
            if getattr(ch, "usage", None) is not None:
                usage = ch.usage
            extra = ch.model_extra or {}
            if "draftd" in extra or "timings" in extra:
                last = extra
        d, tm = (last or {}).get("draftd") or {}, (last or {}).get("timings") or {}
        if usage is not None and usage.completion_tokens is not None:
            tl["tokens"] = int(usage.completion_tokens)
        else:
            tl["tokens"] = int(d.get("output_tokens") or tm.get("predicted_n") or len(tl["chunks"]))
        tl["proposed"] = d.get("proposed_tokens", tm.get("draft_n"))
        tl["accepted"] = d.get("accepted_tokens", tm.get("draft_n_accepted"))
        if "adapter_version" in d:
            tl["adapter_version"] = d["adapter_version"]
            tl["proposer"] = d.get("proposer")
    except Exception as e:  # noqa: BLE001 - counted as a failure
        tl["error"] = repr(e)[:300]
    return tl


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` per key of two counter snapshots (numbers, or dicts of numbers such as
    draftd's fused forwards by sequences); keys missing before count from 0."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, dict):
            out[k] = {kk: vv - (b or {}).get(kk, 0) for kk, vv in v.items() if vv - (b or {}).get(kk, 0)}
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = round(v - (b or 0), 3)
    return out


def server_cost(cpu_s: float | None, counters: dict, output_tokens: int) -> dict:
    """What the server process spent on one load: its CPU seconds (``cpu_s``, see
    ``peers.process_cpu_seconds``) and the decode counters' differences (``counters``, see
    :func:`draftd_counters` / :func:`llama_counters`), each also per output token
    (``cpu_ms_per_token``: CPU milliseconds; ``decode_calls_per_token``, ``rows_per_token``).
    None where a figure is missing or there were no tokens."""
    per = (lambda x: round(x / output_tokens, 4)) if output_tokens else (lambda x: None)  # noqa: E731
    out = {"cpu_s": None if cpu_s is None else round(cpu_s, 3),
           "cpu_ms_per_token": None if cpu_s is None or not output_tokens else round(cpu_s * 1e3 / output_tokens, 3),
           **counters}
    if isinstance(counters.get("decode_calls"), (int, float)):
        out["decode_calls_per_token"] = per(counters["decode_calls"])
    if isinstance(counters.get("decode_rows"), (int, float)):
        out["rows_per_token"] = per(counters["decode_rows"])
    return out


def _get(url: str, timeout: float = 10.0) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def draftd_counters(base: str) -> dict:
    """draftd serve's decode counters (``/draftd/status``'s ``batch``): ``decode_calls`` (fused
    forwards: one ``forward_batch``, i.e. one ``llama_decode``, per engine and step: the target's
    and the draft model's), ``decode_rows`` (tokens fed in them: prefill, verification and draft
    rows), ``decode_ms``, ``by_sequences`` (fused forwards by the sequences in each)."""
    b = json.loads(_get(base + "/draftd/status")).get("batch") or {}
    return {"decode_calls": b.get("fused_forwards", 0), "decode_rows": b.get("rows", 0),
            "decode_ms": b.get("decode_ms", 0.0), "by_sequences": dict(b.get("by_sequences") or {})}


def llama_counters(base: str) -> dict:
    """llama-server's decode counters (``/metrics``, served with ``--metrics``): ``decode_calls``
    (``llamacpp:n_decode_total``: its ``llama_decode`` calls, the speculative draft's own not
    counted), ``slot_decodes`` (sequences over those calls: ``n_busy_slots_per_decode`` x
    calls), ``prompt_tokens`` and ``predicted_tokens`` (so that rows, plain, are their sum)."""
    sys.path.insert(0, str(REPO / "bench"))
    import peers

    v = peers.prometheus_values(_get(base + "/metrics").decode())
    calls = v.get("llamacpp:n_decode_total", 0.0)
    out = {"decode_calls": calls, "slot_decodes": round(v.get("llamacpp:n_busy_slots_per_decode", 0.0) * calls, 1),
           "prompt_tokens": v.get("llamacpp:prompt_tokens_total", 0.0),
           "predicted_tokens": v.get("llamacpp:tokens_predicted_total", 0.0)}
    out["decode_rows"] = out["prompt_tokens"] + out["predicted_tokens"]
    return out


def peer_load(base_url: str, per_client: list[list], max_tokens: int, draftd: bool, warm: list | None = None,
              pid: int | None = None, counters: Callable[[], dict] | None = None) -> dict:
    """Closed-loop load on ``base_url`` (``…/v1``): one thread per client, each streaming its
    prompts one after another; :func:`timeline_stats` of it plus the load average around it.
    ``warm``: ``(workload, ids)`` prompts streamed first, one at a time, with the same
    ``max_tokens``, not measured (a server process's warm-up: the same for every side).
    ``pid``: the server's process, whose CPU seconds over the load (after the warm-up) go into
    ``server`` (:func:`server_cost`) with the differences of ``counters()`` (its decode counts).
    A server that refuses (its ``/models`` or a warm-up request fails) gives ``{"error": reason}``."""
    import openai

    oc0 = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    try:
        model = oc0.models.list().data[0].id
    except Exception as e:  # noqa: BLE001 - a server that refuses is this cell's error, the bench goes on
        return {"error": f"GET {base_url}/models failed: {e!r}"[:1500]}

    def body(w: str) -> dict:
        return {"ignore_eos": True, **({"workload": w} if draftd else {})}

    warm_prompts, warm = warm, stream_once(oc0, model, [1, 2, 3, 4], 4, body("default"))  # first-request allocations, not measured
    if warm["error"]:
        return {"error": f"warm-up request failed: {warm['error']}"}
    for w, ids in warm_prompts or []:
        tl = stream_once(oc0, model, ids, max_tokens, body(w))
        if tl["error"]:
            return {"error": f"warm-up request failed: {tl['error']}"}
    timelines: list[dict] = []
    lock = threading.Lock()

    def client(prompts: list) -> None:
        oc = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        for w, ids in prompts:
            tl = stream_once(oc, model, ids, max_tokens, body(w))
            with lock:
                timelines.append(tl)

    sys.path.insert(0, str(REPO / "bench"))
    import peers

    threads0 = peers.thread_cpu_ticks(pid) if pid is not None else {}

    def snap() -> tuple[float | None, dict]:
        cpu = None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                cpu = peers.process_cpu_seconds(pid)
        c = {}
        if counters is not None:
            try:
                c = counters()
            except Exception as e:  # noqa: BLE001 - the counts are extra; the load still runs
                c = {"counters_error": repr(e)[:200]}
        return cpu, c

    load0 = os.getloadavg()[0]
    cpu0, c0 = snap()
    threads = [threading.Thread(target=client, args=(ps,)) for ps in per_client]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = timeline_stats(timelines, time.perf_counter() - t0)
    cpu1, c1 = snap()
    out["server"] = server_cost(cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None,
                                counter_delta(c0, c1), out["output_tokens"])
    if pid is not None:  # the engine's thread apart from the rest (HTTP, batch members, record writer, ...)
        top = peers.busiest_thread_seconds(threads0, peers.thread_cpu_ticks(pid))
        if top is not None and out["output_tokens"]:
            out["server"]["busiest_thread_cpu_ms_per_token"] = round(top * 1e3 / out["output_tokens"], 3)
    out["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    if draftd:
        out["adapter_versions"] = sorted({str(t.get("adapter_version")) for t in timelines if "adapter_version" in t})
        out["proposers"] = sorted({str(t.get("proposer")) for t in timelines if "adapter_version" in t})
    return out


def cell_line(st: dict) -> str:
    """One cell's progress line: throughput, latency, failures and what the server spent."""
    sv = st.get("server") or {}
    return json.dumps({**{k: st.get(k) for k in ("tokens_per_s", "failures", "ttft_ms", "itl_ms", "error") if k in st},
                       **{k: sv.get(k) for k in ("cpu_ms_per_token", "busiest_thread_cpu_ms_per_token",
                                                 "decode_calls_per_token", "rows_per_token") if k in sv},
                       "loadavg_1m": st.get("loadavg_1m")})


def cost_table(table: dict[int, dict[str, dict]]) -> str:
    """A markdown table of every cell: output tokens/s, ITL p50/p99, the server's CPU ms per output
    token, its llama_decode calls and rows per output token, and the 1-minute load around it."""
    lines = ["| clients | configuration | output tok/s | ITL p50 / p99 ms | server CPU ms/token | its busiest thread's "
             "| decode calls/token | rows/token | failed | load (1 min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, row in table.items():
        for c, st in row.items():
            sv, itl = st.get("server") or {}, st.get("itl_ms") or {}
            la = st.get("loadavg_1m") or []
            lines.append(f"| {n} | {c} | {st.get('tokens_per_s')} | {itl.get('p50')} / {itl.get('p99')} | "
                         f"{sv.get('cpu_ms_per_token')} | {sv.get('busiest_thread_cpu_ms_per_token')} | "
                         f"{sv.get('decode_calls_per_token')} | {sv.get('rows_per_token')} | "
                         f"{st.get('failures', st.get('error'))} | {'-'.join(str(x) for x in la)} |")
    return "\n".join(lines)


def draftd_env(state_dir: Path, redis_url: str, prefix: str, fmt: str, threads: int | None,
               max_batch: int | None) -> dict:
    """Environment for ``daemonctl serve`` in the peer bench: a fresh state directory, a Redis
    key prefix of its own, the weight format pinned (the same file llama-server loads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTD_") or k == "DRAFTD_CACHE_DIR"}
    env.update({"DRAFTD_STATE_DIR": str(state_dir), "DRAFTD_REDIS__URL": redis_url, "DRAFTD_STORE__KEY_PREFIX": prefix,
                "DRAFTD_MODELS__FORMAT": fmt, "DRAFTD_LOG_FORMAT": "json", "DRAFTD_API__ENABLED": "false",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    if threads:
        env["DRAFTD_MODELS__ENGINE_THREADS"] = str(threads)
    if max_batch:
        env["DRAFTD_SERVE__MAX_BATCH"] = str(max_batch)
    return env


def peer_checks(table: dict[int, dict[str, dict]]) -> dict:
    """Issue 35's targets on ``table`` ({clients: {config: stats}}, see :func:`timeline_stats`):
    at 1 client draftd's tokens/s >= every llama-server configuration's; at 4 and 8 clients
    draftd's tokens/s >= llama_plain's and >= the best llama-server speculative configuration's,
    draftd's p99 ITL <= 2x its 1-client p50 ITL, and 0 failed requests (draftd's)."""
    def tps(n, c):
        return ((table.get(n) or {}).get(c) or {}).get("tokens_per_s")

    out = {}
    one = table.get(1) or {}
    d1 = tps(1, "draftd")
    peers1 = {c: tps(1, c) for c in one if c != "draftd" and tps(1, c) is not None}
    if d1 is not None and peers1:
        best = max(peers1, key=peers1.get)
        out["1_client"] = {"draftd_tokens_per_s": d1, "llama_best": best, "llama_best_tokens_per_s": peers1[best],
                           "ratio": round(d1 / peers1[best], 3), "met": d1 >= peers1[best]}
    p50_1 = ((one.get("draftd") or {}).get("itl_ms") or {}).get("p50")
    for n in (4, 8):
        row = table.get(n) or {}
        d = tps(n, "draftd")
        if d is None:
            continue
        plain = tps(n, "llama_plain")
        spec = {c: tps(n, c) for c in row if c not in ("draftd", "llama_plain") and tps(n, c) is not None}
        best = max(spec, key=spec.get) if spec else None
        p99 = ((row.get("draftd") or {}).get("itl_ms") or {}).get("p99")
        fails = (row.get("draftd") or {}).get("failures")
        chk = {"draftd_tokens_per_s": d, "llama_plain_tokens_per_s": plain,
               "vs_plain": round(d / plain, 3) if plain else None, "met_vs_plain": d >= plain if plain else None,
               "llama_best_spec": best, "llama_best_spec_tokens_per_s": spec.get(best),
               "vs_best_spec": round(d / spec[best], 3) if best else None, "met_vs_best_spec": d >= spec[best] if best else None,
               **latency_checks(p99, p50_1, fails)}
        chk["met"] = all_met(chk)
        out[f"{n}_clients"] = chk
    return out


def latency_checks(p99: float | None, p50_1: float | None, fails: int | None) -> dict:
    """Issue 35's latency and failure targets at N clients: draftd's p99 ITL ``p99`` (ms) <= 2x its
    1-client p50 ITL ``p50_1`` (ms), and ``fails`` == 0 failed requests; each ``met_*`` None where
    a figure is missing."""
    return {"draftd_itl_p99_ms": p99, "itl_bound_ms": round(2 * p50_1, 2) if p50_1 is not None else None,
            "met_itl": (p99 <= 2 * p50_1) if p99 is not None and p50_1 is not None else None,
            "draftd_failures": fails, "met_failures": fails == 0 if fails is not None else None}


def all_met(chk: dict) -> bool:
    """Every N-client target of ``chk`` (``met_vs_plain``, ``met_vs_best_spec``, ``met_itl``,
    ``met_failures``) True; a missing figure (None) is not met."""
    return all(chk.get(k) is True for k in ("met_vs_plain", "met_vs_best_spec", "met_itl", "met_failures"))


def _median(xs: list[float], digits: int) -> float | None:
    """The median of ``xs`` rounded, or None without any (e.g. no request with two text chunks)."""
    return round(statistics.median(xs), digits) if xs else None


def paired_ratio(a: list[dict], b: list[dict], confidence: float = 0.95, seed: int = 0) -> dict | None:
    """Side a's tokens/s over side b's, paired per prompt: the geometric mean of the per-prompt
    ratios and a percentile bootstrap interval of it (2000 resamples of the prompts); prompts
    failed on either side are left out. Rows: ``{"tokens", "seconds", "error"}``. None without a pair."""
    import math
    import random

    logs = [math.log((x["tokens"] / x["seconds"]) / (y["tokens"] / y["seconds"]))
            for x, y in zip(a, b) if not x["error"] and not y["error"] and x["seconds"] > 0 and y["seconds"] > 0
            and x["tokens"] and y["tokens"]]
    if not logs:
        return None
    rng = random.Random(seed)
    boots = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(2000))
    lo, hi = boots[int((1 - confidence) / 2 * 2000)], boots[int((1 + confidence) / 2 * 2000) - 1]
    return {"ratio_geomean": round(math.exp(statistics.fmean(logs)), 4),
            f"ci{int(confidence * 100)}": [round(math.exp(lo), 4), round(math.exp(hi), 4)], "pairs": len(logs)}


def paired_one_client(servers: dict[str, tuple[str, bool]], prompts: list, max_tokens: int, warm: list,
                      gap_s: float = 0.5, confidence: float = 0.95, seed: int = 0) -> dict:
    """One client, every server up at once, each prompt streamed to every server in turn (the
    order rotating per prompt): :func:`paired_rounds` with rounds of one prompt."""
    return paired_rounds(servers, [[p] for p in prompts], max_tokens, warm, gap_s, confidence, seed)


def paired_clients(servers: dict[str, tuple[str, bool]], width: int, max_tokens: int,
                   warm: list) -> tuple[Callable[[str, int, str, list[int]], dict], dict[str, str]]:
    """Opens ``width`` openai clients per server of ``servers`` (see :func:`paired_rounds`), reads
    each one's model id and streams it the warm-up (one short request, then ``warm``, one at a time).

    Returns:
        ``(once, failed)``: ``once(name, k, workload, ids)`` streams ``ids`` to server ``name`` on
        its client ``k`` (:func:`stream_once`'s timeline); ``failed`` maps each server that refused
        (its ``/models`` or a warm-up request failed) to the reason; those are left out of the rounds.
    """
    import openai

    ocs: dict[str, list] = {}
    models: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, (url, _) in servers.items():
        ocs[name] = [openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600) for _ in range(width)]
        try:
            models[name] = ocs[name][0].models.list().data[0].id
        except Exception as e:  # noqa: BLE001 - a server that refuses is recorded, the others run
            failed[name] = f"GET {url}/models failed: {e!r}"[:1500]

    def once(name: str, k: int, w: str, ids: list[int]) -> dict:
        return stream_once(ocs[name][k], models[name], ids, max_tokens,
                           {"ignore_eos": True, **({"workload": w} if servers[name][1] else {})})

    for name in models:
        for w, ids in [("default", [1, 2, 3, 4])] + list(warm):
            err = once(name, 0, w, ids)["error"]
            if err:
                failed[name] = f"warm-up request failed: {err}"
                break
    return once, failed


def paired_rounds(servers: dict[str, tuple[str, bool]], rounds: list[list], max_tokens: int, warm: list,
                  gap_s: float = 0.5, confidence: float = 0.95, seed: int = 0) -> dict:
    """Every server up at once; each round's prompts streamed concurrently (one client each) to
    every server in turn (the order rotating per round), so a host whose speed drifts from minute
    to minute (a shared VM) slows every side alike. Per server: each round's aggregate output
    tokens/s (its tokens over the time from sending its first request to its last text chunk,
    prefill included: ``tokens_per_s_median`` is the median over rounds), each request's row
    (``requests``: :func:`request_row`), and the latencies of :func:`paired_summary` (ITL pooled
    over the successful requests' chunk gaps, as :func:`timeline_stats`); per llama-server configuration
    draftd's per-round ratio of tokens/s, its geometric mean and a bootstrap interval of it
    (:func:`paired_ratio`). ``servers``: name -> (``…/v1`` url, whether it is draftd); ``warm``:
    unmeasured prompts streamed to each server first, one at a time; ``gap_s``: seconds of quiet
    before each round (a request sent the moment another server finished paid for that server's
    threads still spinning: 100-150 ms more TTFT for draftd right after llama-server, measured).
    A server that refuses its ``/models`` or a warm-up request is left out, its reason in
    ``failed`` (name -> reason; {} when none did); the others run."""
    from concurrent.futures import ThreadPoolExecutor

    width = max((len(r) for r in rounds), default=1)
    once, failed = paired_clients(servers, width, max_tokens, warm)
    names = [n for n in servers if n not in failed]
    per: dict[str, list[dict]] = {n: [] for n in names}  # one row per round
    reqs: dict[str, list[dict]] = {n: [] for n in names}  # one row per request
    gaps: dict[str, list[float]] = {n: [] for n in names}  # seconds between consecutive text chunks
    load0 = os.getloadavg()[0]
    with ThreadPoolExecutor(max_workers=width) as pool:
        for i, rnd in enumerate(rounds if names else []):
            for name in names[i % len(names):] + names[: i % len(names)]:
                time.sleep(gap_s)  # the last server's threads settle first (llama.cpp's spin after a decode)
                tls = list(pool.map(lambda kp, name=name: once(name, kp[0], *kp[1]), enumerate(rnd)))
                ends = [tl["chunks"][-1] if tl["chunks"] else time.perf_counter() for tl in tls]
                err = next((tl["error"] for tl in tls if tl["error"]), None)
                per[name].append({"tokens": sum(tl["tokens"] for tl in tls), "seconds": max(ends) - min(tl["t0"] for tl in tls),
                                  "error": err})
                for tl, end in zip(tls, ends):
                    reqs[name].append(request_row(i, tl, end))
                    if tl["error"] is None:  # ITL as timeline_stats: successful requests' gaps, pooled
                        gaps[name].extend(b - a for a, b in zip(tl["chunks"], tl["chunks"][1:]))
    out: dict[str, Any] = {"prompts": sum(len(r) for r in rounds), "rounds": len(rounds), "clients": width,
                           "order": "each round's prompts, concurrently, to every server in turn, rotating",
                           "gap_s": gap_s,
                           "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                           "servers": {name: paired_summary(per[name], reqs[name], gaps[name]) for name in names},
                           "failed": failed}
    d = next((n for n in names if servers[n][1]), None)
    for name in names:
        if d is not None and name != d:
            r = paired_ratio(per[d], per[name], confidence, seed)
            if r is not None:
                out[f"draftd_vs_{name}"] = r
    return out


def request_row(round_index: int, tl: dict, end: float) -> dict:
    """One paired request's row from its timeline ``tl`` (:func:`stream_once`) and ``end`` (its
    last text chunk's time, s): round, tokens, seconds (``end - t0``), error, ``ttft_ms``,
    ``tpot_ms`` ((last chunk - first chunk) / (tokens - 1)), ``chunks`` (text chunks streamed),
    ``itl_max_ms`` (its longest gap between consecutive text chunks), draftd's proposer and
    proposed / accepted tokens; the latencies None where it has too few chunks for them."""
    ch = tl["chunks"]
    return {"round": round_index, "tokens": tl["tokens"], "seconds": end - tl["t0"], "error": tl["error"],
            "ttft_ms": 1e3 * (ch[0] - tl["t0"]) if ch else None,
            "proposer": tl.get("proposer"), "proposed": tl.get("proposed"), "accepted": tl.get("accepted"),
            "tpot_ms": 1e3 * (ch[-1] - ch[0]) / max(1, tl["tokens"] - 1) if len(ch) > 1 else None,
            "chunks": len(ch), "itl_max_ms": 1e3 * max(b - a for a, b in zip(ch, ch[1:])) if len(ch) > 1 else None}


def paired_summary(rounds: list[dict], requests: list[dict], itl_gaps: list[float] | None = None) -> dict:
    """One server's paired figures: failed requests, every request's row (:func:`request_row`,
    floats to 4 places), the medians of its rounds' tokens/s and of its requests' TTFT and TPOT,
    and in milliseconds by :func:`pct`'s convention ``ttft_ms`` and ``tpot_ms`` (p50, p99) over
    the successful requests, ``itl_ms`` (p50, p90, p99, max) over ``itl_gaps`` (seconds between
    consecutive text chunks of every successful request, pooled, as :func:`timeline_stats`; kept
    out of the JSON). None without any sample."""
    ok = [r for r in requests if not r["error"] and r["seconds"] > 0]
    okr = [r for r in rounds if not r["error"] and r["seconds"] > 0]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    return {"failures": len(requests) - len(ok),
            "requests": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in requests],
            "tokens_per_s_median": _median([r["tokens"] / r["seconds"] for r in okr], 2),
            "ttft_ms_median": _median(ttft, 2), "tpot_ms_median": _median(tpot, 3),
            "ttft_ms": quantiles(ttft, scale=1), "tpot_ms": quantiles(tpot, scale=1),
            "itl_ms": quantiles(itl_gaps or [], (0.5, 0.9, 0.99), with_max=True)}


PAIRED_RULE = ("met: draftd's paired ratio (geometric mean over rounds) >= 1; interval_above_1: the lower bound "
               "of its bootstrap interval >= 1 as well (met beyond the rounds' spread); the best configuration is "
               "the one draftd's ratio is lowest against")


def paired_runs(files_or_dicts: list) -> dict[int, tuple[str, dict]]:
    """``{clients: (label, paired)}`` from ``--paired`` runs: each item a JSON file's path (the
    bench's output, or ``--out``'s), or its dict, or its ``"paired"`` entry itself.

    Raises:
        ValueError: an item that is not JSON or not a paired run (no ``paired`` entry with ``clients``
            and ``servers``: a sequential run's targets are its own ``checks``), two runs at one
            client count, or runs whose headers name different CPUs (``cpu``: :func:`cpu_name`).
        OSError: a path that cannot be read.
    """
    out: dict[int, tuple[str, dict]] = {}
    cpus: list[tuple[str, str | None]] = []
    for i, x in enumerate(files_or_dicts):
        label = str(x) if isinstance(x, (str, Path)) else f"run {i}"
        try:
            d = json.loads(Path(x).read_text()) if isinstance(x, (str, Path)) else x
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{label}: not JSON ({e}); pass the file serve_bench.py --paired wrote (--out)") from e
        cpu = d.get("cpu") if isinstance(d, dict) else None  # the run's header (peer_header), where recorded
        d = d.get("paired", d) if isinstance(d, dict) else d
        if (not isinstance(d, dict) or isinstance(d.get("clients"), bool) or not isinstance(d.get("clients"), int)
                or not isinstance(d.get("servers"), dict)):
            raise ValueError(f"{label}: not a --paired run (no 'paired' entry with 'clients' and 'servers'); "
                             f"a sequential --peer run's targets are in its own 'checks'")
        n = d["clients"]
        if n in out:
            raise ValueError(f"{label} and {out[n][0]} are both {n}-client runs: pass one file per client count")
        other = next(((lbl, c) for lbl, c in cpus if cpu is not None and c is not None and c != cpu), None)
        if other is not None:
            raise ValueError(f"{label} ran on {cpu!r} and {other[0]} on {other[1]!r}: the ITL bound and the targets "
                             f"compare runs of one host; pass files from one machine")
        cpus.append((label, cpu))
        out[n] = (label, d)
    return out


def paired_vs(paired: dict, peer: str) -> dict:
    """draftd against ``peer`` in one paired run (its ``draftd_vs_<peer>``, :func:`paired_ratio`):
    ``ratio``, ``ci`` (the interval), ``pairs``, ``met`` (ratio >= 1), ``interval_above_1``
    (lower bound >= 1)."""
    r = paired.get(f"draftd_vs_{peer}") or {}
    ci = next((v for k, v in r.items() if k.startswith("ci")), None)
    ratio = r.get("ratio_geomean")
    return {"ratio": ratio, "ci": ci, "pairs": r.get("pairs"), "met": ratio >= 1 if ratio is not None else None,
            "interval_above_1": ci[0] >= 1 if ci else None}


def paired_best(paired: dict, exclude: tuple[str, ...] = ()) -> str | None:
    """The llama-server configuration draftd's paired ratio is lowest against (the fastest peer,
    relative to draftd), leaving out ``exclude``; None without any."""
    ratios = {k[len("draftd_vs_"):]: v["ratio_geomean"] for k, v in paired.items()
              if k.startswith("draftd_vs_") and isinstance(v, dict) and v.get("ratio_geomean") is not None}
    ratios = {k: v for k, v in ratios.items() if k not in exclude}
    return min(ratios, key=ratios.get) if ratios else None


def paired_checks(files_or_dicts: list) -> dict:
    """Issue 35's targets from ``--paired`` runs (:func:`paired_runs`: the 1-client run and the
    N-client ones). Rule (``rule`` in the output): a tokens/s target is ``met`` when draftd's
    paired geometric-mean ratio over rounds is >= 1, and ``*_interval_above_1`` says whether its
    bootstrap interval's lower bound is >= 1 too; the best configuration is the one draftd's
    ratio is lowest against (:func:`paired_best`). ``1_client``: draftd against the best
    llama-server configuration. ``<N>_clients`` (every N > 1 given; issue 35 names 4 and 8):
    against ``llama_plain`` and the best speculative configuration, draftd's p99 ITL <= 2x its
    1-client p50 ITL, its failed requests == 0 (:func:`latency_checks`), ``met`` all four
    (:func:`all_met`). ``left_out``: configurations that failed in that run (not compared).

    Raises:
        ValueError: no 1-client run among them, or :func:`paired_runs`'s errors.
    """
    runs = paired_runs(files_or_dicts)
    if 1 not in runs:
        raise ValueError(f"no 1-client paired run among {[lbl for lbl, _ in runs.values()]}: pass the 1-client file "
                         f"too (the ITL bound is 2x its draftd p50 ITL, and the 1-client target is read from it)")
    out: dict[str, Any] = {"rule": PAIRED_RULE, "sources": {str(n): lbl for n, (lbl, _) in sorted(runs.items())}}
    one = runs[1][1]
    d1 = (one.get("servers") or {}).get("draftd") or {}
    p50_1 = (d1.get("itl_ms") or {}).get("p50")
    best = paired_best(one)
    v = paired_vs(one, best) if best else {}
    out["1_client"] = {"draftd_itl_p50_ms": p50_1, "llama_best": best, "vs_best": v.get("ratio"),
                       "vs_best_ci": v.get("ci"), "vs_best_interval_above_1": v.get("interval_above_1"),
                       "met": v.get("met") is True, "left_out": sorted(one.get("failed") or {})}
    if any("itl_ms" not in ((r.get("servers") or {}).get("draftd") or {"itl_ms": 0}) for _, r in runs.values()):
        out["note"] = "a run without draftd's itl_ms (recorded by --paired since ITL was added): its met_itl is None"
    for n, (_, run) in sorted(runs.items()):
        if n == 1:
            continue
        d = (run.get("servers") or {}).get("draftd")
        if d is None:
            out[f"{n}_clients"] = {"met": False, "why": "no draftd in this run", "left_out": sorted(run.get("failed") or {})}
            continue
        plain, spec = paired_vs(run, "llama_plain"), paired_best(run, exclude=("llama_plain",))
        sv = paired_vs(run, spec) if spec else {}
        chk = {"draftd_tokens_per_s_median": d.get("tokens_per_s_median"),
               "vs_plain": plain["ratio"], "vs_plain_ci": plain["ci"], "vs_plain_interval_above_1": plain["interval_above_1"],
               "met_vs_plain": plain["met"], "llama_best_spec": spec, "vs_best_spec": sv.get("ratio"),
               "vs_best_spec_ci": sv.get("ci"), "vs_best_spec_interval_above_1": sv.get("interval_above_1"),
               "met_vs_best_spec": sv.get("met"),
               **latency_checks((d.get("itl_ms") or {}).get("p99"), p50_1, d.get("failures"))}
        chk["met"] = all_met(chk)
        chk["left_out"] = sorted(run.get("failed") or {})
        out[f"{n}_clients"] = chk
    return out


def ngram_type_list(ngram_types: str) -> list[str] | None:
    """``--ngram-types`` read: None for ``auto``, else the comma-separated names in order, each once.

    Raises:
        ValueError: no name in it (``""``, ``" , "``): a llama_ngram run with no type to run.
    """
    if ngram_types.strip() == "auto":
        return None
    names = list(dict.fromkeys(t.strip() for t in ngram_types.split(",") if t.strip()))
    if not names:
        raise ValueError(f"--ngram-types {ngram_types!r} names no n-gram type: give a comma-separated list of "
                         f"llama-server --spec-type n-gram types (e.g. ngram-simple,ngram-mod), or auto (every "
                         f"one its --help lists), or leave llama_ngram out of --configs")
    return names


def ngram_runs(types: list[str], ngram_types: str) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """The ``llama_<type>`` runs of ``llama_ngram`` and why any named type skips (see :func:`llama_runs`).
    A named type skips where it is not an n-gram type (``ngram-*``; the draft model is ``llama_draft``)
    or this llama-server's --help does not list it, the reason naming the types it does list; ``auto``
    with no n-gram type listed skips ``llama_ngram`` itself.

    Raises:
        ValueError: ``ngram_types`` names no type (:func:`ngram_type_list`).
    """
    listed = [t for t in types if t.startswith("ngram") and t != "ngram-cache"]
    named = ngram_type_list(ngram_types)
    want = listed if named is None else named
    skipped: dict[str, str] = {}
    offer = f"its n-gram types: {', '.join(listed)}" if listed else "it lists no n-gram type"
    if not types:
        skipped["llama_ngram"] = "this llama.cpp's llama-server has no --spec-type"
    elif not listed and named is None:
        skipped["llama_ngram"] = (f"--ngram-types auto: this llama-server's --spec-type lists no n-gram type "
                                  f"(it lists: {', '.join(types)})")
    for t in want:
        if not t.startswith("ngram"):
            skipped[f"llama_{t}"] = (f"--ngram-types {t}: not an n-gram type ({offer}; name those or auto; "
                                     f"the draft model runs as llama_draft)")
        elif t not in types:
            skipped[f"llama_{t}"] = (f"--spec-type {t} is not in this llama-server's --help ({offer}; "
                                     f"name those or auto)")
    return [(f"llama_{t}", {"spec_type": t}) for t in want if f"llama_{t}" not in skipped], skipped


def llama_runs(configs: list[str], types: list[str], ngram_types: str = "auto",
               draft: Path | None = None) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """The llama-server configurations ``--peer`` runs (paired and sequential alike), and why any skips.

    Args:
        configs: the ``--configs`` names; ``llama_plain``, ``llama_ngram`` and ``llama_draft`` count here
            (``draftd`` and unknown names are ignored).
        types: the ``--spec-type`` values this llama-server lists (:func:`peers.spec_types`; [] if none).
        ngram_types: ``auto`` (every ``ngram-*`` type in ``types`` but ``ngram-cache``, which wants a
            cache file) or a comma-separated list of n-gram types (:func:`ngram_runs`).
        draft: the derived draft GGUF (``-md``); ``llama_draft`` runs only where it is a file now.

    Returns:
        ``(runs, skipped)``: ``runs`` is ``[(name, kw)]`` in run order (``llama_plain``, then
        ``llama_<type>`` per n-gram type, then ``llama_draft``), ``kw`` the keyword arguments of
        :func:`peers.server_command` (``spec_type``, ``draft_model``); ``skipped`` maps each
        configuration asked for that does not run to the reason.

    Raises:
        ValueError: ``llama_ngram`` asked for and ``ngram_types`` names no type (``""``).
    """
    runs: list[tuple[str, dict]] = []
    skipped: dict[str, str] = {}
    if "llama_plain" in configs:
        runs.append(("llama_plain", {}))
    if "llama_ngram" in configs:
        ngram, why = ngram_runs(types, ngram_types)
        runs += ngram
        skipped.update(why)
    if "llama_draft" in configs:
        if draft is not None and draft.is_file():
            # -md alone leaves --spec-type at none unless the draft GGUF names a type (this one does not)
            runs.append(("llama_draft", {"draft_model": draft,
                                         "spec_type": "draft-simple" if "draft-simple" in types else None}))
        else:
            skipped["llama_draft"] = (f"no derived draft GGUF cached at {draft} (daemonctl serve "
                                      f"writes it at its first start on llama.cpp)")
    return runs, skipped


def llama_command(binary: Path, target: Path, kw: dict, slots: int, ctx_per_slot: int, threads: int,
                  extra: tuple[str, ...] = ()) -> tuple[list[str], int, str]:
    """One llama-server configuration's command on a free port: ``(cmd, port, shown)``, ``shown``
    the arguments after the binary with the port as ``PORT`` (what ``result["commands"]`` holds).
    ``kw``: from :func:`llama_runs`; ``slots``: ``-np``; the rest as :func:`peers.server_command`."""
    import peers

    port = peers.free_port()
    cmd = peers.server_command(binary, target, port, slots, ctx_per_slot, threads, extra=extra, **kw)
    return cmd, port, " ".join(cmd[1:]).replace(str(port), "PORT")


def paired_servers(stack: contextlib.ExitStack, runs: list[tuple[str, dict]], binary: Path, target: Path,
                   width: int, ctx_per_slot: int, threads: int, logs: Path,
                   commands: dict[str, str]) -> tuple[dict[str, tuple[str, bool]], dict[str, str]]:
    """Starts every llama-server configuration of ``runs`` (:func:`llama_runs`) for ``--paired``,
    ``width`` slots each, kept up until ``stack`` closes; names each command line in ``commands``.

    Returns:
        ``(servers, failed)``: ``servers`` maps name -> (``…/v1`` url, False), as
        :func:`paired_rounds` takes them; ``failed`` maps each configuration that did not come up
        (exited first, or no /health within 300 s: :func:`peers.running_process`) to the reason,
        its log's tail included. The others start all the same.
    """
    import peers

    servers: dict[str, tuple[str, bool]] = {}
    failed: dict[str, str] = {}
    for name, kw in runs:
        cmd, p, shown = llama_command(binary, target, kw, width, ctx_per_slot, threads)
        commands.setdefault(name, shown)
        try:
            url, _ = stack.enter_context(peers.running_process(cmd, p, logs / f"{name}-paired.log", timeout_s=300))
        except RuntimeError as e:
            failed[name] = str(e)
            continue
        servers[name] = (url + "/v1", False)
    return servers, failed


@dataclass
class PeerPlan:
    """What one ``--peer`` run measures, fixed from its arguments before any server starts."""

    clients: list[int]  # --peer-clients, in run order
    threads: int  # engine threads of every server (--threads, else this host's CPUs)
    fmt: str  # --format: the weight format on both sides
    target: Path  # the target GGUF both sides load
    draft: Path  # where the derived draft GGUF lives (llama_draft's -md; serve writes it at its start)
    workloads: list[str]  # --peer-workloads
    per_workload: int  # measured prompts per workload
    cells: dict[int, list[list]]  # per client count, one prompt list per client (cell_prompts)
    warm: list  # (workload, ids) warm-up prompts, --warmup per workload
    configs: list[str]  # --configs
    binary: Path | None  # llama-server; None without a llama_* configuration
    types: list[str]  # its --spec-type values (peers.spec_types)
    logs: Path  # this run's log directory


def peer_plan(a) -> PeerPlan:
    """The :class:`PeerPlan` of the parsed arguments ``a``: the GGUFs, the tokenised prompts split
    into cells and warm-up, llama-server (built once, minutes, where a llama_* configuration is
    asked for) and its speculation types, a fresh log directory.

    Raises:
        ValueError: fewer prompts than the cells need (:func:`cell_prompts`).
    """
    import tempfile

    import peers
    from decoder.models.gguf_export import file_digest16
    from decoder.models.loading import packaged_target, resolve_model_dir
    from decoder.models.packaged import cache_root, packaged_gguf
    from transformers import AutoTokenizer

    clients_list = [int(c) for c in a.peer_clients.split(",")]
    fmt = a.format.strip()
    target = packaged_gguf("smollm2-135m") if fmt.lower() == "packaged" else packaged_target(f"smollm2-135m@{fmt}")
    base = packaged_gguf("smollm2-135m")
    draft = cache_root() / "gguf" / f"{base.stem}-{file_digest16(base)}-layers-0-3.gguf"
    tok = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m"), local_files_only=True)
    workloads = [w.strip() for w in a.peer_workloads.split(",") if w.strip()]
    per_workload = -(-sum(clients_list) * a.requests // len(workloads))
    prompts = peer_prompts(tok, workloads, per_workload + a.warmup)
    # the warm-up prompts: the last a.warmup of each workload, after every measured one
    warm = [p for p in prompts[len(workloads) * per_workload:]] if a.warmup else []
    cells = cell_prompts(prompts[: len(workloads) * per_workload], clients_list, a.requests)
    configs = [c for c in a.configs.split(",") if c]
    llama = any(c.startswith("llama") for c in configs)
    binary = peers.llama_server_binary(peers.say) if llama else None
    types = peers.spec_types(peers.server_help(binary)) if llama else []
    return PeerPlan(clients_list, a.threads or os.cpu_count() or 2, fmt, target, draft, workloads, per_workload,
                    cells, warm, configs, binary, types, Path(tempfile.mkdtemp(prefix="serve_bench_peer.")))


def cpu_name() -> str | None:
    """The CPU as /proc/cpuinfo names it: ``"<model name>, family F model M"`` (a VM's "AMD EPYC" is
    several generations; the family and model tell them apart); None where it cannot be read."""
    from decoder.engines.llamacpp import cpuinfo_fields

    f = cpuinfo_fields()
    if "model name" not in f:
        return None
    return f"{f['model name']}, family {f.get('cpu family', '?')} model {f.get('model', '?')}"


def peer_header(a, plan: PeerPlan) -> dict:
    """The run's JSON before any measurement: host, settings, files, llama-server and its types,
    empty ``skipped`` and ``commands``, where the logs go."""
    import platform

    import peers
    from decoder.workloads import EVAL_RESERVED_PROMPTS

    per_workload = plan.per_workload
    return {"mode": "peer", "host": platform.processor() or platform.machine(), "cpu": cpu_name(), "cpus": os.cpu_count(),
            "threads": plan.threads, "clients": plan.clients, "requests_per_client": a.requests,
            "max_tokens": a.max_tokens, "workloads": plan.workloads, "warmup_per_workload": a.warmup,
            "warmup_note": "every server process streams the same warm-up prompts (--warmup per workload, "
                           "max_tokens each, one at a time, unmeasured) before its first measured cell: "
                           "draftd once (one process), each llama-server process (one per configuration "
                           "and count) once", "greedy": True, "format": plan.fmt,
            "target_gguf": str(plan.target), "llama_cpp_python": peers.pinned_version(),
            "llama_server": str(plan.binary), "llama_spec_types": plan.types or None, "skipped": {}, "commands": {},
            "prompts_per_workload": per_workload,
            "prompts_note": None if per_workload <= EVAL_RESERVED_PROMPTS else
            f"{per_workload} prompts per workload: beyond the first {EVAL_RESERVED_PROMPTS}, which no bootstrap corpus holds",
            "logs": str(plan.logs)}


def draftd_process(a, plan: PeerPlan, result: dict) -> tuple[list[str], dict, int, str]:
    """``daemonctl serve``'s ``(command, environment, port, Redis key prefix)`` for the run: a
    state directory under the logs, a key prefix of its own, ``--draftd-env`` on top; names the
    command in ``result["commands"]`` (and the extra environment in ``result["draftd_env"]``)."""
    import tempfile

    import peers

    prefix = f"bench:peer:{uuid.uuid4().hex[:8]}:"
    state = Path(tempfile.mkdtemp(prefix="draftd-state.", dir=plan.logs))
    port = peers.free_port()
    dcmd = [sys.executable, "-m", "daemon.cli", "serve", "--port", str(port)]
    denv = draftd_env(state, a.redis_url, prefix, plan.fmt, a.threads, a.draftd_max_batch)
    extra_env = dict(kv.split("=", 1) for kv in a.draftd_env or [])
    denv.update(extra_env)
    if extra_env:
        result["draftd_env"] = extra_env
    result["commands"]["draftd"] = " ".join(dcmd) + f"  (DRAFTD_MODELS__FORMAT={plan.fmt}" + \
        (f", DRAFTD_SERVE__MAX_BATCH={a.draftd_max_batch}" if a.draftd_max_batch else ", serve.max_batch default") + ")"
    return dcmd, denv, port, prefix


def drop_keys(redis_url: str, prefix: str) -> None:
    """Delete every Redis key under ``prefix`` (draftd's keys of this run)."""
    import redis as _redis

    r = _redis.Redis.from_url(redis_url)
    for k in r.scan_iter(match=prefix + "*", count=1000):
        r.delete(k)
    r.close()


def run_paired(stack: contextlib.ExitStack, a, plan: PeerPlan, runs: list[tuple[str, dict]], result: dict,
               durl: str | None) -> None:
    """``--paired``: every llama-server of ``runs`` up beside draftd (``durl``, its ``…/v1``; None
    without it), rounds of N concurrent prompts (N: the first client count) to each in turn;
    :func:`paired_rounds`'s output into ``result["paired"]``. A configuration that fails (its server
    exits or never answers /health, or refuses requests) is left out, its reason (with the server
    log's tail where it did not start) in ``result["failed"]``; the others are measured."""
    import peers

    say = peers.say
    width = plan.clients[0]
    servers = {"draftd": (durl, True)} if durl is not None else {}
    llama, failed = paired_servers(stack, runs, plan.binary, plan.target, width, a.ctx_per_slot, plan.threads,
                                   plan.logs, result["commands"])
    servers.update(llama)
    for name, why in failed.items():
        say(f"{name} failed to start, left out: {why}")
    rounds = [list(r) for r in zip(*plan.cells[width])]  # round j: every client's j-th prompt
    say(f"{width} client(s), paired: {len(rounds)} rounds of {width} concurrent prompts, each round to "
        f"{', '.join(servers)} in turn")
    result["paired"] = paired_rounds(servers, rounds, a.max_tokens, plan.warm)
    for name, why in result["paired"]["failed"].items():
        say(f"{name} refused requests, left out: {why}")
    result["failed"] = {**failed, **result["paired"]["failed"]}
    say(json.dumps({k: v for k, v in result["paired"].items() if k != "order"}))


def run_cells(a, plan: PeerPlan, runs: list[tuple[str, dict]], result: dict, table: dict[int, dict[str, dict]],
              draftd: tuple[str, Any] | None, partial: Callable[[], None]) -> None:
    """The sequential cells: per client count, draftd (``draftd``: its base url and Popen; None
    without it) then a fresh llama-server per configuration of ``runs``; each cell's stats into
    ``table[n][name]`` (``{"error": reason}`` where a server did not come up, the reason ending with
    its log's tail, or refused requests: :func:`peer_load`), ``partial()`` after each."""
    import peers

    say = peers.say
    for n in plan.clients:
        if draftd is not None:
            dbase, dproc = draftd
            say(f"{n} client(s): draftd")
            table[n]["draftd"] = peer_load(dbase + "/v1", plan.cells[n], a.max_tokens, draftd=True,
                                           warm=plan.warm if n == plan.clients[0] else None, pid=dproc.pid,
                                           counters=lambda: draftd_counters(dbase))
            say(f"  {cell_line(table[n]['draftd'])}")
            partial()
        for name, kw in runs:
            # --metrics: /metrics's llama_decode counts (what the bench reads, nothing else changes)
            cmd, p, shown = llama_command(plan.binary, plan.target, kw, n, a.ctx_per_slot, plan.threads,
                                          extra=("--metrics",))
            result["commands"].setdefault(name, shown)
            say(f"{n} client(s): {name}")
            try:
                with peers.running_process(cmd, p, plan.logs / f"{name}-{n}.log", timeout_s=300) as (url, proc):
                    table[n][name] = peer_load(url + "/v1", plan.cells[n], a.max_tokens, draftd=False, warm=plan.warm,
                                               pid=proc.pid, counters=lambda url=url: llama_counters(url))
            except RuntimeError as e:  # not up: the reason ends with its log's tail, kept whole
                table[n][name] = {"error": str(e)}
            say(f"  {cell_line(table[n][name])}")
            partial()


def draftd_events(log: Path) -> dict:
    """``{"draftd_engine": ..., "draftd_serve_promoted_cached_v0": ...}`` from draftd serve's JSON log:
    the last such event of each kind, without its level, logger and timestamp."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            ev = json.loads(line)
            if ev.get("event") in ("engine", "serve_promoted_cached_v0"):
                out[f"draftd_{ev['event']}"] = {k: v for k, v in ev.items() if k not in ("level", "logger", "timestamp")}
    return out


def peer_main(a) -> None:
    """``--peer`` (the module docstring): plan the run, start draftd, the llama-server
    configurations (:func:`llama_runs`) paired (:func:`run_paired`) or cell by cell
    (:func:`run_cells`); the JSON on stdout (and into ``--out`` after every cell), the cost table
    on stderr. SIGTERM still stops the servers and deletes draftd's keys."""
    import signal

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "bench"))
    import peers

    plan = peer_plan(a)
    result = peer_header(a, plan)
    table: dict[int, dict[str, dict]] = {n: {} for n in plan.clients}
    measured = [] if a.paired else plan.clients  # the paired run fills no cells
    dcmd, denv, port, prefix = draftd_process(a, plan, result)

    def partial() -> None:  # the JSON so far, after every cell: a run stopped midway keeps what it measured
        if a.out:
            result["results"] = {str(n): table[n] for n in measured}
            Path(a.out).write_text(json.dumps(result, indent=1))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the servers, drops the keys
    with contextlib.ExitStack() as stack:
        draftd = None
        if "draftd" in plan.configs:
            stack.callback(drop_keys, a.redis_url, prefix)
            peers.say(f"starting draftd serve on :{port} (loads the pair; a first start converts and measures)")
            draftd = stack.enter_context(peers.running_process(dcmd, port, plan.logs / "draftd.log", env=denv,
                                                               timeout_s=900))
        # after draftd's start: serve writes the derived draft GGUF then
        runs, skipped = llama_runs(plan.configs, plan.types, a.ngram_types, plan.draft)
        result["skipped"].update(skipped)
        for name, why in skipped.items():
            peers.say(f"skipped {name}: {why}")
        if a.paired:
            run_paired(stack, a, plan, runs, result, draftd[0] + "/v1" if draftd else None)
        else:
            run_cells(a, plan, runs, result, table, draftd, partial)
    if "draftd" in plan.configs:
        result.update(draftd_events(plan.logs / "draftd.log"))
    if a.paired:
        partial()
        print(json.dumps(result, indent=1))
        return
    result["results"] = {str(n): table[n] for n in plan.clients}
    result["summary_tokens_per_s"] = {str(n): {c: v.get("tokens_per_s") for c, v in table[n].items()} for n in plan.clients}
    result["checks"] = peer_checks(table)
    partial()
    peers.say(cost_table(table))
    print(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None, help="per client (default 25; --peer: 2, per client count)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--url", help="a running server with speculation on (…/v1); skips the in-process servers")
    ap.add_argument("--url-off", help="the same server with speculation off (`daemonctl serve --no-spec`)")
    ap.add_argument("--model", default=None, help="model id with --url")
    ap.add_argument("--peer", action="store_true", help="draftd serve against llama-server (module docstring)")
    ap.add_argument("--peer-clients", default="1,2,4,8", help="--peer: concurrent client counts")
    ap.add_argument("--peer-workloads", default="prose,code,math", help="--peer: built-in workloads of the prompts")
    ap.add_argument("--configs", default="draftd,llama_plain,llama_ngram,llama_draft", help="--peer: which sides run")
    ap.add_argument("--ngram-types", default="auto", help="--peer: llama-server --spec-type n-gram types "
                    "(auto: every ngram-* its --help lists but ngram-cache, which wants a cache file)")
    ap.add_argument("--ctx-per-slot", type=int, default=2048, help="--peer: llama-server context per slot, tokens")
    ap.add_argument("--format", default="packaged", help="--peer: weight format on both sides (packaged: the Q4_1 "
                    "file; or a llama.cpp format the packaged file is requantised to, e.g. BF16)")
    ap.add_argument("--out", default=None, help="--peer: also write the JSON here, after every cell (partial runs keep their cells)")
    ap.add_argument("--warmup", type=int, default=0, help="--peer: unmeasured warm-up prompts per workload that "
                    "every server process streams before it is measured (the same for every side)")
    ap.add_argument("--paired", action="store_true", help="--peer: every server up at once, rounds of N concurrent "
                    "prompts (N: the first --peer-clients count) streamed to each in turn (rotating), paired ratios per "
                    "round with a bootstrap interval: robust to a host whose speed drifts; --requests rounds")
    ap.add_argument("--draftd-max-batch", type=int, default=None, help="--peer: serve.max_batch (default: serve's)")
    ap.add_argument("--draftd-env", action="append", default=None, metavar="DRAFTD_X=V",
                    help="--peer: an extra environment variable for draftd serve (repeatable), e.g. "
                    "DRAFTD_SERVE__RECORD_PROMPT=false")
    ap.add_argument("--check-paired", nargs="+", metavar="JSON", default=None,
                    help="check issue 35's targets from --paired runs' JSON files (the 1-client one and the N-client "
                         "ones): prints paired_checks' JSON; runs nothing")
    a = ap.parse_args()
    if a.check_paired:
        try:
            print(json.dumps(paired_checks(a.check_paired), indent=1))
        except (OSError, ValueError) as e:
            ap.error(f"--check-paired: {e}")
        return
    if a.peer:
        try:
            ngram_type_list(a.ngram_types)  # here, not after minutes of building and starting servers
        except ValueError as e:
            ap.error(str(e))
        a.requests = a.requests or 2
        return peer_main(a)
    a.requests = a.requests or 25
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
