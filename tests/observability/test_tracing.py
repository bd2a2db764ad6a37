"""Traces: GenAI semantic-convention spans built by the gateway, asserted through an in-memory span exporter."""
from __future__ import annotations

from pathlib import Path

import httpx
import orjson
import yaml
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.app import Gateway, build_app
from gateway.config import parse_config
from gateway.wiring import wire
from tests.support.procs import start_upstream

from .conftest import KEY, TIGHT_KEY, open_stack

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def spans_by_trace(exp: InMemorySpanExporter) -> dict[int, list]:
    out: dict[int, list] = {}
    for s in exp.get_finished_spans():
        out.setdefault(s.context.trace_id, []).append(s)
    return out


def server_span(spans: list):
    [s] = [s for s in spans if s.kind == SpanKind.SERVER]
    return s


async def test_request_span_follows_genai_conventions(tmp_path: Path, fleet) -> None:
    exp = InMemorySpanExporter()
    async for st in open_stack(tmp_path, fleet, exp):
        r = await st.chat("what is the capital of france " * 8, headers={"traceparent": TRACEPARENT},
                          temperature=0.5, top_p=0.9, max_tokens=6, stream=True,
                          stream_options={"include_usage": True})
        assert r.status_code == 200
        usage = [orjson.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: {")][-1]["usage"]
        backend = r.headers["x-gateway-backend"]
        port = int(st.gw.config.backend(backend).url.split(":")[2].split("/")[0])

        spans = spans_by_trace(exp)[int(TRACE_ID, 16)]
        srv = server_span(spans)
        assert srv.name == "chat sim-model"
        assert srv.parent is not None and srv.parent.span_id == int(PARENT_ID, 16) and srv.parent.is_remote
        a = srv.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.request.model"] == "sim-model"
        assert a["gen_ai.provider.name"] == "vllm"
        assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
        assert a["gen_ai.request.max_tokens"] == 6
        assert a["gen_ai.response.model"] == "sim-model"
        chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert a["gen_ai.response.id"] == chunks[0]["id"]
        assert list(a["gen_ai.response.finish_reasons"]) == [
            c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
        assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert a["server.address"] == "127.0.0.1" and a["server.port"] == port
        assert a["gateway.backend"] == backend and a["http.response.status_code"] == 200
        assert a["gateway.tenant"] == "acme" and a["gateway.route.admission"] == "admit"
        assert a["gateway.ttft_ms"] > 0 and a["gateway.predicted_ttft_ms"] > 0
        assert "gen_ai.input.messages" not in a  # content capture is off by default
        assert "error.type" not in a

        children = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == srv.context.span_id}
        assert set(children) == {"auth", "policy", "budget", "route", "upstream"}
        assert children["auth"].attributes["gateway.stage"] == "authenticate"
        up = children["upstream"]
        assert up.kind == SpanKind.CLIENT
        assert up.attributes["server.address"] == "127.0.0.1" and up.attributes["server.port"] == port
        assert up.attributes["gen_ai.provider.name"] == "vllm"
        assert up.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert [e.name for e in up.events] == ["attempt", "gen_ai.first_token"]
        order = [children[n] for n in ("auth", "policy", "budget", "route", "upstream")]
        for prev, nxt in zip(order, order[1:]):  # stages in pipeline order, inside the request span
            assert prev.start_time <= prev.end_time <= nxt.start_time + 1000
        assert srv.start_time <= order[0].start_time and up.end_time <= srv.end_time
        first_token = up.events[1].timestamp
        assert up.start_time < first_token <= up.end_time


async def test_operation_names_for_each_endpoint(tmp_path: Path, fleet) -> None:
    exp = InMemorySpanExporter()
    async for st in open_stack(tmp_path, fleet, exp):
        h = {"authorization": f"Bearer {KEY}"}
        r1 = await st.client.post("/v1/completions", headers=h, json={"model": "sim-model", "prompt": "hi there",
                                                                      "max_tokens": 3})
        r2 = await st.client.post("/v1/embeddings", headers=h, json={"model": "sim-model", "input": "hi there"})
        assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
        names = sorted(s.name for s in exp.get_finished_spans() if s.kind == SpanKind.SERVER)
        assert names == ["embeddings sim-model", "text_completion sim-model"]
        comp = [s for s in exp.get_finished_spans() if s.name == "text_completion sim-model"][0]
        assert comp.attributes["gen_ai.response.id"] == r1.json()["id"]  # non-streamed: from the body
        assert list(comp.attributes["gen_ai.response.finish_reasons"]) == [r1.json()["choices"][0]["finish_reason"]]
        emb = [s for s in exp.get_finished_spans() if s.name == "embeddings sim-model"][0]
        assert emb.attributes["gen_ai.operation.name"] == "embeddings"
        assert emb.attributes["gen_ai.usage.input_tokens"] == r2.json()["usage"]["prompt_tokens"]
        assert "gen_ai.usage.output_tokens" not in emb.attributes


async def test_refusals_are_traced_with_the_refusing_stage(tmp_path: Path, fleet) -> None:
    exp = InMemorySpanExporter()
    async for st in open_stack(tmp_path, fleet, exp):
        r = await st.chat("hello", key="not-a-key-at-all")
        assert r.status_code == 401
        r2 = await st.chat("hello", key=TIGHT_KEY, max_tokens=500)
        assert r2.status_code == 429, r2.text
        srvs = [s for s in exp.get_finished_spans() if s.kind == SpanKind.SERVER]
        assert [s.attributes["http.response.status_code"] for s in srvs] == [401, 429]
        assert srvs[0].attributes["error.type"] == "invalid_api_key"
        assert srvs[1].attributes["error.type"] == r2.json()["error"]["code"]
        assert "gen_ai.provider.name" not in srvs[0].attributes  # no backend was chosen
        for srv, stage, before in ((srvs[0], "auth", set()), (srvs[1], "budget", {"auth", "policy"})):
            kids = {s.name: s for s in exp.get_finished_spans()
                    if s.parent is not None and s.parent.span_id == srv.context.span_id}
            assert set(kids) == before | {stage}, kids.keys()
            assert kids[stage].status.status_code == StatusCode.ERROR
            assert kids[stage].attributes["error.type"] == srv.attributes["error.type"]


async def test_traceparent_sent_upstream_is_the_gateway_span(tmp_path: Path) -> None:
    up, port = start_upstream(tmp_path)
    try:
        raw = {"backends": [{"name": "mock", "kind": "openai", "url": f"http://127.0.0.1:{port}/v1",
                             "models": ["mock-model"], "health": {"enabled": False}}],
               "keys": [{"key": KEY, "tenant": "t"}], "policy": {"audit_path": str(tmp_path / "a.jsonl")},
               "identity": {"sqlite_path": str(tmp_path / "i.db")}, "budgets": {"sqlite_path": str(tmp_path / "b.db")},
               "data_dir": str(tmp_path)}
        for traced in (True, False):
            gw = Gateway(parse_config(yaml.safe_dump(raw), base_dir=tmp_path))
            exp = InMemorySpanExporter()
            wire(gw, span_exporter=exp if traced else None)
            assert (gw.tracing is not None) == traced
            assert ("trace" in [s.name for s in gw.pipeline.stages]) == traced
            app = build_app(gw)
            await gw.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                    r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}",
                                                                      "traceparent": TRACEPARENT},
                                     json={"model": "mock-model", "messages": [{"role": "user", "content": "x"}]})
                    assert r.status_code == 200, r.text
                    seen = httpx.get(f"http://127.0.0.1:{port}/stats").json()["last_headers"]["traceparent"]
            finally:
                await gw.close()
            if traced:
                [upstream] = [s for s in exp.get_finished_spans() if s.name == "upstream"]
                assert upstream.attributes["gen_ai.provider.name"] == "openai"
                assert upstream.attributes["server.port"] == port
                assert seen == f"00-{TRACE_ID}-{upstream.context.span_id:016x}-01"
            else:  # tracing off: the client's header passes through unchanged, nothing is recorded
                assert seen == TRACEPARENT
                assert exp.get_finished_spans() == ()
    finally:
        up.stop()


async def test_otlp_http_export_from_config(tmp_path: Path, fleet) -> None:
    """observability.otlp_endpoint alone turns tracing on; spans reach an OTLP/HTTP receiver as protobuf."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    got: list[tuple[str, bytes]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            got.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *a) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        async for st in open_stack(tmp_path, fleet, otlp_endpoint=f"http://127.0.0.1:{srv.server_port}",
                                   service_name="gw-under-test"):
            assert st.gw.tracing is not None
            r = await st.chat("hello otlp")
            assert r.status_code == 200
        # gw.close() flushed the batch processor
        assert got and all(path == "/v1/traces" for path, _ in got)
        names, services = [], set()
        for _, body in got:
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
                names += [s.name for ss in rs.scope_spans for s in ss.spans]
        assert services == {"gw-under-test"}
        assert sorted(names) == sorted(["chat sim-model", "auth", "policy", "budget", "route", "upstream"])
    finally:
        srv.shutdown()
