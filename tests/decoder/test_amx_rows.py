"""decoder.engines.amx_rows: where the AMX tiles overtake the per-row kernel, per thread count."""

from __future__ import annotations

import json

import pytest

import decoder.engines.amx_rows as A


def _linear(a: float, b: float) -> dict[int, float]:
    return {n: a + b * n for n in range(1, A.MAX_N + 1)}


def _tiles(a: float, b: float, one: float) -> dict[int, float]:
    """A tiles' cost line whose one-row step is ``one`` (one row takes the per-row kernel on both)."""
    return {**_linear(a, b), 1: one}


def test_the_best_max_rows_is_where_the_tiles_become_cheaper():
    # per-row 10 + 3.5 n against tiles 16 + 2 n: equal at n = 4 (24 ms both), tiles cheaper from 5
    assert A.best_max_rows(_linear(10, 3.5), _linear(16, 2)) == 4
    # the per-row kernel cheaper at every n (an AMX Xeon where it was, up to 9 rows)
    assert A.best_max_rows(_linear(6, 1), _linear(9, 1.2)) == A.MAX_N
    # the tiles cheaper from 2 rows: upstream's choice
    assert A.best_max_rows(_linear(6, 4), _linear(8, 1)) == 1
    # one noisy reading does not move the choice: per-row dearer only at n = 3, cheaper on both sides
    per_row, tiles = _linear(10, 1), _linear(14, 1)
    per_row[3] = tiles[3] + 0.5
    assert A.best_max_rows(per_row, tiles) == A.MAX_N
    # the sum decides: per-row cheaper at 2 and 3 by 1 ms each, dearer at 4..9 by 1 ms each
    per_row = {n: 20.0 for n in range(1, A.MAX_N + 1)}
    tiles = {n: 21.0 if n <= 3 else 19.0 for n in per_row}
    assert A.best_max_rows(per_row, tiles) == 3


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    import decoder.models.packaged as P

    monkeypatch.delenv(A.ENV, raising=False)
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path))
    (tmp_path / "pkg.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(P, "packaged_gguf", lambda name: tmp_path / "pkg.gguf")
    monkeypatch.setattr(A, "_others_busy", lambda *a: 0.0)
    monkeypatch.setattr(A.os, "cpu_count", lambda: 2)
    calls = []

    def measure(model, threads):
        calls.append(threads)
        return {"per_row": {1: _linear(10, 3.5), 2: _linear(6, 2.5)},
                "tiles": {1: _tiles(16, 2, 13.5), 2: _tiles(7, 1.5, 8.6)}}, ""

    monkeypatch.setattr(A, "_measure", measure)
    return calls, tmp_path


def test_the_measured_setting_is_set_per_thread_count_and_cached(fresh, monkeypatch):
    calls, tmp = fresh
    r = A.apply_amx_rows(tmp / "model.gguf")
    # 1 thread: 10 + 3.5 n against 16 + 2 n -> 4; 2 threads: 6 + 2.5 n against 7 + 1.5 n -> equal at 1: tiles from 2
    assert (r["source"], r["setting"]) == ("measured", "4,1")
    assert A.os.environ[A.ENV] == "4,1" and calls == [[1, 2]]
    cached = json.loads((tmp / A.CACHE_NAME).read_text())
    assert [e["setting"] for e in cached.values()] == ["4,1"]
    assert "1 thread(s): the per-row kernel up to 4 row(s)" in r["reason"]
    monkeypatch.delenv(A.ENV)
    again = A.apply_amx_rows(tmp / "model.gguf")
    assert (again["source"], again["setting"], calls) == ("cached", "4,1", [[1, 2]])  # not measured again
    assert A.os.environ[A.ENV] == "4,1"


def test_a_setting_in_the_environment_is_kept_and_nothing_measured(fresh, monkeypatch):
    calls, tmp = fresh
    monkeypatch.setenv(A.ENV, "1")
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert (r["source"], r["setting"], calls) == ("environment", "1", [])
    assert not (tmp / A.CACHE_NAME).exists()


def test_a_noisy_or_failed_measurement_keeps_the_default_and_is_not_cached(fresh, monkeypatch):
    calls, tmp = fresh
    noisy = {"per_row": {1: _linear(10, 3.5), 2: _linear(6, 2.5)},
             "tiles": {1: _tiles(16, 2, 13.5), 2: _tiles(7, 1.5, 10.5)}}
    monkeypatch.setattr(A, "_measure", lambda model, threads: (noisy, ""))  # 2 threads: one-row 8.5 against 10.5 ms
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert r["source"] == "default" and r["setting"] == str(A.DEFAULT) and "noisy" in r["reason"]
    assert A.ENV not in A.os.environ and not (tmp / A.CACHE_NAME).exists()
    monkeypatch.setattr(A, "_measure", lambda model, threads: (None, "the tiles measurement failed (exit 3)"))
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert (r["source"], r["reason"]) == ("default", "the tiles measurement failed (exit 3)")
    assert A.ENV not in A.os.environ


def test_an_unwritable_or_bad_cache_costs_only_the_caching(fresh, monkeypatch):
    calls, tmp = fresh
    (tmp / A.CACHE_NAME).write_text(json.dumps({"x": {"setting": "abc"}}))
    monkeypatch.setattr(A, "_key", lambda model, threads, identity: "x")
    r = A.apply_amx_rows(tmp / "model.gguf")  # a cached setting that is not one of ours: measured again
    assert (r["source"], r["setting"], len(calls)) == ("measured", "4,1", 1)
    for bad in ("999", "", "0", "4,", 7):
        assert not A._valid(bad)
    assert A._valid("4,1") and A._valid("9")

    def refuse(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.delenv(A.ENV)
    (tmp / A.CACHE_NAME).unlink()
    monkeypatch.setattr(A.Path, "write_text", refuse)
    monkeypatch.setattr(A.Path, "unlink", refuse)  # EROFS, not ENOENT: the break session's crash
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert (r["source"], r["setting"], A.os.environ[A.ENV]) == ("measured", "4,1", "4,1")


def test_a_busy_host_or_no_packaged_model_keeps_the_default(fresh, monkeypatch):
    import decoder.models.packaged as P

    calls, tmp = fresh
    monkeypatch.setattr(A, "_others_busy", lambda *a: 0.6)  # another process used 60 % of the CPUs meanwhile
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert r["source"] == "default" and "beside other work" in r["reason"] and A.ENV not in A.os.environ
    assert not (tmp / A.CACHE_NAME).exists()

    def missing(name):
        raise FileNotFoundError(name)

    monkeypatch.setattr(P, "packaged_gguf", missing)
    r = A.apply_amx_rows(tmp / "model.gguf")
    assert r["source"] == "default" and "not installed" in r["reason"] and len(calls) == 1  # nothing measured


def test_the_others_share_leaves_out_this_process_and_its_children():
    from types import SimpleNamespace as NS

    hz = A.os.sysconf("SC_CLK_TCK")
    cpus = A.os.cpu_count() or 1
    # over 10 s: the machine busy for 10 s of CPU; this process 1 s, its children 6 s: others 3 s of 10 x cpus
    j0, j1 = (0, 0), (10 * hz, 1 * hz)
    c0, c1 = NS(children_user=0.0, children_system=0.0), NS(children_user=5.0, children_system=1.0)
    assert A._others_busy(j0, c0, j1, c1, 10.0) == pytest.approx(3.0 / (10.0 * cpus))
    assert A._others_busy(None, c0, j1, c1, 10.0) is None and A._others_busy(j0, c0, j1, c1, 0.0) is None
