"""Adapter registry on a real Redis: artifacts + sha256, atomic promote/rollback, pub/sub."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from store.errors import ArtifactInvalidError, ArtifactMissingError, IntegrityError, InvalidTransitionError, RegistryError, UnknownVersionError
from store.registry import AdapterMeta, AdapterRegistry, parse_event


def peft_dir(path, seed=0):
    """A directory in peft's save_pretrained layout with a real safetensors file."""
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    )
    save_file(
        {
            "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((8, 64)).astype(np.float32),
            "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal((64, 8)).astype(np.float32),
        },
        str(path / "adapter_model.safetensors"),
    )
    return path


def sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def reg(client, cfg, tmp_path):
    return AdapterRegistry(client, tmp_path / "artifacts", cfg, clock=lambda: 1_732_870_000.5)


def next_event(ps, timeout=5.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = ps.get_message(timeout=0.1)
        if m is not None:
            return parse_event(m)
    raise AssertionError("no pub/sub event received")


def test_register_copies_atomically_and_records_sha256(reg, tmp_path):
    src = peft_dir(tmp_path / "out1")
    meta = AdapterMeta(
        samples_trained=512, tokens_trained=65_536, loss=0.4375, alpha_before=0.61, alpha_after=0.68,
        alpha_before_by_workload={"chat": 0.6, "код": 0.55}, alpha_after_by_workload={"chat": 0.7, "код": 0.66},
    )
    v = reg.register(src, meta)
    assert v == 1
    rec = reg.get(1)
    assert rec.sha256 == {"adapter_config.json": sha(src / "adapter_config.json"),
                          "adapter_model.safetensors": sha(src / "adapter_model.safetensors")}
    dest = tmp_path / "artifacts" / "v1"
    assert rec.artifact_path == str(dest.resolve())
    assert (dest / "adapter_model.safetensors").read_bytes() == (src / "adapter_model.safetensors").read_bytes()
    assert [p.name for p in (tmp_path / "artifacts").iterdir()] == ["v1"]  # no temp dir left behind
    assert (rec.state, rec.parent, rec.created_at) == ("candidate", 0, 1_732_870_000.5)
    assert (rec.samples_trained, rec.tokens_trained, rec.loss) == (512, 65_536, 0.4375)
    assert rec.alpha_after_by_workload == {"chat": 0.7, "код": 0.66} and rec.alpha_before == 0.61
    assert not rec.has_bytes
    assert reg.register(peft_dir(tmp_path / "out2", 1), AdapterMeta()) == 2  # monotonic
    assert math.isnan(reg.get(2).loss)
    assert [r.version for r in reg.list()] == [1, 2]


def test_register_refuses_non_peft_dir(reg, tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    with pytest.raises(RegistryError, match="adapter_model.safetensors"):
        reg.register(d, AdapterMeta())


def test_promote_rollback_are_announced_and_atomic(reg, tmp_path):
    v1 = reg.register(peft_dir(tmp_path / "a", 1), AdapterMeta())
    v2 = reg.register(peft_dir(tmp_path / "b", 2), AdapterMeta())
    assert reg.active_version() == 0
    ps = reg.subscribe()
    assert reg.events_channel.endswith("adapter:events")

    assert reg.promote(v1, "alpha +0.07 on held-out") == 0
    assert next_event(ps) == {"event": "promote", "version": 1, "previous": 0,
                              "reason": "alpha +0.07 on held-out", "ts": 1_732_870_000.5, "scope": ""}
    assert reg.register(peft_dir(tmp_path / "c", 3), AdapterMeta()) == 3
    assert reg.get(3).parent == 1  # parent defaults to the active version
    assert reg.promote(v2, "better") == 1
    assert next_event(ps)["previous"] == 1
    assert reg.active_version() == 2

    assert reg.rollback("regression on код") == 1
    assert next_event(ps) == {"event": "rollback", "version": 1, "previous": 2,
                              "reason": "regression on код", "ts": 1_732_870_000.5, "scope": ""}
    assert reg.get(2).state == "rolled_back" and reg.get(2).reason == "regression on код"
    assert reg.active_version() == 1
    assert reg.rollback("again") == 0
    assert reg.get(1).state == "rolled_back"
    with pytest.raises(InvalidTransitionError, match="no adapter is active"):
        reg.rollback("nothing left")
    log = reg.promotion_log()
    assert [(e["event"], e["version"], e["previous"]) for e in log] == [
        ("promote", "1", "0"), ("promote", "2", "1"), ("rollback", "1", "2"), ("rollback", "0", "1")]
    ps.close()


def test_workload_scopes_have_their_own_active_pointer_and_rollback_stack(reg, tmp_path):
    shared1 = reg.register(peft_dir(tmp_path / "s1", 1), AdapterMeta())
    reg.promote(shared1, "shared v1")
    code1 = reg.register(peft_dir(tmp_path / "c1", 2), AdapterMeta(scope="code"))
    assert reg.get(code1).scope == "code" and reg.get(shared1).scope == ""
    assert reg.get(code1).parent == shared1  # code had no own adapter: it was served by the shared one
    assert reg.resolve("code") == shared1 and reg.active_version("code") == 0
    ps = reg.subscribe()
    assert reg.promote(code1, "code +0.1") == 0  # code's own previous: none
    assert next_event(ps) == {"event": "promote", "version": code1, "previous": 0, "reason": "code +0.1",
                              "ts": 1_732_870_000.5, "scope": "code"}
    # the shared pointer did not move; each workload resolves to its own scope, else the shared one
    assert reg.active_version() == shared1 and reg.active_version("code") == code1
    assert (reg.resolve("code"), reg.resolve("math"), reg.resolve("")) == (code1, shared1, shared1)
    assert reg.active_versions() == {"": shared1, "code": code1}
    assert reg.scopes() == ["code"]
    # a new shared version neither replaces nor is replaced by code's
    shared2 = reg.register(peft_dir(tmp_path / "s2", 3), AdapterMeta())
    assert reg.promote(shared2, "shared v2") == shared1
    code2 = reg.register(peft_dir(tmp_path / "c2", 4), AdapterMeta(scope="code"))
    assert reg.get(code2).parent == code1
    assert reg.promote(code2, "code v2") == code1
    assert reg.active_versions() == {"": shared2, "code": code2}
    # the active version of a scope cannot be rejected; one of another scope's can
    with pytest.raises(InvalidTransitionError, match="active"):
        reg.set_state(code2, "rejected", "no")
    # rollback walks code's own stack, then falls back to the shared adapter (0 = none of its own)
    assert reg.rollback("code v2 regressed", scope="code") == code1
    assert reg.active_version() == shared2  # untouched
    assert reg.rollback("code v1 regressed", scope="code") == 0
    assert reg.resolve("code") == shared2
    with pytest.raises(InvalidTransitionError, match="no active adapter of its own"):
        reg.rollback("nothing", scope="code")
    assert reg.rollback("shared v2 bad") == shared1  # the shared stack never held code's versions
    events = [(e["event"], e["version"], e["scope"]) for e in reg.promotion_log() if e["event"] != "set_state"]
    assert events == [("promote", str(shared1), ""), ("promote", str(code1), "code"), ("promote", str(shared2), ""),
                      ("promote", str(code2), "code"), ("rollback", str(code1), "code"), ("rollback", "0", "code"),
                      ("rollback", str(shared1), "")]
    ps.close()


@pytest.mark.parametrize("scope", ["two words", "tab\tx", "x" * 129, "nl\n"])
def test_invalid_scope_is_refused_with_the_value(reg, tmp_path, scope):
    with pytest.raises(ValueError, match="adapter scope"):
        reg.register(peft_dir(tmp_path / "a"), AdapterMeta(scope=scope))
    with pytest.raises(ValueError, match="adapter scope"):
        reg.rollback("x", scope=scope)
    assert reg.list() == []  # nothing registered, no version burned on the way
    assert reg.register(peft_dir(tmp_path / "b"), AdapterMeta()) == 1


def test_rollback_skips_versions_no_longer_promoted(reg, tmp_path):
    for i in range(3):
        reg.register(peft_dir(tmp_path / f"s{i}", i), AdapterMeta())
    reg.promote(1, "a")
    reg.promote(2, "b")
    reg.promote(3, "c")
    assert reg.rollback("3 bad") == 2
    reg.promote(3, "retry 3")  # re-promoting a rolled-back version is allowed
    assert reg.rollback("3 still bad") == 2
    assert reg.rollback("2 bad") == 1


def test_invalid_transitions(reg, tmp_path):
    reg.register(peft_dir(tmp_path / "a"), AdapterMeta())
    reg.set_state(1, "rejected", "alpha fell 0.03")
    assert (reg.get(1).state, reg.get(1).reason) == ("rejected", "alpha fell 0.03")
    with pytest.raises(InvalidTransitionError, match="v1: it is rejected"):
        reg.promote(1, "x")
    with pytest.raises(UnknownVersionError, match="v7"):
        reg.promote(7, "x")
    with pytest.raises(ValueError, match="'promoted'"):
        reg.set_state(1, "promoted", "x")
    reg.register(peft_dir(tmp_path / "b"), AdapterMeta())
    reg.promote(2, "ok")
    with pytest.raises(InvalidTransitionError, match="already the active"):
        reg.promote(2, "again")
    with pytest.raises(InvalidTransitionError, match="rollback"):
        reg.set_state(2, "rejected", "x")
    with pytest.raises(UnknownVersionError):
        reg.get(99)


def test_concurrent_promotions_keep_a_consistent_chain(reg, tmp_path, client, cfg):
    n = 8
    for i in range(n):
        reg.register(peft_dir(tmp_path / f"p{i}", i), AdapterMeta())
    # each thread has its own client and registry object, promoting its own version 5 times
    regs = [AdapterRegistry(type(client)(connection_pool=client.connection_pool), tmp_path / "artifacts", cfg) for _ in range(n)]
    errors = []

    def work(i):
        for _ in range(5):
            try:
                regs[i].promote(i + 1, f"t{i}")
            except InvalidTransitionError:
                pass  # it was already active
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors
    log = [e for e in reg.promotion_log(1000) if e["event"] == "promote"]
    # atomic read-modify-write: every promotion's "previous" is the version promoted just before it
    prev = "0"
    for e in log:
        assert e["previous"] == prev
        prev = e["version"]
    assert reg.active_version() == int(prev)


def test_fetch_checks_sha256(reg, tmp_path):
    v = reg.register(peft_dir(tmp_path / "a"), AdapterMeta())
    p = reg.fetch(v)
    assert p == tmp_path / "artifacts" / "v1"
    copy = reg.fetch(v, tmp_path / "elsewhere" / "v1")
    assert sha(copy / "adapter_model.safetensors") == reg.get(v).sha256["adapter_model.safetensors"]
    f = p / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # one flipped bit
    f.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as ei:
        reg.fetch(v)
    assert sha(f) in str(ei.value) and reg.get(v).sha256["adapter_model.safetensors"] in str(ei.value)


def test_fetch_materialises_from_redis_bytes(reg, client, cfg, tmp_path):
    src = peft_dir(tmp_path / "a", 5)
    v = reg.register(src, AdapterMeta(), store_bytes=True)
    assert reg.get(v).has_bytes
    shutil.rmtree(tmp_path / "artifacts" / f"v{v}")
    p = reg.fetch(v)
    assert sha(p / "adapter_model.safetensors") == sha(src / "adapter_model.safetensors")
    # a decoder on another host, with its own artifact dir
    other = AdapterRegistry(client, tmp_path / "host2", cfg)
    q = other.fetch(v)
    assert q == tmp_path / "host2" / f"v{v}"
    assert (q / "adapter_config.json").read_bytes() == (src / "adapter_config.json").read_bytes()
    # corrupt bytes in Redis are caught too
    client.hset(cfg.keys.adapter_blob(v), "adapter_model.safetensors", b"junk")
    with pytest.raises(IntegrityError, match="redis:"):
        AdapterRegistry(client, tmp_path / "host3", cfg).fetch(v)


def test_fetch_without_files_or_bytes_says_what_to_do(reg, tmp_path):
    v = reg.register(peft_dir(tmp_path / "a"), AdapterMeta())
    shutil.rmtree(tmp_path / "artifacts" / f"v{v}")
    with pytest.raises(ArtifactMissingError, match="store_bytes=True"):
        reg.fetch(v)


def test_counter_reset_does_not_overwrite_artifacts(reg, client, cfg, tmp_path):
    reg.register(peft_dir(tmp_path / "a"), AdapterMeta())
    client.delete(cfg.keys.adapter_counter)  # Redis lost its data, the disk did not
    with pytest.raises(RegistryError, match="already exists"):
        reg.register(peft_dir(tmp_path / "b", 1), AdapterMeta())


def head_dir(path, seed=0, bad=False):
    """A directory holding a head file as decoder.eagle.save_head writes one (safetensors)."""
    path.mkdir(parents=True)
    w = np.random.default_rng(seed).standard_normal((16, 32)).astype(np.float32)
    if bad:
        w[3, 4] = np.nan
    save_file({"fc.weight": w}, str(path / "head.safetensors"), metadata={"target_digest": "0" * 16})
    return path


def test_head_registry_has_its_own_versions_pointers_and_events(client, cfg, reg, tmp_path):
    """Heads (kind "head") go through the same states, scopes and rollback as adapters, under
    their own keys: a head's promotion moves neither the adapters' pointer nor their counter."""
    heads = AdapterRegistry(client, tmp_path / "heads", cfg, kind="head", clock=lambda: 1_732_870_001.0)
    assert heads.events_channel == f"{cfg.key_prefix}head:events" != reg.events_channel
    av = reg.register(peft_dir(tmp_path / "a1"), AdapterMeta())
    reg.promote(av, "adapter")
    ps = heads.subscribe()
    h1 = heads.register(head_dir(tmp_path / "h1", 1), AdapterMeta(alpha_before=0.0, alpha_after=0.31))
    h2 = heads.register(head_dir(tmp_path / "h2", 2), AdapterMeta(alpha_before=0.31, alpha_after=0.4, scope="code"))
    assert (h1, h2) == (1, 2)  # numbered on their own, beside adapter v1
    assert heads.promote(h1, "first head") == 0
    assert next_event(ps) == {"event": "promote", "version": 1, "previous": 0, "reason": "first head",
                              "ts": 1_732_870_001.0, "scope": ""}
    heads.promote(h2, "code head")
    assert heads.active_versions() == {"": 1, "code": 2}
    assert heads.resolve("code") == 2 and heads.resolve("prose") == 1
    assert reg.active_versions() == {"": av} and reg.resolve("code") == av
    assert (heads.fetch(h1) / "head.safetensors").read_bytes() == (tmp_path / "h1" / "head.safetensors").read_bytes()
    assert heads.rollback("regressed", scope="code") == 0
    assert heads.resolve("code") == 1 and heads.get(h2).state == "rolled_back"
    assert [r.version for r in heads.list()] == [1, 2] and [r.version for r in reg.list()] == [av]
    ps.close()


def test_head_registry_refuses_a_directory_without_a_head_and_a_non_finite_head(client, cfg, tmp_path):
    heads = AdapterRegistry(client, tmp_path / "heads", cfg, kind="head")
    with pytest.raises(RegistryError, match=r"not a head directory: missing head\.safetensors.*save_head"):
        heads.register(peft_dir(tmp_path / "a1"), AdapterMeta())
    v = heads.register(head_dir(tmp_path / "h1", bad=True), AdapterMeta())
    assert "NaN or infinity" in heads.artifact_problem(v)
    with pytest.raises(ArtifactInvalidError, match="NaN or infinity"):
        heads.promote(v, "never")
    with pytest.raises(ValueError, match="registry kind 'lora'"):
        AdapterRegistry(client, tmp_path / "x", cfg, kind="lora")
