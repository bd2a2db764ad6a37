"""Issue 18, defect 4 (property): a request whose principal has zero retention, or whose retention is not known
(refused before the policy decision: bad or revoked key, a model the key may not use, a bad body), leaves
none of its content in the audit record, the log, the exported spans or the spend spool, with
`capture_content` on. The real recorder, tracing, log filter and budget stage are driven with generated
request contexts; a known principal whose decision keeps content is the control that shows capture works."""
from __future__ import annotations

import asyncio
import io
import itertools
import logging
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.budget.service import BudgetService
from gateway.budget.stage import BudgetStage
from gateway.config import BackendConfig, Location
from gateway.evidence.recorder import build_record
from gateway.observability.logs import JsonFormatter, RequestContextFilter, current_request
from gateway.observability.tracing import Tracing, build_provider
from gateway.pipeline import RequestContext
from gateway.types import Decision, Principal, Usage
from tests.budget.conftest import make_config

BACKEND = BackendConfig(name="eu-1", url="http://eu-1:8000/v1", models=["q"], location=Location(country="DE"),
                        retention="zero")
STAGES = ["observe", "authenticate", "decide", "reserve", "route", "trace"]
PRINCIPAL = Principal(id="key:zr", kind="api_key", tenant="eu-corp", key_id="zr", labels={"residency": "eea"})


class Env:
    def __init__(self, tmp: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.svc = BudgetService(make_config(tmp, sqlite_path=str(tmp / "b.db"), spool_path=str(tmp / "spool.jsonl"),
                                             ledger_flush_s=3600))
        self.loop.run_until_complete(self.svc.start())
        self.budget = BudgetStage(self.svc)
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing(build_provider("t", exporter=self.exporter), lambda: STAGES, lambda n: BACKEND,
                               lambda: True)
        self.buf = io.StringIO()
        h = logging.StreamHandler(self.buf)
        h.addFilter(RequestContextFilter())
        h.setFormatter(JsonFormatter())
        self.log = logging.getLogger("tests.careless-component")
        self.log.handlers, self.log.propagate = [h], False
        self.log.setLevel(logging.DEBUG)
        self.spool = tmp / "spool.jsonl"

    def close(self) -> None:
        self.loop.run_until_complete(self.svc.close())
        self.loop.close()

    def finish(self, ctx: RequestContext) -> dict[str, str]:
        """Every sink a finished request reaches, as text: audit record, log, spans, spend spool."""
        self.exporter.clear()
        self.buf.seek(0)
        self.buf.truncate()
        rec = build_record(ctx, capture_content=True, backend_lookup=lambda n: BACKEND)
        token = current_request.set(ctx)
        try:  # a careless component logging the body: the filter must replace the line
            self.log.info("saw request %s", ctx.body)
            self.log.warning("failed", extra={"fields": {"body": ctx.body}})
        finally:
            current_request.reset(token)

        async def run() -> None:
            await self.tracing.finish(ctx)
            await self.budget.finish(ctx)
            await asyncio.sleep(0)  # the ledger writes its spool at the end of the loop iteration

        self.loop.run_until_complete(run())
        spool = self.spool.read_text() if self.spool.exists() else ""
        return {"audit": orjson.dumps(rec).decode(), "logs": self.buf.getvalue(),
                "spans": "\n".join(s.to_json() for s in self.exporter.get_finished_spans()),
                "spool": spool + orjson.dumps(list(self.svc.ledger.queue)).decode()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("zr-prop"))
    yield e
    e.close()


_IDS = itertools.count()
canaries = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=6, max_size=24).map(
    lambda s: f"CANARY{s}")


@st.composite
def contexts(draw, retainable: bool = False):
    canary = draw(canaries)
    endpoint = draw(st.sampled_from(["chat", "completions", "embeddings"]))
    if endpoint == "chat":
        content = draw(st.sampled_from(["str", "parts"]))
        msg = (f"tell me {canary}" if content == "str" else [{"type": "text", "text": f"part {canary}"}])
        body = {"model": "q", "messages": [{"role": "system", "content": f"sys {canary}"},
                                           {"role": "user", "content": msg}],
                "stop": [f"{canary}-stop"], "tools": [{"type": "function", "function": {
                    "name": "f", "description": f"tool {canary}"}}]}
    elif endpoint == "completions":
        body = {"model": "q", "prompt": draw(st.sampled_from([f"p {canary}", [f"p {canary}", "x"]])),
                "suffix": f"s {canary}"}
    else:
        body = {"model": "q", "input": [f"in {canary}"]}
    ctx = RequestContext(request_id=f"req_{next(_IDS):08d}", endpoint=endpoint, headers={}, body=body)
    ctx.model = "q"
    ctx.stream = draw(st.booleans())
    if retainable:
        ctx.principal = PRINCIPAL
        ctx.decision = Decision(retention=None)
    else:
        # unknown retention (no principal, or no decision yet) or a decision that says zero
        kind = draw(st.sampled_from(["no-principal", "no-decision", "zero"]))
        if kind != "no-principal":
            ctx.principal = PRINCIPAL
        if kind == "zero":
            ctx.decision = Decision(retention="zero", allow=draw(st.booleans()))
            ctx.evidence["decision"] = ctx.decision.to_evidence()
    # how far it got: refused at some stage, or admitted and served (or cut, or the client left)
    reached = draw(st.integers(1, len(STAGES)))
    ctx.stage_timings_us = {s: 10.0 for s in STAGES[:reached]}
    ctx.status = draw(st.sampled_from([200, 400, 401, 403, 429, 499, 502]))
    ctx.error = None if ctx.status == 200 else draw(st.sampled_from(["model_not_allowed", "invalid_api_key",
                                                                       "revoked_api_key", "client_disconnected"]))
    if draw(st.booleans()):
        ctx.backend, ctx.backend_model = "eu-1", "q"
        ctx.usage = Usage(prompt_tokens=5, completion_tokens=3)
        echo = orjson.dumps(body.get("messages") or body.get("prompt") or body.get("input")).decode()
        ctx.attempts = [{"backend": "eu-1", "error": f"400 bad request: {echo[:300]} too long", "status": 400}]
        ctx.evidence["completion_text"] = f"answer {canary}"
    ctx.total_s = 0.01
    return canary, ctx


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=contexts())
def test_zero_or_unknown_retention_leaves_no_content_anywhere(env, case):
    canary, ctx = case
    sinks = env.finish(ctx)
    for where, text in sinks.items():
        assert canary not in text, f"content of a {ctx.error or ctx.status} request leaked into {where}"
    assert ctx.request_id in sinks["audit"] and ctx.request_id in sinks["spans"]  # observed, just without content
    assert ctx.request_id in sinks["logs"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=contexts(retainable=True))
def test_known_principal_whose_decision_keeps_content_is_captured(env, case):
    """The control: the same sinks do see content when a decision for a known principal allows it."""
    canary, ctx = case
    sinks = env.finish(ctx)
    assert canary in sinks["audit"] and canary in sinks["spans"]
    assert canary not in sinks["spool"]  # the spend spool never carries content
