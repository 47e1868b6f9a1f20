"""What the prompt cache saves a chat request's time to first token, paired per prompt, on a
running ``daemonctl serve``; prints one JSON object.

For each of ``--pairs`` never-repeated prose prompts (chat, the model's template: every request
shares its system prompt), the same request twice back to back, streamed, ``max_tokens`` 8:
first with ``cache_prompt`` true (it can keep only what the request before it left: another
prompt, so the shared template prefix), then false (the whole prompt prefilled). Per side the
median TTFT (ms, first content chunk), the tokens ``usage.prompt_tokens_details.cached_tokens``
reports, and the paired mean saving (false - true) with a bootstrap 95 % interval. Run it alone
on the cores.

Usage::

    DRAFTD_MODELS__FORMAT=packaged .venv/bin/daemonctl serve --no-spec --port 8313 &
    .venv/bin/python bench/prompt_cache_bench.py --url http://127.0.0.1:8313/v1 --pairs 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import openai

    from decoder.workloads import get_workload

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the server's /v1 base URL")
    ap.add_argument("--pairs", type=int, default=16)
    a = ap.parse_args(argv)
    ps = get_workload("prose", a.pairs + 42)[40:]  # past the first 40 (the demo's evaluation keeps some back)
    oc = openai.OpenAI(base_url=a.url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), max_retries=0, timeout=600)
    model = oc.models.list().data[0].id

    def one(p, cache: bool):
        t0, ttft, usage = time.perf_counter(), None, None
        for ch in oc.chat.completions.create(model=model, messages=[{"role": "user", "content": p.text}], max_tokens=8,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "cache_prompt": cache}):
            if ttft is None and ch.choices and ch.choices[0].delta.content:
                ttft = (time.perf_counter() - t0) * 1e3
            usage = ch.usage or usage
        details = usage.prompt_tokens_details if usage is not None else None
        return ttft, usage.prompt_tokens if usage is not None else None, getattr(details, "cached_tokens", None)

    one(ps[0], True)
    one(ps[1], False)  # warm-up, not measured
    rows = [{c: one(p, c) for c in (True, False)} for p in ps[2: 2 + a.pairs]]
    d = [r[False][0] - r[True][0] for r in rows]
    rng = random.Random(0)
    boot = sorted(statistics.mean(rng.choice(d) for _ in d) for _ in range(4000))
    print(json.dumps({"pairs": len(rows), "ttft_ms_median": {"cache": round(statistics.median(r[True][0] for r in rows), 1),
                                                             "no_cache": round(statistics.median(r[False][0] for r in rows), 1)},
                      "saving_ms": {"mean": round(statistics.mean(d), 1), "low": round(boot[100], 1), "high": round(boot[3899], 1)},
                      "cached_tokens": {"cache": sorted({r[True][2] for r in rows}), "no_cache": sorted({r[False][2] for r in rows})},
                      "prompt_tokens_median": statistics.median(r[True][1] for r in rows),
                      "loadavg_1m": round(os.getloadavg()[0], 2)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
