"""``daemonctl``: run the daemon, inspect it, operate it.

Everything but ``run``, ``config`` and ``bootstrap`` talks to the running daemon over its control
API (address and token from the same settings the daemon reads: ``DRAFTD_*``, ``--config``).
``status`` still reports Redis and the buffer when the daemon is down and its Redis is reachable.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import structlog
import typer
from rich.table import Table
from rich.markup import escape

from daemon.client import ApiClient, ApiError, DaemonDown, read_token
from daemon.logging import configure, console
from daemon.settings import (ConfigError, distill_config, draft_vocab_ids, effective, ensure_state_dir, load_settings,
                             store_config)

# Model, Redis, FastAPI and plotting code is imported inside the commands that use it, so that
# `daemonctl status` loads no torch (tests/daemon/test_cli_imports.py).
from daemon.cli_offline import read_or_offline
from daemon.reports import adapters_list as adapters_report, heads_list as heads_report, history_report

app = typer.Typer(help="draftd: online-adapted speculative decoding sidecar. Operate the daemon.", no_args_is_help=True)
adapters_app = typer.Typer(help="Registered draft adapters: list, show, promote, rollback.", no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
heads_app = typer.Typer(help="Registered feature-level heads (trainer.heads, the 'eagle' proposer): list, rollback. "
                             "Read and written in Redis directly.", no_args_is_help=True)
app.add_typer(heads_app, name="heads")

out = console()
err = console(stderr=True)

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config file (else $DRAFTD_CONFIG)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout")]
ReasonOpt = Annotated[str, typer.Option("--reason", "-r", help="why; recorded in the registry")]


def _settings(config: Path | None, **overrides: Any):
    try:
        return load_settings(config, **overrides)
    except ConfigError as e:
        err.print(f"[red]config error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e


def _client(config: Path | None):
    s = _settings(config)
    return ApiClient(s.api_url, read_token(s)), s


def _call(fn, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except DaemonDown as e:
        err.print(f"[red]{escape(str(e))}[/]; start it with `daemonctl run`")
        raise typer.Exit(3) from e
    except ApiError as e:
        err.print(f"[red]refused ({e.status}):[/] {escape(str(e.detail))}")  # may quote a workload's name
        raise typer.Exit(1 if e.status != 401 else 4) from e


def _when(ts: float | None) -> str:
    if ts is None or (isinstance(ts, float) and math.isnan(ts)):
        return "-"
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# -- run / config ------------------------------------------------------------------------------------


@app.command()
def run(
    config: ConfigOpt = None,
    no_models: Annotated[bool, typer.Option("--no-models", help="no model pair, no trainer: bookkeeping, API and metrics only")] = False,
    port: Annotated[Optional[int], typer.Option(help="control API port (overrides api.port)")] = None,
) -> None:
    """Run the daemon in the foreground until SIGTERM or SIGINT."""
    overrides: dict[str, Any] = {}
    s = _settings(config)
    try:
        ensure_state_dir(s)
    except ConfigError as e:
        err.print(f"[red]config error:[/] {escape(str(e))}")
        raise typer.Exit(2) from e
    if no_models:
        overrides["models"] = s.models.model_copy(update={"enabled": False})
    if port is not None:
        overrides["api"] = s.api.model_copy(update={"port": port})
    if overrides:
        s = s.model_copy(update=overrides)
    configure(s.log_format, s.log_level)
    from daemon.app import Daemon

    log = structlog.get_logger("daemon.cli")
    d = Daemon(s)
    rc = 1
    try:
        rc = d.run()
    except Exception as e:  # noqa: BLE001 - one line for the operator, the traceback in the log
        log.exception("daemon_failed", error=str(e))
    finally:
        if d.abandoned_round:  # its thread must not keep the process alive (nor register anything)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    raise typer.Exit(rc)


@app.command("config")
def config_cmd(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Print the effective configuration (environment + file + defaults), secrets masked."""
    s = _settings(config)
    data = effective(s)  # every Redis URL's password masked
    if json_out:
        print(json.dumps(data, indent=2))
        return
    t = Table(title="draftd effective configuration", show_lines=False)
    t.add_column("setting")
    t.add_column("value")
    t.add_column("env")
    for group, val in data.items():
        if isinstance(val, dict):
            for k, v in val.items():
                t.add_row(f"{group}.{k}", escape(str(v)), f"DRAFTD_{group.upper()}__{k.upper()}")
        else:
            t.add_row(group, escape(str(val)), f"DRAFTD_{group.upper()}")
    out.print(t)


