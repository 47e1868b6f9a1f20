"""What ``status`` and ``history`` report, built from the store (and the trainer's status when
one runs): plain functions of their inputs, shared by the running daemon (:class:`daemon.app.Daemon`),
``daemonctl status`` with the daemon down, and the Prometheus collector.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import redis

from store.buffer import dead_letter_count, group_info, stream_depth
from store.history import AcceptanceHistory, HistoryRow, sum_rows
from store.jsonsafe import jsonable, nan_none
from store.registry import AdapterRecord, AdapterRegistry

if TYPE_CHECKING:
    from daemon.redis_embed import RedisHandle
    from daemon.settings import Settings
    from store.config import StoreConfig

RECENT_WINDOW_S = 300.0  # "recent" for status: speculation on/off and the recent acceptance rate


def row_summary(r: HistoryRow) -> dict[str, Any]:
    """Counts and derived rates of a history row, JSON-ready (NaN -> null).

    acceptance_rate = accepted / drafted tokens; tau = emitted tokens / verification steps
    (mean accepted length with the correction or bonus token); alpha = mean per-request alpha;
    goodput = emitted tokens per ms of decode wall time (one unit with the decoder and the controller).
    """
    return {
        "requests": r.requests,
        "num_drafts": r.num_drafts,
        "num_draft_tokens": r.num_draft_tokens,
        "num_accepted_tokens": r.num_accepted_tokens,
        "num_emitted_tokens": r.num_emitted_tokens,
        "num_steps": r.num_steps,
        "acceptance_rate": nan_none(r.acceptance_rate),
        "tau": nan_none(r.tau),
        "alpha": nan_none(r.alpha),
        "goodput_tokens_per_ms": nan_none(r.goodput, 5),
    }


def by_workload(rows: list[HistoryRow], version: int | None = None) -> dict[str, dict[str, Any]]:
    """:func:`row_summary` of ``rows`` summed per workload, workloads sorted."""
    return {w: row_summary(sum_rows([r for r in rows if r.workload == w], w, version)) for w in sorted({r.workload for r in rows})}


def adapter_dict(rec: AdapterRecord) -> dict[str, Any]:
    d = asdict(rec)
    for k in ("loss", "alpha_before", "alpha_after"):
        d[k] = nan_none(d[k])
    return d


def adapters_list(registry: AdapterRegistry) -> list[dict[str, Any]]:
    """Every registered version (``daemonctl adapters list``), with whether it is its scope's active one."""
    actives = registry.active_versions()
    return [adapter_dict(r) | {"active": r.version == actives.get(r.scope, 0)} for r in registry.list()]


def heads_list(registry: AdapterRegistry, history: AcceptanceHistory) -> list[dict[str, Any]]:
    """:func:`adapters_list` for the head registry (``daemonctl heads list``), each version with
    ``live``: the requests it proposed for, summed over workloads from the head history
    (``AcceptanceHistory(kind="head")``): requests, proposed and accepted tokens, and α as the
    history keeps it, the mean of per-request α (the rollback monitor judges the α pooled over
    proposed positions, which weighs long requests more). A history that cannot be read (a
    corrupt index) leaves ``live`` None with ``live_error`` saying why; the versions still list."""
    versions = adapters_list(registry)
    if not versions:
        return []
    try:
        rows = history.read()
    except (ValueError, redis.ResponseError) as e:  # a malformed index or a key of another type; no Redis raises
        return [a | {"live": None, "live_error": f"the head history cannot be read: {e}"} for a in versions]
    out = []
    for a in versions:
        tot = sum_rows([r for r in rows if r.version == a["version"]], None, a["version"])
        out.append(a | {"live": {"requests": tot.requests, "num_draft_tokens": tot.num_draft_tokens,
                                 "num_accepted_tokens": tot.num_accepted_tokens, "alpha": tot.alpha}})
    return out


def active_since(log_events: list[dict], active: int, scope: str = "") -> tuple[float | None, int | None, str | None]:
    """When ``active`` became ``scope``'s active version, the version before it and the reason,
    from the promotion log."""
    ev = activation(log_events, active, scope)
    return (None, None, None) if ev is None else (float(ev["ts"]), int(ev["previous"]), ev.get("reason"))


