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
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# GenAI semconv bucket advice
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple[str, ...], object] = {}
        self._state: list[Any] = []  # collectors of this process's state (register_state)
        # set by the supervisor of `gateway serve --workers N` (gateway/workers.py): every worker's counters and
        # histograms live in files there, and /metrics on any worker renders them merged
        self.multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gateway_requests_total", "Requests by outcome", ["endpoint", "model", "backend",
                                "status", "tenant_class"], registry=r)
        genai = ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"]
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds", "Time to first token seen by the gateway "
                              "(streamed requests)", [*genai, "backend"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds", "Time per output token after the first "
                              "(streamed requests with usage and > 1 output token)", [*genai, "backend"],
                              buckets=TPOT_BUCKETS, registry=r)
        self.duration = Histogram("gen_ai_client_operation_duration_seconds", "Request duration end to end "
                                  "(error_type empty on success)", [*genai, "backend", "error_type"],
                                  buckets=DURATION_BUCKETS, registry=r)
        self.tokens = Histogram("gen_ai_client_token_usage", "Tokens per request", [*genai, "gen_ai_token_type"],
                                buckets=TOKEN_BUCKETS, registry=r)
        # gauges under `gateway serve --workers N` (prometheus-client's multiprocess files): live workers' sum,
        # or the lowest any live worker reports (a circuit open in one worker shows)
        self.in_flight = Gauge("gateway_in_flight_requests", "Requests being served", ["backend"], registry=r,
                               multiprocess_mode="livesum")
        self.rejections = Counter("gateway_rejections_total", "Refused requests by stage and code",
                                  ["stage", "code"], registry=r)
        self.admission_rejections = Counter("gateway_admission_rejections_total", "TTFT admission rejections",
                                            ["reason"], registry=r)
        self.ttft_prediction_error = Histogram("gateway_ttft_prediction_error_ratio",
                                               "|predicted-actual|/actual TTFT per request", ["backend"],
                                               buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.backend_up = Gauge("gateway_backend_circuit_closed", "1 when the backend's circuit is closed",
                                ["backend"], registry=r, multiprocess_mode="livemin")
        self.stage_seconds = Histogram("gateway_stage_duration_seconds", "Time spent per pipeline stage",
                                       ["stage"], buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1),
                                       registry=r)
        self.reloads = Counter("gateway_config_reloads_total", "Config reloads", ["result"], registry=r)
        self.event_loop_tasks = Gauge("gateway_event_loop_tasks", "asyncio tasks alive (leak check, bench/soak.py)",
                                      registry=r, multiprocess_mode="livesum")
        # fed by gateway.observability.hooks (a finish hook) when observability is wired
        self.budget_rejections = Counter("gateway_budget_rejections_total", "Requests refused by a budget",
                                         ["code", "scope", "window"], registry=r)
        self.cached_tokens = Counter("gateway_cached_prompt_tokens_total",
                                     "Prompt tokens the engine served from its prefix cache", ["model", "backend"],
                                     registry=r)
        self.ttft_prediction_delta = Histogram("gateway_ttft_prediction_delta_seconds",
                                               "actual - predicted TTFT per request (signed)", ["backend"],
                                               buckets=(-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.02, -0.01, 0.0,
                                                        0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0), registry=r)

        # unit economics (gateway/cost, docs/cost.md): engine time apportioned to requests, what it cost, what
        # was charged, and GPU-seconds saved (prefix/response cache) or wasted (aborted, cut, failed), per
        # backend, model and request category; the engines' busy time as this gateway saw it
        cat = ["backend", "model", "category"]
        self.cost_requests = Counter("gateway_cost_requests_total", "Requests by cost category", cat, registry=r)
        self.cost_gpu_seconds = Counter("gateway_cost_gpu_seconds_total", "GPU-seconds apportioned to requests",
                                        cat, registry=r)
        self.cost_amount = Counter("gateway_cost_amount_total", "What serving requests cost (cost.currency)", cat,
                                   registry=r)
        self.cost_charged = Counter("gateway_cost_charged_total", "Price charged for requests (budget currency)",
                                    cat, registry=r)
        self.cost_tokens = Counter("gateway_cost_tokens_total", "Prompt + completion tokens by cost category",
                                   cat, registry=r)
        self.cost_saved = Counter("gateway_cost_saved_gpu_seconds_total", "GPU-seconds saved, by reason",
                                  ["backend", "model", "reason"], registry=r)
        self.cost_wasted = Counter("gateway_cost_wasted_gpu_seconds_total", "GPU-seconds wasted, by reason",
                                   ["backend", "model", "reason"], registry=r)

    def child(self, metric, *labels: str):
        """A labelled child, cached: prometheus-client's labels() costs microseconds per call on the hot path."""
        key = (metric._name, *labels)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 10_000:  # bounded: label values are bounded, this is a safety net
                self._children.clear()
            c = self._children[key] = metric.labels(*labels)
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
