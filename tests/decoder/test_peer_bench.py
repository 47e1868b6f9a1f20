"""bench/peers.py and serve_bench.py --peer: the pure parts (llama-server's command line and cache
key, the speculation types read from --help, the latency statistics on a hand-made timeline,
the prompt cells, the target checks). No binary, server or model is needed; nothing is timed."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


peers = _load("peers")
serve_bench = _load("serve_bench")


def test_server_command_scales_context_with_slots_and_adds_speculation():
    cmd = peers.server_command(Path("/x/llama-server"), Path("/m/t.gguf"), 8123, parallel=4, ctx_per_slot=1024, threads=2)
    assert cmd[0] == "/x/llama-server"
    a = dict(zip(cmd[1::1], cmd[2::1]))
    assert a["-m"] == "/m/t.gguf" and a["--port"] == "8123" and a["--host"] == "127.0.0.1"
    assert a["-np"] == "4" and a["-c"] == "4096"  # each of the 4 slots holds 1024 tokens
    assert a["-t"] == "2" and a["-tb"] == "2"
    assert "--no-kv-unified" in cmd and "--spec-type" not in cmd and "-md" not in cmd

    ng = peers.server_command(Path("s"), Path("t"), 1, 1, 2048, 2, spec_type="ngram-simple")
    assert ng[ng.index("--spec-type") + 1] == "ngram-simple" and ng[ng.index("-c") + 1] == "2048"
    md = peers.server_command(Path("s"), Path("t"), 1, 8, 512, 2, draft_model=Path("/d.gguf"))
    assert md[md.index("-md") + 1] == "/d.gguf" and md[md.index("-td") + 1] == "2" and md[md.index("-c") + 1] == "4096"
    # two polling thread pools on two cores starve each other: every pool waits without polling
    assert all(md[md.index(f) + 1] == "0" for f in ("--poll", "--poll-batch", "--poll-draft", "--poll-batch-draft"))
    assert "--poll" not in cmd and "--poll" not in ng  # plain and n-gram servers keep llama.cpp's default
    with pytest.raises(ValueError):
        peers.server_command(Path("s"), Path("t"), 1, 0, 512, 2)


def test_cmake_args_build_the_server_alone_on_cpu_without_downloads():
    args = peers.cmake_configure_args(Path("/src"), Path("/b"), "Ninja")
    assert args[:7] == ["cmake", "-S", "/src", "-B", "/b", "-G", "Ninja"]
    for flag in ("-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_OPENMP=OFF", "-DGGML_CUDA=OFF", "-DBUILD_SHARED_LIBS=OFF"):
        assert flag in args
    assert "-DCMAKE_CXX_FLAGS=-fno-dse -fno-tree-dse" in args  # the wheel's AMX workaround, same kernels


def test_cache_key_follows_version_cpu_flags_and_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTD_CACHE_DIR", str(tmp_path))
    a = peers.cpu_key("processor : 0\nflags : sse avx2 fma\n")
    assert a == peers.cpu_key("flags\t: fma avx2 sse sse\n")  # order and repeats do not matter
    assert a != peers.cpu_key("flags : sse avx2 fma amx_tile\n")
    p = peers.server_path("0.3.36", a)
    assert p == tmp_path / "bin" / f"llama-server-0.3.36-{peers.BUILD_TAG}-cpu{a}" / "llama-server"
    assert peers.server_path("0.3.37", a) != p
    assert peers.llama_server_binary(build=False) is None  # nothing cached here, nothing built


def test_pinned_version_reads_the_pyproject_pin(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('dependencies = ["numpy", "llama-cpp-python==0.3.36", "x"]\n')
    assert peers.pinned_version(f) == "0.3.36"
    f.write_text("dependencies = []\n")
    with pytest.raises(ValueError):
        peers.pinned_version(f)


def test_spec_types_from_help():
    help_text = ("--spec-draft-model, -md FNAME  draft model\n"
                 "--spec-type [none|draft-simple|draft-eagle3|ngram-simple|ngram-map-k|ngram-mod|ngram-cache]\n"
                 "                                        comma-separated list of types (default: none)\n")
    assert peers.spec_types(help_text) == ["draft-simple", "draft-eagle3", "ngram-simple", "ngram-map-k", "ngram-mod",
                                           "ngram-cache"]
    # the form 0.3.36's llama-server prints
    real = ("--spec-type none,draft-simple,draft-eagle3,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache\n"
            "                                        comma-separated list of types of speculative decoding to use (default:\n")
    assert peers.spec_types(real) == ["draft-simple", "draft-eagle3", "ngram-simple", "ngram-map-k", "ngram-map-k4v",
                                      "ngram-mod", "ngram-cache"]
    assert peers.spec_types("-md FNAME\n--draft-max N\n") == []


def test_timeline_stats_on_a_hand_made_timeline():
    """Two requests of 4 tokens: one streamed token by token (chunks 0.1 s apart after a 0.5 s
    first token), one in two chunks of 2 tokens (a speculative server); and one failure."""
    tls = [
        {"t0": 10.0, "chunks": [10.5, 10.6, 10.7, 10.8], "tokens": 4, "error": None, "proposed": 0, "accepted": 0},
        {"t0": 10.0, "chunks": [10.2, 10.6], "tokens": 4, "error": None, "proposed": 6, "accepted": 2},
        {"t0": 10.0, "chunks": [], "tokens": 0, "error": "APIConnectionError()"},
    ]
    s = serve_bench.timeline_stats(tls, wall_s=2.0)
    assert s["requests"] == 2 and s["failures"] == 1 and s["failure_examples"] == ["APIConnectionError()"]
    assert s["output_tokens"] == 8 and s["tokens_per_s"] == 4.0
    assert s["ttft_ms"] == {"p50": 500.0, "p99": 500.0}  # sorted [200, 500]: index int(0.5 * 2) = 1
    assert s["itl_ms"]["p50"] == pytest.approx(100.0) and s["itl_ms"]["p99"] == pytest.approx(400.0)  # gaps: .1 .1 .1 .4
    assert s["tpot_ms"]["p50"] == pytest.approx(133.33, abs=0.01)  # (10.6 - 10.2) / 3 and (10.8 - 10.5) / 3
    assert s["chunks_per_request"] == 3.0 and s["proposed_tokens"] == 6 and s["accepted_tokens"] == 2
    empty = serve_bench.timeline_stats([], wall_s=1.0)
    assert empty["tokens_per_s"] == 0.0 and empty["itl_ms"] == {"p50": None, "p99": None}


def test_cell_prompts_are_disjoint_across_client_counts():
    prompts = [("prose", [i]) for i in range(30)]
    cells = serve_bench.cell_prompts(prompts, [1, 2, 4, 8], 2)
    assert [len(cells[n]) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert all(len(c) == 2 for n in cells for c in cells[n])
    seen = [p[1][0] for n in cells for c in cells[n] for p in c]
    assert len(seen) == len(set(seen)) == 30
    with pytest.raises(ValueError, match="31 prompts needed|prompts needed"):
        serve_bench.cell_prompts(prompts[:29], [1, 2, 4, 8], 2)


def test_peer_checks_compare_against_the_peers():
    def cell(tps, p50=10.0, p99=15.0, failures=0):
        return {"tokens_per_s": tps, "itl_ms": {"p50": p50, "p99": p99}, "failures": failures}

    table = {
        1: {"draftd": cell(100.0, p50=10.0), "llama_plain": cell(90.0), "llama_ngram-mod": cell(110.0)},
        4: {"draftd": cell(300.0, p99=19.0), "llama_plain": cell(250.0), "llama_ngram-mod": cell(280.0)},
        8: {"draftd": cell(300.0, p99=25.0), "llama_plain": cell(320.0), "llama_ngram-mod": cell(200.0)},
    }
    c = serve_bench.peer_checks(table)
    assert c["1_client"]["llama_best"] == "llama_ngram-mod" and c["1_client"]["met"] is False
    assert c["4_clients"]["met"] is True and c["4_clients"]["itl_bound_ms"] == 20.0
    eight = c["8_clients"]
    assert eight["met_vs_plain"] is False and eight["met_vs_best_spec"] is True and eight["met_itl"] is False
    assert eight["met"] is False
    table[4]["draftd"]["failures"] = 1
    assert serve_bench.peer_checks(table)["4_clients"]["met"] is False


def test_parse_stat_reads_the_fields_after_the_command_name():
    # proc(5): pid (comm) state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime ...; a command name with spaces and a ")" must not shift them
    line = "4242 (uvic orn) x)) S 17 4242 4242 0 -1 4194560 100 0 0 0 1234 567 89 10 20 0 5 0 99 0 0\n"
    s = peers.parse_stat(line)
    assert s == {"pid": 4242, "ppid": 17, "utime": 1234, "stime": 567, "cutime": 89, "cstime": 10}
    with pytest.raises(ValueError, match="not a /proc"):
        peers.parse_stat("garbage")


def test_tree_cpu_ticks_sums_the_process_and_its_descendants_only():
    def st(pid, ppid, u, s, cu=0, cs=0):
        return {"pid": pid, "ppid": ppid, "utime": u, "stime": s, "cutime": cu, "cstime": cs}

    stats = {p["pid"]: p for p in (st(10, 1, 100, 20, 5, 1), st(11, 10, 7, 3), st(12, 11, 2, 2),
                                   st(13, 1, 1000, 1000), st(14, 13, 50, 50))}
    assert peers.tree_cpu_ticks(stats, 10) == 100 + 20 + 5 + 1 + 7 + 3 + 2 + 2  # 13 and 14 are not its own
    assert peers.tree_cpu_ticks(stats, 12) == 4
    assert peers.tree_cpu_ticks(stats, 99) == 0


def test_process_cpu_seconds_follows_this_process_cpu_clock():
    """Against CLOCK_PROCESS_CPUTIME_ID (time.process_time): burning CPU moves both by the same
    amount, within the stat file's tick (1 / SC_CLK_TCK) on each reading. Nothing timed."""
    import os
    import time

    tick = 1 / os.sysconf("SC_CLK_TCK")
    a, pa = peers.process_cpu_seconds(os.getpid()), time.process_time()
    x = 0
    while time.process_time() - pa < 0.3:
        x += 1
    b, pb = peers.process_cpu_seconds(os.getpid()), time.process_time()
    assert abs((b - a) - (pb - pa)) <= 3 * tick + 0.01
    with pytest.raises(ProcessLookupError):
        peers.process_cpu_seconds(2**22 + 12345)  # above pid_max's ceiling: no such process


