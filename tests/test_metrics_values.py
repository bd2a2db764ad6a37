"""gateway.metrics' cheaper Counter and Histogram (a lock-free value in one process, bisection for the bucket)
render the very /metrics text prometheus-client's own classes render for the same observations, in one process
and under PROMETHEUS_MULTIPROC_DIR; and ObserveStage's per-request series cache labels requests as before,
across a config reload."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.values import MutexValue

from gateway import metrics as M
from gateway.app import Gateway, ObserveStage
from gateway.config import parse_config
from gateway.pipeline import RequestContext
from gateway.types import Principal, Usage

ROOT = Path(__file__).resolve().parents[1]
BUCKETS = (0.01, 0.02, 0.04, 1.0, 5.0)
AMOUNTS = [0, 0.005, 0.01, 0.010000001, 0.02, 0.03, 1, 4.99, 5.0, 5.0001, 1e9, float("inf"), -1.0, float("nan"), 3]


def _created(text: bytes) -> bytes:
    return re.sub(rb"(_created\{[^}]*\}|_created) [0-9.e+]+", rb"\1 T", text)


def _both(kind: str) -> tuple[CollectorRegistry, object, CollectorRegistry, object]:
    a, b = CollectorRegistry(), CollectorRegistry()
    if kind == "histogram":
        return (a, Histogram("h_seconds", "doc", ["x"], buckets=BUCKETS, registry=a), b,
                M._Histogram("h_seconds", "doc", ["x"], buckets=BUCKETS, registry=b))
    return a, Counter("c_total", "doc", ["x"], registry=a), b, M._Counter("c_total", "doc", ["x"], registry=b)


def test_histogram_renders_what_the_library_renders():
    ra, ha, rb, hb = _both("histogram")
    for i, v in enumerate(AMOUNTS):
        for h in (ha, hb):
            h.labels(str(i % 3)).observe(v)
    assert type(hb.labels("0")._sum) is M._Value and all(type(b) is M._Value for b in hb.labels("0")._buckets)
    assert _created(generate_latest(ra)) == _created(generate_latest(rb))
    # exemplars (OpenMetrics) go through the library's observe
    ha.labels("e").observe(0.015, {"trace_id": "abc"})
    hb.labels("e").observe(0.015, {"trace_id": "abc"})
    strip_ts = re.compile(rb"( # \{trace_id=\"abc\"\} 0\.015) [0-9.]+")
    assert (strip_ts.sub(rb"\1", _created(generate_openmetrics(ra)))
            == strip_ts.sub(rb"\1", _created(generate_openmetrics(rb))))


def test_counter_renders_what_the_library_renders():
    ra, ca, rb, cb = _both("counter")
    for i, v in enumerate([1, 2.5, 0, 1e-9, 3, float("inf")]):
        for c in (ca, cb):
            c.labels(str(i % 2)).inc(v)
    for c in (ca, cb):
        c.labels("d").inc()
    assert type(cb.labels("0")._value) is M._Value
    assert _created(generate_latest(ra)) == _created(generate_latest(rb))


def test_misuse_raises_as_the_library_does():
    _, ha, _, hb = _both("histogram")
    _, ca, _, cb = _both("counter")
    for h in (ha, hb):
        with pytest.raises(ValueError, match="missing label values"):
            h.observe(1.0)
    for c in (ca, cb):
        with pytest.raises(ValueError, match="missing label values"):
            c.inc()
        with pytest.raises(ValueError, match="non-negative"):
            c.labels("a").inc(-1)
    with pytest.raises(TypeError):
        hb.labels("a").observe("x")  # type: ignore[arg-type]


def test_a_nan_observation_counts_in_no_bucket():
    _, ha, _, hb = _both("histogram")
    for h in (ha, hb):
        h.labels("n").observe(float("nan"))
    for h in (ha, hb):
        child = h.labels("n")
        assert [b.get() for b in child._buckets] == [0.0] * (len(BUCKETS) + 1) and math.isnan(child._sum.get())


_MP = """
import os, sys
from gateway import metrics as M
from prometheus_client import Counter, Histogram
if sys.argv[1] == "stock":
    M._Counter, M._Histogram = Counter, Histogram
m = M.Metrics()
for i, v in enumerate([0.001, 0.03, 0.5, 2.0, 100.0, float("nan"), 0.02]):
    m.child(m.duration, "chat", "openai", "m", "m", "up", "").observe(v)
    m.child(m.requests, "chat", "m", "up", "200", str(i % 2)).inc()
    m.child(m.stage_seconds, "route").observe(v / 1000)
