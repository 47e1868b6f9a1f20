"""Fault injection against a running daemon (issue 16): poison records, corrupt adapters, a NaN promote.

Starts its own redis-server on a free port and ``daemonctl run`` on the tiny pair (a random 4-layer
Llama with a 64-character tokenizer, saved to a temp dir; draft ``layers:0-1``), then:

1. **poison**: writes 24 good records and 3 that pass the schema but cannot train (a token id of
   1,000,000, an empty prompt, top-k width 4 among 8), then runs a round (``train-now``);
2. **corrupt adapters**: registers copies of the trained adapter with truncated weights, without
   weights, and with NaN weights, and tries to promote each through the API;
3. **NaN promote**: tries to promote the NaN copy again (refused), then makes it active behind the
   API's back (as ``adapters promote`` could before issue 16) and writes 24 more records: that round
   must fail acking nothing; after a rollback the next round trains on them;
4. **rollback onto a corrupt version**: truncates the version below the active one and rolls
   back: it is skipped, and the response says why; a last round trains on 24 more records.

Prints one JSON object: ``records_written``, ``records_trained`` (trained on, not held out),
``records_heldout``, ``dead_lettered``, ``pending`` (the trainer group's, must be 0),
``failed_rounds`` (decision error or non_finite: 1, the forced NaN-active round, which acks
nothing), ``non_finite_rounds`` (0), ``bad_promotions_tried``,
``bad_promotions_refused``, and the rounds' decisions.

    .venv/bin/python bench/faults.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "decoder"), str(REPO / "tests" / "trainer")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(fn, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")


class Api:
    def __init__(self, port: int, token_file: Path):
        self.base = f"http://127.0.0.1:{port}"
        self.token_file = token_file

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 600) -> tuple[int, dict]:
        req = urllib.request.Request(self.base + path, method=method, data=None if body is None else json.dumps(body).encode())
        req.add_header("Content-Type", "application/json")
        if method != "GET":
            req.add_header("Authorization", f"Bearer {self.token_file.read_text().strip()}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


def tiny_pair_dir(out: Path) -> Path:
    from tiny import char_tokenizer, tiny_target

    d = out / "tiny-target"
    tiny_target().save_pretrained(d)
    char_tokenizer().save_pretrained(d)
    return d


def samples(pair, fp, n: int, seed: int, workload: str = "prose"):
    from tiny_pair import make_samples

    out = make_samples(pair.target, n, workload, seed=seed, k=8)
    return [dataclasses.replace(s, pair=fp, record_id=f"{workload}-{seed}-{i}", request_id=f"{workload}-{seed}-{i}")
            for i, s in enumerate(out)]


def poisons(good):
    import numpy as np

    big = dataclasses.replace(good[0], record_id="poison-id", request_id="poison-id")
    big.output_ids = big.output_ids.copy()
    big.output_ids[3] = 1_000_000
    empty = dataclasses.replace(good[1], record_id="poison-empty", request_id="poison-empty", prompt_ids=np.zeros(0, np.int32))
    narrow = dataclasses.replace(good[2], record_id="poison-width", request_id="poison-width",
                                 topk_ids=good[2].topk_ids[:, :4], topk_probs=good[2].topk_probs[:, :4])
    return [big, empty, narrow]


def bad_copies(registry, src_version: int, work: Path) -> dict[str, int]:
    """Register copies of a good adapter, then break them: truncated, missing and NaN weights."""
    import torch
    from safetensors.torch import load_file, save_file

    from store.registry import AdapterMeta

    src = registry.fetch(src_version)
    out = {}
    for kind in ("truncated", "missing", "nan"):
        d = work / f"copy-{kind}"
        shutil.copytree(src, d)
        w = d / "adapter_model.safetensors"
        if kind == "nan":
            save_file({k: torch.full_like(t, float("nan")) for k, t in load_file(str(w)).items()}, str(w))
        v = registry.register(d, AdapterMeta(samples_trained=1, scope=""))
        w = registry.artifact_dir / f"v{v}" / "adapter_model.safetensors"
        if kind == "truncated":
            w.write_bytes(w.read_bytes()[:-100])
        elif kind == "missing":
            w.unlink()
        out[kind] = v
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (daemon log, state)")
    args = ap.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    import torch

    torch.set_num_threads(1)
    from decoder.models.loading import load_pair
    from store.buffer import SampleWriter, dead_letter_count, group_info
    from store.client import connect
    from store.config import StoreConfig
    from store.registry import AdapterRegistry
    from store.schema import PairFingerprint

    work = Path(tempfile.mkdtemp(prefix="draftd-faults-"))
    procs: list[subprocess.Popen] = []
    try:
        rport, aport = free_port(), free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(work)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"redis://127.0.0.1:{rport}/0"
        client = wait_for(lambda: connect(url), 10, "redis-server")
        target = tiny_pair_dir(work)
        pair = load_pair(str(target), "layers:0-1")
        fp = PairFingerprint(pair.target_name, pair.draft_name, pair.tokenizer_hash)
        state = work / "state"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTD_")}
        env.update(DRAFTD_STATE_DIR=str(state), DRAFTD_REDIS__URL=url, DRAFTD_API__PORT=str(aport),
                   DRAFTD_LOG_FORMAT="json", DRAFTD_MODELS__TARGET=str(target), DRAFTD_MODELS__DRAFT="layers:0-1",
                   DRAFTD_MODELS__TORCH_THREADS="1", DRAFTD_TRAINER__START_PAUSED="true",
                   DRAFTD_TRAINER__MIN_EVAL_SAMPLES="2", DRAFTD_TRAINER__MAX_STEPS="8", DRAFTD_TRAINER__BATCH_SIZE="8",
                   DRAFTD_TRAINER__LR="3e-3", DRAFTD_TRAINER__SHUTDOWN_GRACE_S="5")
        log = open(work / "daemon.log", "w")
        procs.append(subprocess.Popen([str(Path(sys.executable).with_name("daemonctl")), "run"], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
        api = Api(aport, state / "api-token")
        wait_for(lambda: api.call("GET", "/v1/status")[1].get("trainer", {}).get("enabled"), 180, "daemonctl run")
        say(f"daemon up (redis {url}, api {api.base}, state {state})")

        cfg = StoreConfig()
        registry = AdapterRegistry(client, state / "adapters", cfg)
        written, reports = 0, []

        def write(recs) -> None:
            nonlocal written
            with SampleWriter(client, cfg) as w:
                for s in recs:
                    w.submit(s)
                w.flush(10)
                written += w.stats().written

        def round_() -> dict:
            code, r = api.call("POST", "/v1/train-now?wait=true")
            rep = r.get("report") or {"decision": "error", "reason": r.get("detail")}
            reports.append(rep)
            say(f"round: {rep['decision']} trained_on={rep.get('trained_on')} dead_lettered={rep.get('dead_lettered')} "
                f"acked={rep.get('acked')} ({(rep.get('reason') or '')[:100]})")
            return rep

        # 1. poison
        good = samples(pair, fp, 24, seed=1)
        write(good[:12] + poisons(good) + good[12:])
        round_()

        # 2. corrupt adapters
        versions = [a["version"] for a in api.call("GET", "/v1/adapters")[1]]
        if not versions:
            raise RuntimeError("the poison round registered no adapter; see the daemon log")
        bad = bad_copies(registry, versions[0], work)
        tried = refused = 0
        for kind, v in bad.items():
            code, r = api.call("POST", f"/v1/adapters/{v}/promote", {"reason": f"fault: {kind}"})
            tried += 1
            refused += code == 409
            say(f"promote v{v} ({kind}): {code} {r.get('detail', r)}"[:220])

        # 3. NaN promote: refused; then forced active behind the API's back (as main allowed before
        # issue 16): the round must fail without acking, and after a rollback train on those records.
        code, r = api.call("POST", f"/v1/adapters/{bad['nan']}/promote", {"reason": "fault: nan again"})
        tried += 1
        refused += code == 409
        client.set(cfg.keys.active, bad["nan"])
        write(samples(pair, fp, 24, seed=2, workload="code"))
        forced = round_()
        pending_after_forced = next((g.pending + (g.lag or 0) for g in group_info(client, cfg) if g.name == "trainer"), None)
        code, r = api.call("POST", "/v1/rollback", {"reason": "fault: NaN adapter active"})
        say(f"rollback: {code} {r}"[:220])
        after_nan = round_()
        # 4. rollback onto a version corrupted after its promotion: skipped, and said so
        st = api.call("GET", "/v1/status")[1]["adapter"]
        skipped = {}
        stack = [int(v) for v in client.lrange(cfg.keys.active_stack, 0, -1)]
        below = [v for v in stack if v != st["active"]]
        if st["active"] and below:
            w = registry.artifact_dir / f"v{below[-1]}" / "adapter_model.safetensors"
            w.write_bytes(w.read_bytes()[:-64])
            code, r = api.call("POST", "/v1/rollback", {"reason": "fault: rollback onto a corrupt version"})
            skipped = r.get("skipped", {})
            say(f"rollback: {code} {r}"[:300])
        write(samples(pair, fp, 24, seed=3))
        round_()

        st = api.call("GET", "/v1/status")[1]
        groups = {g.name: g for g in group_info(client, cfg)}
        result = {
            "records_written": written,
            "records_trained": sum(r.get("trained_on") or 0 for r in reports),
            "records_heldout": sum(r.get("heldout_added") or 0 for r in reports),
            "records_acked": sum(r.get("acked") or 0 for r in reports),
            "dead_lettered": dead_letter_count(client, cfg),
            "pending": groups["trainer"].pending if "trainer" in groups else None,
            "failed_rounds": sum(r["decision"] in ("error", "non_finite") for r in reports),
            "non_finite_rounds": sum(r["decision"] == "non_finite" for r in reports),
            "rounds": [r["decision"] for r in reports],
            "forced_nan_active_round": {"decision": forced["decision"], "acked": forced.get("acked", 0),
                                        "records_waiting_after": pending_after_forced,
                                        "next_round_after_rollback": after_nan["decision"]},
            "rollback_skipped": skipped,
            "bad_promotions_tried": tried,
            "bad_promotions_refused": refused,
            "active_adapter": st["adapter"]["active"],
        }
        print(json.dumps(result, indent=None if args.json else 2))
        # the one failed round is the forced one (a NaN adapter active), which must ack nothing
        ok = (result["pending"] == 0 and result["failed_rounds"] == 1 and forced["decision"] == "error"
              and not forced.get("acked") and result["non_finite_rounds"] == 0 and refused == tried and skipped)
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
