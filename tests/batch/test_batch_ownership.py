"""Issue 35.2, without processes: who owns batch files and batches (tenant, team, project, partner and the
restriction labels), the decision an input file keeps, a batch taking it whoever creates it, a line never
looser than it, and a batch store written before any of this (SQLite and Postgres) still working."""
from __future__ import annotations

import uuid

import orjson
import pytest

from gateway.batch.scope import InputFileDecision, RetentionGuard, owner_of, record_decisions, tighten
from gateway.batch.store import PostgresBatchStore, SqliteBatchStore, _schema
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext, RequestHeaders
from gateway.policy.eea import EEA_COUNTRIES
from gateway.types import Decision, Principal
from tests.batch.test_batch_store import PG_DSN, _pg_ok
from tests.conftest import require_service

RESTRICTED = ("residency", "retention", "tier")


def P(**kw) -> Principal:
    return Principal(id=kw.pop("id", "key:x"), kind=kw.pop("kind", "api_key"), tenant=kw.pop("tenant", "acme"), **kw)


# ---------------------------------------------------------------------------------------------- the owner scope

def test_owner_scope_is_tenant_team_project_partner_and_restriction_labels():
    plain = owner_of(P(team="t", project="p", labels={"colour": "blue"}), RESTRICTED)
    assert plain == "acme/t/p"  # the form rows were written with before partner and labels counted
    assert owner_of(P(), RESTRICTED) == "acme/-/-"
    scopes = {
        "tenant": owner_of(P(), RESTRICTED),
        "partner opper": owner_of(P(kind="partner", partner="opper"), RESTRICTED),
        "partner other": owner_of(P(kind="partner", partner="other"), RESTRICTED),
        "eea key": owner_of(P(labels={"residency": "eea"}), RESTRICTED),
        "de key": owner_of(P(labels={"residency": "de"}), RESTRICTED),
        "zero key": owner_of(P(labels={"retention": "zero"}), RESTRICTED),
        "policy label": owner_of(P(labels={"tier": "gold"}), RESTRICTED),
        "opper eea": owner_of(P(kind="partner", partner="opper", labels={"residency": "eea"}), RESTRICTED),
    }
    assert len(set(scopes.values())) == len(scopes), scopes
    # labels policy does not restrict on, the key and the principal kind do not split a scope
    assert owner_of(P(id="key:a", key_id="a", labels={"colour": "x"}), RESTRICTED) == scopes["tenant"]
    assert owner_of(P(id="jwt:i|s", kind="jwt"), RESTRICTED) == scopes["tenant"]
    assert owner_of(P(labels={"retention": "zero", "residency": "eea"}), RESTRICTED) == \
        owner_of(P(labels={"residency": "eea", "retention": "zero"}), RESTRICTED)


def test_owner_scope_cannot_be_forged_by_odd_ids_or_label_values():
    # a JWT claim may carry any string: none of these may land in another principal's scope
    real = owner_of(P(kind="partner", partner="opper", labels={"residency": "eea"}), RESTRICTED)
    forged = [
        P(tenant="acme/-/-;partner=opper;labels=residency=eea"),
        P(team="-;partner=opper;labels=residency=eea"),
        P(labels={"residency": "eea;partner=opper"}),
        P(kind="partner", partner="opper;labels=residency=eea"),
        P(kind="partner", partner="opper", labels={"residency": "eea,retention=zero"}),
    ]
    outs = {owner_of(p, RESTRICTED) for p in forged}
    assert real not in outs and len(outs) == len(forged)
    assert owner_of(P(team="-"), RESTRICTED) != owner_of(P(), RESTRICTED)  # a team literally named "-"


# ------------------------------------------------------------------------------------ the file's decision, per line

EEA = Decision(allowed_countries=EEA_COUNTRIES, jurisdiction="EEA", residency_rule="opper", retention="zero",
               retention_rule="opper")
LOOSE = Decision()


def test_a_line_is_never_looser_than_its_files_decision():
    rec = record_decisions({"m": EEA, "n": LOOSE})
    assert rec["zero_retention"] is True and rec["models"]["m"]["jurisdiction"] == "EEA"
    d, applied = tighten(LOOSE, rec, "m", zero=False)
    assert d.allowed_countries == EEA_COUNTRIES and d.jurisdiction == "EEA" and d.retention == "zero" and applied
    # model n was unrestricted at upload, but the file is zero-retention: its lines are too
    d, _ = tighten(LOOSE, rec, "n", zero=False)
    assert d.allowed_countries is None and d.retention == "zero"
    # narrower already: intersected, never widened
    de = Decision(allowed_countries=frozenset({"DE"}), jurisdiction="DE")
    d, _ = tighten(de, rec, "m", zero=False)
    assert d.allowed_countries == frozenset({"DE"})
    us = Decision(allowed_countries=frozenset({"US", "DE"}))
    d, _ = tighten(us, rec, "m", zero=False)
    assert d.allowed_countries == frozenset({"DE"})
    # a model the record does not name (never from the file itself) gets the intersection of all it names
    d, _ = tighten(LOOSE, rec, "other", zero=False)
    assert d.allowed_countries == EEA_COUNTRIES
    # no record (a file stored before records were kept): the batch's own zero retention still holds
    d, applied = tighten(LOOSE, None, "m", zero=True)
    assert d.retention == "zero" and d.allowed_countries is None
    d, applied = tighten(LOOSE, None, "m", zero=False)
    assert d is LOOSE and applied == []


