"""Adapter hot-swap on real tiny models, real peft adapters and a real registry on Redis."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest
import torch
from structlog.testing import capture_logs

from adapt_helpers import fixing_lora, random_lora, save_lora
from decoder.adapters import AdapterManager, IncompatibleAdapterError, check_compatible
from decoder.speculative import DecodeRequest, FixedGamma, SpeculativeDecoder
from tiny import reference_greedy, tiny_llama

PROMPTS = ["the cat sat on", "def f(x): return", "what is 3+4?"]
N_NEW = 10


def _req(tok, prompt: str, workload: str = "default") -> DecodeRequest:
    return DecodeRequest(tok(prompt)["input_ids"], max_new_tokens=N_NEW, ignore_eos=True, workload=workload)


def test_check_compatible_rejects_what_does_not_fit(tmp_path, pair):
    _, draft, noise = pair
    good = fixing_lora(draft, noise, tmp_path / "good")
    assert check_compatible(draft, good)["r"] == 2
    wider = tiny_llama(3, layers=1, hidden=64)  # same module names, other shapes
    with pytest.raises(IncompatibleAdapterError, match="shape"):
        check_compatible(wider, good)
    deeper = random_lora(tiny_llama(4, layers=2, hidden=48), tmp_path / "deep", 1.0, 0,
                         modules=("model.layers.1.mlp.down_proj",))
    with pytest.raises(IncompatibleAdapterError, match="no module named"):
        check_compatible(draft, deeper)
    nan = save_lora(draft, tmp_path / "nan", {n: (u * float("nan"), v) for n, (u, v) in noise.items()}, r=2)
    with pytest.raises(IncompatibleAdapterError, match="non-finite"):
        check_compatible(draft, nan)
    with pytest.raises(IncompatibleAdapterError, match="r=2"):
        check_compatible(draft, good, max_rank=1)


@pytest.mark.parametrize("edit, needle", [
    ({"lora_alpha": "8"}, "lora_alpha='8'"), ({"lora_alpha": float("nan")}, "lora_alpha=nan"),
    ({"lora_alpha": True}, "lora_alpha=True"), ({"alpha_pattern": {"o_proj": "2"}}, "alpha_pattern['o_proj']"),
    ({"rank_pattern": {"o_proj": 2.5}}, "rank_pattern['o_proj']=2.5"),
])
def test_check_compatible_refuses_a_config_peft_would_half_load(tmp_path, pair, edit, needle):
    """peft's load_adapter computes alpha / r per layer: a string alpha raised a TypeError
    half-way, leaving the version's layers in the draft for good (delete_adapter: "does not exist")."""
    import json

    _, draft, noise = pair
    d = fixing_lora(draft, noise, tmp_path / "a")
    cfg = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(IncompatibleAdapterError, match=re.escape(needle)):
        check_compatible(draft, d)


def test_hot_swap_under_concurrent_requests(tok, pair, reg, tmp_path):
    """Several threads decode while versions are promoted over and over: no request fails, each
    result names the version that drafted it (its accepted-prefix signature is that version's),
    the versions match the hook's own boundary log, and greedy output equals plain decoding."""
    target, draft, noise = pair
    versions = [
        reg.register(fixing_lora(draft, noise, tmp_path / "fix")),
        reg.register(fixing_lora(draft, {n: x for n, x in noise.items() if "o_proj" in n}, tmp_path / "half")),
        reg.register(random_lora(draft, tmp_path / "r1", scale=2.0, seed=1)),
    ]
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry, poll_interval_s=0.05)
    ref = {p: reference_greedy(target, tok(p)["input_ids"], N_NEW) for p in PROMPTS}

    # Each version's signature (accepted prefix lengths per prompt, γ = 3), decoded alone.
    sig = {}
    for v in [0] + versions:
        if v:
            reg.registry.promote(v, "signature")
            mgr.poll_once()
        sig[v] = tuple(tuple(dec.generate(_req(tok, p), FixedGamma(3)).accepted_prefix_lengths) for p in PROMPTS)
        assert dec.adapter_version == v
    assert len(set(sig.values())) == len(sig), f"versions must draft differently to be told apart: {sig}"
    swaps_before, boundaries_before = len(mgr.swaps), len(mgr.boundary_log)

    results, errors = [], []
    stop = threading.Event()

    def worker(i: int):
        try:
            for j in range(6):
                p = PROMPTS[(i + j) % len(PROMPTS)]
                results.append((p, dec.generate(_req(tok, p), FixedGamma(3))))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def promoter():
        k = 0
        while not stop.is_set():
            v = versions[k % len(versions)]
            if reg.registry.active_version() != v:
                reg.registry.promote(v, f"churn {k}")
            k += 1
            stop.wait(0.03)

    with mgr:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        pt = threading.Thread(target=promoter)
        pt.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        stop.set()
        pt.join(10)

    assert errors == []
    assert len(results) == 18
    for p, r in results:
        assert r.output_ids == ref[p]
        assert tuple(r.accepted_prefix_lengths) == sig[r.adapter_version][PROMPTS.index(p)], (
            f"request tagged v{r.adapter_version} drafted like another version"
        )
    boundary_versions = list(mgr.boundary_log)[boundaries_before:]
    assert Counter(r.adapter_version for _, r in results) == Counter(boundary_versions)
    st = mgr.status()
    assert st["failures"] == 0 and st["swaps"] > swaps_before
    assert len(set(boundary_versions)) >= 2, "no swap happened while requests were running"
    assert st["pause_ms"]["count"] == st["swaps"] and st["pause_ms"]["max"] < 1000
    assert st["learnt_via"] in ("event", "poll")


