"""Budgets end to end: two `python -m gateway serve` processes sharing the real Redis (own key prefix per test)
in front of an upstream; 200 concurrent requests split across both never settle past the limit by more than
one request's worst case; refusals are 429 insufficient_quota with Retry-After. A streaming request without
max_tokens whose budget is small is cut mid-stream: the openai SDK sees an error, the ledger what was delivered."""
from __future__ import annotations

import asyncio
import sqlite3
import uuid

import httpx
import openai
import orjson
import pytest
import redis
import yaml

from tests.conftest import require_redis
from tests.support.procs import free_port, start_gateway, start_upstream
from tests.support.wait import async_wait_until, wait_until

pytestmark = pytest.mark.e2e
KEY = "budget-e2e-key-0123456789"
CUT_KEY = "budget-cut-key-0123456789"
KEY2 = "budget-e2e-key2-0123456789"
DUP_KEY = "budget-dup-key-0123456789"
DUP_LIMIT = 600
LIMIT, MAXT = 2000, 40
# the reservation bounds the prompt at chars + 16/message + 16 tokens ("go" -> 38), leaving 6 for the stream
CUT_BUDGET = 44


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require_redis()
    tmp = tmp_path_factory.mktemp("budget")
    prefix = f"gwb-e2e-{uuid.uuid4().hex[:10]}"
    up, up_port = start_upstream(tmp)
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "acme-tokens", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "tokens": LIMIT}]},
        {"id": "acme2-tokens", "match": {"tenant": "acme2"}, "budgets": [{"window": "day", "tokens": LIMIT}]},
        {"id": "cut-tokens", "match": {"tenant": "cut"}, "budgets": [{"window": "day", "tokens": CUT_BUDGET}]},
        {"id": "dup-tokens", "match": {"tenant": "dup"}, "budgets": [{"window": "day", "tokens": DUP_LIMIT}]}]}))
    gws = []
    for name in ("a", "b"):
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port},
               "backends": [{"name": "up", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                             "models": ["up-model"], "location": {"country": "DE"}, "retention": "zero"}],
               "keys": [{"key": KEY, "tenant": "acme", "name": "k"}, {"key": CUT_KEY, "tenant": "cut", "name": "c"},
                        {"key": KEY2, "tenant": "acme2", "name": "k2"}, {"key": DUP_KEY, "tenant": "dup", "name": "d"}],
               "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / f"audit-{name}.jsonl")},
               "identity": {"sqlite_path": str(tmp / f"id-{name}.db")},
               "budgets": {"store": "redis", "key_prefix": prefix, "sqlite_path": str(tmp / "ledger.db"),
                           "spool_path": str(tmp / f"spool-{name}.jsonl"), "ledger_flush_s": 0.05,
                           "prices": {"up-model": {"input": 1.0, "output": 2.0}}}}
        path = tmp / f"gw-{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gws.append(start_gateway(path))
    yield {"tmp": tmp, "bases": [f"http://127.0.0.1:{p}" for _, p in gws], "prefix": prefix}
    for g, _ in gws:
        g.stop()
    up.stop()
    r = redis.Redis(host="127.0.0.1", port=6379)
    for k in r.scan_iter(f"{prefix}:*"):
        r.delete(k)
    r.close()


def ledger(tmp) -> list[tuple]:
    db = sqlite3.connect(tmp / "ledger.db")
    try:
        return db.execute("select coalesce(client_request_id, request_id), total_tokens, completion_tokens, "
                          "cut_by_budget, tenant "
                          "from budget_ledger").fetchall()
    finally:
        db.close()


async def test_200_concurrent_across_two_gateways_never_pass_the_limit(stack):
    await _run_200(stack, "count " * 2, "acme")


async def test_short_prompts_underestimated_still_bounded(stack):
    """A prompt whose chars/4 estimate is far below what the engine counts (chat template) must still not let
    concurrent requests overshoot: the reservation uses an upper bound on prompt tokens (the body size)."""
    await _run_200(stack, "count", "acme2")


