"""Prometheus metrics, read from Redis and the trainer at scrape time (a custom collector).

Names carry the ``draftd:`` prefix, labelled by workload. The acceptance metrics are
``draftd:history_*``: sums of store's acceptance history (``AcceptanceHistory``) over its
retention window, written by every decoder that records history, not only this process. They are
gauges, since a bucket expiring after ``history_retention_s`` lowers them, and named apart from
``serve``'s live ``draftd:spec_decode_*`` counters (by adapter version, this process's requests
only), so one Prometheus scraping both gets no clashing series.

The history stores no per-position counts (a store schema change), so no per-position series.
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from daemon.reports import RECENT_WINDOW_S
from store.buffer import dead_letter_count, group_info, stream_depth
from store.client import StoreUnavailableError
from store.history import sum_rows

log = structlog.get_logger(__name__)

P = "draftd:"
H = P + "history_"  # the acceptance history's metrics (serve exports the live draftd:spec_decode_*)

# workload labels the daemon's /metrics exports from the acceptance history (issue 37 item 4: it
# held 2,000 invented names); the ones with the most requests, the rest summed under "other"
METRICS_WORKLOADS = 64


class DraftdCollector:
    """Collects on every scrape; a Redis outage gives ``draftd:redis_up 0`` and no store metrics."""

    def __init__(self, daemon: Any):  # a daemon.app.Daemon (app imports this module, not back)
        self.daemon = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        up = GaugeMetricFamily(P + "redis_up", "1 when the daemon's Redis answers")
        try:
            metrics = list(self._store_metrics())
            up.add_metric([], 1)
        except StoreUnavailableError as e:
            log.warning("metrics_redis_unavailable", error=str(e))
            metrics = []
            up.add_metric([], 0)
        yield up
        yield from metrics
        yield from self._trainer_metrics(d)

    def _store_metrics(self) -> Iterator[Metric]:
        d = self.daemon
        c, cfg = d.redis.client, d.store_config
        now = d.clock()
        rows = d.history.read()
        by_w: dict[str, list] = {}
        for r in rows:
            by_w.setdefault(r.workload, []).append(r)
        if len(by_w) > METRICS_WORKLOADS:  # the busiest keep their label; the rest are summed under "other"
            top = set(sorted(by_w, key=lambda w: (-sum(r.requests for r in by_w[w]), w))[:METRICS_WORKLOADS - 1])
            rest = [r for w, wr in by_w.items() if w not in top for r in wr]
            by_w = {w: by_w[w] for w in top}
            by_w["other"] = by_w.get("other", []) + rest
        workloads = sorted(by_w)
        fams = {  # H + name: sums over the retention window (gauges: an expiring bucket lowers them)
            "num_drafts": GaugeMetricFamily(H + "num_drafts", "Verification steps with a draft proposal (gamma > 0), over the history's retention", labels=["workload"]),
            "num_draft_tokens": GaugeMetricFamily(H + "num_draft_tokens", "Tokens proposed, over the history's retention", labels=["workload"]),
            "num_accepted_tokens": GaugeMetricFamily(H + "num_accepted_tokens", "Proposed tokens the target accepted, over the history's retention", labels=["workload"]),
            "num_emitted_tokens": GaugeMetricFamily(H + "num_emitted_tokens", "Tokens emitted (accepted + corrections + bonus), over the history's retention", labels=["workload"]),
            "requests": GaugeMetricFamily(H + "requests", "Requests recorded in the acceptance history, over its retention", labels=["workload"]),
        }
        # pooled rate (accepted / drafted tokens) and per-request mean α, named apart
        rate = GaugeMetricFamily(H + "acceptance_rate", f"Accepted / drafted tokens (pooled) over the last {RECENT_WINDOW_S:.0f} s", labels=["workload"])
        alpha = GaugeMetricFamily(H + "request_alpha_mean", f"Mean per-request alpha over the last {RECENT_WINDOW_S:.0f} s", labels=["workload"])
        tau = GaugeMetricFamily(H + "mean_accepted_length", f"Emitted tokens per verification step (tau) over the last {RECENT_WINDOW_S:.0f} s", labels=["workload"])
        for w in workloads:
            wr = by_w[w]
            tot = sum_rows(wr, w)
            for name, fam in fams.items():
                fam.add_metric([w], getattr(tot, name))
            recent = sum_rows([r for r in wr if r.ts >= now - RECENT_WINDOW_S], w)
            for fam, value in ((rate, recent.acceptance_rate), (alpha, recent.alpha), (tau, recent.tau)):
                if not math.isnan(value):
                    fam.add_metric([w], value)
        yield from fams.values()
        yield from (rate, alpha, tau)

        depth = GaugeMetricFamily(P + "buffer_depth", "Entries in the verified-sample stream (XLEN)")
        depth.add_metric([], stream_depth(c, cfg))
        yield depth
        lag = GaugeMetricFamily(P + "buffer_consumer_lag", "Entries not yet delivered to the consumer group", labels=["group"])
        pending = GaugeMetricFamily(P + "buffer_consumer_pending", "Entries delivered and not yet acked", labels=["group"])
        for g in group_info(c, cfg):
            if g.lag is not None:
                lag.add_metric([g.name], g.lag)
            pending.add_metric([g.name], g.pending)
        yield lag
        yield pending
        dead = GaugeMetricFamily(P + "buffer_dead_letters", "Entries in the dead-letter stream")
        dead.add_metric([], dead_letter_count(c, cfg))
        yield dead

        active = GaugeMetricFamily(P + "adapter_active_version",
                                   "Active adapter version per scope (scope '' = shared, 0 = base draft; a workload's 0 = uses the shared one)",
                                   labels=["scope"])
        for scope, v in d.registry.active_versions().items():
            active.add_metric([scope], v)
        yield active
        swaps = CounterMetricFamily(P + "adapter_swaps", "Changes of the active adapter, by event", labels=["event"])
        events = d.registry.promotion_log(100_000)
        for ev in ("promote", "rollback"):
            swaps.add_metric([ev], sum(1 for e in events if e.get("event") == ev))
        yield swaps
        states = GaugeMetricFamily(P + "adapters_registered", "Registered adapter versions, by state", labels=["state"])
        counts: dict[str, int] = {}
        for rec in d.registry.list():
            counts[rec.state] = counts.get(rec.state, 0) + 1
        for st in ("candidate", "promoted", "rejected", "rolled_back"):
            states.add_metric([st], counts.get(st, 0))
        yield states

    def _trainer_metrics(self, d: Any) -> Iterator[Metric]:
        enabled = GaugeMetricFamily(P + "trainer_enabled", "1 when the trainer runs in this daemon")
        enabled.add_metric([], 0 if d.trainer is None else 1)
        yield enabled
        if d.trainer is None:
            return
        st = d.trainer.status()
        rounds = CounterMetricFamily(P + "training_rounds", "Training rounds run by this daemon process")
        rounds.add_metric([], st["rounds"])
        yield rounds
        g = GaugeMetricFamily(P + "trainer_paused", "1 when scheduled rounds are paused")
        g.add_metric([], int(st["paused"]))
        yield g
        g = GaugeMetricFamily(P + "trainer_round_running", "1 while a round runs")
        g.add_metric([], int(st["running"]))
        yield g
        lease = st.get("lease")
        if lease is not None:  # several daemons on one Redis (store.lease): exactly one should read 1
            g = GaugeMetricFamily(P + "trainer_lease_leader", "1 while this daemon holds the trainer lease (trains), 0 standing by")
            g.add_metric([], int(lease["role"] == "leader"))
            yield g
            g = GaugeMetricFamily(P + "trainer_lease_token", "The fencing token of this daemon's lease (0 standing by)")
            g.add_metric([], lease["token"])
            yield g
        last = st.get("last_round")
        if last:
            g = GaugeMetricFamily(P + "trainer_last_round_timestamp_seconds", "Start of the last round", labels=["decision"])
            g.add_metric([last["decision"]], last["started_at"])
            yield g
        up = GaugeMetricFamily(P + "daemon_start_time_seconds", "When the daemon started")
        up.add_metric([], d.started_at or time.time())
        yield up
