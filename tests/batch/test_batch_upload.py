"""Uploads (gateway/batch/upload.py), issue 35 findings 1 and 3: a batch line is refused at upload exactly as the
realtime endpoint refuses the same body (a 300-deep extra field used to be stored, then halt the lane), naming
its line; the upload is checked in a worker thread while the event loop keeps answering; its content comes back
byte for byte; concurrent uploads are bounded (429) and so are a tenant's stored files and bytes (429 / 413),
against the batch store that every worker and replica shares."""
from __future__ import annotations

import asyncio
import os
import threading
import uuid
from typing import Any, AsyncIterator

import orjson
import pytest

from gateway.batch.store import PostgresBatchStore, QuotaExceeded, SqliteBatchStore
from tests.batch.inproc import KEYS, auth, gateway, jsonl, lane, line
from tests.conftest import require_service

CHAT = {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(r, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, err
    return err


async def test_a_300_deep_line_is_refused_at_upload_naming_its_line(tmp_path):
    """The issue's file: two good lines, then one whose extra body field nests 300 levels."""
    async with lane(tmp_path, engine=False) as s:
        bad = raw_line(3, deep_body(300))
        r = await s.upload("alpha", line(1) + b"\n" + line(2) + b"\n" + bad + b"\n")
        err = assert_openai_error(r, 400, "invalid_batch_line")
        assert err["line"] == 3 and err["message"].startswith("Line 3: "), err
        assert "nested deeper than 64 levels" in err["message"]
        listed = await s.client.get("/v1/files", headers=auth(KEYS["alpha"]))
        assert listed.json()["data"] == []  # nothing stored
        assert await s.svc.store.usage("alpha") == (0, 0)  # and nothing reserved


def deep_body(levels: int) -> bytes:
    """CHAT with an extra field nested `levels` deep, as JSON text (orjson writes at most 255 levels)."""
    return orjson.dumps(CHAT)[:-1] + b',"x":' + b"[" * levels + b"]" * levels + b"}"


def raw_line(i: int, body: bytes) -> bytes:
    return b'{"custom_id":"c%d","method":"POST","url":"/v1/chat/completions","body":%s}' % (i, body)


@pytest.mark.parametrize("body", [
    deep_body(64),  # 65 levels with the body itself: the first depth realtime refuses
    deep_body(255),  # what orjson could still write: accepted and dispatched before
    deep_body(300),  # the line: accepted, then never saved
    deep_body(1000),
    orjson.dumps({"model": "sim-model"}),  # no messages
    orjson.dumps({**CHAT, "max_tokens": "many"}),
    orjson.dumps({**CHAT, "messages": [{"role": "user", "content": 5}]}),
    orjson.dumps({**CHAT, "model": "m" * 300}),
], ids=["deep65", "deep256", "deep301", "deep1001", "no-messages", "max-tokens-type", "content-type", "long-model"])
async def test_a_line_is_refused_exactly_as_the_realtime_endpoint_refuses_its_body(tmp_path, body):
    async with lane(tmp_path, engine=False) as s:
        rt = await s.client.post("/v1/chat/completions", content=body,
                                 headers={**auth(KEYS["alpha"]), "content-type": "application/json"})
        assert rt.status_code == 400, rt.text
        up = await s.upload("alpha", line(1) + b"\n\n" + raw_line(2, body) + b"\n")
        err = assert_openai_error(up, 400, "invalid_batch_line")
        assert err["line"] == 3 and err["message"] == f"Line 3: body: {rt.json()['error']['message']}", (err, rt.text)


async def test_a_body_as_deep_as_realtime_accepts_is_accepted(tmp_path):
    async with lane(tmp_path, engine=False) as s:
        r = await s.upload("alpha", raw_line(1, deep_body(63)) + b"\n")  # 64 levels with the body
        assert r.status_code == 200, r.text


async def test_the_content_comes_back_byte_for_byte(tmp_path):
    """Blank lines, CRLF line ends, whitespace-only lines and no final newline: stored per line, joined back."""
    async with lane(tmp_path, engine=False) as s:
        data = b"\n" + line(1) + b"\r\n  \r\n" + line(2) + b"\n\n\t\n" + line(3)
        r = await s.upload("alpha", data, filename="x.jsonl")
        assert r.status_code == 200 and r.json()["bytes"] == len(data) and r.json()["filename"] == "x.jsonl"
        c = await s.client.get(f"/v1/files/{r.json()['id']}/content", headers=auth(KEYS["alpha"]))
        assert c.content == data
        assert await s.svc.input_models(r.json()["id"], s.svc.owner(await principal(s, "alpha"))) == ["sim-model"]


async def principal(s, tenant: str) -> Any:
    return await s.gw.identity.authenticate(auth(KEYS[tenant]), "test")


async def test_the_upload_is_checked_off_the_event_loop_while_other_requests_are_answered(tmp_path):
    """The lines are checked in the service's upload thread. That thread is held busy first, so the upload's
    check waits there: meanwhile /healthz and another tenant's file listing are answered, and the upload is
    still in progress (if the check ran on the event loop, `parsing` would never be seen above 0, and nothing
    else would be answered until it ended). Ordering only, no timing."""
    async with lane(tmp_path, engine=False) as s:
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        held = loop.run_in_executor(s.svc.upload_pool, gate.wait)
        try:
            upload = asyncio.create_task(s.upload("alpha", jsonl(500)))
            for _ in range(10000):  # until the upload has been received and waits for its check
                if s.svc.upload_slots.parsing or upload.done():
                    break
                await asyncio.sleep(0.001)
            assert s.svc.upload_slots.parsing == 1 and not upload.done()
            assert (await s.client.get("/healthz")).status_code == 200
            other = await s.client.get("/v1/files", headers=auth(KEYS["beta"]))
            assert other.status_code == 200 and other.json()["data"] == []
            assert not upload.done() and s.svc.upload_slots.parsing == 1  # answered while the upload was pending
        finally:
            gate.set()
            await held
        r = await upload
        assert r.status_code == 200, r.text
        assert s.svc.upload_slots.parsing == 0 and s.svc.upload_slots.total == 0


def multipart(data: bytes, boundary: str = "b0undary") -> tuple[bytes, bytes, dict[str, str]]:
    """A multipart body split in two (the second part is sent when the test says so)."""
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + data
    tail = f"\r\n--{boundary}--\r\n".encode()
    return head, tail, {"content-type": f"multipart/form-data; boundary={boundary}"}


async def test_concurrent_uploads_are_bounded_per_tenant_and_in_all(tmp_path):
    async with lane(tmp_path, engine=False, batch={"max_concurrent_uploads": 2,
                                                   "max_concurrent_uploads_per_tenant": 1}) as s:
        release = asyncio.Event()

        async def slow_upload(tenant: str):
            head, tail, headers = multipart(jsonl(3))

            async def body() -> AsyncIterator[bytes]:
                yield head
                await release.wait()
                yield tail
            return await s.client.post("/v1/files", headers={**auth(KEYS[tenant]), **headers}, content=body())

        first = asyncio.create_task(slow_upload("alpha"))
        for _ in range(10000):
            if s.svc.upload_slots.total == 1:
                break
            await asyncio.sleep(0.001)
        assert s.svc.upload_slots.total == 1
        r = await s.upload("alpha", jsonl(1))  # alpha's one slot is taken
        err = assert_openai_error(r, 429, "too_many_uploads")
        assert r.headers["retry-after"] == "1" and "this tenant" in err["message"]
        second = asyncio.create_task(slow_upload("beta"))  # beta has its own; now both process slots are taken
        for _ in range(10000):
            if s.svc.upload_slots.total == 2:
                break
            await asyncio.sleep(0.001)
        assert s.svc.upload_slots.total == 2
        assert_openai_error(await s.upload("gamma", jsonl(1)), 429, "too_many_uploads")
        release.set()
        assert (await first).status_code == 200 and (await second).status_code == 200
        assert (await s.upload("gamma", jsonl(1))).status_code == 200  # slots are given back


async def test_a_tenants_files_and_bytes_are_bounded_across_workers(tmp_path):
    """Two gateways (as two workers) on one batch store: what one stored counts on the other."""
    one = jsonl(4)
    limits = {"max_files_per_tenant": 3, "max_stored_bytes_per_tenant": 3 * len(one) + 10}
    async with lane(tmp_path, engine=False, batch=limits) as a, gateway(a.config, tmp_path) as b:
        ids = []
        for s in (a, b, a):
            r = await s.upload("alpha", one)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        err = assert_openai_error(await b.upload("alpha", jsonl(1)), 429, "file_limit_exceeded")
        assert "3 files" in err["message"]
        assert (await a.upload("beta", one)).status_code == 200  # another tenant has its own
        d = await a.client.delete(f"/v1/files/{ids[0]}", headers=auth(KEYS["alpha"]))
        assert d.status_code == 200
        big = jsonl(12)  # more than the bytes left
        err = assert_openai_error(await b.upload("alpha", big), 413, "storage_limit_exceeded")
        assert "max_stored_bytes_per_tenant" in err["message"]
        assert (await b.upload("alpha", one)).status_code == 200  # what fits still does
        assert await a.svc.store.usage("alpha") == (3, 3 * len(one))


async def test_quota_is_refused_before_the_body_is_read(tmp_path):
    """A tenant at its limit gets the refusal from the declared size, before anything is spooled."""
    async with lane(tmp_path, engine=False, batch={"max_stored_bytes_per_tenant": 1000}) as s:
        head, tail, headers = multipart(b"x" * 70000)  # larger than the limit even less the framing allowance
        never = asyncio.Event()

        async def body() -> AsyncIterator[bytes]:
            yield head
            await never.wait()  # never sent: the answer must not wait for it
            yield tail
        n = len(head) + len(tail)
        r = await s.client.post("/v1/files", headers={**auth(KEYS["alpha"]), **headers, "content-length": str(n)},
                                content=body())
        assert_openai_error(r, 413, "storage_limit_exceeded")


async def _pg_ok(dsn: str) -> bool:
    import asyncpg

    try:
        c = await asyncpg.connect(dsn, timeout=3)
        await c.close()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_racing_reservations_on_two_stores_never_pass_the_quota(tmp_path, kind):
    """Two store instances (two replicas) reserving at once for one tenant: exactly the quota succeeds."""
    if kind == "sqlite":
        stores = [SqliteBatchStore(tmp_path / "batch.db"), SqliteBatchStore(tmp_path / "batch.db")]
    else:
        dsn = os.environ.get("GATEWAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
        require_service(await _pg_ok(dsn), f"PostgreSQL at {dsn}")
        schema = f"t_quota_{uuid.uuid4().hex[:10]}"
        stores = [PostgresBatchStore(dsn, schema=schema), PostgresBatchStore(dsn, schema=schema)]
    for st in stores:
        await st.open()
        await st.migrate()
    try:
        async def reserve(i: int) -> bool:
            row = {"id": f"file-{i}", "owner": "o", "tenant": "t", "purpose": "batch", "filename": "f",
                   "bytes": 100, "created_at": float(i)}
            try:
                await stores[i % 2].reserve_file(row, max_files=1000, max_bytes=500)
                return True
            except QuotaExceeded as e:
                assert e.kind == "bytes"
                return False
        got = await asyncio.gather(*(reserve(i) for i in range(16)))
        assert sum(got) == 5
        assert await stores[0].usage("t") == (5, 500)
        assert await stores[1].file_content("file-0", "o") is None  # reserved, not visible
    finally:
        if kind == "postgres":
            async with stores[0]._tx() as tx:
                await tx.conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
        for st in stores:
            await st.close()


@pytest.mark.parametrize("raw,code", [
    (b"not multipart at all", "invalid_request"),
    (b"--b0undary\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch", "invalid_request"),
    (b"", "invalid_request"),
])
async def test_a_malformed_multipart_body_is_a_400_never_a_500(tmp_path, raw, code):
    async with lane(tmp_path, engine=False) as s:
        r = await s.client.post("/v1/files", content=raw, headers={
            **auth(KEYS["alpha"]), "content-type": "multipart/form-data; boundary=b0undary"})
        assert_openai_error(r, 400, code)
        assert s.svc.upload_slots.total == 0
