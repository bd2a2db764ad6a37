"""Issue 35.2, without processes: who owns batch files and batches (tenant, team, project, partner and the
restriction labels), and rows a batch store holds from before (SQLite and Postgres) staying with the
no-partner, no-label scope."""
from __future__ import annotations

import uuid

import orjson
import pytest

from gateway.batch.scope import owner_of
from gateway.batch.store import PostgresBatchStore, SqliteBatchStore, _schema
from gateway.types import Principal
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


# ------------------------------------------------------------------------------------------------- the store

@pytest.fixture(params=["sqlite", "postgres"])
async def legacy_store(request, tmp_path):
    """A batch store holding one file and one job written before ownership counted the partner and labels,
    opened and migrated by this gateway."""
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
    assert (await s.get_job("batch_old", tenant))["id"] == "batch_old"
    assert [r["id"] for r in await s.list_files(tenant, None, None, 10)] == ["file-old"]
    for other in (partner, labelled):
        assert await s.get_file("file-old", other) is None and await s.file_content("file-old", other) is None
        assert await s.get_job("batch_old", other) is None
        assert await s.list_files(other, None, None, 10) == [] and await s.list_jobs(other, None, 10) == []
        assert not await s.delete_file("file-old", other)
