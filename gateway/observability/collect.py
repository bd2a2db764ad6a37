"""Scrape-time Prometheus collector: live state read from the subsystems when /metrics is fetched.

Per-backend circuit state, engine load as last scraped, cached KV blocks by tier, KV-index agreement
(predicted vs actual cached tokens) and the router's learned per-engine parameters. Labels are backend/engine
names and tiers only (bounded by the config). Every source is optional: a subsystem that is not wired is skipped.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.proxy.health import Health
    from gateway.routing.gate import FlowGate
    from gateway.routing.mode import ModeBook
    from gateway.routing.peers import PeerBus
    from gateway.routing.predictor import Predictor

log = logging.getLogger("gateway.metrics")
CIRCUIT_STATES = ("closed", "open", "half_open")
STREAM_REASONS = ("no_events", "wrong_topic", "decode", "gap")  # gateway/telemetry/stream_health.py + gap


class FleetSource(Protocol):
    """The engines as telemetry last saw them (gateway/telemetry/service.py TelemetryService)."""

    def fleet_snapshot(self) -> Mapping[str, Any]: ...


class RouterParts(Protocol):
    """The router's parts whose snapshots /metrics shows (gateway/routing/stage.py PredictiveRouteStage)."""

    @property
    def predictor(self) -> Predictor: ...

    @property
    def flow(self) -> FlowGate: ...

    @property
    def modes(self) -> ModeBook: ...

    @property
    def peers(self) -> PeerBus | None: ...


class StateSource(Protocol):
    """What the collector reads at scrape time (gateway/app.py Gateway): snapshots, never a request path."""

    @property
    def health(self) -> Health: ...

    @property
    def telemetry(self) -> FleetSource | None: ...

    @property
    def router(self) -> RouterParts | None: ...


