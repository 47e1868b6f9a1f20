"""`daemonctl generate` / `bench` refuse bad options before loading any model (exit 2, message
naming the option), instead of a traceback after the load or a silently wrong result."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from daemon.cli import app
from daemon.cli_decode import check_generate_args, parse_gammas

# A target that cannot load: if validation ran after the load, the error would be about it.
NOLOAD = ["--target", "/nonexistent/draftd-qa-model"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-p", "hi", "--gamma", "-1"], "--gamma -1"),
        (["-p", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["-p", ""], "--prompt is empty"),
        (["-p", "hi", "--stop", ""], "--stop ''"),
        (["-p", "hi", "--temperature", "inf"], "--temperature inf"),
        (["-p", "hi", "--draft-vocab", "-5"], "--draft-vocab -5"),
        (["-p", "hi", "--draft-precision", "fp16"], "--draft-precision 'fp16': use one of auto, fp32, bf16"),
        (["-p", "hi", "--engine", "gpu"], "--engine 'gpu'"),
        (["-p", "hi", "--proposer", "eagle"], "use one or more of draft, ngram"),
        (["-p", "hi", "--proposer", "ngram,draft"], "one request runs one proposer"),
        # the seed was checked by the sampler, after the models had loaded (minutes for a first download)
        (["-p", "hi", "--temperature", "1", "--seed", str(2**64)], f"--seed {2**64}: "),
        (["-p", "hi", "--seed", str(-(2**63) - 1)], f"--seed {-(2**63) - 1}: "),
    ],
)
def test_generate_rejects_bad_options_before_loading(args, needle):
    r = CliRunner().invoke(app, ["generate", *args, *NOLOAD])
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split()), r.output


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--gammas", "x"], "'x' is not an integer"),
        (["--gammas", "2,,4"], "'' is not an integer"),
        (["--gammas", "-1"], "must be >= 1"),
        (["--prompts", "0"], "--prompts 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["--draft-precision", "int4"], "--draft-precision 'int4'"),
        (["--engine", "vllm"], "--engine 'vllm': use one of auto, torch, llamacpp"),
        (["--proposers", "ngram,medusa"], "use one or more of draft, ngram"),
        (["--proposers", "ngram,ngram"], "each once"),
        (["--adapter", "/nonexistent/adapter"], "no adapter_config.json"),
        (["--llamacpp-peer", "--engine", "torch"], "--llamacpp-peer needs a GGUF target"),
    ],
)
def test_bench_rejects_bad_options_before_loading(args, needle):
    r = CliRunner().invoke(app, ["bench", "--workloads", "math", *args, *NOLOAD])
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split()), r.output


def test_bench_refuses_a_workload_without_prompts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    r = CliRunner().invoke(app, ["bench", "--workloads", str(empty), *NOLOAD])
    assert r.exit_code == 2, r.output
    assert "has no prompts" in " ".join(r.output.split())


@pytest.mark.parametrize("seed, ok", [(0, True), (2**63 - 1, True), (-(2**63), True), (-1, True),
                                      (2**63, False), (2**64 - 1, False), (2**64, False), (-(2**63) - 1, False)])
def test_generate_and_the_api_take_the_same_seeds(seed, ok):
    """`generate --seed` took -2^63 to 2^64 - 1 while the API's `seed` took -2^63 to 2^63 - 1 (vLLM's
    int64 bound): a seed of 2^63 ran from the command line and was a 400 from a client. Both take
    the signed range now, and both refusals name the value and the range."""
    from daemon.serve import ApiError, parse_request
    from serve_helpers import MODEL, tokenizer

    tok = tokenizer()
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 2, "temperature": 1.0, "seed": seed}
    parse = lambda: parse_request(body, "completion", tok, models={MODEL}, context_len=512,  # noqa: E731
                                  vocab=len(tok.get_vocab()), max_tokens_default=4)
    if ok:
        check_generate_args("hi", 4, 8, 1.0, None, 0, seed)
        assert parse().seed == seed
        return
    with pytest.raises(ValueError) as cli:
        check_generate_args("hi", 4, 8, 1.0, None, 0, seed)
    with pytest.raises(ApiError) as api:
        parse()
    assert api.value.param == "seed"
    for msg in (str(cli.value), api.value.message):
        assert str(seed) in msg and str(-(2**63)) in msg and str(2**63 - 1) in msg, msg


def test_an_unsigned_seed_past_the_signed_range_is_told_its_signed_twin():
    """2^64 - 1 (an unsigned -1) draws as -1 (seeded_generator reads seeds modulo 2^64): the refusal
    says which signed seed to send instead."""
    with pytest.raises(ValueError, match=r"send -1 \(the seed minus 2\^64\)"):
        check_generate_args("hi", 4, 8, 1.0, None, 0, 2**64 - 1)


def test_good_options_pass():
    check_generate_args("hi", 0, 1, 0.7, ["\n\n"], 0)
    assert parse_gammas("1, 2,4") == (1, 2, 4)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--source", "web"], "--source 'web'"),
        (["--workloads", "prose,nope"], "no built-in corpus for workload 'nope'"),
        (["--source", "decode", "--workloads", "nope"], "unknown workload 'nope'"),
        (["--workloads", ",,"], "names no workload"),
        (["--source", "decode", "--prompts", "0"], "--prompts"),
        (["--max-steps", "0"], "--max-steps"),
        (["--max-seconds", "inf"], "--max-seconds"),
    ],
)
def test_bootstrap_rejects_bad_options_before_loading(args, needle, monkeypatch):
    monkeypatch.setenv("DRAFTD_MODELS__TARGET", "/nonexistent/draftd-qa-model")
    r = CliRunner().invoke(app, ["bootstrap", *args])
    assert r.exit_code == 2, r.output
    assert needle in " ".join(r.output.split()), r.output


def test_demo_with_a_target_that_cannot_load_says_so_and_keeps_the_last_runs_state(monkeypatch):
    """`DRAFTD_MODELS__TARGET=smollm2-135m@q9 daemonctl demo`: exit 2 with the model error in a line
    (no traceback), and the previous run's keys under the demo's prefix are left as they were (the
    pair loads before the demo empties its namespace)."""
    pytest.importorskip("llama_cpp")
    import uuid

    import redis

    prefix = f"draftd-qa-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    client.set(f"{prefix}demo:last-run", "kept")
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", prefix)
    monkeypatch.setenv("DRAFTD_MODELS__TARGET", "smollm2-135m@q9")
    try:
        r = CliRunner().invoke(app, ["demo", "--quick"])
        out = " ".join(r.output.split())
        assert r.exit_code == 2, r.output
        assert "error: model 'smollm2-135m@q9': 'q9' is not a llama.cpp weight format" in out, r.output
        assert "Traceback" not in r.output
        assert client.get(f"{prefix}demo:last-run") == b"kept"
    finally:
        client.delete(f"{prefix}demo:last-run")


def test_demo_refuses_a_negative_draft_vocab_before_loading(monkeypatch):
    r = CliRunner().invoke(app, ["demo", "--quick", "--draft-vocab", "-5"])
    assert r.exit_code == 2, r.output
    assert "--draft-vocab=-5: must be >= 0 (0 = the full vocabulary)" in " ".join(r.output.split()), r.output


def test_the_demo_trains_and_serves_the_restricted_head_it_is_given():
    """DemoConfig.draft_vocab: None takes models.draft_vocab when set (0 too), else 8192; 0 the full
    vocabulary; the demo's settings (what the bootstrap's cache key, the trainer and the decoder
    read) carry it."""
    from daemon.demo import DemoConfig, demo_settings
    from daemon.settings import Settings

    def effective(cfg, configured):
        return demo_settings(Settings(models={"draft_vocab": configured}), cfg).models.draft_vocab

    assert effective(DemoConfig.quick(), None) == 8192
    assert effective(DemoConfig.quick(), 0) == 0  # set to the full vocabulary
    assert effective(DemoConfig.quick(), 4096) == 4096
    assert effective(DemoConfig.quick(draft_vocab=0), 4096) == 0
    assert effective(DemoConfig.quick(draft_vocab=1024), 0) == 1024
    assert DemoConfig.quick().per_workload is True


def test_the_quick_demo_leaves_the_ablation_rows_out_unless_asked():
    """The copy channel's two ablation rows are a third of the evaluation's decoding: --quick
    leaves them out, the full demo keeps them, --ablation / --no-ablation override either."""
    from daemon.demo import DemoConfig

    assert DemoConfig.quick().copy_ablation is False and DemoConfig().copy_ablation is True
    assert DemoConfig.quick(copy_ablation=True).copy_ablation is True


def test_a_config_error_holding_rich_markup_is_printed_as_written(monkeypatch):
    # the break session of the thirteenth: DRAFTD_API__PORT='[/x]' crashed `daemonctl status` with
    # rich's MarkupError, and "[got 'abc']" vanished as a style tag
    monkeypatch.setenv("DRAFTD_API__PORT", "[/x]")
    r = CliRunner().invoke(app, ["status"])
    assert r.exit_code == 2, r.output
    assert "config error" in r.output and "[/x]" in r.output.replace("\n", "")
    monkeypatch.setenv("DRAFTD_API__PORT", "abc")
    r = CliRunner().invoke(app, ["status"])
    assert r.exit_code == 2 and "[got 'abc']" in " ".join(r.output.split()), r.output


@pytest.fixture
def loads(monkeypatch):
    """generate's model loading replaced by a recorder that stops there: the formats it was asked for."""
    import os

    from daemon import cli_decode

    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    asked = []

    def record(*args, target_format="packaged", format_max_seconds=None, **kw):
        asked.append((target_format, format_max_seconds))
        raise ValueError("stopped before loading")

    monkeypatch.setattr(cli_decode, "_load", record)
    return asked