def test_prometheus_values_and_counter_deltas_give_costs_per_token():
    text = ("# HELP llamacpp:n_decode_total calls\n# TYPE llamacpp:n_decode_total counter\n"
            "llamacpp:n_decode_total 140\nllamacpp:n_busy_slots_per_decode 2.5\n"
            "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"} 3\n")
    v = peers.prometheus_values(text)
    assert v == {"llamacpp:n_decode_total": 140.0, "llamacpp:n_busy_slots_per_decode": 2.5}
    d = serve_bench.counter_delta({"decode_calls": 10, "decode_rows": 30, "by_sequences": {"1": 4}},
                                  {"decode_calls": 74, "decode_rows": 330, "by_sequences": {"1": 4, "4": 60}})
    assert d == {"decode_calls": 64, "decode_rows": 300, "by_sequences": {"4": 60}}
    c = serve_bench.server_cost(1.6, d, output_tokens=256)
    assert c["cpu_ms_per_token"] == 6.25 and c["decode_calls_per_token"] == 0.25 and c["rows_per_token"] == 1.1719
    none = serve_bench.server_cost(None, {}, output_tokens=0)
    assert none["cpu_s"] is None and none["cpu_ms_per_token"] is None


def test_thread_ticks_and_the_busiest_thread():
    import os
    import threading
    import time

    ticks = peers.thread_cpu_ticks(os.getpid())
    assert threading.get_native_id() in ticks and all(v >= 0 for v in ticks.values())
    assert peers.thread_cpu_ticks(2**22 + 12345) == {}
    hz = os.sysconf("SC_CLK_TCK")
    # hand-made readings: thread 3 started in between and used the most
    assert peers.busiest_thread_seconds({1: 10, 2: 5}, {1: 30, 2: 6, 3: 25}) == 25 / hz
    assert peers.busiest_thread_seconds({}, {}) is None
    b0, pa = peers.thread_cpu_ticks(os.getpid()), time.process_time()
    while time.process_time() - pa < 0.2:
        pass
    top = peers.busiest_thread_seconds(b0, peers.thread_cpu_ticks(os.getpid()))
    assert abs(top - (time.process_time() - pa)) <= 3 / hz + 0.01  # this thread burnt it


