"""End to end: the official `openai` SDK against a real gateway process in front of a simulated vLLM fleet.

Files and batches through the SDK unchanged (files.create, batches.create, retrieve, list with pagination,
cancel, files.content), output/error lines in OpenAI's format with custom_id, malformed JSONL refused naming
the line, another tenant's (and another project's) access refused with 404, every line's audit record naming
its batch and line at priority batch, a revoked key stopping its batch, an exhausted budget stopping a job
with the reason per line (batch prices applied), zero-retention files deleted after delivery, and the order
lines get the fleet in (tenants round-robin, earliest deadline first within a tenant).
"""
from __future__ import annotations

import io
import json
import time
from datetime import datetime

import httpx
import pytest
from openai import NotFoundError, OpenAI

from backends.sim.fleet import FleetProcess
from tests.support.procs import free_port, start_gateway
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e
ADMIN = "batch-e2e-admin-0123456789"


def _admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


def new_key(base: str, tenant: str, team: str | None = None, project: str | None = None) -> tuple[str, str]:
    if _admin(base, "GET", f"/admin/tenants/{tenant}").status_code == 404:
        assert _admin(base, "POST", "/admin/tenants", {"id": tenant}).status_code == 201
    if team and _admin(base, "GET", f"/admin/tenants/{tenant}/teams/{team}").status_code == 404:
        assert _admin(base, "POST", f"/admin/tenants/{tenant}/teams", {"id": team}).status_code == 201
    if project:
        r = _admin(base, "POST", "/admin/projects", {"tenant": tenant, "team": team, "id": project})
        assert r.status_code in (201, 409), r.text
    body = {"tenant": tenant, **({"team": team} if team else {}), **({"project": project} if project else {})}
    r = _admin(base, "POST", "/admin/keys", body)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def write_config(tmp, engines, port: int, extra: dict | None = None) -> object:
    backends = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                 "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                 "location": {"country": "DE"}, "retention": "zero"} for e in engines]
    cfg = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends, "admin": {"key": ADMIN},
           "identity": {"sqlite_path": str(tmp / "gateway.db"), "cache_ttl_s": 0.5,
                        "auth_fail_limit_per_minute": 100000},
           "policy": {"audit_path": str(tmp / "audit.jsonl")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl")},
           "telemetry": {"scrape_interval_s": 0.2}, "observability": {"log_level": "warning"},
           "batch": {"lease_s": 2.0}, **(extra or {})}
    path = tmp / "gateway.yaml"
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    fleet = FleetProcess(["--engines", "2", "--profile", "h200-8b", "--base-port", "0"], tmp / "fleet.json")
    man = fleet.start()
    try:
        port = free_port()
        (tmp / "policy.yaml").write_text(json.dumps({"version": 1, "rules": [
            {"id": "budgeted-tokens", "match": {"tenant": "budgeted"}, "budgets": [{"window": "day", "tokens": 600}]},
            {"id": "zdr", "match": {"tenant": "zdr"}, "require": {"retention": "zero"}},
            {"id": "us-only", "match": {"tenant": "us-only"}, "require": {"jurisdiction": ["US"]}},
            {"id": "no-sim", "match": {"tenant": "denied"}, "deny": {"models": ["sim-*"]}, "reason": "not for you"}]}))
        extra = {"policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
                 "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                             "prices": {"sim-model": {"input": 1.0, "output": 2.0, "batch_input": 0.5,
                                                      "batch_output": 1.0}}},
                 "batch": {"lease_s": 2.0, "zero_retention_delete_after_s": 3.0}}
        gw, _ = start_gateway(write_config(tmp, man["engines"], port, extra))
        try:
            yield {"base": f"http://127.0.0.1:{port}", "tmp": tmp, "gw": gw}
        finally:
            gw.stop()
    finally:
        fleet.stop()