m.child(m.tokens, "chat", "openai", "m", "m", "input").observe(37)
m.cost_gpu_seconds.labels("up", "m", "served").inc(0.25)
if sys.argv[1] == "ours":
    from prometheus_client.values import MutexValue
    assert type(m.child(m.duration, "chat", "openai", "m", "m", "up", "")._sum) not in (M._Value, MutexValue)
sys.stdout.buffer.write(m.render())
"""


def test_multiprocess_mode_renders_what_the_library_renders(tmp_path):
    """Under PROMETHEUS_MULTIPROC_DIR the library's file-backed values are kept: the merged text is the same."""
    out = {}
    for which in ("stock", "ours"):
        d = tmp_path / which
        d.mkdir()
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d), "PYTHONPATH": str(ROOT)}
        out[which] = subprocess.run([sys.executable, "-c", textwrap.dedent(_MP), which], env=env, cwd=ROOT,
                                    check=True, capture_output=True).stdout
        assert list(d.glob("*.db"))  # the values went to the files
    assert b'gen_ai_client_operation_duration_seconds_count{' in out["ours"]
    # (the merge orders families by what it reads from the files first: compare the lines, not their order)
    assert sorted(out["stock"].splitlines()) == sorted(out["ours"].splitlines())


def test_single_process_metrics_use_the_lock_free_value():
    m = M.Metrics()
    if m.multiproc_dir is None:
        assert type(m.child(m.requests, "chat", "m", "up", "200", "default")._value) is M._Value
    g = m.in_flight.labels("up")
    assert type(g._value) is MutexValue or m.multiproc_dir  # gauges keep the library's value


def _gateway(tmp_path: Path, models: str) -> Gateway:
    text = f"""
backends:
  - {{name: up, url: "http://127.0.0.1:9/v1", kind: vllm, models: [{models}], health: {{enabled: false}}}}
"""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(text)
    gw = Gateway(parse_config(text, base_dir=tmp_path, path=cfg))
    return gw


def _finished(model: str, **kw: object) -> RequestContext:
    c = RequestContext(request_id="r", endpoint=str(kw.pop("endpoint", "chat")), headers={}, body={})
    c.model, c.backend, c.backend_model, c.status = model, "up", model, 200
    c.principal = Principal(id="k", kind="api_key", tenant="t", labels={"tier": "gold"})
    c.usage = Usage(prompt_tokens=3, completion_tokens=2)
    c.stage_timings_us = {"observe": 1.0, "route": 80.0}
    for k, v in kw.items():
        setattr(c, k, v)
    return c


async def test_observe_stage_series_follow_the_config(tmp_path):
    gw = _gateway(tmp_path, "m")
    st = ObserveStage(gw)
    await st.finish(_finished("m"))
    await st.finish(_finished("m"))
    await st.finish(_finished("m2"))  # not a model of this config: "unknown"
    await st.finish(_finished("m", status=502, error="upstream_error", backend=None, usage=None))
    await st.finish(_finished("m", stream=True, ttft_s=0.01, total_s=None,
                              received_at=time.perf_counter() - 1.0,
                              usage=Usage(prompt_tokens=3, completion_tokens=5)))
    text = gw.metrics.render().decode()
    assert ('gateway_requests_total{backend="up",endpoint="chat",model="m",status="200",tenant_class="gold"} 3.0'
            in text)
    assert 'model="unknown",status="200"' in text
    assert ('gateway_requests_total{backend="none",endpoint="chat",model="m",status="502",tenant_class="gold"} 1.0'
            in text)
    assert ('gen_ai_client_operation_duration_seconds_count{backend="none",error_type="upstream_error",'
            'gen_ai_operation_name="chat",gen_ai_provider_name="",gen_ai_request_model="m",'
            'gen_ai_response_model="m"} 1.0' in text)
    assert ('gen_ai_client_token_usage_count{gen_ai_operation_name="chat",gen_ai_provider_name="vllm",'
            'gen_ai_request_model="m",gen_ai_response_model="m",gen_ai_token_type="input"} 3.0' in text)
    assert 'gen_ai_server_time_per_output_token_seconds_count{backend="up"' in text
    assert 'gateway_stage_duration_seconds_count{stage="route"} 5.0' in text
    # a reload that adds m2: its requests are labelled by name from then on
    (tmp_path / "gw.yaml").write_text((tmp_path / "gw.yaml").read_text().replace("models: [m]", "models: [m, m2]"))
    await gw.reload()
    await st.finish(_finished("m2"))
    text = gw.metrics.render().decode()
    assert 'gateway_requests_total{backend="up",endpoint="chat",model="m2",status="200",tenant_class="gold"} 1.0' in text
    assert ('gateway_requests_total{backend="up",endpoint="chat",model="unknown",status="200",tenant_class="gold"} 1.0'
            in text)