# -- status --------------------------------------------------------------------------------------------


def _offline_status(s) -> dict:
    """What can be known with the daemon down: Redis (URL or default address) and the store."""
    from daemon.redis_embed import RedisHandle, answers
    from store.client import mask_url
    from daemon.reports import status_report
    from store.client import StoreError, connect
    from store.history import AcceptanceHistory
    from store.registry import AdapterRegistry

    down = {"up": False, "api": s.api_url}
    url = s.redis.url or (s.redis.default_url if s.redis.embedded != "always" and answers(s.redis.default_url) else None)
    if url is None:
        return {
            "daemon": down,
            "redis": {"mode": "embedded", "up": False, "data_dir": str(s.redis_dir),
                      "note": "the embedded Redis runs only while the daemon runs"},
            "healthy": False,
            "problems": [f"daemon not running (no answer at {s.api_url})"],
            "warnings": [],
        }
    try:
        client = connect(url)
    except StoreError as e:
        return {"daemon": down, "redis": {"mode": "url", "url": mask_url(url), "up": False, "error": str(e)},
                "healthy": False, "problems": [f"daemon not running (no answer at {s.api_url})", str(e)], "warnings": []}
    try:
        cfg = store_config(s)
        st = status_report(down | {"key_prefix": s.store.key_prefix, "state_dir": str(s.state_dir)}, s,
                           RedisHandle(client, "url" if s.redis.url else "default", mask_url(url)), cfg,
                           AdapterRegistry(client, s.adapter_dir, cfg), AcceptanceHistory(client, cfg), None, time.time())
    finally:
        client.close()
    st["trainer"] = {"enabled": None, "reason": "daemon not running"}
    st["problems"].insert(0, f"daemon not running (no answer at {s.api_url}); what the store holds is shown: "
                             "after `daemonctl demo`, whose loop ran in its own process, that is expected; "
                             "`daemonctl run` starts the daemon")
    st["healthy"] = False
    return st


def _activated(a: dict, own: str = "") -> str:
    """How a scope's active version became active, its reason told as that event's: "v3 active since
    T, promoted: <why> (previous v2)" or "v2 active since T, after v3 was rolled back: <why>". (It was
    "(previous v2: <why>)", which put v3's promotion reason beside v2 as if it were v2's.)"""
    s = f"v{a['active']}{own} active" + (f" since {_when(a['since'])}" if a.get("since") is not None else "")
    prev, reason, how = a.get("previous"), a.get("reason"), a.get("how")
    if own and a["active"] == 0 and how == "rollback":  # a workload whose own adapter was rolled back
        when = f" since {_when(a['since'])}" if a.get("since") is not None else ""
        return f"none of its own{when}: v{prev} was rolled back{': ' + reason if reason else ''}; the shared adapter serves it"
    if prev is None:
        return s
    why = f": {reason}" if reason else ""
    if how == "rollback":
        return f"{s}, after v{prev} was rolled back{why}"
    if how == "promote":
        if own and not prev:  # a workload's first own version: the shared adapter served it before
            return f"{s}, promoted{why} (before it: the shared adapter)"
        return f"{s}, promoted{why} (previous v{prev})"
    return f"{s} (previous v{prev}){'; why: ' + reason if reason else ''}"  # an older daemon's report: no 'how'