@pytest.mark.parametrize("env, args, want", [
    ({}, [], ("packaged", None)),  # unset: no measurement before one prompt
    ({"DRAFTD_MODELS__FORMAT": "f16"}, [], ("F16", None)),  # the break helper's: ignored, packaged decoded
    ({"DRAFTD_MODELS__FORMAT": "auto", "DRAFTD_MODELS__FORMAT_MAX_SECONDS": "30"}, [], ("auto", 30.0)),
    ({"DRAFTD_MODELS__FORMAT": "F16"}, ["--format", "Q8_0"], ("Q8_0", None)),  # the option first
    # --format auto measures within serve's budget (a break session: the budget was dropped with the option)
    ({"DRAFTD_MODELS__FORMAT_MAX_SECONDS": "45"}, ["--format", "auto"], ("auto", 45.0)),
])
def test_generate_decodes_the_format_serve_is_configured_with(loads, monkeypatch, env, args, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    r = CliRunner().invoke(app, ["generate", "-p", "hi", *args])
    assert r.exit_code == 2 and "stopped before loading" in r.output, r.output
    assert loads == [want]


def test_generate_from_a_config_file_format_and_a_bad_one_named(loads, monkeypatch, tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[models]\nformat = "Q8_0"\n')
    monkeypatch.setenv("DRAFTD_CONFIG", str(p))
    CliRunner().invoke(app, ["generate", "-p", "hi"])
    assert loads == [("Q8_0", None)]
    monkeypatch.setenv("DRAFTD_MODELS__FORMAT", "Q9_9")
    r = CliRunner().invoke(app, ["generate", "-p", "hi"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "models.format (DRAFTD_MODELS__FORMAT): models.format 'Q9_9' is not a weight format" in out, out
    assert "[got 'Q9_9']" in out and loads == [("Q8_0", None)], out  # refused before any load, printed as written