def activation(log_events: list[dict], active: int, scope: str = "") -> dict | None:
    """The promotion-log event that made ``active`` ``scope``'s active version (``event`` "promote"
    or "rollback"), None when the log holds none. Its ``reason`` is that event's: why ``active`` was
    promoted, or why ``previous`` (then a newer version) was rolled back."""
    for ev in reversed(log_events):
        if (ev.get("event") in ("promote", "rollback") and ev.get("scope", "") == scope
                and int(ev.get("version", -1)) == active):
            return ev
    return None


def _activation_fields(events: list[dict], active: int, scope: str = "") -> dict:
    ev = activation(events, active, scope)
    if ev is None:
        return {"since": None, "previous": None, "reason": None, "how": None}
    return {"since": float(ev["ts"]), "previous": int(ev["previous"]), "reason": ev.get("reason"), "how": ev["event"]}


# -- status ----------------------------------------------------------------------------------------


def status_report(daemon: dict, settings: "Settings", redis: "RedisHandle", store_config: "StoreConfig",
                  registry: AdapterRegistry, history: AcceptanceHistory, trainer: Any, now: float) -> dict:
    """What ``daemonctl status`` shows: ``daemon`` (the caller's section), Redis, the buffer, the
    trainer (``trainer``: a TrainerService, or None when none runs here), the active adapters and
    acceptance per workload. ``healthy`` is False when ``problems`` is not empty."""
    problems: list[str] = []
    warnings: list[str] = []
    if daemon.get("up") and settings.api.enabled and settings.api.remote:
        warnings.append(f"control API bound to {settings.api.host} (api.allow_remote=true): its read endpoints "
                        f"(pid, state dir, key prefix, /docs) are open to the network; bind 127.0.0.1 behind a TLS proxy")
    redis_info = redis.describe()
    out: dict[str, Any] = {"daemon": daemon, "redis": redis_info}
    if not redis_info.get("up"):
        problems.append(f"Redis unreachable at {redis_info['url']}: {redis_info.get('error')}")
        out.update(healthy=False, problems=problems, warnings=warnings)
        return out
    out["buffer"] = buffer_section(redis.client, store_config, settings.store.consumer_group, warnings)
    out["trainer"] = trainer_section(trainer, problems)
    out["trainer_lease"] = lease_section(redis.client, store_config)
    out["adapter"] = adapter_section(registry)
    # the feature-level proposer's heads (trainer.heads, serve.follow_heads): the same layout
    out["head"] = adapter_section(AdapterRegistry(redis.client, settings.head_dir, store_config, kind="head"))
    out["acceptance"], out["speculation"] = acceptance_sections(history, out["adapter"], now, warnings)
    if not registry.list() and not out["acceptance"]:
        hint = other_prefixes_hint(redis.client, store_config.key_prefix)
        if hint:
            warnings.append(hint)
    from store.heartbeat import read_heartbeats

    out["serving"] = [hb | {"last_seen_s": round(now - float(hb.get("ts") or now), 1)}
                      for hb in read_heartbeats(redis.client, store_config)]  # `daemonctl serve` instances
    warnings.extend(folding_warnings(out["serving"]))
    warnings.extend(buffer_warnings(out["serving"], now))
    out.update(healthy=not problems, problems=problems, warnings=warnings)
    return out


def lease_section(client: Any, store_config: "StoreConfig") -> dict | None:
    """Who holds the trainer lease (store.lease): the daemon that trains when several run on one
    Redis; None when no daemon holds it (none runs, or all run with trainer.lease_ttl_s = 0)."""
    from store.lease import Lease

    cur = Lease(client, store_config, "status-reader").current()
    return None if cur is None else {"holder": cur.holder, "token": cur.token, "expires_in_s": round(cur.ttl_ms / 1000, 1)}


def folding_warnings(serving: list[dict]) -> list[str]:
    """A warning per serve heartbeat whose clients sent more distinct workloads or sampling buckets
    than it keeps (``serve.max_workloads`` / ``serve.max_sampling_buckets``: the rest is folded into
    'other')."""
    out = []
    for hb in serving:
        for key, c in (hb.get("cardinality") or {}).items():
            if isinstance(c, dict) and c.get("folded_requests"):
                setting = "serve.max_workloads" if key == "workload" else "serve.max_sampling_buckets"
                more = "+" if c.get("folded_values", 0) >= 10 * c.get("limit", 0) else ""
                out.append(f"serve {hb.get('server_id')}: {c['folded_requests']} requests with {c.get('folded_values')}{more} "
                           f"new {key} values past {setting}={c.get('limit')} were served under 'other'; raise it if "
                           f"they are real, else look for a client inventing {key}s")
    return out


