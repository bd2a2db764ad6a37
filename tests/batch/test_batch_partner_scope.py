"""Issue 35.2 end to end (the official SDK against a gateway process in front of a simulated fleet with one EEA
engine that keeps nothing and one US engine that keeps data): a partner and its tenant, two partners of one
tenant and two keys of one project with different restriction labels each see only their own files, batches and
output files (list, get, content, delete, a batch over them, cancel: a foreign id is the 404 of an unknown one),
and a batch never runs looser than the decision its input file was uploaded under, whoever creates it: its
lines reach only the EEA engine, its input is deleted when it ends, and no prompt of it is in the audit log."""
from __future__ import annotations

import io
import json
import time
import uuid

import httpx
import pytest
from openai import NotFoundError, OpenAI

from backends.sim.fleet import FleetProcess
from tests.support.procs import free_port, start_gateway

pytestmark = pytest.mark.e2e
ADMIN = "batch-scope-admin-0123456789"
EEA_ENGINE, US_ENGINE = "eu-engine", "us-engine"


def _admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch-scope")
    fleet = FleetProcess(["--engines", "2", "--profile", "tiny", "--base-port", "0"], tmp / "fleet.json")
    man = fleet.start()
    try:
        backends = [{"name": name, "kind": "sim", "url": e["url"], "models": ["sim-model"],
                     "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                     "location": {"country": country}, "retention": retention}
                    # the US engine first: an unrestricted line is as likely to go there as to the EEA one
                    for e, (name, country, retention) in zip(man["engines"], ((US_ENGINE, "US", "none"),
                                                                              (EEA_ENGINE, "DE", "zero")))]
        (tmp / "policy.yaml").write_text(json.dumps({"version": 1, "rules": [
            {"id": "opper-contract", "match": {"partner": "opper"},
             "require": {"jurisdiction": "EEA", "retention": "zero"}},
            {"id": "eea-label", "match": {"labels.residency": "eea"},
             "require": {"jurisdiction": "EEA", "retention": "zero"}},
            {"id": "eu-only-keys", "match": {"key.scopes": "eu-only"},
             "require": {"jurisdiction": "EEA", "retention": "zero"}},
            {"id": "confidential", "match": {"headers": {"x-data-classification": "confidential"}},
             "require": {"jurisdiction": "EEA", "retention": "zero"}}]}))
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends, "admin": {"key": ADMIN},
               "identity": {"sqlite_path": str(tmp / "gateway.db"), "cache_ttl_s": 0.5,
                            "auth_fail_limit_per_minute": 100000},
               "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
               "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl")},
               "telemetry": {"scrape_interval_s": 0.2},
               # content capture on: a line decided looser than its file would put its prompt in the audit log
               "observability": {"log_level": "warning", "capture_content": True},
               "batch": {"lease_s": 2.0, "zero_retention_delete_after_s": 3.0}}
        (tmp / "gateway.yaml").write_text(json.dumps(cfg))
        gw, _ = start_gateway(tmp / "gateway.yaml")
        try:
            base = f"http://127.0.0.1:{port}"
            assert _admin(base, "POST", "/admin/tenants", {"id": "acme"}).status_code == 201
            assert _admin(base, "POST", "/admin/tenants/acme/teams", {"id": "data"}).status_code == 201
            assert _admin(base, "POST", "/admin/projects", {"tenant": "acme", "team": "data",
                                                            "id": "etl"}).status_code == 201
            for partner in ("opper", "other"):
                assert _admin(base, "POST", "/admin/partners", {"id": partner, "tenant": "acme"}).status_code == 201
            yield {"base": base, "tmp": tmp}
        finally:
            gw.stop()
    finally:
        fleet.stop()


def key(base: str, **body) -> OpenAI:
    r = _admin(base, "POST", "/admin/keys", {"tenant": "acme", **body})
    assert r.status_code == 201, r.text
    return OpenAI(base_url=base + "/v1", api_key=r.json()["key"], max_retries=0, timeout=30)


def lines(n: int, marker: str) -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "sim-model", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": f"{marker} line {i}"}]}}) + "\n"
                   for i in range(n)).encode()


def wait_done(c: OpenAI, bid: str, limit_s: float = 60.0):
    deadline = time.monotonic() + limit_s
    while True:
        b = c.batches.retrieve(bid)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch {bid} still {b.status}: {b.request_counts}"
        time.sleep(0.2)