def lines(n: int, prefix: str = "Summarise clause", endpoint: str = "/v1/chat/completions",
          max_tokens: int = 3) -> bytes:
    out = []
    for i in range(n):
        # a body the realtime endpoint at `endpoint` accepts (uploads are checked as realtime checks bodies)
        prompt = ({"prompt": f"{prefix} {i}"} if endpoint == "/v1/completions"
                  else {"messages": [{"role": "user", "content": f"{prefix} {i}"}]})
        out.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": endpoint,
                               "body": {"model": "sim-model", "max_tokens": max_tokens, **prompt}}))
    return ("\n".join(out) + "\n").encode()


def decision(base: str, rid: str) -> dict:
    for _ in range(50):
        r = _admin(base, "GET", f"/admin/decisions/{rid}")
        if r.status_code == 200:
            return r.json()
        time.sleep(0.1)
    raise AssertionError(f"no audit record for {rid}")


def client(base: str, key: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)


def wait_done(c: OpenAI, bid: str, limit_s: float = 60.0):
    deadline = time.monotonic() + limit_s
    while True:
        b = c.batches.retrieve(bid)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch {bid} still {b.status}: {b.request_counts}"
        time.sleep(0.2)


def test_sdk_round_trip_output_in_openai_format(stack):
    base = stack["base"]
    _, key = new_key(base, "acme", "search", "p1")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(12))), purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.bytes > 0 and f.id.startswith("file-")
    assert c.files.retrieve(f.id).filename == "in.jsonl"
    assert c.files.content(f.id).content == lines(12)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"} and b.endpoint == "/v1/chat/completions"
    done = wait_done(c, b.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 12 and done.request_counts.completed == 12 and done.request_counts.failed == 0
    assert done.in_progress_at and done.completed_at and done.finalizing_at and done.error_file_id is None
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(12))
    assert c.files.retrieve(done.output_file_id).purpose == "batch_output"
    with pytest.raises(Exception) as e:  # an output file is not a batch input
        c.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.status_code == 400
    for o in out:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"].startswith("req_")
        assert o["response"]["body"]["object"] == "chat.completion"
    # every line's audit record names its batch and line, at priority batch, as the owner's principal
    rec = decision(base, out[0]["response"]["request_id"])
    assert rec["batch"]["batch_id"] == b.id and rec["batch"]["custom_id"] == out[0]["custom_id"]
    assert rec["batch"]["line"] == int(out[0]["custom_id"].split("-")[1]) + 1
    assert rec["decision"]["priority"] == "batch" and rec["principal"]["tenant"] == "acme"
    assert rec["principal"]["project"] == "p1"


def test_list_is_paginated_newest_first(stack):
    base = stack["base"]
    _, key = new_key(base, "pager")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="batch")
    ids = [c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
           for _ in range(3)]
    page = c.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    rest = c.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in c.batches.list(limit=2)] == ids[::-1]


def test_malformed_jsonl_is_refused_naming_the_line(stack):
    base = stack["base"]
    _, key = new_key(base, "malformed")
    c = client(base, key)
    bad = lines(3).replace(b'"custom_id": "req-1"', b'"custom_id": 7')
    with pytest.raises(Exception) as e:
        c.files.create(file=("in.jsonl", io.BytesIO(bad)), purpose="batch")
    assert e.value.status_code == 400 and "Line 2" in str(e.value)
    broken = lines(2) + b"{not json\n"
    r = httpx.post(base + "/v1/files", headers={"authorization": f"Bearer {key}"}, data={"purpose": "batch"},
                   files={"file": ("x.jsonl", broken)})
    assert r.status_code == 400 and r.json()["error"]["line"] == 3 and "Line 3" in r.json()["error"]["message"]
    dup = lines(2) + lines(1)
    r = httpx.post(base + "/v1/files", headers={"authorization": f"Bearer {key}"}, data={"purpose": "batch"},
                   files={"file": ("x.jsonl", dup)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_custom_id"
    r = httpx.post(base + "/v1/files", headers={"authorization": f"Bearer {key}"}, data={"purpose": "fine-tune"},
                   files={"file": ("x.jsonl", lines(1))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    # a file whose lines target another endpoint than the batch's: the batch fails, the error names the line
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(2, endpoint="/v1/completions"))), purpose="batch")
    b = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)
    assert b.status == "failed" and b.errors.data[0].line == 1 and b.errors.data[0].code == "mismatched_endpoint"
    with pytest.raises(Exception) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert e.value.status_code == 400