def test_paired_ratio_is_the_geometric_mean_of_per_prompt_ratios():
    # draftd at 2x, then 0.5x, then 1x the peer's tokens/s: the geometric mean is 1; a failed prompt is left out
    a = [{"tokens": 64, "seconds": 0.5, "error": None}, {"tokens": 64, "seconds": 2.0, "error": None},
         {"tokens": 32, "seconds": 1.0, "error": None}, {"tokens": 64, "seconds": 1.0, "error": "boom"}]
    b = [{"tokens": 64, "seconds": 1.0, "error": None}, {"tokens": 64, "seconds": 1.0, "error": None},
         {"tokens": 32, "seconds": 1.0, "error": None}, {"tokens": 64, "seconds": 1.0, "error": None}]
    r = serve_bench.paired_ratio(a, b)
    assert r["pairs"] == 3 and r["ratio_geomean"] == 1.0
    lo, hi = r["ci95"]
    assert 0.5 <= lo < 1.0 < hi <= 2.0  # resamples of {2, 0.5, 1}: within the extremes, around the mean
    same = serve_bench.paired_ratio(a[:1] * 5, [{"tokens": 64, "seconds": 0.8, "error": None}] * 5)
    assert same["ratio_geomean"] == 1.6 and same["ci95"] == [1.6, 1.6]
    assert serve_bench.paired_ratio(a[3:], b[3:]) is None


def test_paired_one_client_reports_none_where_no_request_had_two_chunks(monkeypatch):
    # a helper's find: every request streamed its text in one chunk (max_tokens 1): no TPOT at all
    import types

    class _Client:
        def __init__(self, **kw):
            self.models = types.SimpleNamespace(list=lambda: types.SimpleNamespace(data=[types.SimpleNamespace(id="m")]))

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=_Client))
    monkeypatch.setattr(serve_bench, "stream_once", lambda oc, model, ids, n, extra: {
        "t0": 0.0, "chunks": [0.5], "tokens": 1, "error": None, "proposed": None, "accepted": None})
    out = serve_bench.paired_one_client({"draftd": ("u", True), "llama_plain": ("v", False)}, [("w", [1, 2])] * 3,
                                        1, [], gap_s=0)
    d = out["servers"]["draftd"]
    assert d["tpot_ms_median"] is None and d["ttft_ms_median"] == 500.0 and d["tokens_per_s_median"] == 2.0
    assert out["draftd_vs_llama_plain"]["ratio_geomean"] == 1.0 and out["draftd_vs_llama_plain"]["pairs"] == 3


def test_paired_rounds_send_each_round_concurrently_and_pair_the_rounds_aggregate(monkeypatch):
    # 2 clients: a round is two prompts at once; its tokens/s is both requests' tokens over the time
    # from the first sending to the last chunk. draftd's rounds end at 1.0 s, the peer's at 2.0 s
    import threading
    import types

    class _Client:
        def __init__(self, base_url, **kw):
            self.base_url = base_url
            self.models = types.SimpleNamespace(list=lambda: types.SimpleNamespace(data=[types.SimpleNamespace(id="m")]))

    seen: dict[str, set] = {"u": set(), "v": set()}
    inside, most = [0], [0]
    lock = threading.Lock()

    def fake(oc, model, ids, n, extra):
        import time as _t

        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        _t.sleep(0.05)  # long enough for the round's other request to be in flight too
        with lock:
            inside[0] -= 1
            seen[oc.base_url].add(tuple(ids))
        end = 1.0 if oc.base_url == "u" else 2.0
        return {"t0": 0.0, "chunks": [0.1, end], "tokens": 10, "error": None, "proposed": None, "accepted": None}

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=_Client))
    monkeypatch.setattr(serve_bench, "stream_once", fake)
    rounds = [[("w", [1, k]), ("w", [2, k])] for k in range(3)]
    out = serve_bench.paired_rounds({"draftd": ("u", True), "llama_plain": ("v", False)}, rounds, 10, [], gap_s=0)
    assert out["clients"] == 2 and out["rounds"] == 3 and out["prompts"] == 6
    assert most[0] == 2  # the round's two requests overlapped
    assert seen["u"] >= {(1, k) for k in range(3)} | {(2, k) for k in range(3)}
    d, p = out["servers"]["draftd"], out["servers"]["llama_plain"]
    assert d["tokens_per_s_median"] == 20.0 and p["tokens_per_s_median"] == 10.0  # 20 tokens in 1.0 s, in 2.0 s
    assert len(d["requests"]) == 6 and d["ttft_ms_median"] == 100.0
    r = out["draftd_vs_llama_plain"]
    assert r["ratio_geomean"] == 2.0 and r["pairs"] == 3


