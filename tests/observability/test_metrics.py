"""/metrics parsed with prometheus-client's own parser after real traffic through the gateway and the simulator."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import TIGHT_KEY, open_stack

# OpenTelemetry GenAI semantic conventions, explicit bucket boundaries advice (metrics spec)
SEMCONV_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
SEMCONV_DURATION = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
SEMCONV_TOKENS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams, name: str, sample: str | None = None, **labels: str) -> float | None:
    f = fams[name]
    for s in f.samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def buckets(fams, name: str, **labels: str) -> list[float]:
    return [float(s.labels["le"]) for s in fams[name].samples
            if s.name == name + "_bucket" and s.labels["le"] != "+Inf"
            and all(s.labels.get(k) == v for k, v in labels.items())]


async def test_metrics_after_real_traffic(tmp_path: Path, fleet) -> None:
    async for st in open_stack(tmp_path, fleet):
        ok = []
        for i in range(3):
            r = await st.chat(f"shared system prompt for metrics test, question {i % 2}" * 6, stream=True,
                              stream_options={"include_usage": True})
            assert r.status_code == 200
            ok.append(r.headers["x-gateway-backend"])
        r = await st.chat("plain json", stream=False)
        assert r.status_code == 200
        ok.append(r.headers["x-gateway-backend"])
        r = await st.chat("over budget", key=TIGHT_KEY, max_tokens=500)
        assert r.status_code == 429 and r.json()["error"]["code"] in ("rate_limit_exceeded", "insufficient_quota")
        r = await st.chat("impossible target", headers={"x-ttft-slo-ms": "0.001"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "ttft_slo_unattainable", r.text
        await asyncio.sleep(0.5)  # one scrape of the engines' /metrics

        resp = await st.client.get("/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        fams = families(resp.text)

        total_ok = sum(s.value for s in fams["gateway_requests"].samples
                       if s.name == "gateway_requests_total" and s.labels["status"] == "200")
        assert total_ok == 4
        for b in set(ok):
            assert value(fams, "gateway_requests", "gateway_requests_total", model="sim-model", backend=b,
                         status="200", tenant_class="gold", endpoint="chat") == ok.count(b)
        assert value(fams, "gateway_requests", "gateway_requests_total", status="429", tenant_class="default",
                     backend="none") == 1  # the budget refusal (tenant class of an unlabelled key)

        # GenAI histograms with the conventions' bucket advice
        b0 = ok[0]
        assert buckets(fams, "gen_ai_server_time_to_first_token_seconds", backend=b0) == SEMCONV_TTFT
        assert buckets(fams, "gen_ai_client_operation_duration_seconds", backend=b0) == SEMCONV_DURATION
        assert buckets(fams, "gen_ai_client_token_usage", gen_ai_token_type="input") == SEMCONV_TOKENS
        ttft_count = sum(s.value for s in fams["gen_ai_server_time_to_first_token_seconds"].samples
                         if s.name.endswith("_count"))
        assert ttft_count == 3  # streamed requests only: a JSON answer has no first token of its own
        assert value(fams, "gen_ai_client_token_usage", "gen_ai_client_token_usage_count", gen_ai_token_type="output") == 4

        assert value(fams, "gateway_admission_rejections", "gateway_admission_rejections_total",
                     reason="ttft_slo_unattainable") == 1
        [budget] = [s for s in fams["gateway_budget_rejections"].samples if s.name.endswith("_total")]
        assert budget.value == 1 and budget.labels["scope"] == "team" and budget.labels["window"] == "minute"

        pred_err = sum(s.value for s in fams["gateway_ttft_prediction_error_ratio"].samples if s.name.endswith("_count"))
        assert pred_err == 3
        for name in ("sim-0", "sim-1"):
            assert value(fams, "gateway_backend_circuit_state", backend=name, state="closed") == 1
            assert value(fams, "gateway_backend_circuit_state", backend=name, state="open") == 0
            assert value(fams, "gateway_engine_requests_waiting", engine=name) == 0
            learned = st.gw.router.snapshot()["engines"][name]
            assert value(fams, "gateway_predictor_samples", engine=name) == learned["samples"]
            assert value(fams, "gateway_predictor_prefill_tokens_per_second", engine=name) == \
                learned["prefill_tokens_per_s"]  # None (no sample) while the learner has no positive rate
            assert value(fams, "gateway_predictor_overhead_seconds", engine=name) == \
                pytest.approx(learned["overhead_ms"] / 1000)
        agreement = {s.labels["engine"]: s.value for s in fams["gateway_kv_index_token_agreement_ratio"].samples}
        assert set(agreement) == set(ok) and all(0 <= v <= 1 for v in agreement.values())
        tiers = {s.labels["tier"] for s in fams["gateway_kv_index_cached_blocks"].samples}
        assert tiers == {"GPU"}

        # bounded cardinality: no per-key, per-tenant or per-request labels anywhere
        for f in fams.values():
            for s in f.samples:
                assert not {"key", "key_id", "tenant", "request_id", "principal"} & set(s.labels), (f.name, s.labels)


async def test_open_circuit_shows_in_metrics(tmp_path: Path, fleet) -> None:
    async for st in open_stack(tmp_path, fleet):
        for _ in range(3):
            st.gw.health.failure("sim-1", "test: connection refused")
        fams = families((await st.client.get("/metrics")).text)
        assert value(fams, "gateway_backend_circuit_state", backend="sim-1", state="open") == 1
        assert value(fams, "gateway_backend_circuit_state", backend="sim-1", state="closed") == 0
        assert value(fams, "gateway_backend_consecutive_failures", backend="sim-1") == 3
        assert value(fams, "gateway_backend_circuit_state", backend="sim-0", state="closed") == 1
