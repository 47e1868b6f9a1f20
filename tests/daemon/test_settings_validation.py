"""Configuration mistakes fail at load time as ConfigError naming the setting or file: bad TOML,
unknown keys in a group (TOML or DRAFTD_<GROUP>__<FIELD>), unknown loss/weighting names, a Redis
URL without a scheme."""

from __future__ import annotations

import typing

import pytest

from daemon.settings import ConfigError, LossName, WeightingName, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("DRAFTD_"):
            monkeypatch.delenv(k)


def test_bad_toml_names_the_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[redis\nurl=")
    with pytest.raises(ConfigError, match="bad.toml.*not valid TOML"):
        load_settings(p)


def test_unknown_key_in_toml_group(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[trainer]\nintervl_s = 60\n")
    with pytest.raises(ConfigError, match="trainer.intervl_s"):
        load_settings(p)


@pytest.mark.parametrize(
    "var, value, needle",
    [
        ("DRAFTD_TRAINER__INTERVL_S", "60", "trainer.intervl_s"),
        ("DRAFTD_TRAINER__LOSS", "foo", "trainer.loss"),
        ("DRAFTD_TRAINER__WEIGHTING", "bar", "trainer.weighting"),
        ("DRAFTD_REDIS__URL", "127.0.0.1:6379", "not a Redis URL"),
        ("DRAFTD_TRAINER__REPLAY_RATIO", "inf", "trainer.replay_ratio"),
        ("DRAFTD_MODELS__DRAFT_VOCAB", "-1", "models.draft_vocab"),
        ("DRAFTD_TRAINER__PROMOTE_MARGIN", "nan", "trainer.promote_margin"),  # NaN promoted every head
        ("DRAFTD_TRAINER__REGRESS_MARGIN", "nan", "trainer.regress_margin"),
        ("DRAFTD_TRAINER__HEAD_STEPS", "1.5", "trainer.head_steps"),
        ("DRAFTD_MODELS__FORMAT_MAX_SECONDS", "0", "models.format_max_seconds"),
    ],
)
def test_bad_env_values(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=needle):
        load_settings()


def test_good_values_load(monkeypatch):
    monkeypatch.setenv("DRAFTD_TRAINER__LOSS", "jsd")
    monkeypatch.setenv("DRAFTD_REDIS__URL", "unix:///tmp/redis.sock")
    s = load_settings()
    assert s.trainer.loss == "jsd" and s.redis.url == "unix:///tmp/redis.sock"
    assert s.models.format_max_seconds is None  # unset: the measurement's budget is scaled to the host
    monkeypatch.setenv("DRAFTD_MODELS__FORMAT_MAX_SECONDS", "90")
    assert load_settings().models.format_max_seconds == 90.0


def test_null_unsets_an_optional_cap_from_the_environment(monkeypatch):
    """Without it the byte and age caps could be lowered but never unset from the environment."""
    assert load_settings().store.buffer_max_bytes == 1 << 30
    monkeypatch.setenv("DRAFTD_STORE__BUFFER_MAX_BYTES", "null")
    monkeypatch.setenv("DRAFTD_STORE__BUFFER_MAX_AGE_S", "null")
    s = load_settings()
    assert s.store.buffer_max_bytes is None and s.store.buffer_max_age_s is None
    from daemon.settings import store_config

    assert store_config(s).buffer.max_bytes is None
    monkeypatch.setenv("DRAFTD_STORE__BUFFER_MAXLEN", "null")  # not optional: refused by name
    with pytest.raises(ConfigError, match="buffer_maxlen"):
        load_settings()


def test_literals_match_the_trainer():
    from trainer.distill import WEIGHTINGS
    from trainer.losses import LOSSES

    assert typing.get_args(LossName) == tuple(LOSSES)
    assert typing.get_args(WeightingName) == tuple(WEIGHTINGS)


def test_serve_proposers_default_and_bad_names(monkeypatch):
    assert load_settings(None).serve.proposers == ["ngram", "draft"]
    monkeypatch.setenv("DRAFTD_SERVE__PROPOSERS", '["draft"]')
    assert load_settings(None).serve.proposers == ["draft"]
    for bad in ('["medusa"]', '[]', '["ngram", "ngram"]'):
        monkeypatch.setenv("DRAFTD_SERVE__PROPOSERS", bad)
        with pytest.raises(ConfigError, match="proposers"):
            load_settings(None)


def test_serve_ngram_gate_defaults_on_turns_off_and_refuses_a_bad_value(monkeypatch):
    assert load_settings(None).serve.ngram_gate is True
    monkeypatch.setenv("DRAFTD_SERVE__NGRAM_GATE", "false")
    assert load_settings(None).serve.ngram_gate is False
    monkeypatch.setenv("DRAFTD_SERVE__NGRAM_GATE", "maybe")
    with pytest.raises(ConfigError, match="ngram_gate"):
        load_settings(None)


def test_serve_eagle_proposer_takes_a_head_file_or_follows_the_trainers_heads(monkeypatch, tmp_path):
    s = load_settings(None).serve
    assert s.eagle_head is None and s.record_hidden is False and s.follow_heads is True
    assert load_settings(None).trainer.heads is False
    monkeypatch.setenv("DRAFTD_SERVE__PROPOSERS", '["ngram", "eagle"]')
    assert load_settings(None).serve.eagle_head is None  # the head registry's heads serve
    monkeypatch.setenv("DRAFTD_SERVE__FOLLOW_HEADS", "false")
    with pytest.raises(ConfigError, match="include 'eagle' with neither serve.eagle_head nor serve.follow_heads"):
        load_settings(None)
    monkeypatch.delenv("DRAFTD_SERVE__FOLLOW_HEADS")
    monkeypatch.setenv("DRAFTD_SERVE__EAGLE_HEAD", str(tmp_path / "missing.safetensors"))
    with pytest.raises(ConfigError, match="missing.safetensors' does not exist: train one with"):
        load_settings(None)
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"x")  # load_settings checks the path; serve's load_head checks the file
    monkeypatch.setenv("DRAFTD_SERVE__EAGLE_HEAD", str(head))
    assert load_settings(None).serve.eagle_head == head
    monkeypatch.setenv("DRAFTD_SERVE__PROPOSERS", '["ngram"]')
    with pytest.raises(ConfigError, match="without 'eagle' in serve.proposers"):
        load_settings(None)
    monkeypatch.delenv("DRAFTD_SERVE__EAGLE_HEAD")
    monkeypatch.setenv("DRAFTD_SERVE__RECORD_HIDDEN", "true")
    assert load_settings(None).serve.record_hidden is True


def test_serve_eagle_head_empty_is_unset_and_a_bad_file_is_a_load_error(monkeypatch, tmp_path):
    from daemon.serve import _eagle_head
    from decoder.models.packaged import ModelLoadError

    monkeypatch.setenv("DRAFTD_SERVE__EAGLE_HEAD", "")
    assert load_settings(None).serve.eagle_head is None
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match=r"serve.eagle_head: head file .*junk.bin.* cannot be read"):
        _eagle_head(junk, None)