SPEC_TYPES = ["ngram-cache", "ngram-simple", "ngram-map-k", "draft-simple"]  # as spec_types reads a --help


def test_llama_runs_list_plain_each_ngram_type_then_the_draft_model(tmp_path):
    draft = tmp_path / "smollm2-layers-0-3.gguf"
    draft.write_bytes(b"GGUF")
    configs = ["draftd", "llama_plain", "llama_ngram", "llama_draft"]
    runs, skipped = serve_bench.llama_runs(configs, SPEC_TYPES, "auto", draft)
    assert runs == [("llama_plain", {}), ("llama_ngram-simple", {"spec_type": "ngram-simple"}),
                    ("llama_ngram-map-k", {"spec_type": "ngram-map-k"}),  # ngram-cache wants a cache file
                    ("llama_draft", {"draft_model": draft, "spec_type": "draft-simple"})]
    assert skipped == {}
    # -md with a llama.cpp that has no draft-simple type: no --spec-type for it
    runs, _ = serve_bench.llama_runs(["llama_draft"], ["ngram-simple"], "auto", draft)
    assert runs == [("llama_draft", {"draft_model": draft, "spec_type": None})]
    # without llama_draft asked for: neither run nor skipped, cached or not
    runs, skipped = serve_bench.llama_runs(["llama_plain", "llama_ngram"], SPEC_TYPES, "auto", tmp_path / "absent.gguf")
    assert [n for n, _ in runs] == ["llama_plain", "llama_ngram-simple", "llama_ngram-map-k"] and skipped == {}


def test_llama_runs_skip_an_uncached_draft_and_unlisted_ngram_types_with_the_reason(tmp_path):
    absent = tmp_path / "absent.gguf"
    runs, skipped = serve_bench.llama_runs(["llama_plain", "llama_ngram", "llama_draft"], SPEC_TYPES,
                                           "ngram-simple,ngram-mod", absent)
    assert runs == [("llama_plain", {}), ("llama_ngram-simple", {"spec_type": "ngram-simple"})]
    assert set(skipped) == {"llama_ngram-mod", "llama_draft"}
    assert skipped["llama_draft"].startswith(f"no derived draft GGUF cached at {absent} ")
    assert skipped["llama_ngram-mod"] == ("--spec-type ngram-mod is not in this llama-server's --help "
                                          "(its n-gram types: ngram-simple, ngram-map-k; name those or auto)")
    runs, skipped = serve_bench.llama_runs(["llama_ngram"], [], "auto", absent)
    assert runs == [] and skipped == {"llama_ngram": "this llama.cpp's llama-server has no --spec-type"}


def test_llama_runs_refuse_an_empty_ngram_type_list_naming_the_fix(tmp_path):
    # --ngram-types "" used to give no run and no skip reason: a silent empty result
    for empty in ("", " , ", ","):
        with pytest.raises(ValueError, match=r"--ngram-types '.*' names no n-gram type: .*ngram-simple.*auto"):
            serve_bench.llama_runs(["llama_plain", "llama_ngram"], SPEC_TYPES, empty, None)
        with pytest.raises(ValueError, match="names no n-gram type"):
            serve_bench.ngram_type_list(empty)
    # without llama_ngram asked for, the list is not read
    runs, skipped = serve_bench.llama_runs(["llama_plain"], SPEC_TYPES, "", None)
    assert runs == [("llama_plain", {})] and skipped == {}
    assert serve_bench.ngram_type_list("auto") is None
    assert serve_bench.ngram_type_list(" ngram-mod, ngram-simple,ngram-mod ") == ["ngram-mod", "ngram-simple"]


def test_llama_runs_skip_unknown_and_non_ngram_types_naming_what_is_listed():
    runs, skipped = serve_bench.llama_runs(["llama_ngram"], SPEC_TYPES, "ngram-simpel,draft-simple,ngram-simple", None)
    assert runs == [("llama_ngram-simple", {"spec_type": "ngram-simple"})]
    assert skipped == {
        # a typo: not listed
        "llama_ngram-simpel": "--spec-type ngram-simpel is not in this llama-server's --help (its n-gram types: "
                              "ngram-simple, ngram-map-k; name those or auto)",
        # listed, but not an n-gram type: it used to run as llama_draft-simple with no draft model
        "llama_draft-simple": "--ngram-types draft-simple: not an n-gram type (its n-gram types: ngram-simple, "
                              "ngram-map-k; name those or auto; the draft model runs as llama_draft)"}
    # auto on a llama-server whose --spec-type lists no n-gram type: llama_ngram skips, it used to vanish
    runs, skipped = serve_bench.llama_runs(["llama_plain", "llama_ngram"], ["draft-simple", "ngram-cache"], "auto")
    assert runs == [("llama_plain", {})]
    assert skipped == {"llama_ngram": "--ngram-types auto: this llama-server's --spec-type lists no n-gram type "
                                      "(it lists: draft-simple, ngram-cache)"}