class GatewayStateCollector(Collector):
    def __init__(self, gw: StateSource) -> None:
        self.gw = gw

    def describe(self) -> list:  # names are dynamic per source; skip the registry's duplicate check
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._health()
            yield from self._telemetry()
            yield from self._router()
            yield from self._flow()
            yield from self._modes()
            yield from self._peers()
        except Exception:  # a broken source must not break /metrics
            log.exception("collecting gateway state metrics failed")

    def _health(self) -> Iterator[Metric]:
        snap = self.gw.health.snapshot()
        state = GaugeMetricFamily("gateway_backend_circuit_state", "1 for the backend's current circuit state",
                                  labels=["backend", "state"])
        fails = GaugeMetricFamily("gateway_backend_consecutive_failures", "Consecutive failures per backend",
                                  labels=["backend"])
        for name, st in sorted(snap.items()):
            for s in CIRCUIT_STATES:
                state.add_metric([name, s], 1.0 if st["state"] == s else 0.0)
            fails.add_metric([name], float(st["consecutive_failures"]))
        yield state
        yield fails

    def _telemetry(self) -> Iterator[Metric]:
        tel = self.gw.telemetry
        if tel is None:
            return
        engines = tel.fleet_snapshot().get("engines", {})
        running = GaugeMetricFamily("gateway_engine_requests_running", "Engine's running requests (last scrape)",
                                    labels=["engine"])
        waiting = GaugeMetricFamily("gateway_engine_requests_waiting", "Engine's queued requests (last scrape)",
                                    labels=["engine"])
        kv = GaugeMetricFamily("gateway_engine_kv_cache_usage_ratio", "Engine's KV cache usage 0..1 (last scrape)",
                               labels=["engine"])
        inflight = GaugeMetricFamily("gateway_engine_inflight_requests", "Requests the gateway has in flight",
                                     labels=["engine"])
        blocks = GaugeMetricFamily("gateway_kv_index_cached_blocks", "Blocks the KV index holds per engine and tier",
                                   labels=["engine", "tier"])
        stale = GaugeMetricFamily("gateway_kv_index_stale", "1 while the engine's KV view is stale (rebuilding "
                                  "after lost events, or its event stream is silent)", labels=["engine"])
        sstale = GaugeMetricFamily("gateway_kv_stream_stale", "1 for the reason the engine's KV view is stale "
                                   "(no_events, wrong_topic, decode, gap), 0 for the others",
                                   labels=["engine", "reason"])
        sbatches = GaugeMetricFamily("gateway_kv_stream_batches", "KV-event batches applied per engine",
                                     labels=["engine"])
        sother = GaugeMetricFamily("gateway_kv_stream_other_topic_frames", "KV-event frames received on a topic "
                                   "the gateway does not take", labels=["engine"])
        sage = GaugeMetricFamily("gateway_kv_stream_last_batch_age_seconds", "Seconds since the engine's last "
                                 "applied KV-event batch", labels=["engine"])
        tok = GaugeMetricFamily("gateway_kv_index_token_agreement_ratio",
                                "Predicted vs actual cached tokens: sum(min)/max(sums), all time", labels=["engine"])
        win = GaugeMetricFamily("gateway_kv_index_window_token_agreement_ratio",
                                "Token agreement over the recent window", labels=["engine"])
        err = GaugeMetricFamily("gateway_kv_index_error_agreement_ratio",
                                "1 - sum|predicted - actual| / sum actual cached tokens, all time (a client's count)",
                                labels=["engine"])
        aerr = CounterMetricFamily("gateway_kv_abs_error_cached_tokens", "|predicted - actual| cached tokens",
                                   labels=["engine"])
        req = GaugeMetricFamily("gateway_kv_index_request_agreement_ratio",
                                "Share of requests whose predicted cached tokens matched exactly", labels=["engine"])
        # the agreement's all-time sums as counters (rate() over them gives the agreement of any range)
        apred = CounterMetricFamily("gateway_kv_predicted_cached_tokens", "Cached tokens the KV index predicted",
                                    labels=["engine"])
        aact = CounterMetricFamily("gateway_kv_actual_cached_tokens", "Cached tokens the engine reported",
                                   labels=["engine"])
        aagr = CounterMetricFamily("gateway_kv_agreed_cached_tokens", "min(predicted, actual) cached tokens",
                                   labels=["engine"])
        areq = CounterMetricFamily("gateway_kv_agreement_requests", "Requests compared (result: exact or differ)",
                                   labels=["engine", "result"])
        for name, e in sorted(engines.items()):
            load = e.get("load") or {}
            if load:
                running.add_metric([name], float(load.get("running") or 0.0))
                waiting.add_metric([name], float(load.get("waiting") or 0.0))
                kv.add_metric([name], float(load.get("kv_usage") or 0.0))
            inflight.add_metric([name], float((e.get("inflight") or {}).get("requests", 0)))
            for tier, n in sorted((e.get("cached_blocks") or {}).items()):
                blocks.add_metric([name, str(tier)], float(n))
            stale.add_metric([name], 1.0 if e.get("stale") else 0.0)
            ke = e.get("kv_events")
            if ke:
                for r in STREAM_REASONS:
                    sstale.add_metric([name, r], 1.0 if e.get("stale_reason") == r else 0.0)
                sbatches.add_metric([name], float(ke.get("batches") or 0))
                sother.add_metric([name], float(ke.get("other_topic_frames") or 0))
                if ke.get("last_batch_age_s") is not None:
                    sage.add_metric([name], float(ke["last_batch_age_s"]))
            a = e.get("agreement") or {}
            apred.add_metric([name], float(a.get("predicted_tokens") or 0))
            aact.add_metric([name], float(a.get("actual_tokens") or 0))
            aagr.add_metric([name], float(a.get("agreed_tokens") or 0))
            aerr.add_metric([name], float(a.get("abs_error_tokens") or 0))
            exact = float(a.get("requests_exact") or 0)
            areq.add_metric([name, "exact"], exact)
            areq.add_metric([name, "differ"], float(a.get("requests") or 0) - exact)
            if a.get("requests"):
                tok.add_metric([name], float(a["token_agreement"]))
                win.add_metric([name], float(a["window_token_agreement"]))
                req.add_metric([name], float(a["request_agreement"]))
                err.add_metric([name], float(a["error_agreement"]))
        yield from (running, waiting, kv, inflight, blocks, stale, sstale, sbatches, sother, sage, tok, win, req,
                    err, apred, aact, aagr, aerr, areq)

    def _router(self) -> Iterator[Metric]:
        router = self.gw.router
        if router is None:
            return
        pred = router.predictor
        rate = GaugeMetricFamily("gateway_predictor_prefill_tokens_per_second", "Learned prefill rate per engine",
                                 labels=["engine"])
        over = GaugeMetricFamily("gateway_predictor_overhead_seconds", "Learned fixed TTFT overhead per engine",
                                 labels=["engine"])
        mape = GaugeMetricFamily("gateway_predictor_mape_ratio", "Mean absolute percentage error of TTFT "
                                 "predictions per engine", labels=["engine"])
        samples = GaugeMetricFamily("gateway_predictor_samples", "TTFT observations learned from", labels=["engine"])
        for name, s in pred.snapshot().items():
            if s.get("prefill_tokens_per_s") is not None:
                rate.add_metric([name], float(s["prefill_tokens_per_s"]))
            if s.get("overhead_ms") is not None:
                over.add_metric([name], float(s["overhead_ms"]) / 1000)
            if s.get("mape") is not None:
                mape.add_metric([name], float(s["mape"]))
            samples.add_metric([name], float(s.get("samples") or 0))
        yield from (rate, over, mape, samples)

    def _flow(self) -> Iterator[Metric]:
        """Flow control (gateway/routing/gate.py): per flow (tenant, team, project, key or partner: at most 200
        of them, the snapshot's bound) tokens served, requests waiting per priority class and refusals."""
        router = self.gw.router
        if router is None:
            return
        snap = router.flow.snapshot()
        served = CounterMetricFamily("gateway_flow_served_tokens", "Tokens served per flow since start (prompt "
                                     "tokens dispatched, completion tokens finished)", labels=["flow", "kind"])
        depth = GaugeMetricFamily("gateway_flow_queue_depth", "Requests waiting in the gateway's fair queue",
                                  labels=["flow", "priority"])
        refused = CounterMetricFamily("gateway_flow_refusals", "Requests refused by flow control, by reason "
                                      "(predicted_wait, queue_full, queue_timeout)", labels=["flow", "reason"])
        wait = GaugeMetricFamily("gateway_flow_mean_wait_seconds", "Mean wait in the fair queue of the requests "
                                 "dispatched from it", labels=["priority"])
        for flow, f in snap["flows"].items():
            served.add_metric([flow, "prompt"], float(f["served_prompt_tokens"]))
            served.add_metric([flow, "completion"], float(f["served_completion_tokens"]))
            for cls, n in f["waiting"].items():
                depth.add_metric([flow, cls], float(n))
            for reason, n in f["refused"].items():
                refused.add_metric([flow, reason], float(n))
        for cls, ms in snap["mean_wait_ms"].items():
            wait.add_metric([cls], ms / 1000)
        holds = CounterMetricFamily("gateway_flow_harmful_holds", "Times the model held requests for an engine "
                                    "that had room (the harmful-hold check released them; gateway/routing/room.py)")
        holds.add_metric([], float(snap["stats"].get("harmful_holds", 0)))
        holding = GaugeMetricFamily("gateway_flow_holding_with_room", "1 while the model calls this engine closed "
                                    "although it has room (the check keeps it open)", labels=["engine"])
        for e in snap.get("holding_with_room", ()):
            holding.add_metric([e], 1.0)
        yield from (served, depth, refused, wait, holds, holding)

    def _modes(self) -> Iterator[Metric]:
        """Each upstream's mode (gateway/routing/mode.py): 1 for the mode it is in, 0 for the other."""
        router = self.gw.router
        if router is None:
            return
        book = router.modes
        g = GaugeMetricFamily("gateway_upstream_mode", "1 for the mode each upstream is in: modelled (prediction, "
                              "admission, flow control act on it) or pass_through", labels=["backend", "mode"])
        for name, m in book.snapshot().items():
            g.add_metric([name, "modelled"], 1.0 if m["mode"] == "modelled" else 0.0)
            g.add_metric([name, "pass_through"], 1.0 if m["mode"] == "pass_through" else 0.0)
        changes = CounterMetricFamily("gateway_upstream_mode_changes", "Changes of an upstream's mode")
        changes.add_metric([], float(book.changes))
        yield from (g, changes)

    def _peers(self) -> Iterator[Metric]:
        """The peer bus (gateway/routing/peers.py): replicas heard, the other replicas' flights per engine, events
        in/out/dropped. Labels: engine names and a fixed direction only (never replica ids)."""
        router = self.gw.router
        bus = router.peers if router is not None else None
        if bus is None:
            return
        snap = bus.snapshot()
        peers = GaugeMetricFamily("gateway_peers_heard", "Other gateway replicas heard within peer_timeout_s")
        peers.add_metric([], float(len(snap["peers"])))
        remote = GaugeMetricFamily("gateway_peers_remote_flights", "Other replicas' requests in flight per engine",
                                   labels=["engine"])
        tokens = GaugeMetricFamily("gateway_peers_remote_prefilling_tokens", "Other replicas' uncached prompt "
                                   "tokens still prefilling per engine", labels=["engine"])
        for name, e in snap["remote_flights"].items():
            remote.add_metric([name], float(e["flights"]))
            tokens.add_metric([name], float(e["prefilling_tokens"]))
        events = CounterMetricFamily("gateway_peers_events", "Peer bus events by direction (in, out, dropped: "
                                     "not delivered to some peer, bad: undecodable)", labels=["direction"])
        for d, k in (("in", "events_in"), ("out", "events_out"), ("dropped", "dropped_out"), ("bad", "bad_in")):
            events.add_metric([d], float(snap.get(k, 0)))
        yield from (peers, remote, tokens, events)
