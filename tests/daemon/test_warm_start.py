"""v0 before the first request (daemon.warm_start) on a tiny pair, a real registry and a real cache dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decoder"))

from tiny import char_tokenizer, tiny_llama  # noqa: E402

import trainer.bootstrap as tb  # noqa: E402
from daemon.settings import ConfigError, Settings, warm_start_config  # noqa: E402
from daemon.warm_start import WarmStartConfig, bootstrap_cache_root, cache_key, ensure_v0  # noqa: E402
from decoder.workloads import EVAL_RESERVED_PROMPTS, bootstrap_documents, documents, get_workload  # noqa: E402
from store.config import StoreConfig  # noqa: E402
from store.registry import AdapterRegistry  # noqa: E402
from store.schema import PairFingerprint  # noqa: E402
from trainer.distill import DistillConfig, Distiller  # noqa: E402

FP = PairFingerprint(target="tiny-t", draft="tiny-d", tokenizer_hash="chars")
CFG = WarmStartConfig(workloads=("prose",), corpus_tokens=1536, heldout_tokens=384, max_steps=40, max_seconds=120,
                      round_steps=20)
DCFG = DistillConfig(lr=1e-2, batch_size=8)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "models"))
    return tmp_path / "models" / "bootstrap"


@pytest.fixture
def pair():
    return SimpleNamespace(target=tiny_llama(0, head_scale=20.0), draft=tiny_llama(1, layers=1), tokenizer=char_tokenizer())


def _registry(redis_client, prefix: str, tmp_path: Path) -> AdapterRegistry:
    return AdapterRegistry(redis_client, tmp_path / prefix.strip(":").replace(":", "-"), StoreConfig(key_prefix=prefix))


def _runs(text: str, n: int = 8) -> set:
    w = text.split()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


@pytest.mark.parametrize("workload", ["prose", "code", "math"])
def test_bootstrap_documents_never_hold_an_evaluation_prompt(workload):
    docs, kept = documents(workload), bootstrap_documents(workload)
    if not docs:
        pytest.skip("no GSM8K without ../shared/data")
    prompts = get_workload(workload, EVAL_RESERVED_PROMPTS)
    held = set().union(*(_runs(p.text) for p in prompts))
    assert not any(_runs(t) & held for _, t in kept)  # not one 8-word run of any reserved prompt
    dropped = {k for k, _ in docs} - {k for k, _ in kept}
    assert dropped == {k for k, t in docs if _runs(t) & held}  # and only those go: the rest still trains
    assert [k for k, _ in kept] == [k for k, _ in docs if k not in dropped]  # in the corpus's order
    if workload == "math":
        assert len(dropped) == EVAL_RESERVED_PROMPTS  # GSM8K rows stand alone
    if workload == "code":  # pydoc's _getdoc (a code prompt) quotes inspect's cleandoc docstring
        assert "inspect" in dropped and len(kept) >= len(docs) - 4


def test_bootstrap_documents_drop_a_document_that_quotes_a_reserved_prompt(monkeypatch):
    reserved = get_workload("prose", EVAL_RESERVED_PROMPTS)
    other = get_workload("prose", EVAL_RESERVED_PROMPTS + 1)[-1]  # the first prompt that may be served
    planted = [("clean", "a document about nothing the evaluation asks " * 3),
               ("quotes", "intro words here " + " ".join(reserved[3].text.split()[5:14]) + " and more"),
               ("served", other.text)]
    monkeypatch.setattr("decoder.workloads.documents", lambda w: planted)
    assert [k for k, _ in bootstrap_documents("prose")] == ["clean", "served"]
    assert [k for k, _ in bootstrap_documents("prose", reserved=0)] == ["clean", "quotes", "served"]
    with pytest.raises(ValueError, match="reserved=-1"):
        bootstrap_documents("prose", reserved=-1)


def test_first_start_trains_v0_caches_it_and_promotes_it_then_later_starts_take_the_cache(
        pair, cache, redis_client, key_prefix, tmp_path, monkeypatch):
    reg = _registry(redis_client, key_prefix, tmp_path)
    lines: list[str] = []
    r = ensure_v0(pair, FP, reg, Distiller(pair.draft, DCFG), CFG, "fp32", progress=lines.append)
    assert r.source == "trained" and r.version == 1, r.reason
    assert reg.active_version() == 1 and reg.get(1).state == "promoted" and reg.get(1).reason.startswith("v0 bootstrap")
    d = Path(r.cache_dir)
    assert d.parent == cache and d.name == cache_key(FP.key(), CFG, DCFG, None)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["alpha_after"] > meta["alpha_base"] + 0.01, meta  # the point of v0: a floor above the base draft (0.29 -> 0.31 here)
    assert meta["gain"] == pytest.approx(meta["served_after"] - meta["served_base"]) and meta["gain"] > 0, meta
    assert [p["steps"] for p in meta["curve"]] == [20, 40] and meta["heldout_samples"] > 0
    assert meta["scoring"]["workloads"]["prose"]["train_positions"] >= 1000
    assert any("bootstrapping v0" in m for m in lines)
    assert not list(cache.glob(".*tmp*"))  # written whole

    # a later start (an empty registry, e.g. the demo's fresh namespace): the cache, no scoring or training
    def no_training(*a, **kw):
        raise AssertionError("trained again despite the cache")

    monkeypatch.setattr("daemon.warm_start.train_v0", no_training)
    reg2 = _registry(redis_client, key_prefix + "second:", tmp_path)
    fresh = tiny_llama(1, layers=1)
    r2 = ensure_v0(pair, FP, reg2, Distiller(fresh, DCFG), CFG, "fp32")
    assert r2.source == "cache" and r2.version == 1 and reg2.active_version() == 1
    a = (reg.fetch(1) / "adapter_model.safetensors").read_bytes()
    assert (reg2.fetch(1) / "adapter_model.safetensors").read_bytes() == a == (d / "adapter" / "adapter_model.safetensors").read_bytes()
    assert reg2.get(1).alpha_after == pytest.approx(meta["alpha_after"])

    # a registry with history is never touched; disabled does nothing
    r3 = ensure_v0(pair, FP, reg2, Distiller(tiny_llama(1, layers=1), DCFG), CFG, "fp32")
    assert r3.source == "registry" and r3.version is None and len(reg2.list()) == 1
    off = WarmStartConfig(enabled=False)
    assert ensure_v0(pair, FP, _registry(redis_client, key_prefix + "third:", tmp_path), None, off).source == "disabled"
    # another budget is another key: it would train (here the patched trainer refuses, so the start says so)
    r4 = ensure_v0(pair, FP, _registry(redis_client, key_prefix + "fourth:", tmp_path),
                   Distiller(tiny_llama(1, layers=1), DCFG), WarmStartConfig(workloads=("prose",), max_steps=41), "fp32")
    assert r4.source == "failed" and "trained again despite the cache" in r4.reason and r4.version is None


def test_a_bootstrap_without_gain_is_cached_as_such_and_nothing_is_promoted(
        pair, cache, redis_client, key_prefix, tmp_path, monkeypatch):
    real = tb.bootstrap

    def flat(samples, distiller, registry, config, **kw):  # the real evaluation, no training
        ev = distiller.evaluate(kw["heldout"])
        return tb.BootstrapResult(None, False, "flat", 0, 0.0, len(list(samples)), len(kw["heldout"]), ev, ev, [])

    monkeypatch.setattr(tb, "bootstrap", flat)
    reg = _registry(redis_client, key_prefix, tmp_path)
    r = ensure_v0(pair, FP, reg, Distiller(pair.draft, DCFG), CFG, "fp32")
    assert r.source == "no gain" and r.version is None and reg.list() == []
    d = Path(r.cache_dir)
    assert (d / "meta.json").is_file() and not (d / "adapter").exists() and f"remove {d}" in r.reason
    monkeypatch.setattr(tb, "bootstrap", real)
    assert ensure_v0(pair, FP, reg, Distiller(tiny_llama(1, layers=1), DCFG), CFG, "fp32").source == "no gain"  # not retried


def test_no_corpus_text_starts_from_the_base_draft(pair, cache, redis_client, key_prefix, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTD_SHARED_DATA", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    reg = _registry(redis_client, key_prefix, tmp_path)
    r = ensure_v0(pair, FP, reg, Distiller(pair.draft, DCFG), WarmStartConfig(workloads=("math",)), "fp32")
    assert r.source == "no data" and r.version is None and reg.list() == [] and "training and held-out" in r.reason


def test_bootstrap_settings_are_checked():
    assert warm_start_config(Settings()).workloads == ("prose", "code", "math")
    with pytest.raises(ConfigError, match="'prose,poetry'"):
        warm_start_config(Settings(bootstrap={"workloads": "prose,poetry"}))
    with pytest.raises(ValueError, match="heldout_fraction=1.5"):
        WarmStartConfig(heldout_fraction=1.5)


def _damage(d: Path, damage: str) -> None:
    import shutil

    meta = json.loads((d / "meta.json").read_text())
    if damage == "meta":
        (d / "meta.json").write_text("{not json")
    elif damage == "weights":
        w = d / "adapter" / "adapter_model.safetensors"
        w.write_bytes(w.read_bytes()[:100])  # truncated
    elif damage == "adapter gone":  # alpha rose, so an adapter must be there
        shutil.rmtree(d / "adapter")
    elif damage == "meta gone":
        (d / "meta.json").unlink()
    elif damage == "a string alpha":
        (d / "meta.json").write_text(json.dumps({**meta, "alpha_base": "0.3"}))
    elif damage == "a scoped record":
        (d / "meta.json").write_text(json.dumps({**meta, "adapter_meta": {**meta["adapter_meta"], "scope": "prose"}}))


@pytest.mark.parametrize("damage", ["meta", "weights", "adapter gone", "meta gone", "a string alpha", "a scoped record"])
def test_a_damaged_cache_entry_is_bootstrapped_again_not_served(pair, cache, redis_client, key_prefix, tmp_path, damage):
    r = ensure_v0(pair, FP, _registry(redis_client, key_prefix, tmp_path), Distiller(pair.draft, DCFG), CFG, "fp32")
    d = Path(r.cache_dir)
    _damage(d, damage)
    lines: list[str] = []
    reg2 = _registry(redis_client, key_prefix + "again:", tmp_path)
    r2 = ensure_v0(pair, FP, reg2, Distiller(tiny_llama(1, layers=1), DCFG), CFG, "fp32", progress=lines.append)
    assert r2.source == "trained" and r2.version == 1 and reg2.active_version() == 1, r2.reason
    assert any("cannot be used" in m for m in lines) or damage == "meta gone", lines
    assert reg2.get(1).scope == "" and not list(cache.glob(".*tmp*"))
    assert json.loads((d / "meta.json").read_text())["alpha_after"] == pytest.approx(r2.meta["alpha_after"])


def test_a_bootstrap_that_goes_non_finite_starts_from_the_base_draft(pair, cache, redis_client, key_prefix, tmp_path):
    dist = Distiller(pair.draft, DistillConfig(lr=1e30, batch_size=8))
    reg = _registry(redis_client, key_prefix, tmp_path)
    r = ensure_v0(pair, FP, reg, dist, CFG, "fp32")
    assert r.source == "failed" and r.version is None and reg.list() == [] and "non-finite" in r.reason, r.reason
    assert dist.weights_finite and not [p for p in cache.iterdir() if not p.name.endswith(".lock")]  # nothing cached: the next start tries again


def test_a_start_that_failed_to_promote_leaves_a_candidate_the_next_start_replaces(
        pair, cache, redis_client, key_prefix, tmp_path, monkeypatch):
    reg = _registry(redis_client, key_prefix, tmp_path)
    from store.errors import StoreUnavailableError

    def down(*a, **kw):
        raise StoreUnavailableError("PROMOTE: Redis went away")

    monkeypatch.setattr(reg, "promote", down)
    dist = Distiller(pair.draft, DCFG)
    with pytest.raises(StoreUnavailableError):
        ensure_v0(pair, FP, reg, dist, CFG, "fp32")
    assert [r.state for r in reg.list()] == ["candidate"] and reg.active_version() == 0
    lora_b = [p for n, p in dist.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.abs().sum()) == 0 for p in lora_b)  # reset: peft's no-op init, the base draft that serves
    monkeypatch.undo()
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(cache.parent))
    r = ensure_v0(pair, FP, reg, Distiller(tiny_llama(1, layers=1), DCFG), CFG, "fp32")
    assert r.source == "cache" and r.version == 2 and reg.active_version() == 2, r.reason  # the bootstrap was kept


def test_an_unwritable_cache_costs_the_cache_not_v0(pair, tmp_path, redis_client, key_prefix, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path / "afile" / "models"))  # under a file: nothing can be made
    reg = _registry(redis_client, key_prefix, tmp_path)
    lines: list[str] = []
    r = ensure_v0(pair, FP, reg, Distiller(pair.draft, DCFG), CFG, "fp32", progress=lines.append)
    assert r.source == "trained" and r.version == 1 and reg.active_version() == 1, r.reason
    assert any("cannot be cached" in m for m in lines), lines


def test_serve_alone_promotes_the_cached_v0_and_never_bootstraps(pair, cache, redis_client, key_prefix, tmp_path, monkeypatch):
    """issue 34: `serve` started without `run` served the untrained draft although the bootstrap
    was cached. promote_cached_v0 (what serve calls at start) promotes the cache into an empty
    registry; with no cache it does nothing (it never trains: the first request never waits)."""
    from daemon.warm_start import promote_cached_v0

    monkeypatch.setattr("daemon.warm_start.train_v0", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("trained")))
    empty = _registry(redis_client, key_prefix + "nocache:", tmp_path)
    assert promote_cached_v0(FP, empty, CFG, DCFG) is None and empty.list() == []
    monkeypatch.undo()
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(cache.parent))
    trained = ensure_v0(pair, FP, _registry(redis_client, key_prefix + "trainer:", tmp_path), Distiller(pair.draft, DCFG),
                        CFG, "fp32")
    assert trained.source == "trained" and trained.version == 1, trained.reason
    reg = _registry(redis_client, key_prefix + "serve:", tmp_path)
    ws = promote_cached_v0(FP, reg, CFG, DCFG)
    assert ws is not None and ws.source == "cache" and reg.active_version() == 1
    cached = Path(trained.cache_dir) / "adapter" / "adapter_model.safetensors"
    assert (reg.fetch(1) / "adapter_model.safetensors").read_bytes() == cached.read_bytes()
    assert promote_cached_v0(FP, reg, CFG, DCFG) is None and len(reg.list()) == 1  # history: left alone
    # another pair's serve finds no cache of its own
    other = PairFingerprint(target="other-t", draft="tiny-d", tokenizer_hash="chars")
    assert promote_cached_v0(other, _registry(redis_client, key_prefix + "other:", tmp_path), CFG, DCFG) is None
    # a damaged cache entry is not served
    (Path(trained.cache_dir) / "adapter" / "adapter_model.safetensors").unlink()
    assert promote_cached_v0(FP, _registry(redis_client, key_prefix + "damaged:", tmp_path), CFG, DCFG) is None