def test_another_tenant_or_project_gets_404(stack):
    base = stack["base"]
    _, owner_key = new_key(base, "owner-t", "team", "pa")
    _, other_tenant = new_key(base, "other-t")
    _, other_project = new_key(base, "owner-t", "team", "pb")
    c = client(base, owner_key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(2))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for key in (other_tenant, other_project):
        o = client(base, key)
        for call in (lambda: o.batches.retrieve(b.id), lambda: o.batches.cancel(b.id),
                     lambda: o.files.retrieve(f.id), lambda: o.files.content(f.id), lambda: o.files.delete(f.id),
                     lambda: o.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                              completion_window="24h")):
            with pytest.raises(NotFoundError) as e:
                call()
            assert e.value.status_code == 404
        assert b.id not in [x.id for x in o.batches.list().data]
        assert f.id not in [x.id for x in o.files.list().data]
    r = httpx.get(base + f"/v1/batches/{b.id}")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert wait_done(c, b.id).status == "completed"
    assert c.files.delete(f.id).deleted is True
    with pytest.raises(NotFoundError):
        c.files.retrieve(f.id)


def test_cancel_ends_cancelled_with_partial_results(stack):
    base = stack["base"]
    _, key = new_key(base, "canceller")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(400, "long " * 50))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 1, timeout=30,
               what="the batch under way (a line completed)")
    cb = c.batches.cancel(b.id)
    assert cb.status in ("cancelling", "cancelled") and cb.cancelling_at
    done = wait_done(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    n = done.request_counts
    assert n.total == 400 and n.completed + n.failed == 400 and n.completed < 400
    errs = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    assert errs and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errs)
    with pytest.raises(Exception) as e:
        c.batches.cancel(b.id)
    assert e.value.status_code == 409


def test_revoked_key_stops_its_batch(stack):
    base = stack["base"]
    kid, key = new_key(base, "revokee")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(600, "slow " * 80))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 1, timeout=30,
               what="the batch under way (a line completed)")
    assert _admin(base, "DELETE", f"/admin/keys/{kid}").status_code in (200, 204)
    # the revoked key can no longer read anything; another key of the same owner scope (tenant) can
    _, key2 = new_key(base, "revokee")
    c2 = client(base, key2)
    done = wait_done(c2, b.id)
    assert done.status == "failed" and done.errors.data[0].code == "revoked_api_key"
    n = done.request_counts
    assert n.total == 600 and n.completed + n.failed == 600 and n.failed > 0
    errs = [json.loads(x) for x in c2.files.content(done.error_file_id).text.splitlines()]
    assert all(e["error"]["code"] == "revoked_api_key" for e in errs)
    assert len({e["custom_id"] for e in errs}) == n.failed
    out = [json.loads(x) for x in c2.files.content(done.output_file_id).text.splitlines()]
    assert len(out) == n.completed and not ({o["custom_id"] for o in out} & {e["custom_id"] for e in errs})


