"""/metrics against the OpenTelemetry GenAI semantic conventions: the four GenAI metrics under their semconv
names rendered Prometheus-style, with the conventions' attribute names as labels and the same
`gen_ai.operation.name` values the spans carry; the KV agreement counters on /metrics; probe and scrape
lines out of the INFO log."""
from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.observability.logs import configure_logging
from tests.support.wait import async_wait_until

from .conftest import KEY, open_stack
from .test_metrics import families

# semconv metric name -> (unit, attributes every data point carries here); from the GenAI metrics spec
# (gen-ai-metrics.md): required gen_ai.operation.name, gen_ai.provider.name; conditionally required
# gen_ai.request.model, error.type; recommended gen_ai.response.model; gen_ai.token.type on token usage.
SEMCONV = {
    "gen_ai.client.token.usage": ("{token}", {"gen_ai.operation.name", "gen_ai.provider.name",
                                              "gen_ai.request.model", "gen_ai.response.model", "gen_ai.token.type"}),
    "gen_ai.client.operation.duration": ("s", {"gen_ai.operation.name", "gen_ai.provider.name",
                                               "gen_ai.request.model", "gen_ai.response.model", "error.type"}),
    "gen_ai.server.time_to_first_token": ("s", {"gen_ai.operation.name", "gen_ai.provider.name",
                                                "gen_ai.request.model", "gen_ai.response.model"}),
    "gen_ai.server.time_per_output_token": ("s", {"gen_ai.operation.name", "gen_ai.provider.name",
                                                  "gen_ai.request.model", "gen_ai.response.model"}),
}
OPERATIONS = {"chat", "text_completion", "embeddings"}  # gen_ai.operation.name well-known values used here


def prometheus_name(name: str, unit: str) -> str:
    """OpenTelemetry's Prometheus rendering: dots to underscores, unit `s` as `_seconds`, `{...}` units dropped."""
    return name.replace(".", "_") + ("_seconds" if unit == "s" else "")


def label(attr: str) -> str:
    return attr.replace(".", "_")