def buffer_warnings(serving: list[dict], now: float) -> list[str]:
    """A warning per serve heartbeat whose record writer (``store.buffer.SampleWriter``: its stats in
    the heartbeat's ``buffer``) lost Redis or dropped records: Redis unreachable now (since when), or
    its last outage (when, how long), the records dropped, and the last error. Once Redis is back the
    daemon's own Redis row is green again; this says what the outage cost. ``now``: seconds since
    the epoch (this host's clock; the writer's times are on its serve's, read against the
    heartbeat's ``ts``). A heartbeat of an older serve (no ``buffer``, or one without these keys)
    says what it has."""
    out = []
    for hb in serving:
        b = hb.get("buffer")
        if not isinstance(b, dict) or not (b.get("outages") or b.get("dropped") or b.get("down_since") is not None):
            continue
        lo = b.get("last_outage")
        if b.get("down_since") is not None:
            what = (f"cannot reach Redis for {_serve_seconds_since(hb, b['down_since'], now):.0f} s "
                    f"(records queue in memory meanwhile)")
        elif isinstance(lo, (list, tuple)) and len(lo) == 2:
            went, back = lo
            what = (f"lost Redis {b.get('outages')} time{'' if b.get('outages') == 1 else 's'}, last at "
                    f"{_clock_time(went)} for {max(0.0, back - went):.0f} s "
                    f"(back {_serve_seconds_since(hb, back, now):.0f} s ago)")
        else:
            what = "wrote every record it could"
        dropped = b.get("dropped") or 0
        down = (f"{b['dropped_redis_down']} while Redis was down, the oldest first; "
                if b.get("dropped_redis_down") is not None else "")
        out.append(f"serve {hb.get('server_id')}: its record writer {what}; {dropped} record{'' if dropped == 1 else 's'} "
                   f"dropped ({down}the trainer never sees them), {b.get('written') or 0} written"
                   + (f"; last error at {_clock_time(b['last_error_at'])}: {b.get('last_error')}"
                      if b.get("last_error") and b.get("last_error_at") else ""))
    return out


def _serve_seconds_since(hb: dict, t: float, now: float) -> float:
    """Seconds from ``t`` (on the serve's clock) to ``now`` (this host's): up to the heartbeat's
    ``ts`` on the serve's own clock, then the heartbeat's age here, neither below 0 (hosts' clocks
    differ)."""
    ts = hb.get("ts")
    if not isinstance(ts, (int, float)):
        return max(0.0, now - t)
    return max(0.0, ts - t) + max(0.0, now - ts)


def _clock_time(t: float) -> str:
    """Seconds since the epoch as the local "HH:MM:SS"."""
    import datetime as dt

    return dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S")


def buffer_section(client: Any, cfg: "StoreConfig", consumer_group: str, warnings: list[str]) -> dict:
    """Stream depth, dead letters and the consumer groups (the trainer's lag and pending first)."""
    groups = [asdict(g) | {"last_delivered_id": g.last_delivered_id.decode()} for g in group_info(client, cfg)]
    trainer_group = next((g for g in groups if g["name"] == consumer_group), None)
    dead = dead_letter_count(client, cfg)
    if dead:
        warnings.append(f"{dead} dead-lettered entries in {cfg.keys.dead_letter} (daemonctl status --json shows the count; inspect with XRANGE)")
    return {
        "stream": cfg.keys.stream,
        "depth": stream_depth(client, cfg),
        "dead_letters": dead,
        "consumer_lag": None if trainer_group is None else trainer_group["lag"],
        "consumer_pending": None if trainer_group is None else trainer_group["pending"],
        "groups": groups,
    }