def upload_and_run(c: OpenAI, n: int = 2):
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(n, "hello"))), purpose="batch")
    b = wait_done(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h").id)
    assert b.status == "completed" and b.output_file_id, b
    f2 = c.files.create(file=("in2.jsonl", io.BytesIO(lines(n, "hello again"))), purpose="batch")
    return f2, b


def assert_sealed(base: str, stranger: OpenAI, owner: OpenAI, f, b) -> None:
    """`stranger` cannot see or touch `owner`'s file f, batch b or b's output file: every call is the 404 of an
    id that does not exist, and none of them is listed; `owner` still can."""
    for fid in (f.id, b.output_file_id):
        for call in (lambda: stranger.files.retrieve(fid), lambda: stranger.files.content(fid),
                     lambda: stranger.files.delete(fid),
                     lambda: stranger.batches.create(input_file_id=fid, endpoint="/v1/chat/completions",
                                                     completion_window="24h")):
            with pytest.raises(NotFoundError):
                call()
    for call in (lambda: stranger.batches.retrieve(b.id), lambda: stranger.batches.cancel(b.id)):
        with pytest.raises(NotFoundError):
            call()
    listed_files = {x.id for x in stranger.files.list()}
    assert f.id not in listed_files and b.output_file_id not in listed_files
    assert b.id not in {x.id for x in stranger.batches.list()}
    # no existence oracle: a foreign id answers exactly what an unknown one does (but for the id it names)
    h = {"authorization": f"Bearer {stranger.api_key}"}
    for path, unknown in ((f"/v1/files/{f.id}", "/v1/files/file-000000000000000000000000"),
                          (f"/v1/files/{f.id}/content", "/v1/files/file-000000000000000000000000/content"),
                          (f"/v1/batches/{b.id}", "/v1/batches/batch_000000000000000000000000")):
        got, none = httpx.get(base + path, headers=h), httpx.get(base + unknown, headers=h)
        assert got.status_code == none.status_code == 404
        ge, ne = got.json()["error"], none.json()["error"]
        assert {k: v for k, v in ge.items() if k != "message"} == {k: v for k, v in ne.items() if k != "message"}
    # the owner's own view is untouched
    assert owner.files.retrieve(f.id).id == f.id and owner.files.content(b.output_file_id).text
    assert owner.batches.retrieve(b.id).status == "completed"


def test_a_partner_and_its_tenant_do_not_share_files_or_batches_either_way(stack):
    base = stack["base"]
    tenant, opper = key(base), key(base, partner="opper")
    fo, bo = upload_and_run(opper)
    fa, ba = upload_and_run(tenant)
    assert_sealed(base, tenant, opper, fo, bo)  # the tenant's own key cannot read or run the partner's prompts
    assert_sealed(base, opper, tenant, fa, ba)  # nor the partner the tenant's
    assert opper.files.delete(fo.id).deleted and tenant.files.delete(fa.id).deleted


def test_two_partners_of_one_tenant_do_not_share(stack):
    base = stack["base"]
    opper, other = key(base, partner="opper"), key(base, partner="other")
    fo, bo = upload_and_run(opper)
    fx, bx = upload_and_run(other)
    assert_sealed(base, other, opper, fo, bo)
    assert_sealed(base, opper, other, fx, bx)
    # a second key of the same partner is the same scope: it sees and may use the partner's file
    opper2 = key(base, partner="opper")
    assert opper2.files.retrieve(fo.id).id == fo.id and bo.id in {x.id for x in opper2.batches.list()}


def test_two_keys_of_one_project_with_different_restriction_labels_do_not_share(stack):
    base = stack["base"]
    where = {"team": "data", "project": "etl"}
    eea, plain = key(base, **where, labels={"residency": "eea"}), key(base, **where)
    fe, be = upload_and_run(eea)
    fp, bp = upload_and_run(plain)
    assert_sealed(base, plain, eea, fe, be)
    assert_sealed(base, eea, plain, fp, bp)
    # another key of the project with the same restriction labels (and other labels) shares the scope
    eea2 = key(base, **where, labels={"residency": "eea", "colour": "blue"})
    assert eea2.files.retrieve(fe.id).id == fe.id and eea2.batches.retrieve(be.id).id == be.id


def _audit(tmp, bid: str, n: int) -> tuple[list[dict], str]:
    deadline = time.monotonic() + 10
    while True:
        text = (tmp / "audit.jsonl").read_text() if (tmp / "audit.jsonl").exists() else ""
        recs = [json.loads(x) for x in text.splitlines() if x.strip()]
        mine = [r for r in recs if (r.get("batch") or {}).get("batch_id") == bid]
        if len(mine) >= n:
            return mine, text
        assert time.monotonic() < deadline, f"{len(mine)} of {n} audit records of {bid}"
        time.sleep(0.1)


def _check_never_looser(stack, creator: OpenAI, f, marker: str, n: int) -> None:
    b = creator.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.model_extra["retention"]["zero_data_retention"] is True
    done = wait_done(creator, b.id)
    assert done.status == "completed" and done.request_counts.completed == n, done
    recs, text = _audit(stack["tmp"], b.id, n)
    for r in recs:  # every line decided within the file's decision and served in the EEA only
        assert r["backend"] == EEA_ENGINE, r["backend"]
        assert r["decision"]["jurisdiction"] == "EEA" and r["decision"]["retention"] == "zero", r["decision"]
        assert r["zero_retention"] is True and "content" not in r
    assert marker not in text  # no prompt of the file in the audit log
    with pytest.raises(NotFoundError):  # the input is gone as soon as the batch ended
        creator.files.retrieve(f.id)
    assert len(creator.files.content(done.output_file_id).text.splitlines()) == n  # delivered, then deleted


def test_a_batch_never_runs_looser_than_the_decision_its_file_was_uploaded_under(stack):
    """Two keys of one project share its scope (same restriction labels), but policy restricts one of them by its
    key scope: the file the EEA key uploaded keeps EEA + zero retention when the other key runs it."""
    base = stack["base"]
    where = {"team": "data", "project": "etl"}
    eu_key, loose_key = key(base, **where, scopes=["eu-only"]), key(base, **where)
    n, marker = 8, f"eu-secret-{uuid.uuid4().hex}"
    f = eu_key.files.create(file=("in.jsonl", io.BytesIO(lines(n, marker))), purpose="batch")
    assert loose_key.files.retrieve(f.id).id == f.id  # the same scope: it may run the file ...
    _check_never_looser(stack, loose_key, f, marker, n)  # ... but only as the file's decision allows


def test_a_file_uploaded_as_confidential_stays_confidential_in_its_batch(stack):
    """The upload request's own headers are part of the decision the file keeps: a file uploaded with
    `x-data-classification: confidential` runs EEA + zero retention though its lines carry no such header."""
    base = stack["base"]
    c = key(base)
    n, marker = 6, f"confidential-{uuid.uuid4().hex}"
    f = c.files.create(file=("in.jsonl", io.BytesIO(lines(n, marker))), purpose="batch",
                       extra_headers={"x-data-classification": "confidential"})
    _check_never_looser(stack, c, f, marker, n)
