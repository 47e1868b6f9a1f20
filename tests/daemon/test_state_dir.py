"""``daemonctl run``, ``serve`` and ``demo`` create the state directory when they load their settings:
five walkthroughs set a fresh ``DRAFTD_STATE_DIR`` and found it never created (the demo keeps its
adapters under its --out, and a Redis on 127.0.0.1 needs no embedded data dir), so nothing said the
setting had been read. A state_dir that cannot be created is a config error (exit 2) naming it."""

import os

import pytest
from typer.testing import CliRunner

from daemon.cli import app


@pytest.fixture
def env(monkeypatch, tmp_path):
    for k in [k for k in os.environ if k.startswith("DRAFTD_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", "draftd-qa-statedir:")
    return monkeypatch


# each command stopped by a refused option after its settings loaded: nothing is served or run
@pytest.mark.parametrize("args", [["demo", "--quick", "--draft-vocab", "-5"], ["serve", "--host", "0.0.0.0"]])
def test_the_state_dir_exists_once_a_command_loaded_its_settings(env, tmp_path, args):
    state = tmp_path / "fresh" / "state"
    env.setenv("DRAFTD_STATE_DIR", str(state))
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output  # refused as before
    assert state.is_dir(), r.output


@pytest.mark.parametrize("cmd", [["run", "--no-models"], ["demo", "--quick"], ["serve"]])
def test_a_state_dir_that_cannot_be_created_is_a_config_error_naming_it(env, tmp_path, cmd):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    env.setenv("DRAFTD_STATE_DIR", str(blocker / "state"))
    r = CliRunner().invoke(app, cmd)
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"state_dir '{blocker / 'state'}' cannot be created" in out and "DRAFTD_STATE_DIR" in out, r.output
    assert "Traceback" not in r.output


def test_ensure_state_dir_returns_the_directory_and_leaves_an_existing_one_as_it_is(tmp_path):
    from daemon.settings import ensure_state_dir, load_settings

    d = tmp_path / "s"
    d.mkdir()
    (d / "api-token").write_text("kept")
    assert ensure_state_dir(load_settings(state_dir=d)) == d
    assert (d / "api-token").read_text() == "kept"


def test_a_tilde_is_expanded_on_the_setting_itself_so_every_path_under_it_agrees(env, tmp_path):
    from daemon.settings import load_settings

    env.setenv("HOME", str(tmp_path / "home"))
    env.setenv("DRAFTD_STATE_DIR", "~/draftd-state")
    s = load_settings()
    assert s.state_dir == tmp_path / "home" / "draftd-state"
    assert s.adapter_dir == tmp_path / "home" / "draftd-state" / "adapters"  # not ./~/draftd-state/adapters


@pytest.mark.parametrize("value, says", [("~no-such-user-draftd/state", "cannot be expanded"),
                                         ("", "an empty path would keep state in the working directory")])
def test_an_unexpandable_or_empty_state_dir_is_a_config_error(env, value, says):
    env.setenv("DRAFTD_STATE_DIR", value)
    r = CliRunner().invoke(app, ["run", "--no-models"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert says in out and "DRAFTD_STATE_DIR" in out, r.output


def test_a_state_dir_this_user_cannot_write_is_a_config_error(env, tmp_path, monkeypatch):
    import daemon.settings as settings_mod

    state = tmp_path / "ro"
    state.mkdir()
    env.setenv("DRAFTD_STATE_DIR", str(state))
    # root may write anywhere, so the check's answer is stubbed: what a non-root user gets on a mode-555 directory
    real = os.access
    monkeypatch.setattr(settings_mod.os, "access", lambda p, mode: False if str(p) == str(state) else real(p, mode))
    r = CliRunner().invoke(app, ["run", "--no-models"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert f"state_dir '{state}' is not writable by this user" in out, r.output