async def test_the_stages_refuse_an_empty_intersection_and_keep_refused_lines_content_free():
    rec = record_decisions({"m": EEA})
    ctx = RequestContext(request_id="r", endpoint="chat", headers=RequestHeaders(), body={}, client_addr="batch")
    ctx.model = "m"
    ctx.decision = Decision(allowed_countries=frozenset({"US"}), jurisdiction="US")
    with pytest.raises(GatewayError) as e:
        await InputFileDecision(rec, zero=False).run(ctx)
    assert e.value.status == 403 and e.value.code == "residency_unsatisfiable"
    # a line `decide` itself refused (InputFileDecision never ran): still zero retention when recorded
    ctx.decision = Decision(allow=False, deny_rule="r")
    ctx.evidence["decision"] = ctx.decision.to_evidence()
    await RetentionGuard(rec, zero=False).finish(ctx)
    assert ctx.zero_retention and not ctx.content_retainable and ctx.evidence["decision"]["retention"] == "zero"


# ------------------------------------------------------------------------------------------------- the store

@pytest.fixture(params=["sqlite", "postgres"])
async def legacy_store(request, tmp_path):
    """A batch store whose tables were created by the gateway before files kept their decision, holding one
    file and one job of the no-partner, no-label scope; then opened and migrated by this gateway."""
    if request.param == "sqlite":
        s = SqliteBatchStore(tmp_path / "batch.db")
    else:
        require_service(await _pg_ok(), f"PostgreSQL at {PG_DSN}")
        s = PostgresBatchStore(PG_DSN, schema=f"t_batch_{uuid.uuid4().hex[:10]}")
    await s.open()
    async with s._tx() as tx:  # the schema as it shipped, and rows as the old gateway wrote them
        for stmt in _schema(s.blob):
            await tx.execute(stmt)
        await tx.execute("INSERT INTO batch_files (id, owner, tenant, purpose, filename, bytes, created_at, expires_at, "
                         "deleted, content) VALUES ('file-old', 'acme/-/-', 'acme', 'batch', 'in.jsonl', 1, 1.0, NULL, "
                         "0, ?)", b"x")
        await tx.execute("INSERT INTO batch_jobs (id, owner, tenant, principal, endpoint, input_file_id, "
                         "completion_window, status, created_at, expires_at) VALUES ('batch_old', 'acme/-/-', 'acme', "
                         "?, '/v1/chat/completions', 'file-old', '24h', 'completed', 1.0, 90000.0)",
                         orjson.dumps({"id": "key:a", "kind": "api_key", "tenant": "acme"}).decode())
    await s.migrate()
    await s.migrate()  # idempotent: a restart (or a second replica) finds the columns there
    yield s
    if request.param == "postgres":
        async with s._tx() as tx:
            await tx.conn.execute(f'DROP SCHEMA "{s.schema}" CASCADE')
    await s.close()


async def test_rows_written_before_ownership_counted_the_partner_stay_with_the_no_partner_scope(legacy_store):
    s = legacy_store
    tenant = owner_of(P(), RESTRICTED)
    partner = owner_of(P(kind="partner", partner="opper"), RESTRICTED)
    labelled = owner_of(P(labels={"residency": "eea"}), RESTRICTED)
    assert (await s.get_file("file-old", tenant))["id"] == "file-old"
    assert await s.file_content("file-old", tenant) == b"x"
    assert (await s.get_job("batch_old", tenant))["restriction"] is None
    assert [r["id"] for r in await s.list_files(tenant, None, None, 10)] == ["file-old"]
    for other in (partner, labelled):
        assert await s.get_file("file-old", other) is None and await s.file_content("file-old", other) is None
        assert await s.get_job("batch_old", other) is None
        assert await s.list_files(other, None, None, 10) == [] and await s.list_jobs(other, None, 10) == []
        assert not await s.delete_file("file-old", other)
    # a batch over the old file: no record, so its creator's decision alone (as before)
    await s.insert_job({"id": "batch_new", "owner": tenant, "tenant": "acme", "principal": {"id": "key:a"},
                        "endpoint": "/v1/chat/completions", "input_file_id": "file-old", "completion_window": "24h",
                        "created_at": 2.0, "expires_at": 90000.0})
    job = await s.get_job("batch_new", tenant)
    assert job["restriction"] is None and not job["zero_retention"]


async def test_a_batch_takes_its_files_decision_whoever_creates_it(legacy_store):
    s = legacy_store
    owner = owner_of(P(kind="partner", partner="opper"), RESTRICTED)
    rec = record_decisions({"m": EEA})
    await s.insert_file({"id": "file-zdr", "owner": owner, "tenant": "acme", "purpose": "batch",
                         "filename": "in.jsonl", "bytes": 1, "created_at": 3.0, "content": b"x", "restriction": rec})
    # a creator whose own decision is not zero-retention (say a tenant admin acting on the file): the job still is
    await s.insert_job({"id": "batch_zdr", "owner": owner, "tenant": "acme", "principal": {"id": "admin"},
                        "endpoint": "/v1/chat/completions", "input_file_id": "file-zdr", "completion_window": "24h",
                        "created_at": 4.0, "expires_at": 90000.0, "zero_retention": False})
    job = await s.get_job("batch_zdr")
    assert job["zero_retention"] and job["restriction"] == rec
    assert [j["id"] for j in await s.jobs_in(("validating",))] == ["batch_zdr"]
    assert (await s.jobs_in(("validating",)))[0]["restriction"]["models"]["m"]["countries"] == sorted(EEA_COUNTRIES)