def test_corrupt_or_incompatible_adapter_never_fails_a_request(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    good = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    corrupt = reg.register(random_lora(draft, tmp_path / "r1", scale=2.0, seed=1))
    wrong = reg.register(random_lora(tiny_llama(3, layers=1, hidden=64), tmp_path / "w", 1.0, 0))
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry)
    reg.registry.promote(good, "ok")
    mgr.poll_once()
    assert dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version == good

    w = reg.registry.artifact_dir / f"v{corrupt}" / "adapter_model.safetensors"
    with capture_logs() as logs:
        for bad, kind in ((corrupt, "integrity"), (wrong, "incompatible")):
            reg.registry.promote(bad, "bad")  # the registry checks artifacts at promotion (issue 16) ...
            if bad == corrupt:  # ... so the file is corrupted after it: the decoder must refuse it too
                w.write_bytes(w.read_bytes()[:-8] + b"\0" * 8)  # a flipped tail: sha256 differs
            mgr.poll_once()
            r = dec.generate(_req(tok, PROMPTS[1]), FixedGamma(3))
            assert r.adapter_version == good and r.counts.acceptance_rate == 1.0
            assert mgr.failures[-1].version == bad and mgr.failures[-1].kind == kind
    assert "sha256" in mgr.failures[0].reason and "shape" in mgr.failures[1].reason
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["adapter_load_failed"] * 2
    st = mgr.status()
    assert st["failures"] == 2 and st["active_version"] == good and st["last_failure"]["kind"] == "incompatible"
    # the poll loop does not retry a failed version (it would fail again)
    with mgr:
        time.sleep(0.4)
        assert mgr.status()["failures"] == 2 and mgr.status()["watching"]