def test_main_rejects_an_empty_ngram_type_list_before_starting_anything(monkeypatch, capsys):
    monkeypatch.setattr(serve_bench, "peer_main", lambda a: pytest.fail("peer_main ran with --ngram-types ''"))
    monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--peer", "--ngram-types", ""])
    with pytest.raises(SystemExit) as e:
        serve_bench.main()
    assert e.value.code == 2  # argparse's usage error
    assert "--ngram-types '' names no n-gram type" in capsys.readouterr().err


def test_paired_servers_start_the_draft_model_peer_and_name_its_command(tmp_path, monkeypatch):
    # issue 35: --paired ran llama_plain and the n-gram types only; llama_draft joins them
    import contextlib

    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    started, ports = [], iter(range(9001, 9100))
    monkeypatch.setitem(sys.modules, "peers", peers)
    monkeypatch.setattr(peers, "free_port", lambda: next(ports))

    @contextlib.contextmanager
    def fake_running(cmd, port, log_path, env=None, timeout_s=0):
        started.append((cmd, log_path.name))
        yield f"http://127.0.0.1:{port}", None

    monkeypatch.setattr(peers, "running_process", fake_running)
    runs, _ = serve_bench.llama_runs(["llama_plain", "llama_ngram", "llama_draft"], SPEC_TYPES, "ngram-simple", draft)
    commands: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        servers, failed = serve_bench.paired_servers(stack, runs, Path("/b/llama-server"), Path("/m/t.gguf"), width=4,
                                                     ctx_per_slot=512, threads=2, logs=tmp_path, commands=commands)
    assert failed == {}
    assert servers == {"llama_plain": ("http://127.0.0.1:9001/v1", False),
                       "llama_ngram-simple": ("http://127.0.0.1:9002/v1", False),
                       "llama_draft": ("http://127.0.0.1:9003/v1", False)}
    assert [log for _, log in started] == ["llama_plain-paired.log", "llama_ngram-simple-paired.log",
                                           "llama_draft-paired.log"]
    cmd = started[2][0]
    assert cmd[cmd.index("-md") + 1] == str(draft) and cmd[cmd.index("--spec-type") + 1] == "draft-simple"
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-c") + 1] == "2048"
    assert commands["llama_draft"] == " ".join(cmd[1:]).replace("9003", "PORT")
    assert "--port PORT" in commands["llama_draft"] and f"-md {draft}" in commands["llama_draft"]
    assert set(commands) == set(servers)


# a stand-in for llama-server: answers /health and /v1/models on its --port until SIGTERM, or, with
# -md (the draft-model configuration), answers /health but refuses /v1/models with a 503
FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

refuse = "-md" in sys.argv


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/v1/models" and refuse:
            code, body = 503, {"error": {"message": "loading model", "code": 503}}
        elif self.path in ("/health", "/v1/models"):
            code, body = 200, {"status": "ok", "object": "list", "data": [{"id": "m", "object": "model",
                                                                           "created": 0, "owned_by": "x"}]}
        else:
            code, body = 404, {}
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def _fake_llama_server(tmp_path):
    """A shell script in llama-server's place: with ``--spec-type ngram-simple`` it prints 60 lines
    of loading (about 2.4 kB) and an error on stderr and exits 1 at start; otherwise it runs FAKE_SERVER."""
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\n"
                      'case " $* " in *" --spec-type ngram-simple "*)\n'
                      '  for i in $(seq 60); do echo "load_tensors: layer $i assigned to device CPU" >&2; done\n'
                      '  echo "error: the ngram-simple draft needs --spec-ngram-size-n >= 1" >&2; exit 1;;\n'
                      "esac\n"
                      f'exec "{sys.executable}" "{tmp_path / "fake_server.py"}" "$@"\n')
    script.chmod(0o755)
    return script


def test_paired_run_records_a_peer_that_exits_at_start_and_one_that_refuses_and_measures_the_rest(tmp_path,
                                                                                                   monkeypatch):
    # issue 35: one llama-server exiting at its start (or refusing requests) aborted the whole paired bench
    import argparse
    import contextlib

    monkeypatch.setitem(sys.modules, "peers", peers)
    binary = _fake_llama_server(tmp_path)
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    runs, _ = serve_bench.llama_runs(["llama_plain", "llama_ngram", "llama_draft"], SPEC_TYPES, "ngram-simple", draft)
    assert [n for n, _ in runs] == ["llama_plain", "llama_ngram-simple", "llama_draft"]

    def fake_stream(oc, model, ids, n, extra):  # draftd streams its 10 tokens in 0.5 s, the peer in 1.0 s
        end = 0.5 if "workload" in extra else 1.0
        return {"t0": 0.0, "chunks": [0.1, end], "tokens": 10, "error": None, "proposed": None, "accepted": None}

    monkeypatch.setattr(serve_bench, "stream_once", fake_stream)
    plan = serve_bench.PeerPlan(clients=[1], threads=1, fmt="packaged", target=Path("/m/t.gguf"), draft=draft,
                                workloads=["w"], per_workload=2, cells={1: [[("w", [1, 2]), ("w", [3, 4])]]}, warm=[],
                                configs=["draftd", "llama_plain", "llama_ngram", "llama_draft"], binary=binary,
                                types=SPEC_TYPES, logs=tmp_path)
    a = argparse.Namespace(ctx_per_slot=64, max_tokens=10)
    result: dict = {"commands": {}}
    with contextlib.ExitStack() as stack:
        port = peers.free_port()  # draftd's stand-in: the same fake, no -md
        dbase, _ = stack.enter_context(peers.running_process([str(binary), "--port", str(port)], port,
                                                             tmp_path / "draftd.log", timeout_s=60))
        serve_bench.run_paired(stack, a, plan, runs, result, dbase + "/v1")
    failed = result["failed"]
    assert set(failed) == {"llama_ngram-simple", "llama_draft"}
    # the one that exited: its exit status and its stderr's tail
    assert failed["llama_ngram-simple"].startswith("the server exited with 1 before /health answered")
    assert failed["llama_ngram-simple"].rstrip().endswith("error: the ngram-simple draft needs --spec-ngram-size-n >= 1")
    # the one that came up but refused: its /models' 503
    assert failed["llama_draft"].startswith("GET http://127.0.0.1:") and "/v1/models failed" in failed["llama_draft"]
    assert "503" in failed["llama_draft"] and "loading model" in failed["llama_draft"]
    paired = result["paired"]
    assert paired["failed"] == {"llama_draft": failed["llama_draft"]}
    assert list(paired["servers"]) == ["draftd", "llama_plain"]  # the two left out are not measured
    assert paired["servers"]["draftd"]["tokens_per_s_median"] == 20.0  # 10 tokens in 0.5 s
    assert paired["servers"]["llama_plain"]["tokens_per_s_median"] == 10.0
    assert paired["draftd_vs_llama_plain"]["ratio_geomean"] == 2.0 and paired["draftd_vs_llama_plain"]["pairs"] == 2
    assert "draftd_vs_llama_draft" not in paired and "draftd_vs_llama_ngram-simple" not in paired
    assert set(result["commands"]) == {"llama_plain", "llama_ngram-simple", "llama_draft"}  # what was tried