def test_shared_turn_off_needs_workload_turns(monkeypatch):
    monkeypatch.setenv("DRAFTD_TRAINER__SHARED_TURN", "false")
    with pytest.raises(ConfigError, match="shared_turn=false without trainer.per_workload=true.*DRAFTD_TRAINER__PER_WORKLOAD"):
        load_settings(None)
    monkeypatch.setenv("DRAFTD_TRAINER__PER_WORKLOAD", "true")
    from daemon.settings import service_config

    cfg = service_config(load_settings(None))
    assert (cfg.per_workload, cfg.shared_turn) == (True, False)


@pytest.mark.parametrize("group, key", [("models", "format_max_seconds"), ("models", "engine_threads"),
                                        ("trainer", "interval_s")])
def test_a_boolean_where_a_number_belongs_is_refused(tmp_path, group, key):
    """TOML's ``true`` for a number was read as 1 (pydantic's lax mode): a cap of 1 s, one thread."""
    p = tmp_path / "c.toml"
    p.write_text(f"[{group}]\n{key} = true\n")
    with pytest.raises(ConfigError, match=f"(?s){group}.{key}.*True is a boolean; this setting takes a number"):
        load_settings(p)


def test_boolean_settings_still_take_booleans(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[serve]\nrecord_prompt = true\n")
    assert load_settings(p).serve.record_prompt is True


@pytest.mark.parametrize("var, value, key, says", [
    ("DRAFTD_STORE__URL", "redis://x:6379", "store.url", "not a setting of the store group"),
    ("DRAFTD_SERVE__PORT", "abc", "serve.port", "valid integer"),
    ("DRAFTD_STATE_DIR", "", "state_dir", "an empty path would keep state"),  # a top-level setting
])
def test_a_config_error_names_the_key_and_its_variable_without_pydantics_url(monkeypatch, var, value, key, says):
    """``DRAFTD_STORE__URL=...`` printed pydantic's "store.url / Extra inputs are not permitted ...
    For further information visit https://errors.pydantic.dev/...": a URL to pydantic's docs, and
    a key the user never wrote (they set the environment variable)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert f"{key} ({var})" in msg and says in msg, msg
    assert "errors.pydantic.dev" not in msg and "For further information" not in msg, msg
    assert "validation error" not in msg and "[type=" not in msg, msg


@pytest.mark.parametrize("var, value, named", [
    ("DRAFTD_SERVE__PROPOSERS", '["ngram", "medusa"]',
     "serve.proposers[1] (DRAFTD_SERVE__PROPOSERS, a JSON list: item 1): "),
    ("DRAFTD_TRAINER__TEACHER_TEMPERATURE", "warm", "trainer.teacher_temperature (DRAFTD_TRAINER__TEACHER_TEMPERATURE)"),
])
def test_an_error_inside_a_settings_value_names_the_variable_that_holds_it(monkeypatch, var, value, named):
    """A list item's error named DRAFTD_SERVE__PROPOSERS__1, a variable that sets nothing (pydantic's
    location, a list index, read as a nested field); a union member's tag was read so too. The
    variable named is the one the user sets, with the item's index beside it."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert named in msg, msg
    assert f"{var}__" not in msg, msg