def test_swap_pause_is_measured_and_rollback_to_base_and_previous(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    v2 = reg.register(random_lora(draft, tmp_path / "r1", scale=2.0, seed=1))
    dec = SpeculativeDecoder(target, draft, tok)
    base_logits = draft(torch.tensor([[5, 6, 7]])).logits
    mgr = AdapterManager(dec, reg.registry, keep_loaded=2)
    seen = []
    for step in (v1, v2, "rollback", "rollback"):
        if step == "rollback":
            reg.registry.rollback("test")
        else:
            reg.registry.promote(step, "test")
        mgr.poll_once()
        seen.append(dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version)
    assert seen == [v1, v2, v1, 0]
    assert torch.equal(draft(torch.tensor([[5, 6, 7]])).logits, base_logits)  # version 0 = the base draft, exactly
    pauses = mgr.pause_ms
    assert len(pauses) == 4 and all(0 < p < 1000 for p in pauses)
    assert [(s.from_version, s.to_version) for s in mgr.swaps] == [(0, v1), (v1, v2), (v2, v1), (v1, 0)]
    assert mgr.status()["pause_ms"]["p99"] is not None


def test_learns_a_promotion_from_the_event_channel(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"))
    dec = SpeculativeDecoder(target, draft, tok)
    with AdapterManager(dec, reg.registry, poll_interval_s=30.0) as mgr:  # polling too slow to matter
        time.sleep(0.3)  # the watcher is subscribed and blocked on get_message
        reg.registry.promote(v1, "event")
        assert mgr.wait_prepared(v1, timeout=10)
        assert mgr.status()["learnt_via"] == "event"
        assert dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version == v1


def test_each_workload_is_drafted_by_its_own_adapter_and_others_by_the_shared_one(tok, pair, reg, tmp_path):
    """Per-workload adapters: a "code" scope version serves code requests, the shared version
    serves every other workload (and idle boundaries), interleaved request by request; each
    request drafts exactly like its version decoded alone; rolling the code scope back returns
    code to the shared adapter; routed versions are never evicted."""
    target, draft, noise = pair
    fix_shared = reg.register(fixing_lora(draft, noise, tmp_path / "fix0"))  # same weights as code's, shared
    rand_shared = reg.register(random_lora(draft, tmp_path / "r1", scale=2.0, seed=1))
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry, keep_loaded=1)
    ref = {p: reference_greedy(target, tok(p)["input_ids"], N_NEW) for p in PROMPTS}
    sig = {}
    for v in (fix_shared, rand_shared):  # each version's signature, decoded alone as the shared adapter
        reg.registry.promote(v, "signature")
        mgr.poll_once()
        sig[v] = [tuple(dec.generate(_req(tok, p), FixedGamma(3)).accepted_prefix_lengths) for p in PROMPTS]
    assert sig[fix_shared] != sig[rand_shared]
    code = reg.register(fixing_lora(draft, noise, tmp_path / "fix1"), scope="code")
    reg.registry.promote(code, "code's own")
    mgr.poll_once()
    assert mgr.status()["routes"] == {"": rand_shared, "code": code}
    assert set(mgr.status()["loaded"]) >= {rand_shared, code}  # keep_loaded=1 never evicts a routed version

    swaps_before = len(mgr.swaps)
    got = []
    for i in range(9):
        w = ("code", "prose", "math")[i % 3]
        p = PROMPTS[i % len(PROMPTS)]
        r = dec.generate(_req(tok, p, w), FixedGamma(3))
        assert r.output_ids == ref[p]
        got.append((w, r.adapter_version))
        want_sig = sig[fix_shared] if w == "code" else sig[rand_shared]
        assert tuple(r.accepted_prefix_lengths) == want_sig[PROMPTS.index(p)], f"{w} request drafted by the wrong weights"
    assert got == [(("code", "prose", "math")[i % 3], code if i % 3 == 0 else rand_shared) for i in range(9)]
    swaps = list(mgr.swaps)[swaps_before:]
    assert [(s.to_version, s.workload) for s in swaps] == [(code, "code"), (rand_shared, "prose")] * 3

    assert reg.registry.rollback("code regressed", scope="code") == 0
    mgr.poll_once()
    assert mgr.route("code") == rand_shared
    r = dec.generate(_req(tok, PROMPTS[0], "code"), FixedGamma(3))
    assert r.adapter_version == rand_shared and tuple(r.accepted_prefix_lengths) == sig[rand_shared][0]


def test_learns_a_workload_promotion_from_the_event_channel(tok, pair, reg, tmp_path):
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "fix"), scope="код")
    dec = SpeculativeDecoder(target, draft, tok)
    with AdapterManager(dec, reg.registry, poll_interval_s=30.0) as mgr:
        time.sleep(0.3)
        reg.registry.promote(v1, "event")
        assert mgr.wait_prepared(v1, timeout=10, scope="код")
        assert dec.generate(_req(tok, PROMPTS[0], "prose"), FixedGamma(3)).adapter_version == 0
        assert dec.generate(_req(tok, PROMPTS[0], "код"), FixedGamma(3)).adapter_version == v1