def trainer_section(trainer: Any, problems: list[str]) -> dict:
    """The trainer's state and last round; a failed last round is a problem."""
    if trainer is None:
        return {"enabled": False, "reason": "models.enabled=false: no model pair loaded, no rounds"}
    st = trainer.status()
    last = st.get("last_round")
    if last and last.get("decision") == "error":
        problems.append(f"last training round failed: {last.get('reason')}")
    return {
        "enabled": True,
        "fingerprint": getattr(trainer, "fingerprint", None),
        "paused": st["paused"],
        "running": st["running"],
        "rounds": st["rounds"],
        "next_run_time": None if st["paused"] else st["next_run_time"],
        "heldout": st["heldout"],
        "warm_start": st.get("warm_start"),  # v0's bootstrap (daemon.warm_start): "pending", its result, or "failed: ..."
        "heads": st.get("heads"),  # trainer.heads: the head it trains from, its pools and its last turn (None: off)
        "lease": st.get("lease"),  # store.lease: "leader" or "standby", its token, who holds the lease (None: no lease)
        "last_round": None if last is None else {
            k: last.get(k) for k in ("trigger", "started_at", "seconds", "decision", "reason", "version", "read", "trained_on",
                                     "acked", "scopes")
        },
    }


def adapter_section(registry: AdapterRegistry) -> dict:
    """The shared active adapter and each workload's own, with when and how each became active:
    ``how`` "promote" (``reason``: why it was promoted over ``previous``) or "rollback"
    (``reason``: why ``previous`` was rolled back), None when the promotion log does not say."""
    actives = registry.active_versions()
    active = actives[""]
    events = registry.promotion_log(1000)
    own = {}
    for w, v in actives.items():
        if w and v:
            own[w] = {"active": v, **_activation_fields(events, v, w)}
        elif w and activation(events, 0, w) is not None:  # its own adapter was rolled back: the shared one serves it
            own[w] = {"active": 0, **_activation_fields(events, 0, w)}
    return {"active": active, **_activation_fields(events, active), "registered": len(registry.list()), "workloads": own}


STATUS_WORKLOADS = 50  # workloads `daemonctl status` lists (those with the most requests); a warning counts the rest


def acceptance_sections(history: AcceptanceHistory, adapter: dict, now: float,
                        warnings: list[str] | None = None) -> tuple[dict, dict]:
    """Per workload: the adapter serving it (its own, else the shared one) vs the one before it,
    and the recent window; and whether speculation is on there, with why. At most
    :data:`STATUS_WORKLOADS` workloads, those with the most requests: the history may hold
    thousands (clients invent them; servers fold them into 'other' only past their bound), and
    the rest are counted in ``warnings``."""
    own = adapter["workloads"]
    rows = history.read()
    by_w: dict[str, list[HistoryRow]] = {}
    for r in rows:
        by_w.setdefault(r.workload, []).append(r)
    shown = sorted(by_w)
    if len(shown) > STATUS_WORKLOADS:
        top = sorted(by_w, key=lambda w: (-sum(r.requests for r in by_w[w]), w))[:STATUS_WORKLOADS]
        if warnings is not None:
            warnings.append(f"{len(by_w) - STATUS_WORKLOADS} more workloads in the acceptance history than the "
                            f"{STATUS_WORKLOADS} with the most requests shown here (clients sending new workload names? "
                            f"serve.max_workloads bounds them per server)")
        shown = sorted(top)
    acc, spec = {}, {}
    for w in shown:
        wr = by_w[w]
        # The history's names are "workload@sampling bucket" (decoder.shift.key_str); a workload
        # with its own adapter (trainer.per_workload) is served by it, the rest by the shared one.
        src = own.get(w.split("@", 1)[0], adapter)
        w_active, w_since, w_previous = src["active"], src["since"], src["previous"]
        if src is not adapter and w_active == 0:  # its own adapter rolled back: the shared one serves it, compared with that one
            w_active = adapter["active"]
        elif src is not adapter and not w_previous:  # its first own version: the shared adapter served it before
            w_previous = adapter["active"]
        cur = [r for r in wr if r.version == w_active and (w_since is None or r.ts + history.bucket_s > w_since)]
        prev = [r for r in wr if w_previous is not None and r.version == w_previous]
        recent = [r for r in wr if r.ts >= now - RECENT_WINDOW_S]
        rs = sum_rows(recent, w)
        acc[w] = {
            "now": row_summary(sum_rows(cur, w, w_active)) | {"version": w_active},
            "previous": None if w_previous is None else row_summary(sum_rows(prev, w, w_previous)) | {"version": w_previous},
            "recent": row_summary(rs),
        }
        last_ts = max(r.ts for r in wr) if wr else None
        # no recent traffic (after a demo, a stopped daemon): the window that ended at the last request
        last = sum_rows([r for r in wr if r.ts >= last_ts - RECENT_WINDOW_S], w) if last_ts is not None else None
        spec[w] = speculation_state(recent, rs, last_ts, now, last)
    return acc, spec