@pytest.mark.parametrize("value, ok", [("256", True), ("1", True), ("257", False), ("1" + "0" * 38, False)])
def test_serve_max_batch_is_bounded_by_llama_cpps_sequences(monkeypatch, value, ok):
    """serve.max_batch 10**38 loaded (and reached llama.cpp as n_seq_max, which refuses more than
    LLAMA_MAX_SEQ = 256 sequences in a context); the error names the value and the bound."""
    from daemon.settings import MAX_BATCH

    assert MAX_BATCH == 256
    monkeypatch.setenv("DRAFTD_SERVE__MAX_BATCH", value)
    if ok:
        assert load_settings().serve.max_batch == int(value)
        return
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert f"serve.max_batch (DRAFTD_SERVE__MAX_BATCH): {value} is more than 256" in msg, msg
    assert "LLAMA_MAX_SEQ" in msg, msg


def test_max_batch_is_the_bundled_llama_cpps_own_bound(tmp_path):
    """MAX_BATCH is LLAMA_MAX_SEQ of the libllama installed: a context of MAX_BATCH sequences
    (serve.max_batch's n_seq) builds, one of MAX_BATCH + 1 is refused by llama.cpp itself."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("llama_cpp")
    from daemon.settings import MAX_BATCH
    from decoder.engines.base import EngineError
    from decoder.engines.llamacpp import LlamaCppEngine

    src = Path(__file__).resolve().parents[1] / "decoder" / "test_gguf_export.py"  # the tiny GGUF writer
    spec = importlib.util.spec_from_file_location("_max_batch_gguf_helpers", src)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    path = helpers.write_tiny_gguf(helpers.tiny_model(), tmp_path / "tiny.gguf")
    LlamaCppEngine(path, n_ctx=32, threads=1, n_seq=MAX_BATCH).close()
    with pytest.raises(EngineError):
        LlamaCppEngine(path, n_ctx=32, threads=1, n_seq=MAX_BATCH + 1)


@pytest.mark.parametrize("toml, says, not_said", [
    # a group validator's error, without pydantic's prefix and link
    ("[serve]\nproposers = [\"ngram\", \"eagle\"]\nfollow_heads = false\n", "\n  serve: serve.proposers=",
     ("Value error,", "errors.pydantic.dev")),
    # a table nothing resembles: the groups listed, no guess
    ("[zzzzqq]\nx = 1\n", "[zzzzqq] (in the config file): not a settings group", ("did you mean",)),
], ids=["group_validator_without_pydantics_prefix", "unknown_table_without_a_guess"])
def test_a_config_file_error_says_what_is_wrong_and_nothing_misleading(tmp_path, toml, says, not_said):
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as ei:
        load_settings(p)
    msg = str(ei.value)
    assert says in msg and not any(x in msg for x in not_said), msg


def test_a_groups_own_errors_are_named_by_their_full_key():
    """serve's --host/--port options validate ServeSettings alone: its errors name serve.port
    (DRAFTD_SERVE__PORT), not port (DRAFTD_PORT)."""
    from pydantic import ValidationError

    from daemon.settings import ServeSettings, validation_text

    with pytest.raises(ValidationError) as ei:
        ServeSettings.model_validate({"port": "abc"})
    assert validation_text(ei.value, group="serve").startswith("  serve.port (DRAFTD_SERVE__PORT): ")


@pytest.mark.parametrize("var,value,secret", [
    ("DRAFTD_SERVE__API_KEY", " se\\cret ", "se\\cret"),  # a backslash: repr doubles it
    ("DRAFTD_SERVE__API_KEY", "\tsecretTAB ", "secretTAB"),
    ("DRAFTD_SERVE__API_KEY", " it's\"both ", "it's"),
    ("DRAFTD_REDIS__URL", "http://u:pa\\ss@h:1/0", "pa\\ss"),  # a scheme Redis refuses, with a password
])
def test_a_config_error_never_quotes_a_secret_whatever_its_characters(monkeypatch, var, value, secret):
    # the break session of the thirteenth: "[got ' se\\cret ']" printed a key the mask (searching the raw text) missed
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        load_settings()
    text = str(e.value)
    for form in (secret, repr(secret)[1:-1]):
        assert form not in text, text
    assert var.split("__")[-1].lower() in text  # the setting is still named


def test_a_numeric_secret_in_toml_is_not_quoted(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[serve]\napi_key = 123456789\n")
    with pytest.raises(ConfigError) as e:
        load_settings(p)
    assert "123456789" not in str(e.value) and "serve.api_key" in str(e.value)


def test_a_one_character_secret_leaves_the_message_readable(monkeypatch):
    # a token "e" masked every "e" of the api group's message ("is not a loopback addr**********ss")
    monkeypatch.setenv("DRAFTD_API__TOKEN", "e")
    monkeypatch.setenv("DRAFTD_API__HOST", "0.0.0.0")
    try:
        load_settings()
    except ConfigError as e:
        text = str(e)
        assert "*****" not in text.replace("'**********'", ""), text
        assert "'e'" not in text and '"e"' not in text


def test_a_non_ascii_api_key_is_refused_by_name(monkeypatch):
    # accepted before, then unusable: the openai client cannot put it in an Authorization header
    monkeypatch.setenv("DRAFTD_SERVE__API_KEY", "k3y-é")
    with pytest.raises(ConfigError, match="serve.api_key.*printable ASCII"):
        load_settings()
    monkeypatch.setenv("DRAFTD_SERVE__API_KEY", "k3y-e_!~")
    assert load_settings().serve.api_key.get_secret_value() == "k3y-e_!~"


def test_effective_and_repr_mask_the_settings_url_key_names(monkeypatch):
    """effective() and RedisSettings' repr kept their own ("url", "default_url") list beside
    _url_key, the test every error message masks by: both follow _url_key now, so a URL setting
    added there is masked everywhere at once."""
    from daemon import settings as settings_mod
    from daemon.settings import RedisSettings, Settings, effective

    url = "redis://u:hunter2@h:6379/0"
    s = Settings(redis={"url": url, "default_url": url}, serve={"server_id": url})
    real = effective(s)
    assert real["redis"]["url"] == real["redis"]["default_url"] == "redis://u:***@h:6379/0"
    assert real["serve"]["server_id"] == url  # not a URL setting
    assert "hunter2" not in repr(RedisSettings(url=url, default_url=url))
    monkeypatch.setattr(settings_mod, "_url_key", lambda loc: tuple(loc) in (("redis", "url"), ("serve", "server_id")))
    moved = effective(s)
    assert moved["serve"]["server_id"] == "redis://u:***@h:6379/0" and moved["redis"]["default_url"] == url
    shown = repr(RedisSettings(url=url, default_url=url))
    assert shown.count("hunter2") == 1 and "u:***@h" in shown, shown


@pytest.mark.parametrize("var", ["DRAFTD_SERVE__API_KEYS", "DRAFTD_SERVE__APIKEY", "DRAFTD_API__TOKENS"])
def test_a_misspelt_setting_never_quotes_its_value(monkeypatch, var):
    """``DRAFTD_SERVE__API_KEYS=sk-secret123`` printed "not a setting of the serve group ... [got
    'sk-secret123']": an unknown key may be a misspelt secret, so its value is never quoted."""
    monkeypatch.setenv(var, "sk-secret123")
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert "not a setting of the" in msg and "sk-secret123" not in msg and "[got" not in msg, msg