def render_status(st: dict) -> None:
    d, r = st["daemon"], st.get("redis", {})
    t = Table(title="draftd status", show_header=False, title_justify="left")
    t.add_column("", style="bold", no_wrap=True)
    t.add_column("", overflow="fold")  # reasons wrap (a long path or key folds), never cut
    up = "[green]up[/]" if d.get("up") else "[red]down[/]"
    t.add_row("daemon", f"{up}  {escape(str(d.get('api', '')))}" + (f"  pid {d['pid']}  uptime {d['uptime_s']:.0f} s" if d.get("up") else ""))
    if r.get("up"):
        t.add_row("redis", escape(f"{r['mode']}  {r.get('url')}  Redis {r.get('version')}  {r.get('used_memory_human')} used"
                                  + ("  AOF on" if r.get("aof_enabled") else "")))
    else:
        t.add_row("redis", f"[red]down[/] {escape(str(r.get('mode')))} {escape(str(r.get('note') or r.get('error') or ''))}")
    b = st.get("buffer")
    if b:
        def n(x):
            return "-" if x is None else x

        t.add_row("buffer", escape(f"{b['stream']}: {b['depth']} entries; trainer lag {n(b['consumer_lag'])} pending "
                                   f"{n(b['consumer_pending'])}; dead letters {b['dead_letters']}"))
    tr = st.get("trainer")
    if tr:
        if not tr.get("enabled"):
            t.add_row("trainer", escape(f"off: {tr.get('reason')}"))
        else:
            state = "paused" if tr["paused"] else ("running a round" if tr["running"] else "idle")
            ws = tr.get("warm_start")
            if ws in ("pending", "running"):
                state = "bootstrapping v0 (its first job: daemon/warm_start.py)" if ws == "running" else "v0 bootstrap pending"
            t.add_row("trainer", escape(f"{state}; {tr['rounds']} rounds; next run {tr['next_run_time'] or '-'}"))
            if isinstance(ws, dict):
                t.add_row("v0", escape(f"{ws.get('source')}: {ws.get('reason')}"))
            elif isinstance(ws, str) and ws not in ("pending", "running"):
                t.add_row("v0", escape(ws))
            lr = tr.get("last_round")
            if lr:
                t.add_row("last round", escape(f"{lr['decision']} v{lr['version']} at {_when(lr['started_at'])} "
                                               f"({lr['seconds']:.1f} s, {lr['trained_on']} samples): {lr['reason']}"))
                for w, sr in (lr.get("scopes") or {}).items():
                    t.add_row(escape(f"  ({w})"), escape(f"{sr['decision']}{' v' + str(sr['version']) if sr['version'] else ''} "
                                                                   f"({sr['trained_on']} samples): {sr['reason']}"))
    a = st.get("adapter")
    if a:
        t.add_row("adapter", escape(f"{_activated(a)}; {a['registered']} registered"))
        for w, wa in (a.get("workloads") or {}).items():
            t.add_row(escape(f"adapter ({w})"), escape(_activated(wa, " (its own)")))
    hd = st.get("head")
    if hd and (hd.get("registered") or hd.get("active")):  # trainer.heads: the feature-level head's registry
        t.add_row("head (eagle)", escape(f"{_activated(hd)}; {hd['registered']} registered"))
        for w, wa in (hd.get("workloads") or {}).items():
            t.add_row(escape(f"head ({w})"), escape(_activated(wa, " (its own)")))
    for hb in st.get("serving") or []:
        spec = ", ".join(f"{w} {'on' if on else 'off'}" for w, on in (hb.get("speculation_by_workload") or {}).items()) or "-"
        t.add_row("serving", escape(f"{hb.get('server_id')}: adapter v{hb.get('adapter_version')}, {hb.get('requests_served')} "
                                    f"served, queue {hb.get('queue_depth')}/{hb.get('queue_size')}"
                                    f"{', draining' if hb.get('draining') else ''}; speculation {spec}"
                                    + (f" (proposers offered: {', '.join(hb['proposers_offered']) or 'none'})"
                                       if hb.get("proposers_offered") is not None else "")
                                    + f"; last seen {hb.get('last_seen_s')} s ago"))
        for k, by in (hb.get("speculation_by_batch") or {}).items():  # the controller's γ per batch size
            t.add_row(escape(f"  γ by batch ({k})"), escape(", ".join(
                f"{b}: {'?' if g is None else ('off' if g == 0 else f'γ={g}')}" for b, g in by.items())))
        sf = hb.get("served_format")
        if sf:  # decoder.models.formats: the target's weight format and why
            t.add_row("served format", escape(f"{hb.get('server_id')}: {sf.get('format')} ({sf.get('file')}; "
                                              f"models.format={sf.get('setting')}): {sf.get('reason')}"
                                              + (f"; V cache {sf['v_cache']}" if sf.get("v_cache") else "")
                                              + (f"; AMX per-row kernel up to GGML_AMX_VNNI_MAX_ROWS="
                                                 f"{sf['amx_rows'].get('setting')} rows ({sf['amx_rows'].get('source')})"
                                                 if isinstance(sf.get("amx_rows"), dict) else "")))
    for p in st.get("problems", []):  # plain text that may quote a workload's name or an error's
        t.add_row("[red]problem[/]", escape(p))
    for w in st.get("warnings", []):
        t.add_row("[yellow]warning[/]", escape(w))
    out.print(t)
    _render_acceptance(st, out)