def test_budget_runs_out_lines_fail_with_the_reason_and_batch_prices_apply(stack):
    base = stack["base"]
    _, key = new_key(base, "budgeted")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(60))), purpose="batch")
    done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    n = done.request_counts
    assert done.status == "completed" and n.total == 60 and n.completed > 0 and n.failed > 0
    assert n.completed + n.failed == 60
    errs = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert len(errs) == n.failed and len(out) == n.completed
    assert {e["custom_id"] for e in errs} | {o["custom_id"] for o in out} == {f"req-{i}" for i in range(60)}
    for e in errs:  # which line failed and why: the 429 insufficient_quota the budget answered
        code = (e["error"] or {}).get("code") or e["response"]["body"]["error"]["code"]
        assert code == "insufficient_quota" and e["response"]["status_code"] == 429
    rec = decision(base, out[0]["response"]["request_id"])
    cost, usage = rec["cost"], rec["usage"]
    assert cost["priced_as"] == "batch" and rec["budget"] is not None
    expect = (usage["prompt_tokens"] * 0.5 + usage["completion_tokens"] * 1.0) / 1e6
    assert abs(cost["amount"] - expect) < 1e-12


def test_zero_retention_files_are_deleted_after_delivery(stack):
    base = stack["base"]
    _, key = new_key(base, "zdr")
    c = client(base, key)
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(3))), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.model_extra["retention"]["zero_data_retention"] is True
    done = wait_done(c, b.id)
    assert done.status == "completed"
    ret = done.model_extra["retention"]
    assert ret["zero_data_retention"] is True and ret["files_deleted_at"] >= done.completed_at
    with pytest.raises(NotFoundError):  # the input is gone as soon as the batch ended
        c.files.retrieve(f.id)
    assert len(c.files.content(done.output_file_id).text.splitlines()) == 3  # delivered
    deadline = time.monotonic() + 15
    while True:
        try:
            c.files.retrieve(done.output_file_id)
        except NotFoundError:
            break
        assert time.monotonic() < deadline, "output file of a zero-retention batch was not deleted"
        time.sleep(0.2)
    with pytest.raises(NotFoundError):
        c.files.content(done.output_file_id)


def _audit(stack, bid: str, n: int) -> list[dict]:
    """The audit records of batch `bid`'s lines, once the recorder's writer has flushed at least `n` of them."""
    def recs() -> list[dict]:
        rs = [json.loads(x) for x in (stack["tmp"] / "audit.jsonl").read_text().splitlines()]
        return [r for r in rs if r.get("batch") and r["batch"]["batch_id"] == bid]

    wait_until(lambda: len(recs()) >= n, what=f"{n} audit records of batch {bid}")
    return recs()


def test_tenants_take_turns_and_a_tenants_jobs_go_earliest_deadline_first(stack):
    base = stack["base"]
    _, ka = new_key(base, "fair-a")
    _, kb = new_key(base, "fair-b")
    ca, cb = client(base, ka), client(base, kb)
    big = ca.files.create(file=("a.jsonl", io.BytesIO(lines(300, "tenant a " * 30, max_tokens=100))), purpose="batch")
    small = ca.files.create(file=("a2.jsonl", io.BytesIO(lines(10, "tenant a later"))), purpose="batch")
    a1 = ca.batches.create(input_file_id=big.id, endpoint="/v1/chat/completions", completion_window="24h")
    a2 = ca.batches.create(input_file_id=small.id, endpoint="/v1/chat/completions", completion_window="24h")
    fb = cb.files.create(file=("b.jsonl", io.BytesIO(lines(20, "tenant b"))), purpose="batch")
    b1 = cb.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions", completion_window="24h")
    done_b = wait_done(cb, b1.id, 120)
    assert done_b.status == "completed"
    # tenant b did not wait behind tenant a's 300 lines: round-robin across tenants
    assert ca.batches.retrieve(a1.id).status == "in_progress"
    assert wait_done(ca, a1.id, 180).status == "completed" and wait_done(ca, a2.id).status == "completed"
    # within tenant a, the earlier deadline (a1, created first) got every line before a2 got any
    t1 = [datetime.fromisoformat(r["ts"]) for r in _audit(stack, a1.id, 300)]
    t2 = [datetime.fromisoformat(r["ts"]) for r in _audit(stack, a2.id, 10)]
    assert len(t1) >= 300 and len(t2) >= 10 and min(t2) >= max(t1)


