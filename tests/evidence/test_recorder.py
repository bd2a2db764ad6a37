"""Evidence recorder: one record per request, JSON lines + Postgres, and no content for zero retention."""
from __future__ import annotations

import asyncio
import logging
import os
import uuid

import asyncpg
import orjson
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.config import BackendConfig, Location
from gateway.evidence.admin import make_decision_handler
from gateway.evidence.postgres import PostgresSink
from gateway.evidence.recorder import EvidenceRecorder, _scrub, _strip_content, build_record
from gateway.pipeline import RequestContext
from gateway.policy.compiler import compile_text
from gateway.policy.stage import PolicyStage
from gateway.types import Principal, Usage
from tests.conftest import unavailable
from tests.support.wait import async_wait_until

CANARY_PROMPT = "CANARY-PROMPT-7f3a9c1e secret merger plans"
CANARY_COMPLETION = "CANARY-COMPLETION-b24d88aa the answer"
POL = compile_text("rules:\n  - id: opper\n    match: {partner: opper}\n    require: {jurisdiction: EEA, retention: zero}\n")
BACKEND = BackendConfig(name="eu-1", url="http://eu-1", models=["q"], location=Location(country="DE", region="fra"),
                        retention="zero")


async def finished_ctx(rid: str, partner: str | None) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={"x-team": "a"},
                       body={"model": "q", "messages": [{"role": "user", "content": CANARY_PROMPT}]})
    c.principal = Principal(id="key:1", kind="api_key", tenant="acme", partner=partner, key_id="1")
    c.model = "q"
    await PolicyStage(lambda: POL).run(c)
    c.evidence["budget"] = {"before": {"tokens": 10}, "after": {"tokens": 60}}
    c.evidence["candidates"] = [{"backend": "us-1", "dropped": "residency: inference in US"},
                                {"backend": "eu-1", "predicted_ttft_ms": 120.0}]
    c.evidence["predicted_ttft_ms"] = 120.0
    c.evidence["predicted_cached_tokens"] = 32
    c.evidence["cost"] = {"amount": 0.0012, "currency": "EUR"}
    c.evidence["completion_text"] = CANARY_COMPLETION
    # a careless stage that stashed content, and an upstream error echoing the prompt
    c.evidence["debug"] = {"messages": [{"content": CANARY_PROMPT}], "note": "ok"}
    c.attempts = [{"backend": "eu-2", "error": f"400 bad request: '{CANARY_PROMPT}' too long"},
                  {"backend": "eu-1", "status": 200}]
    c.backend, c.backend_model, c.status = "eu-1", "q", 200
    c.usage = Usage(prompt_tokens=40, completion_tokens=10, cached_tokens=32)
    c.ttft_s, c.total_s = 0.131, 0.5
    return c


async def test_build_record_fields():
    c = await finished_ctx("r-1", None)
    rec = build_record(c, backend_lookup=lambda n: BACKEND)
    assert rec["principal"]["tenant"] == "acme" and rec["matched_rules"] == []
    assert rec["budget"]["after"] == {"tokens": 60}
    assert rec["candidates"][0]["dropped"].startswith("residency")
    assert rec["backend"] == "eu-1" and rec["backend_location"]["country"] == "DE"
    assert rec["ttft_ms"] == {"predicted": 120.0, "actual": 131.0}
    assert rec["cached_tokens"] == {"predicted": 32, "actual": 32}
    assert rec["cost"]["amount"] == 0.0012 and rec["status"] == 200 and rec["usage"]["prompt_tokens"] == 40
    assert "content" not in rec  # capture_content off
    assert "messages" not in rec["evidence"]["debug"] and rec["evidence"]["debug"]["note"] == "ok"
    rec = build_record(c, capture_content=True)
    assert rec["content"]["messages"][0]["content"] == CANARY_PROMPT
    assert rec["content"]["completion"] == CANARY_COMPLETION


