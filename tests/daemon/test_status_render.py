"""`daemonctl status` / `adapters list` / `history` as a person reads them: each reason is told as
the event's it is (never beside the previous version as if it were that version's), and no reason
or figure is cut with an ellipsis on a narrow terminal (the columns fold instead)."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

import daemon.cli as cli
from daemon.reports import adapter_section

HASH = "3f9a2c1d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39"  # a cache key: one long word


class FakeRegistry:
    def __init__(self, actives: dict[str, int], events: list[dict], n: int):
        self._actives, self._events, self._n = actives, events, n

    def active_versions(self) -> dict[str, int]:
        return dict(self._actives)

    def promotion_log(self, count: int = 1000) -> list[dict]:
        return list(self._events)

    def list(self) -> list:
        return [None] * self._n


def ev(event: str, version: int, previous: int, reason: str, scope: str = "") -> dict:
    return {"event": event, "version": str(version), "previous": str(previous), "reason": reason,
            "ts": str(time.time()), "scope": scope}


@pytest.fixture
def screen(monkeypatch):
    def make(width: int = 100) -> io.StringIO:
        buf = io.StringIO()
        monkeypatch.setattr(cli, "out", Console(file=buf, width=width, force_terminal=False, color_system=None))
        return buf
    return make


def _status(adapter: dict, **more) -> dict:
    return {"daemon": {"up": True, "api": "http://127.0.0.1:8787", "pid": 1, "uptime_s": 5.0},
            "redis": {"up": True, "mode": "url", "url": "redis://127.0.0.1:6379/0", "version": "7.2",
                      "used_memory_human": "1M"},
            "adapter": adapter, "problems": [], "warnings": [], **more}


def _flat(text: str) -> str:
    return "".join(text.split())


def test_a_promotion_reason_is_the_active_versions_not_the_previous_ones(screen):
    reg = FakeRegistry({"": 2, "code": 3}, [
        ev("promote", 1, 0, "v0 bootstrap: held-out alpha 0.18 -> 0.33"),
        ev("promote", 2, 1, "paired gain +0.031 over v1"),
        ev("promote", 3, 0, "code: paired gain +0.05", scope="code"),
    ], 3)
    a = adapter_section(reg)
    assert (a["active"], a["previous"], a["how"]) == (2, 1, "promote")
    buf = screen(200)
    cli.render_status(_status(a))
    text = buf.getvalue()
    assert "previous v1: paired gain" not in text  # v2's reason read as v1's
    assert "v2 active since" in text and "promoted: paired gain +0.031 over v1 (previous v1)" in text, text
    assert "v3 (its own) active since" in text and "promoted: code: paired gain +0.05 (before it: the shared adapter)" in text, text


def test_a_rollback_says_which_version_was_rolled_back_and_why(screen):
    reg = FakeRegistry({"": 2}, [
        ev("promote", 2, 1, "paired gain +0.031"),
        ev("promote", 3, 2, "paired gain +0.002"),
        ev("rollback", 2, 3, "rollback monitor: live acceptance fell 0.41 -> 0.22"),
    ], 3)
    a = adapter_section(reg)
    assert (a["active"], a["previous"], a["how"]) == (2, 3, "rollback")
    buf = screen(200)
    cli.render_status(_status(a))
    text = buf.getvalue()
    assert "after v3 was rolled back: rollback monitor: live acceptance fell 0.41 -> 0.22" in text, text
    assert "previous v3: rollback monitor" not in text


@pytest.mark.parametrize("width", [80, 100, 140])
def test_reasons_and_figures_wrap_rather_than_truncate(screen, width):
    reason = f"v0 bootstrap (cached, {HASH}): held-out α 0.179 -> 0.327 in 45 steps, 13.8 CPU minutes"
    rows = [dict(version=1, active=True, scope="", parent=0, created_at=time.time(), state="promoted", alpha_before=0.179,
                 alpha_after=0.327, samples_trained=1234, reason=reason)]
    buf = screen(width)
    cli.out.print(cli._versions_table("adapters", rows, "samples"))
    heads = [r | {"live": {"alpha": 0.41, "requests": 12}} for r in rows]
    cli.out.print(cli._versions_table("heads", heads, "records"))
    cli.render_status(_status(
        {"active": 1, "since": time.time(), "previous": 0, "reason": reason, "how": "promote", "registered": 1,
         "workloads": {}},
        acceptance={"code": {"now": {"version": 1, "requests": 5, "acceptance_rate": 0.5, "tau": 2.0, "alpha": 0.4,
                                     "goodput_tokens_per_ms": 0.05},
                             "previous": {"version": 0, "requests": 9, "acceptance_rate": 0.25, "tau": 1.5, "alpha": 0.2,
                                          "goodput_tokens_per_ms": 0.0312}}},
        speculation={"code": {"on": None, "why": "no requests recorded in the last 300 s; the last was recorded "
                                                 "12 min ago (its rates are in 'now' and 'previous')"}}))
    text = buf.getvalue()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text  # nothing cropped at the right edge either
    # the long word folds onto several lines of its column; read column-wise, it is whole
    reason_cells = "".join(line.split("│")[-2] for line in text.splitlines() if line.count("│") >= 3)
    assert HASH in _flat(reason_cells), text
    assert "0.250/1.50/0.200/0.0312" in _flat("".join(line.split("│")[-3] for line in text.splitlines()
                                                      if line.count("│") >= 9)), text


def test_the_serving_row_says_gamma_per_batch_size(screen):
    buf = screen(120)
    hb = {"server_id": "s1", "adapter_version": 0, "requests_served": 3, "queue_depth": 0, "queue_size": 64,
          "speculation_by_workload": {"prose": True}, "last_seen_s": 1.0,
          "speculation_by_batch": {"prose@greedy": {"1": 4, "2": 3, "4": 0}, "code@greedy": {"1": None}}}
    cli.render_status(_status({"active": 0, "registered": 0}, serving=[hb]))
    text = buf.getvalue()
    assert "γ by batch (prose@greedy)" in text and "1: γ=4, 2: γ=3, 4: off" in text
    assert "γ by batch (code@greedy)" in text and "1: ?" in text


def test_status_after_a_demo_shows_each_workloads_last_acceptance_and_its_age(screen, redis_client, key_prefix):
    """Issue 34's walkthrough: after a demo every row said "? no requests recorded in the last
    300 s". Each row now tells its last request's age and the acceptance of the window that ended
    there (accepted / drafted, by hand: prose 12 / 30 = 0.400 twelve minutes ago, code 3 / 20 =
    0.150 forty minutes ago; math drafted nothing: off then)."""
    from daemon.reports import acceptance_sections
    from store.config import StoreConfig
    from store.history import AcceptanceHistory

    h = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    now = time.time()
    h.record("prose@greedy", 1, {"requests": 4, "num_steps": 12, "num_drafts": 6, "num_draft_tokens": 30,
                                 "num_accepted_tokens": 12}, ts=now - 12 * 60)
    h.record("code@greedy", 1, {"requests": 2, "num_steps": 9, "num_drafts": 5, "num_draft_tokens": 20,
                                "num_accepted_tokens": 3}, ts=now - 40 * 60)
    h.record("math@greedy", 1, {"requests": 1, "num_steps": 5}, ts=now - 13 * 60)
    adapter = {"active": 1, "since": None, "previous": None, "workloads": {}}
    acc, spec = acceptance_sections(h, adapter, now)
    assert spec["prose@greedy"]["last"]["acceptance_rate"] == 0.4 and spec["code@greedy"]["last"]["acceptance_rate"] == 0.15
    buf = screen(220)
    cli.render_status(_status({"active": 1, "since": None, "previous": None, "reason": "v0", "how": "promote",
                               "registered": 1, "workloads": {}}, acceptance=acc, speculation=spec))
    text = _flat(buf.getvalue())
    assert "no requests recorded" not in text, buf.getvalue()
    # the bucket's start is recorded, so the age is the bucket's, within one bucket of the request
    for w, mins, tail in (("prose", 12, "speculationwason(6of12stepsdrafted),acceptance0.400"),
                          ("code", 40, "speculationwason(5of9stepsdrafted),acceptance0.150"),
                          ("math", 13, "speculationwasoff(all5stepsplain)")):
        age = spec[f"{w}@greedy"]["last"]["age_s"]
        assert mins * 60 <= age < mins * 60 + h.bucket_s
        assert _flat(f"last request {round(age / 60)} min ago: ") + tail in text, buf.getvalue()


def test_a_workload_name_with_rich_markup_is_shown_as_written_and_never_breaks_status(screen, redis_client, key_prefix):
    """Workload names are the clients' (any UTF-8): one holding a closing tag ("x[/]") made
    `daemonctl status` fail with rich's MarkupError on the acceptance table, and one holding a
    style ("[red]y[/]") lost its brackets. Both are printed as written."""
    from daemon.reports import acceptance_sections
    from store.config import StoreConfig
    from store.history import AcceptanceHistory

    h = AcceptanceHistory(redis_client, StoreConfig(key_prefix=key_prefix))
    now = time.time()
    for w in ("x[/]", "[red]y[/]"):
        h.record(w, 0, {"requests": 1, "num_steps": 4, "num_drafts": 3, "num_draft_tokens": 12,
                        "num_accepted_tokens": 6}, ts=now - 10 * 60)
    adapter = {"active": 0, "since": None, "previous": None, "workloads": {}}
    acc, spec = acceptance_sections(h, adapter, now)
    buf = screen(220)
    st = _status({"active": 0, "since": None, "previous": None, "reason": None, "how": None,
                  "registered": 0, "workloads": {}}, acceptance=acc, speculation=spec)
    st["problems"] = ["last training round failed: workload 'x[/]' refused"]  # a reason quoting the name
    cli.render_status(st)
    text = buf.getvalue()
    assert "│ x[/]" in text and "│ [red]y[/]" in text, text
    assert "last training round failed: workload 'x[/]' refused" in text, text
    assert _flat("speculation was on (3 of 4 steps drafted), acceptance 0.500") in _flat(text)


def test_the_previous_adapter_shows_how_many_requests_its_figures_rest_on():
    """A previous adapter's rate 0.000 beside α 0.179 read as a contradiction in a walkthrough:
    it rested on one request. The cell now says how many."""
    row = {"requests": 12, "acceptance_rate": 0.41, "tau": 1.8, "alpha": 0.45, "goodput_tokens_per_ms": 0.048}
    prev = {"version": 3, "requests": 1, "acceptance_rate": 0.0, "tau": 1.0, "alpha": 0.179, "goodput_tokens_per_ms": 0.0187}
    st = {"acceptance": {"prose": {"now": {**row, "version": 4}, "previous": prev}},
          "speculation": {"prose": {"on": True, "why": "ngram γ=2"}}}
    buf = io.StringIO()
    cli._render_acceptance(st, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "previous (req): rate/tau/alpha/goodput" in text
    assert "v3 (1): 0.000/1.00/0.179/0.0187" in text, text


def test_the_serving_row_names_the_proposers_offered(screen):
    """A break session: while the derived draft was held (serve.base_draft, no adapter version yet)
    `daemonctl status` said only "adapter v0 ... speculation prose off"; the offered proposers were
    in the service's own status alone."""
    buf = screen(200)
    hb = {"server_id": "s1", "adapter_version": 0, "requests_served": 3, "queue_depth": 0, "queue_size": 64,
          "speculation_by_workload": {"prose": False}, "last_seen_s": 1.0, "proposers_offered": ["ngram"]}
    cli.render_status(_status({"active": 0, "registered": 0}, serving=[hb]))
    assert "speculation prose off (proposers offered: ngram); last seen 1.0 s ago" in " ".join(buf.getvalue().split())