def test_bad_requests_get_openai_shaped_4xx_never_5xx(stack):
    base = stack["base"]
    _, key = new_key(base, "garbage")
    h = {"authorization": f"Bearer {key}"}
    f = client(base, key).files.create(file=("in.jsonl", io.BytesIO(lines(1))), purpose="batch")
    cases = [
        ("POST", "/v1/batches", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
        ("POST", "/v1/batches", {"json": [1, 2]}),
        ("POST", "/v1/batches", {"json": {"input_file_id": f.id, "endpoint": "/v1/images", "completion_window": "24h"}}),
        ("POST", "/v1/batches", {"json": {"input_file_id": 5, "endpoint": "/v1/embeddings", "completion_window": "24h"}}),
        ("POST", "/v1/batches", {"json": {"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h", "metadata": {"k": 1}}}),
        ("POST", "/v1/batches", {"json": {"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h", "metadata": {f"k{i}": "v" for i in range(17)}}}),
        ("GET", "/v1/batches?limit=0", {}), ("GET", "/v1/batches?limit=abc", {}), ("GET", "/v1/batches?limit=101", {}),
        ("GET", "/v1/batches?after=batch_nope", {}), ("GET", "/v1/batches/batch_nope", {}),
        ("POST", "/v1/batches/batch_nope/cancel", {}), ("GET", "/v1/files/file-nope", {}),
        ("GET", "/v1/files/file-nope/content", {}), ("DELETE", "/v1/files/file-nope", {}),
        ("POST", "/v1/files", {"content": b"x", "headers": {"content-type": "application/json"}}),
        ("POST", "/v1/files", {"content": b"garbage", "headers": {"content-type": "multipart/form-data; boundary=zz"}}),
        ("POST", "/v1/files", {"content": b"--zz--", "headers": {"content-type": "multipart/form-data"}}),
        ("POST", "/v1/files", {"data": {"purpose": "batch"}, "files": {"other": ("x", b"1")}}),
        ("POST", "/v1/files", {"data": {"purpose": "batch"}, "files": {"file": ("x.jsonl", b"")}}),
        ("POST", "/v1/files", {"data": {"purpose": "batch"}, "files": {"file": ("x.jsonl", b"\xff\xfe\x00\n")}}),
        ("PUT", "/v1/batches", {}), ("DELETE", "/v1/batches/x", {}),
    ]
    for method, path, kw in cases:
        r = httpx.request(method, base + path, headers={**h, **kw.pop("headers", {})}, timeout=10, **kw)
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"], (method, path, r.text)
    # an upload announcing more than batch.max_file_bytes is refused before its body is read
    import socket

    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
                  "content-type: multipart/form-data; boundary=zz\r\ncontent-length: 1000000000000\r\n\r\n".encode())
        got = b""
        while b"file_too_large" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 413") and b"file_too_large" in got


def test_residency_and_policy_refusals_land_in_the_error_file_per_line(stack):
    """Lines get the same residency filter and policy as realtime: a US-only tenant's lines never reach the DE
    fleet (403 residency_unsatisfiable per line), a denied model is 403 policy_denied per line."""
    base = stack["base"]
    for tenant, code in (("us-only", "residency_unsatisfiable"), ("denied", "policy_denied")):
        _, key = new_key(base, tenant)
        c = client(base, key)
        f = c.files.create(file=("in.jsonl", io.BytesIO(lines(3))), purpose="batch")
        done = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.failed == 3 and done.output_file_id is None
        errs = [json.loads(x) for x in c.files.content(done.error_file_id).text.splitlines()]
        assert [e["custom_id"] for e in errs] == ["req-0", "req-1", "req-2"]
        for e in errs:
            assert e["error"] is None and e["response"]["status_code"] == 403
            assert e["response"]["body"]["error"]["code"] == code
        rec = decision(base, errs[0]["response"]["request_id"])
        assert rec["backend"] is None and rec["batch"]["custom_id"] == "req-0" and rec["status"] == 403