def test_a_failed_switch_falls_back_to_a_loaded_version_and_is_retried(tok, pair, reg, tmp_path):
    """A transient set_adapter failure: the request is served by what was serving, the route never
    points at an evicted version, and the next poll retries the switch (QA: the old fallback
    routed to an evicted version and every request failed from then on)."""
    target, draft, noise = pair
    v1 = reg.register(fixing_lora(draft, noise, tmp_path / "a"))
    v2 = reg.register(random_lora(draft, tmp_path / "b", scale=2.0, seed=1))
    v3 = reg.register(random_lora(draft, tmp_path / "c", scale=2.0, seed=2))
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry, keep_loaded=1)
    reg.registry.promote(v1, "x")
    mgr.poll_once()
    assert dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version == v1
    reg.registry.promote(v2, "x")
    mgr.poll_once()  # prepared, no request in between
    reg.registry.promote(v3, "x")
    mgr.poll_once()  # v2 evicted: neither routed nor active
    assert v2 not in mgr.status()["loaded"]
    real, calls = mgr._peft.set_adapter, []

    def flaky(name, **kw):
        calls.append(name)
        if len(calls) == 1:
            raise RuntimeError("transient")
        return real(name, **kw)

    mgr._peft.set_adapter = flaky
    served = [dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version for _ in range(3)]
    assert served == [v1, v1, v1] and mgr.status()["failures"] == 1  # one failure, no flood
    assert mgr.route(None) in {v for v in mgr.status()["loaded"]} | {0}
    mgr._prepare(reg.registry.active_version(), "poll")  # the watcher's next poll
    assert dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3)).adapter_version == v3


def test_an_adapters_copy_gate_is_switched_in_with_it(tok, pair, reg, tmp_path):
    """An adapter saved with a copy gate (store.copy_channel.GATE_FILE) serves with it: the swap
    sets decoder.copy_gate to its weights; one without a gate, and version 0, serve with none; a
    malformed gate file makes the version incompatible and the old one keeps serving."""
    from store.copy_channel import save_gate

    target, draft, noise = pair
    gated_dir = fixing_lora(draft, noise, tmp_path / "gated")
    save_gate(gated_dir, [1.0, 2, 3, 4, 5, 6])
    gated = reg.register(gated_dir)
    plain = reg.register(random_lora(draft, tmp_path / "plain", scale=2.0, seed=1))
    bad_dir = fixing_lora(draft, noise, tmp_path / "bad")
    (bad_dir / "copy_gate.json").write_text('{"format": 1, "w": [1]}')
    bad = reg.register(bad_dir)
    dec = SpeculativeDecoder(target, draft, tok)
    mgr = AdapterManager(dec, reg.registry, keep_loaded=2)
    gates = []
    for v in (gated, plain, gated, bad):
        reg.registry.promote(v, "test")
        mgr.poll_once()
        r = dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3))
        assert r.output_ids == reference_greedy(target, tok(PROMPTS[0])["input_ids"], N_NEW)
        gates.append((r.adapter_version, None if dec.copy_gate is None else dec.copy_gate.tolist()))
    assert gates == [(gated, [1.0, 2, 3, 4, 5, 6]), (plain, None), (gated, [1.0, 2, 3, 4, 5, 6]),
                     (gated, [1.0, 2, 3, 4, 5, 6])]
    assert mgr.failures[-1].version == bad and mgr.failures[-1].kind == "incompatible"
    reg.registry.rollback("test")
    reg.registry.rollback("test")
    reg.registry.rollback("test")
    mgr.poll_once()
    dec.generate(_req(tok, PROMPTS[0]), FixedGamma(3))
    assert dec.adapter_version == 0 and dec.copy_gate is None


def test_a_registry_outage_is_logged_once_a_minute_and_its_end_once():
    """A Redis outage logged adapter_watch_error every second (the break session: 41 lines in 40 s).
    Now the first failure and one line a minute (with the count) at warning, and the recovery once."""
    import threading

    import redis

    from decoder.registry_follow import watch_registry

    class PubSub:
        def get_message(self, timeout=0.0):
            return None

        def close(self):
            pass

    class Registry:
        calls = 0

        def subscribe(self):
            Registry.calls += 1
            if Registry.calls <= 30:
                raise redis.ConnectionError("Connection refused")
            return PubSub()

        def active_versions(self):
            return {}

    t = [0.0]

    def clock():  # each reading 10 s later: 30 failures span 290 s
        t[0] += 10.0
        return t[0]

    stop = threading.Event()
    with capture_logs() as logs:
        watch_registry(Registry(), lambda *a: None, stop, poll_interval_s=0.001, clock=clock, after=stop.set)
    errors = [e for e in logs if e["event"] == "adapter_watch_error"]
    # the first failure at 10 s, then a line whenever 60 s have passed since the last: 70, 130, 190, 250 s
    assert [e.get("failures") for e in errors] == [None, 7, 13, 19, 25], errors
    assert all(e["log_level"] == "warning" for e in errors)
    back = [e for e in logs if e["event"] == "adapter_watch_recovered"]
    assert len(back) == 1 and back[0]["failures"] == 30 and back[0]["log_level"] == "info", back
