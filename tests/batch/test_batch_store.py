"""The batch store on SQLite and on PostgreSQL: leases, exactly-once recording, expiry, cancel, finalize,
pricing of batch lines, the scheduler's job order and the JSONL validation (errors name the line)."""
from __future__ import annotations

import os
import uuid

import orjson
import pytest

from gateway.batch.jsonl import parse_input, prompt_prefix
from gateway.batch.scheduler import pick_jobs
from gateway.batch.store import PostgresBatchStore, SqliteBatchStore
from gateway.budget.config import ModelPrice
from gateway.budget.pricing import cost, find_price
from gateway.errors import GatewayError
from gateway.types import Usage
from tests.conftest import require_service

PG_DSN = os.environ.get("GATEWAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


async def _pg_ok() -> bool:
    import asyncpg

    try:
        c = await asyncpg.connect(PG_DSN, timeout=3)
        await c.close()
        return True
    except Exception:
        return False


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        s = SqliteBatchStore(tmp_path / "batch.db")
    else:
        require_service(await _pg_ok(), f"PostgreSQL at {PG_DSN}")
        s = PostgresBatchStore(PG_DSN, schema=f"t_batch_{uuid.uuid4().hex[:10]}")
    await s.open()
    await s.migrate()
    yield s
    if request.param == "postgres":
        async with s._tx() as tx:
            await tx.conn.execute(f'DROP SCHEMA "{s.schema}" CASCADE')
    await s.close()


async def _job(store, n: int, now: float = 1000.0, expires: float = 90000.0, tenant: str = "t") -> str:
    bid = "batch_" + uuid.uuid4().hex[:8]
    await store.insert_file({"id": "file-" + bid, "owner": "o", "tenant": tenant, "purpose": "batch",
                             "filename": "in.jsonl", "bytes": 1, "created_at": now, "content": b"x"})
    await store.insert_job({"id": bid, "owner": "o", "tenant": tenant, "principal": {"id": "p"},
                            "endpoint": "/v1/chat/completions", "input_file_id": "file-" + bid,
                            "completion_window": "24h", "created_at": now, "expires_at": expires})
    rows = [(i + 1, f"c{i}", {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}, f"k{i % 2}")
            for i in range(n)]
    assert await store.start_job(bid, rows, now)
    assert not await store.start_job(bid, rows, now)  # only once
    return bid


def _files(kind: str, data: bytes) -> dict:
    return {"id": f"file-{kind}-{uuid.uuid4().hex[:6]}", "owner": "o", "tenant": "t", "purpose": "batch_output",
            "filename": kind, "bytes": len(data), "created_at": 0.0, "content": data}


async def test_lease_lapses_to_another_worker_and_only_the_holder_records(store):
    bid = await _job(store, 4)
    a = await store.claim(bid, "wa", 1000.0, 5.0, 3)
    assert sorted(x.line_no for x in a) == [1, 2, 3]
    assert await store.claim(bid, "wb", 1001.0, 5.0, 10) != []  # only line 4 was free
    # wa died: its leases lapse at 1005; wb takes them over
    b = await store.claim(bid, "wb", 1006.0, 5.0, 10)
    assert sorted(x.line_no for x in b) == sorted(x.line_no for x in a)
    res = {"custom_id": "c", "response": {"status_code": 200}}
    assert not await store.record(a[0], "wa", True, res, 1007.0)  # the dead holder's late answer is discarded
    assert await store.record(b[0], "wb", True, res, 1007.0)
    assert not await store.record(b[0], "wb", True, res, 1007.0)  # never twice
    job = await store.get_job(bid)
    assert job["completed"] == 1 and job["failed"] == 0


async def test_release_all_returns_a_stopping_workers_lines(store):
    bid = await _job(store, 3)
    got = await store.claim(bid, "wa", 1000.0, 60.0, 2)
    assert await store.record(got[0], "wa", True, {"x": 1}, 1001.0)
    assert await store.release_all("wa") == 1  # the recorded line stays done
    again = await store.claim(bid, "wb", 1002.0, 60.0, 5)
    assert sorted(x.line_no for x in again) == sorted({1, 2, 3} - {got[0].line_no})


async def test_renew_keeps_a_running_line(store):
    bid = await _job(store, 1)
    (ln,) = await store.claim(bid, "wa", 1000.0, 5.0, 1)
    await store.renew("wa", 1004.0, 5.0, [(bid, ln.line_no)])
    assert await store.claim(bid, "wb", 1006.0, 5.0, 1) == []  # renewed until 1009
    assert await store.record(ln, "wa", True, {"x": 1}, 1007.0)


async def test_expiry_ends_unfinished_lines_in_the_error_file(store):
    bid = await _job(store, 3)
    (l1,) = await store.claim(bid, "wa", 1000.0, 60.0, 1)
    assert await store.record(l1, "wa", True, {"custom_id": "c0", "ok": 1}, 1001.0)
    await store.claim(bid, "wa", 1001.0, 60.0, 1)  # in flight when the window ends
    await store.expire(bid, 2000.0)
    job = await store.get_job(bid)
    assert await store.finalize(job, 2000.0, _files) == "expired"
    job = await store.get_job(bid)
    assert job["status"] == "expired" and job["expired_at"] == 2000.0 and job["completed"] == 1 and job["failed"] == 2
    err = [orjson.loads(x) for x in (await store.file_content(job["error_file_id"], "o")).splitlines()]
    assert [e["custom_id"] for e in err] == ["c1", "c2"] and all(e["error"]["code"] == "batch_expired" for e in err)
    out = (await store.file_content(job["output_file_id"], "o")).splitlines()
    assert len(out) == 1


async def test_cancel_and_zero_retention_purge(store):
    bid = await _job(store, 3)
    (l1,) = await store.claim(bid, "wa", 1000.0, 60.0, 1)
    job = await store.cancel_job(bid, "o", 1000.5)
    assert job["status"] == "cancelling" and job["failed"] == 2  # the two not yet sent are cancelled at once
    assert await store.claim(bid, "wa", 1001.0, 60.0, 5) == []
    job["zero_retention"] = 1
    assert await store.finalize(job, 1001.0, _files) is None  # a line is still in flight
    assert await store.record(l1, "wa", True, {"custom_id": "c0"}, 1002.0)
    assert await store.finalize(job, 1003.0, _files, delete_after_s=10.0) == "cancelled"
    job = await store.get_job(bid)
    assert job["status"] == "cancelled" and job["delete_files_at"] == 1013.0
    assert await store.get_file(job["input_file_id"], "o") is None  # input deleted at the end
    assert await store.get_file(job["output_file_id"], "o") is not None
    assert await store.purge_expired_files(1012.0) == 0
    assert await store.purge_expired_files(1013.0) == 2
    assert await store.get_file(job["output_file_id"], "o") is None


async def test_claims_group_lines_sharing_a_prefix(store):
    bid = await _job(store, 6)  # prefix keys alternate k0, k1
    got = await store.claim(bid, "wa", 1000.0, 60.0, 3)
    assert sorted(x.line_no for x in got) == [1, 3, 5]  # every k0 line first, then k1


def test_pick_jobs_round_robin_tenants_earliest_deadline_first():
    jobs = [{"id": "a1", "tenant": "a", "expires_at": 5, "created_at": 1},
            {"id": "a2", "tenant": "a", "expires_at": 3, "created_at": 2},
            {"id": "b1", "tenant": "b", "expires_at": 9, "created_at": 1}]
    order, rr = pick_jobs(jobs, 0)
    assert [j["id"] for j in order] == ["a2", "b1", "a1"]
    order, _ = pick_jobs(jobs, rr)
    assert [j["id"] for j in order] == ["b1", "a2", "a1"]


def test_jsonl_errors_name_the_line():
    ok = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", "input": "x"}}\n'
    assert parse_input(ok + b"\n" + ok.replace(b'"a"', b'"b"'), 10, 10000)[1].line_no == 3
    cases = [(ok + b"[1]\n", 2, "invalid_batch_line"), (ok + ok, 2, "duplicate_custom_id"),
             (ok.replace(b"POST", b"GET"), 1, "invalid_batch_line"),
             (ok.replace(b"/v1/embeddings", b"/v1/images"), 1, "invalid_batch_line"),
             (ok + ok.replace(b'"a"', b'"b"').replace(b'"input"', b'"stream": true, "input"'), 2, "invalid_batch_line"),
             (ok + ok.replace(b'"a"', b'"b"') + ok.replace(b'"a"', b'"c"'), 3, "too_many_lines")]
    for data, line, code in cases:
        with pytest.raises(GatewayError) as e:
            parse_input(data, 2, 10000)
        assert e.value.status == 400 and e.value.extra["line"] == line and e.value.code == code
        assert f"Line {line}:" in e.value.message
    with pytest.raises(GatewayError) as e:
        parse_input(ok, 10, 20)
    assert e.value.code == "line_too_large"
    assert prompt_prefix({"model": "m", "messages": [{"content": "x" * 300 + "a"}]}, 256) == \
        prompt_prefix({"model": "m", "messages": [{"content": "x" * 300 + "b"}]}, 256)


def test_batch_prices_replace_input_and_output():
    prices = {"m": ModelPrice(input=2.0, output=4.0, cached_input=1.5, batch_input=1.0, batch_output=2.0),
              "plain": ModelPrice(input=2.0, output=4.0)}
    u = Usage(prompt_tokens=1000, completion_tokens=500, cached_tokens=200)
    assert cost("m", u, prices) == (800 * 2.0 + 200 * 1.5 + 500 * 4.0) / 1e6
    assert cost("m", u, prices, batch=True) == (800 * 1.0 + 200 * 1.0 + 500 * 2.0) / 1e6
    assert find_price("plain", prices, batch=True) == prices["plain"]


async def test_two_finalizers_at_once_write_one_output(store):
    """Two replicas finalizing the same job at the same moment: one writes the files, the other finds it done."""
    import asyncio

    bid = await _job(store, 2)
    for ln in await store.claim(bid, "wa", 1000.0, 60.0, 2):
        assert await store.record(ln, "wa", True, {"custom_id": ln.custom_id}, 1001.0)
    job = await store.get_job(bid)
    if isinstance(store, PostgresBatchStore):
        other = PostgresBatchStore(store.dsn, schema=store.schema)
        await other.open()
    else:
        other = store  # one SQLite connection per process; its transactions are serialised anyway
    try:
        got = await asyncio.gather(store.finalize(job, 1002.0, _files), other.finalize(job, 1002.0, _files))
    finally:
        if other is not store:
            await other.close()
    assert sorted(got, key=str) == [None, "completed"]
    async with store._tx() as tx:
        n = await tx.fetch("SELECT COUNT(*) AS n FROM batch_files WHERE purpose = 'batch_output'")
    assert int(n[0]["n"]) == 1


async def test_renew_skips_lines_whose_task_is_gone(store):
    bid = await _job(store, 2)
    a, b = await store.claim(bid, "wa", 1000.0, 5.0, 2)
    await store.renew("wa", 1004.0, 5.0, [(bid, a.line_no)])  # b's task died without recording
    (again,) = await store.claim(bid, "wb", 1006.0, 5.0, 5)
    assert again.line_no == b.line_no
