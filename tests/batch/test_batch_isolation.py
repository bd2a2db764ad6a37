"""One job's failure is that job's alone (issue 35 finding 1): a job the lane cannot validate, dispatch or finalize
ends `failed` with the reason, and another tenant's batch, created after it, completes. The poisoned jobs are
persisted in the batch store before the gateway starts (the state the issue's attack left behind, which a
restart used to resume into the same halt), so each is also the restart case; a second restart finds them
still failed, not retried."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import asyncpg
import orjson
import pytest

from gateway.batch.service import store_unavailable
from gateway.batch.store import SqliteBatchStore
from tests.batch.inproc import lane, line

DEEP = (b'{"custom_id":"c1","method":"POST","url":"/v1/chat/completions","body":{"model":"sim-model",'
        b'"messages":[{"role":"user","content":"hi"}],"x":' + b"[" * 300 + b"]" * 300 + b"}}")
OWNER = "mallory/-/-"


async def _file_and_job(st: SqliteBatchStore, bid: str, content: bytes, now: float) -> None:
    await st.insert_file({"id": "file-" + bid, "owner": OWNER, "tenant": "mallory", "purpose": "batch",
                          "filename": "in.jsonl", "bytes": len(content), "created_at": now, "content": content})
    await st.insert_job({"id": bid, "owner": OWNER, "tenant": "mallory",
                         "principal": {"id": "static:mallory", "kind": "static", "tenant": "mallory"},
                         "endpoint": "/v1/chat/completions", "input_file_id": "file-" + bid,
                         "completion_window": "24h", "created_at": now, "expires_at": now + 86400})


async def _started(st: SqliteBatchStore, bid: str, now: float, n: int = 2) -> None:
    await _file_and_job(st, bid, b"\n".join(line(i) for i in range(n)), now)
    body = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
    assert await st.start_job(bid, [(i + 1, f"c{i}", body, "k") for i in range(n)], now)


async def poison(st: SqliteBatchStore, kind: str, bid: str) -> None:
    now = time.time()
    if kind == "deep_line":  # the file, stored whole before uploads were checked like realtime bodies
        await _file_and_job(st, bid, DEEP + b"\n", now)
    elif kind == "lines_exist":  # validating fails in the store: its line rows are already there
        await _file_and_job(st, bid, line(0) + b"\n", now)
        async with st._tx() as tx:
            await tx.execute("INSERT INTO batch_lines (batch_id, line_no, custom_id, body, prefix_key, state) "
                             "VALUES (?, 1, 'x', NULL, 'k', 'done')", bid)
    elif kind == "unreadable_line":  # dispatching fails: a line body the store cannot hand out
        await _started(st, bid, now)
        async with st._tx() as tx:
            await tx.execute("UPDATE batch_lines SET body = '{' WHERE batch_id = ? AND line_no = 1", bid)
    elif kind == "lost_result":  # finalizing fails: an answered line without its answer
        await _started(st, bid, now)
        async with st._tx() as tx:
            await tx.execute("UPDATE batch_lines SET state = 'done', result = NULL WHERE batch_id = ?", bid)
    elif kind == "unreadable_job":  # even the job row cannot be read
        await _started(st, bid, now)
        async with st._tx() as tx:
            await tx.execute("UPDATE batch_jobs SET principal = 'not json' WHERE id = ?", bid)
    else:
        raise AssertionError(kind)


EXPECT = {"deep_line": ("invalid_batch_line", 1), "lines_exist": ("batch_failed", None),
          "unreadable_line": ("batch_failed", None), "lost_result": ("batch_failed", None),
          "unreadable_job": ("batch_failed", None)}


async def _status(st_path: Path, bid: str) -> dict:
    st = SqliteBatchStore(st_path)
    await st.open()
    try:
        job = await st.get_job(bid)
        assert job is not None
        return job
    finally:
        await st.close()


@pytest.mark.parametrize("kind", sorted(EXPECT))
async def test_a_poisoned_job_fails_alone_and_stays_failed_across_restarts(tmp_path, kind):
    st = SqliteBatchStore(tmp_path / "batch.db")
    await st.open()
    await st.migrate()
    await poison(st, kind, "batch_poisoned")
    await st.close()

    async with lane(tmp_path) as s:  # the restart: the poisoned job is in the store from the start
        victim = await s.batch("beta", n=3)
        done = await s.wait("beta", victim["id"])
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 3, done
        for _ in range(600):  # the lane's next steps: the poisoned job has ended
            job = await s.svc.store.get_job("batch_poisoned")
            if job["status"] not in ("validating", "in_progress", "cancelling"):
                break
            await s.client.get("/healthz")
        assert job["status"] == "failed" and job["failed_at"], job
        code, ln = EXPECT[kind]
        assert job["errors"]["data"][0]["code"] == code and job["errors"]["data"][0]["line"] == ln, job["errors"]
        assert s.svc.stats["jobs_failed"] == (0 if kind == "deep_line" else 1)
        open_ids = [j["id"] for j in await s.svc.store.jobs_in(("validating", "in_progress", "cancelling"))]
        assert "batch_poisoned" not in open_ids
        if kind == "unreadable_line":  # stopped, then finalized: its unanswered lines say why
            err = [orjson.loads(x) for x in (await s.svc.store.file_content(job["error_file_id"], OWNER)).splitlines()]
            assert {e["error"]["code"] for e in err if e["error"]} == {"batch_failed"}

    async with lane(tmp_path) as s:  # a second restart: still failed, and the lane still runs
        assert (await _status(tmp_path / "batch.db", "batch_poisoned"))["status"] == "failed"
        again = await s.batch("beta", n=1)
        assert (await s.wait("beta", again["id"]))["status"] == "completed"


def test_only_the_store_being_unavailable_is_retried_not_failed():
    """What `_job_failed` retries instead of failing the job: the store's own trouble, never the job's data."""
    assert store_unavailable(sqlite3.OperationalError("database is locked"))
    assert store_unavailable(OSError("disk"))
    assert store_unavailable(TimeoutError())
    assert store_unavailable(asyncpg.exceptions.ConnectionDoesNotExistError("gone"))
    assert store_unavailable(asyncpg.exceptions.SerializationError("retry"))
    assert not store_unavailable(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not store_unavailable(orjson.JSONDecodeError("x", "{", 1))
    assert not store_unavailable(TypeError("Recursion limit reached"))
    assert not store_unavailable(asyncpg.exceptions.UniqueViolationError("dup"))
    assert not store_unavailable(asyncpg.exceptions.DataError("bad input"))