def test_a_long_unknown_setting_name_is_cut_to_80_characters(monkeypatch):
    """A 10,000-character DRAFTD_SERVE__<name> was echoed whole, twice (33 KB of output)."""
    name = "X" * 10_000
    monkeypatch.setenv(f"DRAFTD_SERVE__{name}", "1")
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert f"serve.{'x' * 80}... (DRAFTD_SERVE__{'X' * 80}...)" in msg and len(msg) < 2000, msg[:300]


@pytest.mark.parametrize("value, says", [
    ("nan", "nan is not a time budget: give a finite number of seconds from 1 to 3600"),
    ("inf", "inf is not a time budget: give a finite number of seconds from 1 to 3600"),
    ("-inf", "-inf is not a time budget"),
    ("1e-300", "1e-300 s is too short to time a format: the budget must hold, for each file measured, a prefill, "
               "a row check and 3 repeats of its 1-8-row steps (48 llama_decode calls)"),
    ("0.5", "0.5 s is too short to time a format"),
    ("0", "0 s is too short to time a format"),
    ("3601", "3601 s is over 3600 s"),
])
def test_format_max_seconds_refuses_a_budget_that_is_not_one_naming_it_and_the_range(monkeypatch, value, says):
    """The break helper's: ``nan`` was refused as "less than or equal to 3600" (it is no number at
    all), and ``1e-300`` was accepted, then every format "did not finish in 0.0 s"."""
    monkeypatch.setenv("DRAFTD_MODELS__FORMAT_MAX_SECONDS", value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert "models.format_max_seconds (DRAFTD_MODELS__FORMAT_MAX_SECONDS): " + says in msg, msg
    assert "or unset it (the budget is then scaled to this CPU)" in msg or "3601" in value, msg


@pytest.mark.parametrize("value", ["1", "1.0", "3600", "90.5"])
def test_format_max_seconds_takes_one_second_to_an_hour(monkeypatch, value):
    monkeypatch.setenv("DRAFTD_MODELS__FORMAT_MAX_SECONDS", value)
    assert load_settings().models.format_max_seconds == float(value)


@pytest.mark.parametrize("var, value", [
    ("DRAFTD_SERVE__MAX_BATCH", "1_0"),  # read as 10
    ("DRAFTD_SERVE__PORT", "80_00"),
    ("DRAFTD_STORE__BUFFER_MAX_BYTES", "1_000_000"),  # int | None
    ("DRAFTD_TRAINER__MAX_STEPS", "6_4"),
    ("DRAFTD_BOOTSTRAP__CORPUS_TOKENS", "12_000"),
    ("DRAFTD_SERVE__MAX_BATCH", "8.0"),
])
def test_an_integer_setting_takes_plain_digits_only(monkeypatch, var, value):
    """pydantic's lax parsing read ``DRAFTD_SERVE__MAX_BATCH=1_0`` as 10: a typo of 1 or of 100
    served 10 sequences. Every integer setting refuses it, naming the variable."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as ei:
        load_settings()
    msg = str(ei.value)
    assert f"({var}): {value!r} is not a valid integer: write it in plain digits, e.g. 10" in msg, msg


def test_an_integer_setting_as_a_toml_string_takes_plain_digits_only(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[serve]\nmax_batch = "1_0"\n')
    with pytest.raises(ConfigError, match=r"serve.max_batch \(DRAFTD_SERVE__MAX_BATCH\): '1_0' is not a valid integer"):
        load_settings(p)
    p.write_text("[serve]\nmax_batch = 1_0\n")  # TOML's own digit grouping: an integer before draftd sees it
    assert load_settings(p).serve.max_batch == 10


@pytest.mark.parametrize("var, value, want", [
    ("DRAFTD_SERVE__MAX_BATCH", "12", 12), ("DRAFTD_SERVE__MAX_BATCH", " 12 ", 12),
    ("DRAFTD_STORE__BUFFER_MAX_BYTES", "null", None), ("DRAFTD_TRAINER__REPLAY_PER_WORKLOAD", "0", 0),
])
def test_plain_integers_still_load(monkeypatch, var, value, want):
    monkeypatch.setenv(var, value)
    group, key = var.removeprefix("DRAFTD_").lower().split("__")
    assert getattr(getattr(load_settings(), group), key) == want


def test_a_float_setting_refuses_underscores_between_digits(monkeypatch):
    monkeypatch.setenv("DRAFTD_TRAINER__INTERVAL_S", "3_00")
    with pytest.raises(ConfigError, match=r"trainer.interval_s \(DRAFTD_TRAINER__INTERVAL_S\): '3_00': write the "
                                          r"number without '_' between digits"):
        load_settings()
    monkeypatch.setenv("DRAFTD_TRAINER__INTERVAL_S", "2.5e2")
    assert load_settings().trainer.interval_s == 250.0


@pytest.mark.parametrize("toml, says", [
    ("[serv]\nport = 8001\n", "[serv] (in the config file): not a settings group nor a top-level setting (the groups: "
                              "[redis], [store], [models], [trainer], [bootstrap], [api], [serve]; top-level: state_dir, "
                              "log_format, log_level); did you mean [serve]?"),
    ("[trainr]\ninterval_s = 60\n", "did you mean [trainer]?"),
    ("state_dr = '/tmp/x'\n", "state_dr (in the config file): not a settings group nor a top-level setting"),
    ("state_dr = '/tmp/x'\n", "did you mean state_dir?"),
    ("port = 8001\n", "did you mean port under [api] or port under [serve]?"),
])
def test_a_misspelt_toml_group_or_key_outside_the_groups_gets_the_nearest_name(tmp_path, toml, says):
    """``[serv]`` for ``[serve]`` was refused as pydantic's bare "Extra inputs are not permitted"
    (under a DRAFTD_SERV variable that nobody set), while a misspelt DRAFTD_SERV__PORT was told
    "did you mean serve"."""
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as ei:
        load_settings(p)
    msg = str(ei.value)
    assert says in msg, msg
    assert "DRAFTD_SERV" not in msg and "Extra inputs" not in msg, msg


def test_more_engine_threads_than_cpus_is_refused_and_as_many_taken(tmp_path, monkeypatch):
    """engine_threads=3 on 2 CPUs decoded a token in 3-6 s instead of 3 ms (the break session: ggml's
    threads wait for each other at every barrier); it is refused, naming the CPUs and the fix."""
    import os

    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setenv("DRAFTD_MODELS__ENGINE_THREADS", str(cpus + 1))
    with pytest.raises(ConfigError, match=f"(?s)engine_threads={cpus + 1} is more than the {cpus} CPUs.*set at most {cpus}"):
        load_settings(None)
    monkeypatch.setenv("DRAFTD_MODELS__ENGINE_THREADS", str(cpus))
    assert load_settings(None).models.engine_threads == cpus


@pytest.mark.parametrize("draft, mode, held", [
    ("layers:0-3", "auto", True), ("layers:0-3", "offer", False), ("layers:0-3", "hold", True),
    ("self", "auto", False), ("HuggingFaceTB/SmolLM2-135M-Instruct", "auto", False),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "hold", True)])
def test_base_draft_holds_a_derived_draft_by_default_and_obeys_a_pin(monkeypatch, draft, mode, held):
    from daemon.serve import holds_base_draft

    monkeypatch.setenv("DRAFTD_MODELS__DRAFT", draft)
    monkeypatch.setenv("DRAFTD_SERVE__BASE_DRAFT", mode)
    assert holds_base_draft(load_settings(None)) is held


def test_base_draft_refuses_an_unknown_mode(monkeypatch):
    monkeypatch.setenv("DRAFTD_SERVE__BASE_DRAFT", "later")
    with pytest.raises(ConfigError, match="serve.base_draft"):
        load_settings(None)