async def test_zero_retention_leaves_no_canary_anywhere(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    path = tmp_path / "audit.jsonl"
    rec = EvidenceRecorder(path, capture_content=True, backend_lookup=lambda n: BACKEND)
    await rec.start()
    c = await finished_ctx("zr-1", "opper")
    assert c.zero_retention
    assert rec.record(c)
    got = await rec.get("zr-1")
    await rec.close()
    text = path.read_text()
    assert "zr-1" in text
    blob = text + orjson.dumps(got).decode() + caplog.text + orjson.dumps(c.evidence.get("decision")).decode()
    assert "CANARY" not in blob
    row = orjson.loads(text.splitlines()[0])
    assert row["zero_retention"] and "content" not in row
    assert row["attempts"][0]["error"].startswith("[redacted")
    assert row["decision"]["jurisdiction"] == "EEA"


async def test_jsonl_get_after_restart_and_bounded_queue(tmp_path):
    path = tmp_path / "a.jsonl"
    rec = EvidenceRecorder(path, recent=2)
    await rec.start()
    for i in range(5):
        assert rec.record(await finished_ctx(f"id-{i}", None))
    await rec.close()
    assert len(path.read_text().splitlines()) == 5
    rec2 = EvidenceRecorder(path, recent=2)
    got = await rec2.get("id-1")  # not in memory: scanned from the file
    assert got["request_id"] == "id-1" and got["ttft_ms"]["actual"] == 131.0
    assert await rec2.get("missing") is None
    small = EvidenceRecorder(tmp_path / "b.jsonl", max_queue=2)  # writer not started: the queue fills
    results = [small.record(await finished_ctx(f"q-{i}", None)) for i in range(4)]
    assert results == [True, True, False, False] and small.dropped == 2


async def test_records_arriving_together_are_written_in_one_append(tmp_path, monkeypatch):
    """Under load the writer waits `linger_s` after a batch's first record and appends the batch at once:
    one thread hand-off per batch, not per request. Lookups see a record at once, before it is written."""
    rec = EvidenceRecorder(tmp_path / "a.jsonl", linger_s=0.05)
    appends: list[int] = []
    real = rec._append
    monkeypatch.setattr(rec, "_append", lambda data: (appends.append(data.count(b"\n")), real(data)))
    await rec.start()
    for i in range(3):
        assert rec.record(await finished_ctx(f"b-{i}", None))
        assert (await rec.get(f"b-{i}"))["request_id"] == f"b-{i}"
        await asyncio.sleep(0.005)
    out = tmp_path / "a.jsonl"
    await async_wait_until(lambda: out.exists() and out.read_text().count("\n") == 3, what="the three records written")
    assert appends == [3]
    await rec.close()
    assert len((tmp_path / "a.jsonl").read_text().splitlines()) == 3


async def test_admin_endpoint(tmp_path):
    rec = EvidenceRecorder(tmp_path / "a.jsonl")
    await rec.start()
    rec.record(await finished_ctx("adm-1", None))
    app = Starlette(routes=[Route("/admin/decisions/{request_id}", make_decision_handler(rec))])
    with TestClient(app) as client:
        r = client.get("/admin/decisions/adm-1")
        assert r.status_code == 200 and r.json()["request_id"] == "adm-1"
        r = client.get("/admin/decisions/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    await rec.close()


PG_DSN = os.environ.get("GATEWAY_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


async def _pg_or_skip():
    try:
        conn = await asyncpg.connect(PG_DSN, timeout=3)
    except (OSError, asyncpg.PostgresError) as e:
        unavailable(f"no PostgreSQL at {PG_DSN}: {e}")
    return conn


async def test_postgres_sink_roundtrip_and_zero_retention():
    conn = await _pg_or_skip()
    table = f"audit_test_{uuid.uuid4().hex[:8]}"
    try:
        rec = EvidenceRecorder(None, sink=PostgresSink(PG_DSN, table=table), capture_content=True)
        await rec.start()
        rec.record(await finished_ctx("pg-1", "opper"))
        rec.record(await finished_ctx("pg-2", None))
        await rec.close()
        rows = await conn.fetch(f"SELECT request_id, tenant, allow, backend, status, record::text AS r FROM {table} ORDER BY request_id")
        assert [(r["request_id"], r["tenant"], r["allow"], r["backend"], r["status"]) for r in rows] == [
            ("pg-1", "acme", True, "eu-1", 200), ("pg-2", "acme", True, "eu-1", 200)]
        assert "CANARY" not in rows[0]["r"]
        assert CANARY_PROMPT in rows[1]["r"]  # capture_content on and not zero-retention
        sink = PostgresSink(PG_DSN, table=table)
        await sink.start()
        reader = EvidenceRecorder(None, sink=sink)
        got = await reader.get("pg-1")  # from Postgres, not memory
        assert got["decision"]["retention"] == "zero"
        await sink.close()
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.close()


def _lists(v):
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_lists(x) for x in v]
    return v


_json = st.recursive(st.none() | st.integers(-1000, 1000) | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
                     | st.dictionaries(st.sampled_from(["backend", "content", "messages", "note", "delta", "x"]),
                                       inner, max_size=3), max_leaves=12)


@given(_json)
def test_strip_content_equals_the_full_scrub_and_copies_only_when_it_must(value):
    """The no-secrets fast path drops exactly the content keys the full scrub drops, and hands back the very
    same object (no copy) when there is nothing to drop, leaving the input untouched either way."""
    before = orjson.dumps(value)
    out = _strip_content(value)
    assert _lists(out) == _lists(_scrub(value, []))
    assert orjson.dumps(value) == before
    if _lists(out) == _lists(value):
        assert out is value
