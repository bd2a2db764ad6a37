"""Prometheus metrics of the gateway (prometheus-client), on a registry of its own.

The GenAI metrics follow the OpenTelemetry GenAI semantic conventions rendered Prometheus-style (dots become
underscores, the unit `s` becomes `_seconds`): `gen_ai.client.token.usage` -> `gen_ai_client_token_usage`,
`gen_ai.client.operation.duration` -> `gen_ai_client_operation_duration_seconds`,
`gen_ai.server.time_to_first_token` -> `gen_ai_server_time_to_first_token_seconds`,
`gen_ai.server.time_per_output_token` -> `gen_ai_server_time_per_output_token_seconds`, with the conventions'
attribute names as labels (`gen_ai_operation_name`, `gen_ai_provider_name`, `gen_ai_request_model`,
`gen_ai_response_model`, `gen_ai_token_type`, `error_type`) and their bucket advice. Everything else is
`gateway_*`. Label cardinality is bounded: model, backend, status class and tenant class, never key ids or
tenants.
"""
from __future__ import annotations

import os
from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.values import MutexValue

# GenAI semconv bucket advice
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


class _Value:
    """prometheus-client's MutexValue (the single-process value: a float and an exemplar) without its lock. The
    gateway writes its request metrics only from the event loop's thread (stages and finish hooks; worker
    threads load configs and write files, never metrics), so the lock only cost (docs/benchmarks.md, "Hot path
    choices"); a request makes ~25 increments (10 histogram observes, the counters).
    Gauges keep the library's value.
    Under PROMETHEUS_MULTIPROC_DIR the library's file-backed value is kept (see _Counter/_Histogram)."""

    __slots__ = ("_value", "_exemplar")
    _multiprocess = False

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


class _Counter(Counter):
    """prometheus-client's Counter, cheaper per inc: _Value instead of MutexValue when that is the library's
    value class (one process; under PROMETHEUS_MULTIPROC_DIR its file-backed value is kept), and no
    observability check's two method calls (the child's value is there or the library's inc raises as before).
    Exemplars and negative amounts take the library's inc. Relies on the library's _metric_init and _value;
    tests/test_metrics_values.py renders both side by side (one process and multiprocess)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        if type(self._value) is MutexValue:  # not under PROMETHEUS_MULTIPROC_DIR (the values live in files then)
            self._value = _Value()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount < 0:
            return super().inc(amount, exemplar)
        try:
            value = self._value  # set by _metric_init, which runs only when the metric is observable
        except AttributeError:  # a parent whose labels are missing: the library raises its ValueError
            return super().inc(amount, exemplar)
        if type(value) is _Value:
            value._value += amount  # _Value.inc, without the call
        else:
            value.inc(amount)


class _Histogram(Histogram):
    """prometheus-client's Histogram, cheaper per observe: _Value for MutexValue as in _Counter, the bucket found
    by bisection (bounds are sorted and end with +Inf) instead of a Python loop over them, and the observability
    check is the presence of the child's values. The same values are incremented in the same order (the sum,
    then one bucket; none for NaN, as the library's `amount <= bound` never holds), so /metrics is the same
    text. A served request observes ~10 (duration, tokens twice, one per stage), so the per-observe cost counts
    (docs/benchmarks.md, "Hot path choices"). Relies on _metric_init, _sum, _buckets and _upper_bounds (tests pin the output)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        if type(self._sum) is MutexValue:  # not under PROMETHEUS_MULTIPROC_DIR (the values live in files then)
            self._sum = _Value()
            self._buckets = [_Value() for _ in self._buckets]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:
            return super().observe(amount, exemplar)
        try:
            buckets, total = self._buckets, self._sum  # set by _metric_init (observable metrics only)
        except AttributeError:  # a parent whose labels are missing: the library raises its ValueError
            return super().observe(amount, exemplar)
        bounds = self._upper_bounds
        i = bisect_left(bounds, amount)  # the first bound >= amount: the library's first `amount <= bound`
        if type(total) is _Value:  # _Value.inc, without the two calls
            total._value += amount
            if amount <= bounds[i]:  # False only for NaN (bisect_left gives 0 then)
                buckets[i]._value += 1
            return
        total.inc(amount)
        if amount <= bounds[i]:
            buckets[i].inc(1)