def speculation_state(recent: list[HistoryRow], rs: HistoryRow, last_ts: float | None = None, now: float | None = None,
                      last: HistoryRow | None = None) -> dict:
    """On when recent verification steps (the last :data:`RECENT_WINDOW_S` s) drafted (γ > 0), off
    when all were plain, None without recent traffic. Then, when the workload's last request was
    recorded (``last_ts``, epoch s) and ``last`` (its counts over the window ending there) are
    known, ``last`` holds what was true then: ``age_s`` (s since ``last_ts``), ``on``, the
    acceptance rate (accepted / drafted tokens) and requests, and ``why`` says it with its age,
    so a status after a demo shows each workload's last known acceptance rather than one message."""
    if not recent or rs.num_steps == 0:
        if last_ts is None or now is None:
            return {"on": None, "why": f"no requests recorded in the last {RECENT_WINDOW_S:.0f} s"}
        age = max(0.0, now - last_ts)
        if last is None or last.num_steps == 0:
            return {"on": None, "last": {"age_s": round(age, 1)},
                    "why": f"last request {_ago(age)} ago (its rates are in 'now' and 'previous')"}
        was_on = last.num_drafts > 0
        rate = nan_none(last.acceptance_rate)
        then = (f"speculation was on ({last.num_drafts} of {last.num_steps} steps drafted), acceptance "
                f"{'-' if rate is None else f'{rate:.3f}'}" if was_on else
                f"speculation was off (all {last.num_steps} steps plain)")
        reqs = f"{last.requests} request" + ("" if last.requests == 1 else "s")
        return {"on": None,
                "last": {"age_s": round(age, 1), "on": was_on, "acceptance_rate": rate, "requests": last.requests},
                "why": f"last request {_ago(age)} ago: {then} ({reqs} in the {RECENT_WINDOW_S / 60:.0f} min up to it)"}
    if rs.num_drafts > 0:
        return {"on": True, "why": f"{rs.num_drafts} of {rs.num_steps} verification steps drafted in the last {RECENT_WINDOW_S:.0f} s"}
    return {"on": False, "why": f"all {rs.num_steps} steps in the last {RECENT_WINDOW_S:.0f} s were plain (gamma = 0)"}


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def other_prefixes_hint(client: Any, key_prefix: str) -> str | None:
    """When nothing is registered under ``key_prefix`` but a demo left data under
    ``<key_prefix>demo:`` (``daemonctl demo`` keeps its own namespace), the export that shows it."""
    demo = f"{key_prefix}demo:"
    try:
        found = next(iter(client.scan_iter(match=demo.replace("*", r"\*") + "*", count=1000)), None)
    except Exception:  # noqa: BLE001 - a hint only
        return None
    if found is None:
        return None
    return (f"nothing is registered under {key_prefix!r}, but `daemonctl demo` left its run under {demo!r}: "
            f"export DRAFTD_STORE__KEY_PREFIX={demo} to see it")


# -- history ---------------------------------------------------------------------------------------


def history_report(registry: AdapterRegistry, history: AcceptanceHistory, since: float | None = None) -> dict:
    """Per adapter version: metadata, held-out alpha before/after, live acceptance per workload
    while it was active; the promotion log; and the bucketed acceptance series for plots."""
    rows = history.read(start=since)
    actives = registry.active_versions()
    versions = []
    for rec in registry.list():
        live = by_workload([r for r in rows if r.version == rec.version], rec.version)
        versions.append(adapter_dict(rec) | {"active": rec.version == actives.get(rec.scope, 0), "live": live})
    base_live = by_workload([r for r in rows if r.version == 0], 0)
    series = [{"ts": r.ts, "workload": r.workload, "version": r.version} | row_summary(r) for r in rows]
    return {"active": actives[""], "actives": actives, "base_live": base_live, "adapters": versions,
            "events": registry.promotion_log(1000), "series": series, "bucket_s": history.bucket_s}