async def test_genai_metrics_follow_the_semantic_conventions(tmp_path: Path, fleet) -> None:
    exp = InMemorySpanExporter()
    async for st in open_stack(tmp_path, fleet, exp):
        h = {"authorization": f"Bearer {KEY}"}
        for i in range(2):
            r = await st.chat(f"streamed question {i}", stream=True, max_tokens=8,
                              stream_options={"include_usage": True})
            assert r.status_code == 200
        r = await st.client.post("/v1/completions", headers=h, json={"model": "sim-model", "prompt": "hi there",
                                                                     "max_tokens": 3})
        assert r.status_code == 200, r.text
        r = await st.client.post("/v1/embeddings", headers=h, json={"model": "sim-model", "input": "hi there"})
        assert r.status_code == 200, r.text
        r = await st.chat("no such model", model="no-such-model")
        assert r.status_code == 404 or r.status_code == 400, r.text
        refused_code = r.json()["error"]["code"]

        async def finished() -> bool:  # the tracing finish hook runs after the response: all 5 recorded
            f = families((await st.client.get("/metrics")).text).get("gen_ai_client_operation_duration_seconds")
            n = sum(s.value for s in f.samples if s.name.endswith("_count")) if f else 0
            return n >= 5 and len([sp for sp in exp.get_finished_spans() if sp.kind == SpanKind.SERVER]) >= 5

        await async_wait_until(finished, what="the five requests' durations on /metrics and their server spans")
        fams = families((await st.client.get("/metrics")).text)

        for name, (unit, attrs) in SEMCONV.items():
            prom = prometheus_name(name, unit)
            assert prom in fams and fams[prom].type == "histogram", prom
            samples = [s for s in fams[prom].samples if s.name == prom + "_count"]
            assert samples, f"{prom} has no data point"
            for s in samples:
                assert {label(a) for a in attrs} <= set(s.labels), (prom, s.labels)
                # the pre-semconv label names are gone
                assert not {"model", "operation", "token_type", "status"} & set(s.labels), (prom, s.labels)
                assert s.labels["gen_ai_operation_name"] in OPERATIONS, s.labels

        # the same operation names in metrics and spans
        span_ops = {sp.attributes["gen_ai.operation.name"] for sp in exp.get_finished_spans()
                    if sp.kind == SpanKind.SERVER}
        dur = [s for s in fams["gen_ai_client_operation_duration_seconds"].samples if s.name.endswith("_count")]
        assert {s.labels["gen_ai_operation_name"] for s in dur} == span_ops == OPERATIONS

        ok = [s for s in dur if s.labels["error_type"] == ""]
        assert sum(s.value for s in ok) == 4
        assert all(s.labels["gen_ai_provider_name"] == "vllm" and s.labels["gen_ai_request_model"] == "sim-model"
                   and s.labels["gen_ai_response_model"] == "sim-model" for s in ok)
        [refused] = [s for s in dur if s.labels["error_type"]]
        assert refused.labels["error_type"] == refused_code and refused.value == 1
        assert refused.labels["gen_ai_provider_name"] == "" and refused.labels["gen_ai_request_model"] == "unknown"

        usage = fams["gen_ai_client_token_usage"].samples
        assert {s.labels["gen_ai_token_type"] for s in usage if s.name.endswith("_count")} == {"input", "output"}
        # time per output token: the two streams (8 output tokens each), never the JSON answers
        tpot = [s for s in fams["gen_ai_server_time_per_output_token_seconds"].samples if s.name.endswith("_count")]
        assert sum(s.value for s in tpot) == 2 and {s.labels["gen_ai_operation_name"] for s in tpot} == {"chat"}
        ttft = [s for s in fams["gen_ai_server_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
        assert sum(s.value for s in ttft) == 2


async def test_kv_agreement_counters_are_on_metrics(tmp_path: Path, fleet) -> None:
    async for st in open_stack(tmp_path, fleet):
        for i in range(3):
            r = await st.chat("a shared prefix for the agreement counters " * 8 + str(i))
            assert r.status_code == 200
        text = (await st.client.get("/metrics")).text
        fams = families(text)
        agree = {e: a for e, a in ((n, st.gw.telemetry.agreement(n)) for n in ("sim-0", "sim-1")) if a["requests"]}
        assert sum(a["requests"] for a in agree.values()) == 3
        for engine, a in agree.items():
            req = {s.labels["result"]: s.value for s in fams["gateway_kv_agreement_requests"].samples
                   if s.labels["engine"] == engine and s.name == "gateway_kv_agreement_requests_total"}
            assert req == {"exact": a["requests_exact"], "differ": a["requests"] - a["requests_exact"]}
            for fam, key in (("gateway_kv_predicted_cached_tokens", "predicted_tokens"),
                             ("gateway_kv_actual_cached_tokens", "actual_tokens"),
                             ("gateway_kv_agreed_cached_tokens", "agreed_tokens")):
                [v] = [s.value for s in fams[fam].samples if s.labels["engine"] == engine]
                assert v == a[key], fam


async def test_probes_and_scrapes_are_not_info_lines(tmp_path: Path, fleet) -> None:
    """uvicorn's access line for /healthz, /readyz and /metrics, and httpx's line for each of the gateway's own
    scrapes of the engines' /metrics, are DEBUG: absent at INFO, present at DEBUG. Other requests keep INFO."""
    def access(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    for level, want_probe_lines in (("info", False), ("debug", True)):
        buf = io.StringIO()
        (tmp_path / level).mkdir()
        h = configure_logging(level, json_logs=True, stream=buf)
        try:
            async for st in open_stack(tmp_path / level, fleet):
                await asyncio.sleep(0.5)  # a few scrapes of each engine's /metrics (every 0.2 s)
                r = await st.chat("hello")
                assert r.status_code == 200
            for path in ("/healthz", "/readyz?verbose=1", "/metrics"):
                logging.getLogger("uvicorn.access").handle(access(path))
            logging.getLogger("uvicorn.access").handle(access("/v1/chat/completions"))
        finally:
            logging.getLogger().removeHandler(h)
            logging.getLogger().setLevel(logging.WARNING)
        out = buf.getvalue()
        scrape_lines = [ln for ln in out.splitlines() if '"logger":"httpx"' in ln and "/metrics" in ln]
        probe_lines = [ln for ln in out.splitlines() if '"logger":"uvicorn.access"' in ln  # the sims' own too
                       and ("/healthz" in ln or "/readyz" in ln or "GET /metrics" in ln)]
        assert '"GET /v1/chat/completions' in out  # an ordinary request keeps its INFO access line
        if want_probe_lines:
            assert scrape_lines and all('"level":"debug"' in ln for ln in scrape_lines + probe_lines)
            assert len([ln for ln in probe_lines if "127.0.0.1:5 -" in ln]) == 3
        else:
            assert not scrape_lines and not probe_lines, out[-2000:]