class Metrics:
    def __init__(self) -> None:
        # metric -> label values -> child (see child)
        self._children: dict[Any, dict[tuple[str, ...], Any]] = {}
        self._state: list[Any] = []  # collectors of this process's state (register_state)
        # set by the supervisor of `gateway serve --workers N` (gateway/workers.py): every worker's counters and
        # histograms live in files there, and /metrics on any worker renders them merged
        self.multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = _Counter("gateway_requests_total", "Requests by outcome", ["endpoint", "model", "backend",
                                 "status", "tenant_class"], registry=r)
        genai = ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"]
        self.ttft = _Histogram("gen_ai_server_time_to_first_token_seconds", "Time to first token seen by the gateway "
                               "(streamed requests)", [*genai, "backend"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = _Histogram("gen_ai_server_time_per_output_token_seconds", "Time per output token after the first "
                               "(streamed requests with usage and > 1 output token)", [*genai, "backend"],
                               buckets=TPOT_BUCKETS, registry=r)
        self.duration = _Histogram("gen_ai_client_operation_duration_seconds", "Request duration end to end "
                                   "(error_type empty on success)", [*genai, "backend", "error_type"],
                                   buckets=DURATION_BUCKETS, registry=r)
        self.tokens = _Histogram("gen_ai_client_token_usage", "Tokens per request", [*genai, "gen_ai_token_type"],
                                 buckets=TOKEN_BUCKETS, registry=r)
        # gauges under `gateway serve --workers N` (prometheus-client's multiprocess files): live workers' sum,
        # or the lowest any live worker reports (a circuit open in one worker shows)
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests being served", ["backend"], registry=r,
                               multiprocess_mode="livesum")
        self.rejections = _Counter("gateway_rejections_total", "Refused requests by stage and code",
                                   ["stage", "code"], registry=r)
        self.admission_rejections = _Counter("gateway_admission_rejections_total", "TTFT admission rejections",
                                             ["reason"], registry=r)
        self.ttft_prediction_error = _Histogram("gateway_ttft_prediction_error_ratio",
                                                "|predicted-actual|/actual TTFT per request", ["backend"],
                                                buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.backend_up = Gauge("gateway_backend_circuit_closed", "1 when the backend's circuit is closed",
                                ["backend"], registry=r, multiprocess_mode="livemin")
        self.stage_seconds = _Histogram("gateway_stage_duration_seconds", "Time spent per pipeline stage",
                                        ["stage"], buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
                                        registry=r)
        self.reloads = _Counter("gateway_config_reloads_total", "Config reloads", ["result"], registry=r)
        self.event_loop_tasks = Gauge("gateway_event_loop_tasks", "asyncio tasks alive (leak check, bench/soak.py)",
                                      registry=r, multiprocess_mode="livesum")
        # fed by gateway.observability.hooks (a finish hook) when observability is wired
        self.budget_rejections = _Counter("gateway_budget_rejections_total", "Requests refused by a budget",
                                          ["code", "scope", "window"], registry=r)
        self.cached_tokens = _Counter("gateway_cached_prompt_tokens_total",
                                      "Prompt tokens the engine served from its prefix cache", ["model", "backend"],
                                      registry=r)
        self.ttft_prediction_delta = _Histogram("gateway_ttft_prediction_delta_seconds",
                                                "actual - predicted TTFT per request (signed)", ["backend"],
                                                buckets=(-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.02, -0.01, 0.0,
                                                         0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0), registry=r)

        # unit economics (gateway/cost, docs/cost.md): engine time apportioned to requests, what it cost, what
        # was charged, and GPU-seconds saved (prefix/response cache) or wasted (aborted, cut, failed), per
        # backend, model and request category; the engines' busy time as this gateway saw it
        cat = ["backend", "model", "category"]
        self.cost_requests = _Counter("gateway_cost_requests_total", "Requests by cost category", cat, registry=r)
        self.cost_gpu_seconds = _Counter("gateway_cost_gpu_seconds_total", "GPU-seconds apportioned to requests",
                                         cat, registry=r)
        self.cost_amount = _Counter("gateway_cost_amount_total", "What serving requests cost (cost.currency)", cat,
                                    registry=r)
        self.cost_charged = _Counter("gateway_cost_charged_total", "Price charged for requests (budget currency)",
                                     cat, registry=r)
        self.cost_tokens = _Counter("gateway_cost_tokens_total", "Prompt + completion tokens by cost category",
                                    cat, registry=r)
        self.cost_saved = _Counter("gateway_cost_saved_gpu_seconds_total", "GPU-seconds saved, by reason",
                                   ["backend", "model", "reason"], registry=r)
        self.cost_wasted = _Counter("gateway_cost_wasted_gpu_seconds_total", "GPU-seconds wasted, by reason",
                                    ["backend", "model", "reason"], registry=r)
        self.rollout_rollbacks = _Counter("gateway_rollout_rollbacks_total", "Alias arms rolled back to weight 0 "
                                          "on regression (docs/rollouts.md)", ["alias", "arm"], registry=r)

    def child(self, metric, *labels: str):
        """A labelled child, cached: prometheus-client's labels() costs microseconds per call on the hot path."""
        per = self._children.get(metric)
        if per is None:
            per = self._children[metric] = {}
        c = per.get(labels)
        if c is None:
            if len(per) > 10_000:  # bounded: label values are bounded, this is a safety net
                per.clear()
            c = per[labels] = metric.labels(*labels)
        return c

    def register_state(self, collector: Any) -> None:
        """A collector computed at scrape time from this process's state (routing view, flow, engine costs)."""
        self._state.append(collector)
        self.registry.register(collector)

    def render(self) -> bytes:
        if self.multiproc_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged, self.multiproc_dir)  # the request metrics of every worker
        for c in self._state:  # state gauges: the answering worker's view
            merged.register(c)
        return generate_latest(merged)