def test_paired_rounds_leave_out_a_server_whose_warm_up_fails_and_run_none_when_all_fail(monkeypatch):
    import types

    class _Client:
        def __init__(self, base_url, **kw):
            self.base_url = base_url
            self.models = types.SimpleNamespace(list=lambda: types.SimpleNamespace(data=[types.SimpleNamespace(id="m")]))

    def fake(oc, model, ids, n, extra):
        err = "APIStatusError('slot unavailable')" if oc.base_url == "v" else None
        return {"t0": 0.0, "chunks": [] if err else [0.1, 1.0], "tokens": 0 if err else 10, "error": err,
                "proposed": None, "accepted": None}

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=_Client))
    monkeypatch.setattr(serve_bench, "stream_once", fake)
    out = serve_bench.paired_rounds({"draftd": ("u", True), "llama_plain": ("v", False)}, [[("w", [1])]] * 2, 10, [],
                                    gap_s=0)
    assert out["failed"] == {"llama_plain": "warm-up request failed: APIStatusError('slot unavailable')"}
    assert list(out["servers"]) == ["draftd"] and out["servers"]["draftd"]["tokens_per_s_median"] == 10.0
    out = serve_bench.paired_rounds({"llama_plain": ("v", False)}, [[("w", [1])]] * 2, 10, [], gap_s=0)
    assert list(out["failed"]) == ["llama_plain"] and out["servers"] == {} and out["rounds"] == 2


def test_peer_load_gives_a_refusing_server_an_error_cell(monkeypatch):
    # the sequential cells: a /models that raises was an exception through the whole bench
    import types

    def refuse():
        raise ConnectionError("connection refused")

    class _Client:
        def __init__(self, **kw):
            self.models = types.SimpleNamespace(list=refuse)

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=_Client))
    cell = serve_bench.peer_load("http://127.0.0.1:1/v1", [[("w", [1])]], 4, draftd=False)
    assert cell == {"error": "GET http://127.0.0.1:1/v1/models failed: ConnectionError('connection refused')"}


def test_sequential_cells_record_a_peer_that_exits_at_start_with_its_stderr_tail_and_go_on(tmp_path, monkeypatch):
    # the error cell kept the first 1500 characters of the reason: the log's tail, where the
    # error is, was cut off once the log passed them; a refusing server aborted the bench
    import argparse

    monkeypatch.setitem(sys.modules, "peers", peers)
    binary = _fake_llama_server(tmp_path)
    draft = tmp_path / "d.gguf"
    draft.write_bytes(b"GGUF")
    runs, _ = serve_bench.llama_runs(["llama_plain", "llama_ngram", "llama_draft"], SPEC_TYPES, "ngram-simple", draft)
    monkeypatch.setattr(serve_bench, "stream_once", lambda oc, model, ids, n, extra: {
        "t0": 0.0, "chunks": [0.1, 0.5], "tokens": 4, "error": None, "proposed": None, "accepted": None})
    cells = {1: [[("w", [1, 2])]], 2: [[("w", [3])], [("w", [4])]]}
    plan = serve_bench.PeerPlan(clients=[1, 2], threads=1, fmt="packaged", target=Path("/m/t.gguf"), draft=draft,
                                workloads=["w"], per_workload=3, cells=cells, warm=[],
                                configs=["llama_plain", "llama_ngram", "llama_draft"], binary=binary,
                                types=SPEC_TYPES, logs=tmp_path)
    table: dict = {1: {}, 2: {}}
    saved = []
    serve_bench.run_cells(argparse.Namespace(ctx_per_slot=64, max_tokens=4), plan, runs, {"commands": {}}, table,
                          None, lambda: saved.append(1))
    assert len(saved) == 6  # every cell, failed or not, written out
    for n in (1, 2):
        assert table[n]["llama_plain"]["requests"] == n and table[n]["llama_plain"]["failures"] == 0
        err = table[n]["llama_ngram-simple"]["error"]
        assert err.startswith("the server exited with 1 before /health answered")
        assert len(err) > 1500 and err.rstrip().endswith("error: the ngram-simple draft needs --spec-ngram-size-n >= 1")
        assert "/v1/models failed" in table[n]["llama_draft"]["error"] and "503" in table[n]["llama_draft"]["error"]


