"""`daemonctl` prints every client- or operator-given string as written: a workload name is the
client's (``[/]`` and ``[bold]x`` pass serve's rule), and rich reads ``[...]`` in a printed string
as markup, so an unescaped ``[/]`` made `history`, `adapters list` and `adapters rollback` fail
with MarkupError, and ``[bold]x`` showed as ``x``."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import daemon.cli as cli
from conftest import REDIS_URL, free_port
from daemon.cli import app
from daemon.client import ApiError
from helpers import make_adapter_dir
from store.config import StoreConfig
from store.history import AcceptanceHistory
from store.registry import AdapterMeta, AdapterRegistry

CLOSE, BOLD = "[/]", "[bold]x"  # both usable workload tags (store.schema.workload_problem)


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    """Consoles wide enough that no cell folds (the module's own are 200 columns off a terminal)."""
    from rich.console import Console

    for name in ("out", "err"):
        monkeypatch.setattr(cli, name, Console(width=400, stderr=name == "err", color_system=None))


@pytest.fixture
def offline(monkeypatch, tmp_path, key_prefix):
    """Settings of a daemon that is down (nothing on its API port) over the shared Redis."""
    monkeypatch.setenv("DRAFTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DRAFTD_STORE__KEY_PREFIX", key_prefix)
    monkeypatch.setenv("DRAFTD_REDIS__URL", REDIS_URL)
    monkeypatch.setenv("DRAFTD_API__PORT", str(free_port()))
    return tmp_path


def test_history_and_adapters_list_show_markup_workloads_as_written(offline, redis_client, key_prefix):
    cfg = StoreConfig(key_prefix=key_prefix)
    reg = AdapterRegistry(redis_client, offline / "state" / "adapters", cfg)
    for i, scope in enumerate((CLOSE, BOLD)):
        v = reg.register(make_adapter_dir(offline / f"src{i}", seed=i), AdapterMeta(parent=0, scope=scope))
        reg.promote(v, f"held-out alpha rose for {scope}")
    hist = AcceptanceHistory(redis_client, cfg)
    for w in (CLOSE, BOLD):
        hist.record(w, 0, {"requests": 2, "num_steps": 4, "num_drafts": 4, "num_draft_tokens": 10,
                           "num_accepted_tokens": 4})
    run = CliRunner()
    r = run.invoke(app, ["history"], terminal_width=400)
    assert r.exit_code == 0, (r.output, r.exception)
    text = r.stdout
    # v0's live cell: both workloads at 4 / 10 accepted, 2 requests each
    assert f"{CLOSE} 0.400 (2 req); {BOLD} 0.400 (2 req)" in text, text
    assert f"v1 ({CLOSE})" in text and f"v2 ({BOLD})" in text, text
    assert f"held-out alpha rose for {CLOSE}" in text and f"held-out alpha rose for {BOLD}" in text, text
    r = run.invoke(app, ["adapters", "list"], terminal_width=400)
    assert r.exit_code == 0, (r.output, r.exception)
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]] for line in r.stdout.splitlines()
            if line.count("│") > 3 and line.split("│")[1].strip().startswith("v")}
    assert rows["v1 *"][0] == CLOSE and rows["v2 *"][0] == BOLD, r.stdout
    assert rows["v1 *"][-1] == f"held-out alpha rose for {CLOSE}", r.stdout


class FakeApi:
    """The daemon's API answering one POST: ``answer`` (a dict) or raising it (an ApiError)."""

    def __init__(self, answer):
        self.answer = answer

    def post(self, path, body=None, **kw):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_adapters_rollback_of_a_markup_workload_prints_it_as_written(monkeypatch):
    api = FakeApi({"active": 0, "previous": 3, "skipped": {"2": f"its files under adapters/{CLOSE} are gone"}})
    monkeypatch.setattr(cli, "_client", lambda config: (api, None))
    r = CliRunner().invoke(app, ["adapters", "rollback", "--workload", CLOSE], terminal_width=300)
    assert r.exit_code == 0, (r.output, r.exception)
    assert f"{CLOSE}: the shared adapter (rolled back v3)" in r.stdout
    assert f"skipped v2: its artifact fails the check: its files under adapters/{CLOSE} are gone" in r.stdout
    api.answer = ApiError(409, f"workload {BOLD!r} has no adapter of its own")
    r = CliRunner().invoke(app, ["adapters", "rollback", "--workload", BOLD], terminal_width=300)
    assert r.exit_code == 1, (r.output, r.exception)
    assert f"refused (409): workload {BOLD!r} has no adapter of its own" in r.output


def test_a_refusal_read_offline_prints_its_detail_as_written(offline, monkeypatch):
    """`history` reads through daemon.cli_offline.read_or_offline, which printed the detail raw."""
    import daemon.client

    def refuse(self, path, **kw):
        raise ApiError(400, f"since= holds {CLOSE}")

    monkeypatch.setattr(daemon.client.ApiClient, "get", refuse)
    r = CliRunner().invoke(app, ["history"], terminal_width=300)
    assert r.exit_code == 1, (r.output, r.exception)
    assert f"refused (400): since= holds {CLOSE}" in r.output


def test_config_prints_a_value_holding_brackets_as_written(monkeypatch):
    monkeypatch.setenv("DRAFTD_SERVE__MODEL_NAME", BOLD)
    r = CliRunner().invoke(app, ["config"], terminal_width=300)
    assert r.exit_code == 0, (r.output, r.exception)
    row = next(line for line in r.stdout.splitlines() if "serve.model_name" in line)
    assert row.split("│")[2].strip() == BOLD, row