def _render_acceptance(st: dict, out) -> None:
    """The status's acceptance table: per workload, the adapter serving it against the one before it."""
    acc = st.get("acceptance") or {}
    if acc:
        at = Table(title="acceptance per workload, active adapter vs the previous one (rate = accepted/drafted, "
                   "tau = tokens/step, alpha = mean per request, goodput = tokens/ms)", title_justify="left")
        for col in ("workload", "adapter", "req", "rate", "tau", "alpha", "goodput", "previous (req): rate/tau/alpha/goodput"):
            at.add_column(col, overflow="fold")  # figures fold whole onto a second line, never cut
        at.add_column("speculation", overflow="fold")  # the reason takes the room left
        for w, v in acc.items():
            n, p = v["now"], v.get("previous")
            sp = (st.get("speculation") or {}).get(w, {})
            on = {True: "[green]on[/]", False: "[yellow]off[/]", None: "?"}[sp.get("on")]
            if sp.get("on") is None and sp.get("last"):  # no recent traffic: the why tells the last request's state
                on = ""
            # its request count beside: a rate of 0.000 from one request reads as a contradiction of α 0.179
            prev = "-" if not p else (f"v{p['version']} ({p.get('requests', '?')}): {_f(p['acceptance_rate'])}/"
                                      f"{_f(p['tau'], 2)}/{_f(p['alpha'])}/{_f(p['goodput_tokens_per_ms'], 4)}")
            # a workload name is the client's (any UTF-8): "x[/]" would be a rich MarkupError
            at.add_row(escape(w), f"v{n['version']}", str(n["requests"]), _f(n["acceptance_rate"]), _f(n["tau"], 2),
                       _f(n["alpha"]), _f(n["goodput_tokens_per_ms"], 4), prev, f"{on} {escape(sp.get('why', ''))}".strip())
        out.print(at)


