"""Canary strings: a zero-retention request's content reaches no trace, log line, metric, audit record or
dashboard, even with content capture switched on; the same canary from an ordinary principal does reach the
span when capture is on (so the check can see a leak)."""
from __future__ import annotations

import io
import logging
from pathlib import Path

import orjson
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.logs import configure_logging
from gateway.completion import Step

from .conftest import ADMIN_KEY, KEY, ZR_KEY, open_stack

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def spans_text(exp: InMemorySpanExporter) -> str:
    return "\n".join(s.to_json() for s in exp.get_finished_spans())


async def test_zero_retention_content_leaves_no_trace(tmp_path: Path, fleet) -> None:
    canary = "CANARY-7f3a9c-zero-retention-secret"
    plain_canary = "CANARY-plain-4411-captured"
    exp = InMemorySpanExporter()
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging("debug", json_logs=True, stream=buf)
    careless = logging.getLogger("gateway.careless")

    async def careless_hook(ctx) -> None:  # a buggy component that logs the prompt; the filter must catch it
        careless.info("saw prompt %s", ctx.body.get("messages"))
        careless.warning("failed", extra={"fields": {"body": ctx.body}})

    try:
        async for st in open_stack(tmp_path, fleet, exp, server={"access_log": True}, capture_content=True):
            st.gw.pipeline = st.gw.pipeline.with_step(Step("careless", careless_hook), after="access_log")
            rids = []
            for stream in (False, True):
                r = await st.chat(f"please summarise {canary} now", key=ZR_KEY, stream=stream,
                                  stop=[f"{canary}-stop"])
                assert r.status_code == 200, r.text
                rids.append(r.headers["x-request-id"])
            r = await st.chat(f"too long {canary}", key=ZR_KEY, max_tokens=10**7)  # refused, content in body
            assert r.status_code >= 400
            rids.append(r.headers["x-request-id"])
            r = await st.chat(f"ordinary {plain_canary}", key=KEY)
            assert r.status_code == 200
            plain_rid = r.headers["x-request-id"]

            metrics = (await st.client.get("/metrics")).text
            ui = (await st.client.get("/admin/ui/data", headers=ADMIN)).text
            decisions = [(await st.client.get(f"/admin/decisions/{rid}", headers=ADMIN)).text for rid in rids]
        audit = (tmp_path / "audit.jsonl").read_text()  # flushed by close
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])

    logs = buf.getvalue()
    traces = spans_text(exp)
    for where, text in (("spans", traces), ("logs", logs), ("metrics", metrics), ("dashboard", ui),
                        ("audit", audit), ("decisions", "\n".join(decisions))):
        assert canary not in text, f"zero-retention content leaked into {where}"

    # the requests were observed: spans, access-log lines with request ids, audit records, dashboard rows
    zr_spans = [s for s in exp.get_finished_spans() if s.attributes.get("gateway.request_id") in rids]
    assert len(zr_spans) == 3 and all(s.attributes["gateway.decision.retention"] == "zero" for s in zr_spans)
    assert all("gen_ai.input.messages" not in s.attributes and "gen_ai.request.stop_sequences" not in s.attributes
               for s in zr_spans)
    lines = [orjson.loads(line) for line in logs.splitlines() if line.startswith("{")]
    access = [x for x in lines if x["logger"] == "gateway.access"]
    assert {x["request_id"] for x in access} >= set(rids) | {plain_rid}
    assert all(x["zero_retention"] for x in access if x["request_id"] in rids)
    redacted = [x for x in lines if x["logger"] == "gateway.careless" and x["request_id"] in rids]
    assert len(redacted) == 6 and all(x["msg"] == "[redacted: zero retention]" and "body" not in x for x in redacted)
    assert all(rid in audit and rid in ui for rid in rids)
    assert KEY not in logs and ZR_KEY not in logs and ADMIN_KEY not in logs  # secrets never logged
    for secret in (KEY, ZR_KEY, ADMIN_KEY, "Bearer "):  # nor traced (issue 4: logs, traces or errors)
        assert secret not in traces and secret not in metrics and secret not in audit, secret

    # positive control: with capture on, an ordinary request's content is in its span (and in the careless log)
    [plain] = [s for s in exp.get_finished_spans() if s.attributes.get("gateway.request_id") == plain_rid
               and s.name == "chat sim-model"]
    assert plain_canary in plain.attributes["gen_ai.input.messages"]
    assert plain_canary in logs


async def test_content_capture_is_off_by_default(tmp_path: Path, fleet) -> None:
    canary = "CANARY-default-off-2288"
    exp = InMemorySpanExporter()
    async for st in open_stack(tmp_path, fleet, exp):
        r = await st.chat(f"hello {canary}", key=KEY, stream=True)
        assert r.status_code == 200
    assert exp.get_finished_spans() and canary not in spans_text(exp)
    assert canary not in (tmp_path / "audit.jsonl").read_text()
