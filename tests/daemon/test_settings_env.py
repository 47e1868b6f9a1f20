"""A ``DRAFTD_*`` variable no setting reads is warned about at settings load: a misspelt group
(``DRAFTD_SERVER__PORT``) was ignored silently, and the server came up on the default port. The
variables draftd reads outside the settings (``DRAFTD_CACHE_DIR``, ...) are not warned about: the
tree is grepped for every such read."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from daemon import settings as settings_mod
from daemon.settings import READ_ELSEWHERE, ConfigWarning, env_keys, load_settings, unread_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.upper().startswith("DRAFTD_"):
            monkeypatch.delenv(k)
    monkeypatch.setattr(settings_mod, "_warned_env", set())  # "once per process" starts afresh per test


def _load() -> list[str]:
    """load_settings' ConfigWarning messages."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_settings()
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def test_a_misspelt_group_is_warned_about_with_the_nearest_group(monkeypatch):
    monkeypatch.setenv("DRAFTD_SERVER__PORT", "9001")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_settings()
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert s.serve.port == 8000  # still not read: a warning, not a guess
    assert msgs == ["DRAFTD_SERVER__PORT is set but nothing in draftd reads it: 'server' is not a settings group; "
                    "did you mean serve: DRAFTD_SERVE__PORT?"], msgs


def test_the_warning_comes_once_per_variable(monkeypatch):
    monkeypatch.setenv("DRAFTD_TRAINR__LR", "0.1")
    assert len(_load()) == 1
    assert _load() == []  # a second load in the same process (demo, then serve) does not repeat it
    monkeypatch.setenv("DRAFTD_STATEDIR", "/tmp/x")
    assert [m.split(" ")[0] for m in _load()] == ["DRAFTD_STATEDIR"]


@pytest.mark.parametrize("var, says", [
    ("DRAFTD_PORT", "no setting has that name; did you mean DRAFTD_API__PORT or DRAFTD_SERVE__PORT?"),
    ("DRAFTD_STATEDIR", "no setting has that name; did you mean DRAFTD_STATE_DIR?"),
    ("DRAFTD_QQQQQQ__X", "'qqqqqq' is not a settings group (the groups: redis, store, models, trainer, bootstrap, "
                         "api, serve)"),
])
def test_a_top_level_misspelling_is_told_the_settings_it_may_mean(var, says):
    assert unread_env({var: "1"}) == {var: says}


def test_what_draftd_reads_is_not_warned_about(monkeypatch):
    env = {k: "1" for k in sorted(env_keys() | set(READ_ELSEWHERE))}
    env["draftd_serve__port"] = "1"  # the settings read names case-insensitively
    env["OTHER_VAR"] = "1"
    assert unread_env(env) == {}
    monkeypatch.setenv("DRAFTD_CACHE_DIR", "/tmp/cache")
    monkeypatch.setenv("DRAFTD_SERVE__PORT", "8123")
    assert _load() == []


def test_a_real_groups_unknown_field_is_left_to_the_load_error():
    """DRAFTD_TRAINER__INTERVL_S is refused by the trainer group (extra="forbid"), naming it."""
    assert unread_env({"DRAFTD_TRAINER__INTERVL_S": "60"}) == {}


def test_a_groups_own_name_is_read_as_the_group_not_warned_unread():
    """DRAFTD_SERVE=1 was told "nothing in draftd reads it" and then refused by the load as the
    serve group's value (the settings read a group's name as the group in JSON): one message now,
    the load's."""
    assert unread_env({"DRAFTD_SERVE": "1", "draftd_trainer": "{}"}) == {}


def test_a_groups_own_name_with_a_value_that_is_not_an_object_says_how_to_set_one_setting(monkeypatch):
    from daemon.settings import ConfigError

    monkeypatch.setenv("DRAFTD_SERVE", "1")
    with pytest.raises(ConfigError) as e:
        load_settings()
    text = str(e.value)
    assert "DRAFTD_SERVE sets the whole serve group and takes a JSON object; one setting is DRAFTD_SERVE__<FIELD>" in text
    assert "[got 1]" in text and "valid dictionary" not in text


_READS = [
    re.compile(r"""(?:environ\.get\(|environ\[|getenv\(|environ\.setdefault\()\s*["'](DRAFTD_[A-Z0-9_]+)["']"""),
    re.compile(r"\$\{?(DRAFTD_[A-Z0-9_]+)"),  # shell and compose interpolation
]


def _read_names() -> dict[str, set[str]]:
    """Every DRAFTD_ name the tree reads from the environment, with the files that read it."""
    found: dict[str, set[str]] = {}
    files = [p for d in ("daemon", "decoder", "store", "trainer", "bench", "scripts") for p in (ROOT / d).rglob("*")
             if p.is_file() and (p.suffix in (".py", ".sh", "") and "__pycache__" not in p.parts)]
    files += [ROOT / "docker-compose.yml", *ROOT.glob("Dockerfile*")]
    for p in files:
        if not p.is_file():
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for rx in _READS:
            for name in rx.findall(text):
                found.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    return found


def test_every_draftd_variable_read_outside_the_settings_is_known():
    """A new os.environ read of a DRAFTD_ name must be listed in READ_ELSEWHERE (or be a setting),
    else setting it would be warned about as unread; and every entry there must still be read."""
    reads = _read_names()
    assert "DRAFTD_CACHE_DIR" in reads and "DRAFTD_LLAMA_LOG" in reads, reads  # the grep sees them
    unknown = {n: sorted(f) for n, f in reads.items() if n not in env_keys() and n not in READ_ELSEWHERE}
    assert unknown == {}, f"add these to daemon.settings.READ_ELSEWHERE: {unknown}"
    assert sorted(set(READ_ELSEWHERE) - set(reads)) == [], "READ_ELSEWHERE lists names nothing reads"