async def _finish_before(gw: Gateway, ctx: RequestContext) -> None:
    """ObserveStage.finish's metrics as they were written before the series cache (the reference)."""
    from gateway.app import error_type
    from gateway.observability.semconv import operation_name, provider_name

    m = gw.metrics
    ctx.total_s = time.perf_counter() - ctx.received_at
    backend = ctx.backend or "none"
    status = str(ctx.status or 200)
    tclass = (ctx.principal.labels.get("tier", "default") if ctx.principal else "anonymous")
    c = m.child
    model = ctx.model if ctx.model in gw.config.models or ctx.model in gw.config.aliases else "unknown"
    c(m.requests, ctx.endpoint, model, backend, status, tclass).inc()
    try:
        prov = provider_name(gw.config.backend(ctx.backend).kind) if ctx.backend else ""
    except KeyError:
        prov = ""
    genai = (operation_name(ctx.endpoint), prov, model, ctx.backend_model or "")
    c(m.duration, *genai, backend, error_type(ctx)).observe(ctx.total_s)
    if ctx.ttft_s is not None and ctx.backend:
        c(m.ttft, *genai, backend).observe(ctx.ttft_s)
    u = ctx.usage
    if u is not None and ctx.backend_model:
        c(m.tokens, *genai, "input").observe(u.prompt_tokens)
        c(m.tokens, *genai, "output").observe(u.completion_tokens)
        if ctx.stream and ctx.ttft_s is not None and u.completion_tokens > 1 and ctx.total_s > ctx.ttft_s:
            c(m.tpot, *genai, backend).observe((ctx.total_s - ctx.ttft_s) / (u.completion_tokens - 1))
    for st, us in ctx.stage_timings_us.items():
        c(m.stage_seconds, st).observe(us / 1e6)


def _variants() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for model in ("m", "m2", ""):
        for status, error in ((200, None), (0, None), (429, "budget_exceeded"), (502, "Upstream Error!"), (503, None)):
            for backend in ("up", None, "gone"):
                out.append({"model": model, "status": status, "error": error, "backend": backend,
                            "backend_model": model if backend else None})
    out += [{"principal": None}, {"endpoint": "embeddings", "usage": None}, {"stream": True, "ttft_s": 0.2},
            {"stream": True, "ttft_s": 0.2, "usage": Usage(prompt_tokens=9, completion_tokens=1)},
            {"stage_timings_us": {"observe": 2.0, "authenticate": 9.0, "meter": 0.2}}]
    return out


async def test_observe_stage_counts_what_the_code_before_the_cache_counted(tmp_path):
    """Every label and count ObserveStage writes, for requests of many shapes, equals the reference's (the
    sums of the wall-clock durations aside: the two runs take different times)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ga, gb = _gateway(tmp_path / "a", "m"), _gateway(tmp_path / "b", "m")
    st = ObserveStage(gb)
    for round_ in range(2):
        for kw in _variants():
            t0 = time.perf_counter() - 0.05  # 50 ms ago: the same duration bucket in both runs
            kw = {"model": "m", **kw}
            await _finish_before(ga, _finished(received_at=t0, **kw))  # type: ignore[arg-type]
            await st.finish(_finished(received_at=t0, **kw))  # type: ignore[arg-type]
        if round_ == 0:  # a reload between the rounds: m2 becomes a model, backend "gone" stays unknown
            for g in (ga, gb):
                g.config.path.write_text(g.config.path.read_text().replace("models: [m]", "models: [m, m2]"))
                await g.reload()

    def lines(g: Gateway) -> list[str]:
        keep = []
        for line in _created(g.metrics.render()).decode().splitlines():
            if re.match(r"(gen_ai_client_operation_duration_seconds|gen_ai_server_time_per_output_token_seconds)"
                        r"_sum", line):
                line = line.rsplit(" ", 1)[0]
            keep.append(line)
        return keep

    assert lines(ga) == lines(gb)