@app.command()
def status(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Daemon, Redis, buffer, trainer, active adapter, acceptance per workload. Exit 1 when unhealthy."""
    client, s = _client(config)
    try:
        st = client.get("/v1/status")
    except DaemonDown:
        st = _offline_status(s)
    except ApiError as e:
        st = {"daemon": {"up": True, "api": s.api_url}, "healthy": False, "problems": [f"status failed: {e}"], "warnings": []}
    if json_out:
        print(json.dumps(st, indent=2))
    else:
        render_status(st)
    raise typer.Exit(0 if st.get("healthy") else 1)


# -- history -------------------------------------------------------------------------------------------


def plot_history(h: dict, path: Path) -> None:
    """Acceptance rate per history bucket and workload over time, promotions and rollbacks marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    by_w: dict[str, dict[float, list[int]]] = {}
    for r in h["series"]:
        acc = by_w.setdefault(r["workload"], {}).setdefault(r["ts"], [0, 0])
        acc[0] += r["num_accepted_tokens"]
        acc[1] += r["num_draft_tokens"]
    for w, pts in sorted(by_w.items()):
        xs = [dt.datetime.fromtimestamp(t) for t, (a, n) in sorted(pts.items()) if n]
        ys = [a / n for t, (a, n) in sorted(pts.items()) if n]
        ax.plot(xs, ys, marker=".", label=w)
    for ev in h["events"]:
        if ev.get("event") not in ("promote", "rollback"):
            continue
        x = dt.datetime.fromtimestamp(float(ev["ts"]))
        color = "tab:green" if ev["event"] == "promote" else "tab:red"
        ax.axvline(x, color=color, linestyle="--", alpha=0.7)
        ax.text(x, 1.01, f"{'v' + ev['version'] if ev['event'] == 'promote' else 'rollback->v' + ev['version']}",
                rotation=90, va="bottom", ha="center", fontsize=8, color=color, transform=ax.get_xaxis_transform())
    if not by_w:
        ax.text(0.5, 0.5, "no acceptance history recorded yet (decoders write it per workload and adapter)",
                ha="center", va="center", transform=ax.transAxes, color="gray")
        times = [dt.datetime.fromtimestamp(float(e["ts"])) for e in h["events"]]
        if times:
            ax.set_xlim(min(times) - dt.timedelta(minutes=5), max(times) + dt.timedelta(minutes=5))
    ax.set_ylim(0, 1)
    ax.set_ylabel("acceptance rate (accepted / drafted tokens)")
    ax.set_xlabel(f"time (buckets of {h['bucket_s']} s)")
    ax.set_title("draftd: acceptance per workload; dashed: adapter promoted (green) / rolled back (red)", pad=40)
    if by_w:
        ax.legend(loc="lower right")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_plot_path(path: Path) -> Path:
    """``history --plot``'s file, checked before anything is read or printed: a name ending in a
    format matplotlib writes (its canvas's ``get_supported_filetypes``: png, pdf, svg, ...), in a
    folder that exists and is writable. Returns ``path``.

    Raises:
        ValueError: the first problem, naming the value and the fix.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    shown = f"--plot {str(path)!r}"
    if path.is_dir():
        raise ValueError(f"{shown} is a folder: give a file name in it, e.g. --plot {path / 'history.png'}")
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in kinds:
        what = "has no file type suffix" if not suffix else f"ends in .{suffix}, which matplotlib does not write"
        raise ValueError(f"{shown} {what}: end it in one of {', '.join('.' + k for k in sorted(kinds))}, "
                         f"e.g. --plot {path.with_suffix('.png').name}")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{shown}: the folder {str(folder)!r} does not exist; create it (mkdir -p {folder}) or "
                         f"write elsewhere")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{shown}: the folder {str(folder)!r} is not writable by this user; write elsewhere")
    return path


def _live(live: dict) -> str:
    """A version's live acceptance per workload, as markup: the workload names are the clients'
    (``[/]`` is a valid one), so they are escaped."""
    return escape("; ".join(f"{w} {_f(v['acceptance_rate'])} ({v['requests']} req)" for w, v in live.items()) or "-")


@app.command()
def history(
    config: ConfigOpt = None,
    json_out: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write a PNG of acceptance over time per workload, swaps marked")] = None,
    since_h: Annotated[Optional[float], typer.Option("--since-hours", help="only history newer than this many hours")] = None,
) -> None:
    """Adapter history: per version parent, created, samples, held-out alpha before/after,
    live acceptance per workload while active, state and reason."""
    if plot is not None:  # before the table: a bad file name must not cost a table and then a traceback
        try:
            check_plot_path(plot)
        except ValueError as e:
            err.print(f"[red]error:[/] {escape(str(e))}")
            raise typer.Exit(2) from e
    since = None if since_h is None else time.time() - since_h * 3600
    q = "" if since is None else f"?since={since}"
    h = read_or_offline(config, "/v1/history" + q, "history", lambda reg, hist: history_report(reg, hist, since))
    if json_out:
        print(json.dumps(h, indent=2))
    else:
        t = Table(title="adapter history (alpha = held-out, per position; live = acceptance rate while active)", title_justify="left")
        for col in ("version", "parent", "created", "samples", "alpha before", "alpha after", "live acceptance", "state"):
            t.add_column(col, overflow="fold")
        t.add_column("reason", overflow="fold")  # wraps, never cut
        t.add_row("v0 (base)", "-", "-", "-", "-", "-", _live(h["base_live"]), "active" if h["active"] == 0 else "", "")
        for a in h["adapters"]:
            state = escape(a["state"]) + (" [green](active)[/]" if a["active"] else "")
            t.add_row(f"v{a['version']}" + escape(f" ({a['scope']})" if a.get("scope") else ""), f"v{a['parent']}",
                      _when(a["created_at"]), str(a["samples_trained"]),
                      _f(a["alpha_before"]), _f(a["alpha_after"]), _live(a["live"]), state, escape(a["reason"] or ""))
        out.print(t)
    if plot is not None:
        try:
            plot_history(h, plot)
        except OSError as e:  # checked above; the disk can still refuse (full, removed meanwhile)
            err.print(f"[red]error:[/] --plot {escape(repr(str(plot)))}: {escape(str(e))}")
            raise typer.Exit(1) from e
        err.print(f"wrote {escape(str(plot))}")


# -- adapters and trainer control ----------------------------------------------------------------------


def _versions_table(kind: str, rows: list[dict], trained: str) -> Table:
    """A registry's versions (``daemon.reports.adapters_list`` rows) as ``adapters list`` and
    ``heads list`` print them; ``trained`` names the samples_trained column."""
    t = Table(title=f"{kind} (* = active in its scope; scope '-' = shared)")
    live = any("live" in a for a in rows)  # heads: the requests each proposed for (the head history)
    for col in ("version", "scope", "parent", "created", "state", "alpha before", "alpha after", trained,
                *(("live alpha, mean per request (requests)",) if live else ())):
        t.add_column(col, overflow="fold")  # a value folds whole onto a second line, never cut
    t.add_column("reason", overflow="fold")  # the reason wraps in the room left, never cut
    for a in rows:
        lv = a.get("live") or {}
        t.add_row(f"v{a['version']}" + (" *" if a["active"] else ""), escape(a.get("scope") or "-"), f"v{a['parent']}",
                  _when(a["created_at"]), escape(a["state"]), _f(a["alpha_before"]), _f(a["alpha_after"]),
                  str(a["samples_trained"]), *((f"{_f(lv.get('alpha'))} ({lv.get('requests', 0)})",) if live else ()),
                  escape(a["reason"] or ""))  # scope and reason may hold a client's workload name
    return t


@adapters_app.command("list")
def adapters_list(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Registered adapter versions, oldest first."""
    rows = read_or_offline(config, "/v1/adapters", "adapters list", lambda reg, hist: adapters_report(reg))
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    out.print(_versions_table("adapters", rows, "samples"))


@adapters_app.command("show")
def adapters_show(version: int, config: ConfigOpt = None) -> None:
    """One adapter version as JSON, with its live acceptance per workload."""
    client, _ = _client(config)
    print(json.dumps(_call(client.get, f"/v1/adapters/{version}"), indent=2))


@adapters_app.command("promote")
def adapters_promote(version: int, config: ConfigOpt = None, reason: ReasonOpt = "operator promote") -> None:
    """Make VERSION the active adapter."""
    client, _ = _client(config)
    r = _call(client.post, f"/v1/adapters/{version}/promote", {"reason": reason})
    where = f" for workload {escape(r['workload'])}" if r.get("workload") else ""
    out.print(f"v{r['active']} active{where} (was v{r['previous']})")


@adapters_app.command("rollback")
def adapters_rollback(
    config: ConfigOpt = None,
    reason: ReasonOpt = "operator rollback",
    workload: Annotated[str, typer.Option("--workload", help="roll back this workload's own adapter (default: the shared one)")] = "",
) -> None:
    """Roll the active adapter back to the previous promoted one (v0 = base draft). With
    --workload, that workload's own adapter (v0 = it uses the shared one again)."""
    client, _ = _client(config)
    r = _call(client.post, "/v1/rollback", {"reason": reason, "workload": workload})
    if workload:
        now = f"v{r['active']}" if r["active"] else "the shared adapter"
        out.print(f"{escape(workload)}: {now} (rolled back v{r['previous']})")
    else:
        out.print(f"v{r['active']} active (rolled back v{r['previous']})")
    for v, why in (r.get("skipped") or {}).items():
        out.print(f"skipped v{v}: its artifact fails the check: {escape(str(why))}")


@heads_app.command("list")
def heads_list(config: ConfigOpt = None, json_out: JsonOpt = False) -> None:
    """Registered head versions, oldest first (the head registry in Redis)."""
    from daemon.cli_offline import offline_call

    rows = offline_call(_settings(config), "heads list", heads_report, kind="head")
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        out.print("no heads registered (the trainer registers them with trainer.heads=true, from records that carry "
                  "hidden states: serve.record_hidden=true)")
        return
    out.print(_versions_table("heads", rows, "records"))


@heads_app.command("rollback")
def heads_rollback(
    config: ConfigOpt = None,
    reason: ReasonOpt = "operator rollback",
    workload: Annotated[str, typer.Option("--workload", help="roll back this workload's own head (default: the shared one)")] = "",
) -> None:
    """Roll the active head back to the previous promoted one (v0 = no head: the controller stops
    offering 'eagle'); serving loops that follow heads swap at their next request."""
    from daemon.cli_offline import offline_call
    from store.errors import ArtifactMissingError, InvalidTransitionError

    try:
        r = offline_call(_settings(config), "heads rollback",
                         lambda reg, hist: dict(zip(("active", "skipped"),
                                                    reg.rollback_checked(reason, scope=workload, refuse_missing=True))),
                         kind="head")
    except (InvalidTransitionError, ArtifactMissingError, ValueError) as e:  # nothing active, files elsewhere, bad scope
        err.print(f"[red]error:[/] {escape(str(e))}")
        raise typer.Exit(1) from e
    out.print(f"{escape(workload or 'shared')}: head v{r['active']} active" + (" (none: 'eagle' is not offered)" if not r["active"] else ""))
    for v, why in (r.get("skipped") or {}).items():
        out.print(f"skipped v{v}: its artifact fails the check: {escape(str(why))}")


@app.command("train-now")
def train_now(
    config: ConfigOpt = None,
    wait: Annotated[bool, typer.Option(help="wait for the round and print its report")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Run a training round now (waits behind a running one)."""
    client, _ = _client(config)
    if wait:
        with err.status("training round running in the daemon ..."):
            r = _call(client.post, "/v1/train-now?wait=true", timeout=3600)
    else:
        r = _call(client.post, "/v1/train-now")
    if json_out:
        print(json.dumps(r, indent=2))
    elif "report" in r:
        rep = r["report"]
        out.print(escape(f"round: {rep['decision']} v{rep['version']} ({rep['seconds']:.1f} s, {rep['trained_on']} "
                         f"samples): {rep['reason']}"))
    else:
        out.print("round submitted" + (" (queued behind the running round)" if r.get("queued_behind_running_round") else ""))


@app.command()
def pause(config: ConfigOpt = None) -> None:
    """Pause scheduled training rounds (a running round finishes; train-now still works)."""
    client, _ = _client(config)
    _call(client.post, "/v1/pause")
    out.print("trainer paused")


@app.command()
def resume(config: ConfigOpt = None) -> None:
    """Resume scheduled training rounds."""
    client, _ = _client(config)
    _call(client.post, "/v1/resume")
    out.print("trainer resumed")


# -- bootstrap -----------------------------------------------------------------------------------------


@app.command()
def bootstrap(
    config: ConfigOpt = None,
    workloads: Annotated[str, typer.Option(help="built-in workloads, comma-separated")] = "prose,code,math",
    source: Annotated[str, typer.Option(help="'corpus': the target scores built-in documents in one forward "
                                        "pass per window (~50x the positions per CPU second); 'decode': "
                                        "the target generates from built-in prompts")] = "corpus",
    corpus_tokens: Annotated[int, typer.Option(min=128, help="corpus tokens per workload (--source corpus)")] = 30_000,
    prompts: Annotated[int, typer.Option(min=1, help="prompts per workload (--source decode)")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="tokens the target generates per prompt (--source decode)")] = 96,
    max_steps: Annotated[int, typer.Option(min=1, help="optimiser steps in total")] = 200,
    max_seconds: Annotated[float, typer.Option(min=1.0, max=7 * 24 * 3600.0, help="training seconds in total")] = 600.0,
    round_steps: Annotated[int, typer.Option(min=1, help="steps between held-out evaluations")] = 25,
    no_promote: Annotated[bool, typer.Option("--no-promote", help="register the adapter but do not promote it")] = False,
) -> None:
    """The v0 adapter from the built-in corpora, promoted if held-out alpha rose: the target's
    distributions on built-in text go into the buffer (teacher-forced corpus windows, or its own
    generations at gamma = 0), the trainer distils them into the base draft, and the adapter is
    registered under the registry's next version number (v1 in an empty registry: version 0 is
    the base draft itself) and promoted if held-out alpha rose over the base draft's (held out:
    whole documents or prompts, by a hash of the request id)."""
    s = _settings(config)
    configure(s.log_format, "warning", stream=sys.stderr)
    names, prompts_all, corpora = _bootstrap_inputs(workloads, source, prompts)
    pair = _load_pair(s)
    try:  # before any scoring: a bad models.draft_vocab fails in seconds
        vocab = draft_vocab_ids(s, pair.tokenizer)
    except ValueError as e:
        err.print(f"[red]{escape(str(e))}[/]")
        raise typer.Exit(2) from e
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from daemon.bootstrap_data import decode_prompts, score_corpora
    from daemon.redis_embed import open_redis
    from store.buffer import SampleWriter
    from store.registry import AdapterRegistry
    from store.schema import PairFingerprint
    from trainer.bootstrap import BootstrapConfig, NotEnoughSamples
    from trainer.bootstrap import bootstrap as run_bootstrap
    from trainer.distill import Distiller, TrainerError

    fp = PairFingerprint(target=pair.target_name, draft=pair.draft_name, tokenizer_hash=pair.tokenizer_hash)
    scfg = store_config(s)
    samples = []
    with open_redis(s.redis, s.redis_dir) as h, SampleWriter(h.client, scfg) as writer:
        registry = AdapterRegistry(h.client, s.adapter_dir, scfg)

        def sink(sample: Any) -> None:
            samples.append(sample)
            writer.submit(sample)

        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*cols, console=err) as prog:
            def progress(description: str, total: int):
                task = prog.add_task(description, total=total)
                return lambda n: prog.advance(task, n)

            if source == "decode":
                decode_prompts(pair, fp, prompts_all, max_new_tokens, sink, progress)
            else:
                score_corpora(pair, fp, corpora, corpus_tokens, s.trainer.precision, sink, progress, _no_corpus_text)
            writer.flush(30)
            dcfg = dataclasses.replace(distill_config(s), weighting="all")
            distiller = Distiller(pair.draft, dcfg, vocab=vocab)
            task2 = prog.add_task("distilling into the draft (held-out alpha: -)", total=max_steps)

            def on_round(pt: Any) -> None:
                prog.update(task2, completed=pt.steps, description=f"distilling into the draft (held-out alpha {pt.alpha:.3f})")

            bcfg = BootstrapConfig(max_steps=max_steps, max_seconds=max_seconds, round_steps=round_steps, promote=not no_promote)
            try:
                res = run_bootstrap(samples, distiller, registry, bcfg, on_round=on_round)
            except TrainerError as e:
                err.print(f"[red]bootstrap failed:[/] {escape(str(e))}")
                if isinstance(e, NotEnoughSamples):
                    more, now = ("--corpus-tokens", corpus_tokens) if source == "corpus" else ("--prompts", prompts)
                    err.print(f"more data: raise {more} (now {now} per workload); the samples scored so far "
                              f"stay in {escape(scfg.keys.stream)}")
                raise typer.Exit(1) from e
    out.print(escape(f"{len(samples)} samples into {scfg.keys.stream}; v{res.version} "
                     f"{'promoted' if res.promoted else 'registered, not promoted'}: {res.reason}"))


def _no_corpus_text(w: str) -> None:
    why = " (GSM8K needs ../shared/data)" if w in ("math", "gsm8k") else ""
    err.print(f"[yellow]no corpus text for {escape(repr(w))}{why}; skipped[/]")


def _bootstrap_inputs(workloads: str, source: str, prompts: int) -> tuple[list[str], list, dict]:
    """Workload names, and their prompts (decode) or documents (corpus); exit 2 on a bad value,
    before the model load."""
    from decoder.workloads import documents, get_workload

    if source not in ("corpus", "decode"):
        err.print(f"[red]--source {escape(repr(source))}[/]: use 'corpus' or 'decode'")
        raise typer.Exit(2)
    names = [w.strip() for w in workloads.split(",") if w.strip()]
    if not names:
        err.print(f"[red]--workloads {escape(repr(workloads))}[/] names no workload; e.g. --workloads prose,code,math")
        raise typer.Exit(2)
    try:
        prompts_all = [p for w in names for p in get_workload(w, prompts)] if source == "decode" else []
        corpora = {w: documents(w) for w in names} if source == "corpus" else {}
    except ValueError as e:
        err.print(f"[red]--workloads {escape(repr(workloads))}[/]: {escape(str(e))}")
        raise typer.Exit(2) from e
    return names, prompts_all, corpora


def _load_pair(s) -> Any:
    """The configured model pair, with a spinner; exit 1 when it cannot be loaded."""
    from decoder.models.loading import load_pair
    from decoder.models.packaged import ModelLoadError

    m = s.models
    try:
        with err.status(escape(f"loading {m.target} + draft {m.draft} ...")) as sp:
            return load_pair(m.target, m.draft, device=m.device, progress=lambda msg: sp.update(escape(msg)))
    except (ModelLoadError, ValueError) as e:
        err.print(f"[red]cannot load the model pair:[/] {escape(str(e))}")
        raise typer.Exit(1) from e


from daemon.cli_decode import register as register_decode  # noqa: E402

register_decode(app)  # generate, bench


from daemon.demo import register as register_demo  # noqa: E402

register_demo(app)

from daemon.serve import register as register_serve  # noqa: E402

register_serve(app)

if __name__ == "__main__":
    app()