def test_paired_rounds_report_itl_quantiles_pooled_over_chunk_gaps(monkeypatch):
    """Hand-made timelines (t0 = 0): request A streams 101 chunks whose 100 gaps are 1..100 ms in
    a shuffled order, B two chunks 500 ms apart (5 tokens: one speculative chunk), C one chunk, D
    fails after chunks 1000 ms apart (left out of every latency). Pooled gaps: 1..100 and 500 ms."""
    import random
    import types

    import numpy as np

    order = list(range(1, 101))
    random.Random(3).shuffle(order)
    a_chunks = [0.2]
    for g in order:
        a_chunks.append(a_chunks[-1] + g / 1e3)
    timelines = {1: {"chunks": a_chunks, "tokens": 101, "error": None},
                 2: {"chunks": [0.3, 0.8], "tokens": 5, "error": None},
                 3: {"chunks": [0.4], "tokens": 1, "error": None},
                 4: {"chunks": [0.1, 1.1], "tokens": 2, "error": "APIError('boom')"}}

    class _Client:
        def __init__(self, base_url, **kw):
            self.models = types.SimpleNamespace(list=lambda: types.SimpleNamespace(data=[types.SimpleNamespace(id="m")]))

    def fake(oc, model, ids, n, extra):
        tl = timelines.get(ids[0], {"chunks": [0.1, 0.2], "tokens": 2, "error": None})  # the warm-up
        return {"t0": 0.0, "proposed": None, "accepted": None, **tl}

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=_Client))
    monkeypatch.setattr(serve_bench, "stream_once", fake)
    rounds = [[("w", [1]), ("w", [2])], [("w", [3]), ("w", [4])]]
    out = serve_bench.paired_rounds({"draftd": ("u", True)}, rounds, 8, [], gap_s=0)
    d = out["servers"]["draftd"]
    pooled = sorted(list(range(1, 101)) + [500])  # 101 gaps, ms
    # pct's convention: the sorted sample's element at index int(q * n): 50, 90, 99 of 101; here
    # q * (n - 1) is a whole number, so numpy's "higher" method reads the same elements
    assert [pooled[int(q * 101)] for q in (0.5, 0.9, 0.99)] == [51, 91, 100]
    assert [float(np.percentile(pooled, q, method="higher")) for q in (50, 90, 99)] == [51.0, 91.0, 100.0]
    assert d["itl_ms"] == pytest.approx({"p50": 51.0, "p90": 91.0, "p99": 100.0, "max": 500.0})
    assert d["ttft_ms"] == pytest.approx({"p50": 300.0, "p99": 400.0})  # sorted [200, 300, 400]: indices 1, 2
    # TPOT: A (5050 ms over 100 tokens after the first) 50.5, B 500 / 4 = 125; C has one chunk
    assert d["tpot_ms"] == pytest.approx({"p50": 125.0, "p99": 125.0})  # sorted [50.5, 125]: index 1 both
    rows = {r["tokens"]: r for r in d["requests"]}
    assert [(rows[t]["chunks"], rows[t]["itl_max_ms"]) for t in (101, 5, 1, 2)] == \
        [(101, pytest.approx(100.0)), (2, pytest.approx(500.0)), (1, None), (2, pytest.approx(1000.0))]
    assert d["failures"] == 1
    assert all(not isinstance(v, list) for r in d["requests"] for v in r.values())  # no per-gap lists


def _paired_run(n, itl_p50=10.0, itl_p99=15.0, failures=0, **ratios):
    """A --paired run's JSON at ``n`` clients: draftd's ITL and failures, draftd_vs_<peer> entries
    from ``peer=(ratio, lower, upper)``."""
    p = {"clients": n, "failed": {},
         "servers": {"draftd": {"failures": failures, "tokens_per_s_median": 100.0 * n,
                                "itl_ms": {"p50": itl_p50, "p90": itl_p99, "p99": itl_p99, "max": itl_p99}}}}
    for peer, (g, lo, hi) in ratios.items():
        p["servers"][peer] = {"failures": 0}
        p[f"draftd_vs_{peer}"] = {"ratio_geomean": g, "ci95": [lo, hi], "pairs": 10}
    return {"mode": "peer", "paired": p}


def test_paired_checks_meet_every_target():
    one = _paired_run(1, itl_p50=10.0, llama_plain=(1.3, 1.1, 1.5), **{"llama_ngram-mod": (1.2, 1.05, 1.3)})
    four = _paired_run(4, itl_p99=19.0, llama_plain=(1.4, 1.2, 1.6), **{"llama_ngram-mod": (1.5, 1.3, 1.7),
                                                                        "llama_ngram-simple": (1.1, 0.95, 1.3)})
    c = serve_bench.paired_checks([one, four])
    assert c["1_client"]["llama_best"] == "llama_ngram-mod" and c["1_client"]["vs_best"] == 1.2
    assert c["1_client"]["met"] is True and c["1_client"]["vs_best_interval_above_1"] is True
    f = c["4_clients"]
    assert f["vs_plain"] == 1.4 and f["vs_plain_ci"] == [1.2, 1.6] and f["met_vs_plain"] is True
    # the best speculative peer is the one draftd's ratio is lowest against; met, its interval not above 1
    assert f["llama_best_spec"] == "llama_ngram-simple" and f["vs_best_spec"] == 1.1
    assert f["met_vs_best_spec"] is True and f["vs_best_spec_interval_above_1"] is False
    assert f["itl_bound_ms"] == 20.0 and f["met_itl"] is True and f["met_failures"] is True and f["met"] is True
    assert "rule" in c and set(c) >= {"1_client", "4_clients"}