async def _run_200(stack, content: str, tenant: str) -> None:
    body = orjson.dumps({"model": "up-model", "messages": [{"role": "user", "content": content}], "max_tokens": MAXT})
    key = KEY if tenant == "acme" else KEY2

    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        return await c.post(stack["bases"][i % 2] + "/v1/chat/completions", content=body, timeout=30,
                            headers={"authorization": f"Bearer {key}", "content-type": "application/json",
                                     "x-request-id": f"bud-{tenant}-{i}"})

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=200)) as c:
        rs = await asyncio.gather(*(one(c, i) for i in range(200)))
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) + len(refused) == 200, {r.status_code for r in rs}
    for r in refused:
        assert r.json()["error"]["code"] in ("insufficient_quota", "rate_limit_exceeded")
        assert r.headers["retry-after"] and r.headers["retry-after-ms"]
    assert ok and refused
    await async_wait_until(lambda: len([x for x in ledger(stack["tmp"]) if x[4] == tenant]) >= len(ok),
                           what=f"{len(ok)} ledger rows of {tenant} (the outbox flushes in the background)")
    rows = [x for x in ledger(stack["tmp"]) if x[4] == tenant]
    assert len(rows) == len(ok) == len({x[0] for x in rows})  # one row per request, none twice
    settled = sum(x[1] for x in rows)
    worst = 11 + MAXT + 16  # actual prompt + max_tokens + the prompt estimate's slack
    assert settled <= LIMIT + worst, settled
    assert settled >= LIMIT // 2  # and the budget was actually used, not refused early
    r = redis.Redis(host="127.0.0.1", port=6379, decode_responses=True)
    totals = [int(r.hget(k, "T") or 0) for k in r.scan_iter(f"{stack['prefix']}:tenant:{tenant}:day:*")
              if r.type(k) == "hash"]
    r.close()
    assert totals == [settled]  # Redis settled exactly what the ledger recorded: nothing charged twice


async def test_a_reused_client_request_id_cannot_merge_or_skip_budget_holds(stack):
    """Every client request carries the same x-request-id. It is echoed, but budgets, the ledger and the audit
    record are keyed by the gateway's own id: each request holds and settles on its own, so the limit holds
    and every served request has its ledger row (with the client id reused, holds used to overwrite each
    other, later settles were skipped as replays and ledger rows were dropped as duplicates)."""
    body = orjson.dumps({"model": "up-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": MAXT})

    async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
        return await c.post(stack["bases"][i % 2] + "/v1/chat/completions", content=body, timeout=30,
                            headers={"authorization": f"Bearer {DUP_KEY}", "content-type": "application/json",
                                     "x-request-id": "same-id"})

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=60)) as c:
        rs = await asyncio.gather(*(one(c, i) for i in range(60)))
    ok = [r for r in rs if r.status_code == 200]
    assert ok and len(ok) < 60 and all(r.status_code in (200, 429) for r in rs)
    assert {r.headers["x-request-id"] for r in rs} == {"same-id"}  # echoed to the client
    gids = [r.headers["x-gateway-request-id"] for r in rs]
    assert len(set(gids)) == 60 and all(g.startswith("req_") for g in gids)
    await async_wait_until(lambda: len([x for x in ledger(stack["tmp"]) if x[4] == "dup"]) >= len(ok),
                           what=f"{len(ok)} ledger rows of dup (the outbox flushes in the background)")
    rows = [x for x in ledger(stack["tmp"]) if x[4] == "dup"]
    assert len(rows) == len(ok) and {x[0] for x in rows} == {"same-id"}
    settled = sum(x[1] for x in rows)
    assert settled <= DUP_LIMIT + 11 + MAXT + 16, settled
    r = redis.Redis(host="127.0.0.1", port=6379, decode_responses=True)
    totals = [int(r.hget(k, "T") or 0) for k in r.scan_iter(f"{stack['prefix']}:tenant:dup:day:*")
              if r.type(k) == "hash"]
    r.close()
    assert totals == [settled]
    for _ in range(50):  # the audit writers flush in the background
        audit = [orjson.loads(line) for name in ("a", "b") if (stack["tmp"] / f"audit-{name}.jsonl").exists()
                 for line in (stack["tmp"] / f"audit-{name}.jsonl").read_bytes().splitlines() if line.strip()]
        dup = [a for a in audit if a.get("client_request_id") == "same-id"]
        if len(dup) >= 60:
            break
        await asyncio.sleep(0.1)
    assert len(dup) == 60 and len({a["request_id"] for a in dup}) == 60  # one record each, none overwritten


def test_uncapped_stream_is_cut_at_the_remaining_budget(stack):
    c = openai.OpenAI(base_url=stack["bases"][1] + "/v1", api_key=CUT_KEY, max_retries=0)
    got = []
    with pytest.raises(openai.APIError) as ei:
        for ch in c.chat.completions.create(model="up-model", messages=[{"role": "user", "content": "go"}],
                                            stream=True, extra_headers={"x-request-id": "cut-1"}):
            if ch.choices:
                got.append(ch.choices[0].delta.content or "")
    assert "udget" in str(ei.value)
    assert "".join(got)  # part of the answer was delivered before the cut
    wait_until(lambda: [x for x in ledger(stack["tmp"]) if x[0] == "cut-1"], what="the ledger row of cut-1")
    rows = [x for x in ledger(stack["tmp"]) if x[0] == "cut-1"]
    assert len(rows) == 1 and rows[0][3] == 1 and rows[0][2] > 0  # cut, and charged for what was delivered
    assert rows[0][1] <= CUT_BUDGET + 8  # never more than the budget plus one chunk past the allowance
