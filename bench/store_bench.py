"""Benchmark of the verified-sample buffer on a real Redis; prints one JSON object.

Records are realistic: γ = 4, 128 new tokens, top-32 target distributions, ~200-token prompt.

Measured (one process):
- ``encode_records_per_s``: ``store.schema.encode`` alone, one thread.
- ``write_records_per_s``: N ``SampleWriter.submit`` calls, then ``flush``; N / wall time
  from the first submit until Redis acknowledged the last XADD (encode + pipeline + server).
- ``submit_us_mean`` / ``submit_us_p99``: cost of one ``submit()`` on the caller's thread,
  which is all the decoder pays inline.
- ``writer_us_per_record``: wall time per record of the whole write path (1e6 / write rate);
  an upper bound on the CPU the writer thread can take from the decoder per record (GIL).
- ``overhead_pct_submit`` and ``overhead_pct_upper_bound``: those two costs relative to one
  decode of ``--decode-ms`` (default 8000 ms: 128 tokens at ~16 tok/s). Target <= 2 %.
- ``read_decode_records_per_s``: ``SampleReader.read`` (XREADGROUP + decode + dedupe check)
  plus ``ack``, until all N are consumed.
- ``bytes_per_record``: encoded field bytes; ``redis_bytes_per_record``: MEMORY USAGE of the
  stream / N.

Run twice in one process, side by side: records as the decoder writes them by default (schema 1,
top-k only: ``without_hidden``) and records that also carry the target's hidden states
(``DecoderConfig.record_hidden``, schema 2: ``with_hidden``, H = ``--hidden-size``, 576 for
SmolLM2-135M, float16), ``--n-hidden`` of them; ``hidden_growth`` gives the ratios (bytes per
record, write and read rates).

Usage: ``.venv/bin/python bench/store_bench.py [--url redis://127.0.0.1:6379/0] [--n 5000] [--hidden-size 576]``.
Keys live under a unique ``bench:store:<hex>:`` prefix and are deleted at the end.

Side by side (issue 36): ``--url`` may be given several times (``redis+cluster://host:port,...``
for a Redis Cluster), and ``--local-cluster`` also starts a 3-master, 3-replica Redis Cluster of
redis-server processes on free loopback ports (tests/store/store_helpers.LocalCluster), measures
it and stops it; the JSON then holds one object per target under ``targets``, keyed by URL
(password masked).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
import uuid

import numpy as np

from store.buffer import SampleReader, SampleWriter
from store.synthetic import synthetic_sample
from store.client import connect, mask_url
from store.config import BufferConfig, StoreConfig, resolve_config
from store.schema import PairFingerprint, SamplingSettings, VerifiedSample, encode

PAIR = PairFingerprint("google/gemma-3-4b-it", "google/gemma-3-270m-it", "bench-tokenizer")


def realistic_sample(rng: np.random.Generator, n_tokens: int = 128, k: int = 32, prompt_len: int = 200, gamma: int = 4,
                     hidden_size: int = 0) -> VerifiedSample:
    now = time.time()
    return synthetic_sample(rng, n_tokens, k, prompt_len, gamma, hidden_size=hidden_size,
                            request_id=uuid.uuid4().hex, workload="chat",
                            adapter_version=3, pair=PAIR, sampling=SamplingSettings(temperature=0.0),
                            started_at=now - 8.0, finished_at=now)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", help="Redis URL (repeatable); default redis://127.0.0.1:6379/0")
    ap.add_argument("--local-cluster", action="store_true",
                    help="also start a local 3-master, 3-replica Redis Cluster and measure it (redis-server on PATH)")
    ap.add_argument("--n", type=int, default=5000, help="records to write and read")
    ap.add_argument("--decode-ms", type=float, default=8000.0, help="latency of one decode to compare against, ms")
    ap.add_argument("--hidden-size", type=int, default=576, help="H of the records with hidden states (0: skip that run)")
    ap.add_argument("--n-hidden", type=int, default=1000, help="records with hidden states to write and read")
    args = ap.parse_args()
    if args.n < 1 or args.n_hidden < 1 or args.hidden_size < 0:
        ap.error(f"--n {args.n} and --n-hidden {args.n_hidden} must be >= 1, --hidden-size {args.hidden_size} >= 0")
    urls = args.url or ["redis://127.0.0.1:6379/0"]
    cluster = None
    if args.local_cluster:
        import sys
        import tempfile
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "store"))
        from store_helpers import LocalCluster

        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="draftd-bench-cluster-")), masters=3, replicas=1)
        cluster.start()
        urls.append(cluster.url)
    try:
        out = {mask_url(u): runs_for(args, u) for u in urls}
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps(next(iter(out.values())) if len(out) == 1 else {"targets": out}, indent=2))


def runs_for(args, url: str) -> dict:
    args = argparse.Namespace(**{**vars(args), "url": url})
    runs = {"without_hidden": measure(args, args.n, 0)}
    if args.hidden_size:
        runs["with_hidden"] = measure(args, args.n_hidden, args.hidden_size)
        a, b = runs["without_hidden"], runs["with_hidden"]
        runs["hidden_growth"] = {k: round(b[k] / a[k], 2) if a[k] else None for k in
                                 ("bytes_per_record", "redis_bytes_per_record", "write_records_per_s",
                                  "read_decode_records_per_s", "overhead_pct_upper_bound")}
    return runs


def measure(args, n: int, hidden_size: int) -> dict:
    rng = np.random.default_rng(0)
    base = [realistic_sample(rng, hidden_size=hidden_size) for _ in range(64)]
    # distinct record ids (the reader dedupes on them); arrays shared, not copied
    samples = [dataclasses.replace(base[i % 64], record_id=uuid.uuid4().hex) for i in range(n)]

    t = time.perf_counter()
    enc = [encode(s) for s in samples[:2000]]
    encode_rate = len(enc) / (time.perf_counter() - t)
    bytes_per_record = float(np.mean([sum(len(k) + len(v) for k, v in f.items()) for f in enc]))

    client = connect(args.url)
    prefix = f"bench:store:{uuid.uuid4().hex[:8]}:"
    cfg = StoreConfig(key_prefix=prefix, buffer=BufferConfig(maxlen=max(n, 1000), max_bytes=None,
                                                             queue_size=max(n, 10_000)))
    try:
        key = resolve_config(cfg, client).keys.stream
        w = SampleWriter(client, cfg)
        lat = np.empty(n, dtype=np.int64)
        t0 = time.perf_counter()
        for i, s in enumerate(samples):
            a = time.perf_counter_ns()
            w.submit(s)
            lat[i] = time.perf_counter_ns() - a
        submit_done = time.perf_counter()
        flushed = w.flush(120)
        write_s = time.perf_counter() - t0
        st = w.close()
        write_rate = st.written / write_s
        if hasattr(client, "get_node_from_key"):  # a cluster: ask the node holding the stream
            redis_bytes = client.execute_command("MEMORY USAGE", key, "SAMPLES", 0,
                                                 target_nodes=client.get_node_from_key(key)) or 0
        else:
            redis_bytes = client.memory_usage(key, samples=0) or 0

        r = SampleReader(client, cfg, "bench", "c1", expected_fingerprint=PAIR)
        got = 0
        t = time.perf_counter()
        while got < st.written:
            batch = r.read(count=500)
            if not batch:
                break
            r.ack(batch)
            got += len(batch)
        read_rate = got / (time.perf_counter() - t)

        submit_us_mean = float(lat.mean() / 1e3)
        writer_us = 1e6 / write_rate
        decode_us = args.decode_ms * 1e3
        out = {
            "records": n,
            "record": {"gamma": 4, "new_tokens": 128, "top_k": 32, "prompt_tokens": 200, "hidden_size": hidden_size,
                       "schema_version": samples[0].schema_version},
            "encode_records_per_s": round(encode_rate),
            "write_records_per_s": round(write_rate),
            "write_all_flushed": flushed,
            "submit_loop_records_per_s": round(n / (submit_done - t0)),
            "submit_us_mean": round(submit_us_mean, 2),
            "submit_us_p99": round(float(np.percentile(lat, 99) / 1e3), 2),
            "submit_us_max": round(float(lat.max() / 1e3), 1),  # includes waiting for the GIL
            "writer_us_per_record": round(writer_us, 1),
            "decode_ms": args.decode_ms,
            "overhead_pct_submit": float(f"{submit_us_mean / decode_us * 100:.3g}"),
            "overhead_pct_upper_bound": float(f"{(submit_us_mean + writer_us) / decode_us * 100:.3g}"),
            "read_decode_records_per_s": round(read_rate),
            "read_records": got,
            "bytes_per_record": round(bytes_per_record),
            "redis_bytes_per_record": round(redis_bytes / max(st.written, 1)),
            "writer_stats": st.as_dict(),
            "targets": {"write_records_per_s": ">= 5000", "overhead_pct": "<= 2"},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "redis": client.info("server")["redis_version"]},
        }
    finally:
        for k in client.scan_iter(match=f"{prefix}*".encode(), count=1000):
            client.delete(k)
        client.close()
    return out


if __name__ == "__main__":
    main()