def test_paired_checks_miss_each_target():
    one = _paired_run(1, itl_p50=10.0, llama_plain=(1.3, 1.1, 1.5), **{"llama_ngram-mod": (0.97, 0.9, 1.05)})
    c = serve_bench.paired_checks([one, _paired_run(4, llama_plain=(1.2, 1.1, 1.3), **{"llama_ngram-mod": (1.1, 1, 1.2)})])
    assert c["1_client"]["llama_best"] == "llama_ngram-mod" and c["1_client"]["met"] is False
    assert c["4_clients"]["met"] is True
    misses = {"met_vs_plain": _paired_run(4, llama_plain=(0.99, 0.9, 1.1), **{"llama_ngram-mod": (1.1, 1, 1.2)}),
              "met_vs_best_spec": _paired_run(4, llama_plain=(1.2, 1.1, 1.3), **{"llama_ngram-mod": (0.9, 0.8, 1.0)}),
              "met_itl": _paired_run(4, itl_p99=20.01, llama_plain=(1.2, 1.1, 1.3), **{"llama_ngram-mod": (1.1, 1, 1.2)}),
              "met_failures": _paired_run(4, failures=1, llama_plain=(1.2, 1.1, 1.3), **{"llama_ngram-mod": (1.1, 1, 1.2)})}
    for key, run in misses.items():
        chk = serve_bench.paired_checks([one, run])["4_clients"]
        assert chk[key] is False and chk["met"] is False, key
        assert all(chk[k] is True for k in ("met_vs_plain", "met_vs_best_spec", "met_itl", "met_failures") if k != key)
    # no speculative peer measured (e.g. every one failed at start): not met, and it says which were left out
    lone = _paired_run(8, llama_plain=(1.2, 1.1, 1.3))
    lone["paired"]["failed"] = {"llama_ngram-mod": "the server exited with 1"}
    chk = serve_bench.paired_checks([one, lone])["8_clients"]
    assert chk["met_vs_best_spec"] is None and chk["met"] is False and chk["left_out"] == ["llama_ngram-mod"]


def test_paired_checks_read_files_and_refuse_what_they_cannot_check(tmp_path, monkeypatch, capsys):
    import json

    f1, f4 = tmp_path / "a_c1.json", tmp_path / "a_c4.json"
    f1.write_text(json.dumps(_paired_run(1, llama_plain=(1.3, 1.1, 1.5))))
    f4.write_text(json.dumps(_paired_run(4, itl_p99=25.0, llama_plain=(1.4, 1.2, 1.6))))
    monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--check-paired", str(f1), str(f4)])
    serve_bench.main()
    out = json.loads(capsys.readouterr().out)
    assert out["sources"] == {"1": str(f1), "4": str(f4)}
    assert out["4_clients"]["met_itl"] is False and out["4_clients"]["draftd_itl_p99_ms"] == 25.0
    with pytest.raises(ValueError, match="no 1-client paired run"):
        serve_bench.paired_checks([f4])
    with pytest.raises(ValueError, match="both 4-client runs"):
        serve_bench.paired_checks([f1, f4, f4])
    with pytest.raises(ValueError, match="not a --paired run"):
        serve_bench.paired_checks([{"mode": "peer", "results": {}}, f1])
    monkeypatch.setattr(sys, "argv", ["serve_bench.py", "--check-paired", str(f4)])
    with pytest.raises(SystemExit) as e:
        serve_bench.main()
    assert e.value.code == 2 and "pass the 1-client file" in capsys.readouterr().err


def test_paired_checks_name_a_file_that_is_not_json_or_not_a_run(tmp_path):
    """Found by the break session: an empty, truncated or non-UTF-8 file gave the decoder's message
    without the path; ``"clients": true`` read as a 1-client run."""
    import json

    for name, data in (("empty.json", b""), ("cut.json", b'{"paired": '), ("bin.json", b"\xff\xfe{")):
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}: not JSON"):
            serve_bench.paired_checks([f])
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"paired": {"clients": True, "servers": {}}}))
    with pytest.raises(ValueError, match="odd.json: not a --paired run"):
        serve_bench.paired_checks([odd])


def test_paired_checks_refuse_runs_of_two_cpus(tmp_path):
    """Found by the break session: an AMX Xeon's 1-client run and a Zen 4's 4-client run gave a verdict."""
    import json

    a = {**_paired_run(1, llama_plain=(1.3, 1.1, 1.5)), "cpu": "AMD EPYC, family 25 model 1"}
    b = {**_paired_run(4, itl_p99=25.0, llama_plain=(1.4, 1.2, 1.6)), "cpu": "AMD EPYC, family 25 model 17"}
    fa, fb = tmp_path / "a_c1.json", tmp_path / "b_c4.json"
    fa.write_text(json.dumps(a)), fb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="b_c4.json ran on 'AMD EPYC, family 25 model 17' and .*a_c1.json"):
        serve_bench.paired_checks([fa, fb])
    fb.write_text(json.dumps({**b, "cpu": a["cpu"]}))
    assert serve_bench.paired_checks([fa, fb])["sources"] == {"1": str(fa), "4": str(fb)}
    assert serve_bench.cpu_name() is None or "family" in serve_bench.cpu_name()
