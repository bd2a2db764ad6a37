"""SqliteBudgetStore: the reference model over rows of one SQLite file, one BEGIN IMMEDIATE transaction per call,
so the worker processes of one host share one exact budget.

Pins: identical replies to the reference model on random reserve/settle/crash/clock sequences, with the calls
spread over two store instances on the one file (the state is the file's, not a process's); two real processes
x 100 concurrent requests through the real BudgetService on `budgets.store: auto` with GATEWAY_WORKERS=2 (what a
worker of `gateway serve --workers 2` gets) never pass a token limit by more than one request's worst case and
count requests exactly; a database another process keeps locked, or a path that cannot be a database, is
`StoreUnavailable` and the service's 503 (fail-closed), never a hang or a 500; expired rows are cleaned up."""
from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from gateway.budget.model import BudgetState, ScopePlan
from gateway.budget.service import BudgetService
from gateway.budget.store import SqliteBudgetStore
from gateway.budget.windows import resolve
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.types import BudgetSpec, Principal
from tests.budget.conftest import reserve_args, settle_args, window_plan
from tests.budget.test_store import _ref_scopes

UTC = ZoneInfo("UTC")
ROOT = Path(__file__).resolve().parents[2]
T0 = 1_750_000_000.0


def plan(now: float, limits: dict, conc: dict | None = None) -> tuple[ScopePlan, ...]:
    """Like BudgetService._scopes: key expiry twice a rolling window, a day past a calendar period, none for
    lifetime (so a key never expires while the model still counts it)."""
    out = []
    for scope, wins in limits.items():
        base = f"p:{scope}:id"
        wps = []
        for window, (t, m, r, g) in wins.items():
            ref = resolve(window, now, UTC)
            ttl = ref.bucket_s * ref.buckets * 2 if ref.rolling else int(ref.end - now) + 86400 \
                if math.isfinite(ref.end) else 0
            wps.append(window_plan(window, f"{base}:{ref.key_suffix()}", ref.rolling, ref.bucket, ref.buckets,
                                   ref.bucket_s, ref.end, ttl, t, m, r, g))
        out.append(ScopePlan(scope, "id", f"{base}:hold", (conc or {}).get(scope), tuple(wps)))
    return tuple(out)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 40), st.integers(1, 60), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("settle"), st.integers(0, 30), st.integers(0, 80), st.booleans(), st.integers(0, 3)),
        st.tuples(st.just("tick"), st.sampled_from([0.4, 1, 7, 30, 59, 61, 130, 3600, 86400, 40 * 86400]),
                  st.just(0), st.just(False), st.just(0)),
    ),
    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=ops, tok=st.integers(50, 400), rpm=st.integers(1, 8), conc=st.integers(1, 4),
       money=st.integers(10_000, 400_000), which=st.lists(st.booleans(), min_size=40, max_size=40))
def test_the_sqlite_store_matches_the_reference_model(tmp_path_factory, ops, tok, rpm, conc, money, which):
    """Identical replies (and final state) to BudgetState; each call on one of two store instances sharing
    the file, as two workers would."""
    path = tmp_path_factory.mktemp("sq") / "c.db"
    lim = {"key": {"minute": (tok, None, rpm, money // 2)},
           "team": {"hour": (tok * 3, money, None, None), "day": (None, None, 50, money)},
           "project": {"month": (tok * 20, None, None, None)},
           "tenant": {"lifetime": (tok * 10, None, None, None)}}
    conc_l = {"key": conc}

    async def run() -> None:
        stores = [SqliteBudgetStore(path), SqliteBudgetStore(path)]
        for s in stores:
            await s.start()
        ref = BudgetState()
        now = T0
        live: list[str] = []
        try:
            for i, (kind, a, b, flag, extra) in enumerate(ops):
                sq = stores[which[i]]
                if kind == "tick":
                    now += a
                    continue
                if kind == "reserve":
                    rid = uuid.uuid4().hex
                    args = reserve_args(rid, now, now + 45.0, 105, a, a * extra * 100, b, 1 if flag else b,
                                       extra * 300, plan(now, lim, conc_l), fixed_gpu=a * extra * 70,
                                       gpu_per_token=(3 - extra) * 250)
                    got = await sq.reserve(args)
                    want = ref.reserve(args)
                    assert [got.ok, got.completion, got.fail_kind] == [want[0] == 1, want[1], want[4]]
                    assert [[s.held_in("tokens"), s.held_in("money"), s.holds, s.held_in("gpu_seconds"),
                             [(w.used_in("requests"), w.used_in("tokens"), w.used_in("money"), w.oldest_bucket, w.used_in("gpu_seconds")) for w in s.windows]]
                            for s in got.scopes] == _ref_scopes(want, args)
                    if got.ok:
                        live.append(rid)
                elif live:
                    rid = live.pop(a % len(live))
                    if flag:  # crash: this reservation is never settled
                        continue
                    sa = settle_args(rid, now, b, b * extra * 100, plan(now, lim), f"p:settled:{rid}", 300,
                                    gpu=b * (3 - extra) * 200)
                    assert await sq.settle(sa) is True and ref.settle(sa) == 1
                    if extra == 3:  # a replay of a settle (on the other worker): a no-op on both
                        assert await stores[not which[i]].settle(sa) is False and ref.settle(sa) == 0
            final = reserve_args("final", now + 0.5, now + 45.5, 105, 0, 0, 1, 1, 0, plan(now + 0.5, lim, conc_l))
            got = await stores[0].reserve(final)
            want = ref.reserve(final)
            assert got.ok == (want[0] == 1)
            assert [[s.held_in("tokens"), s.holds, s.held_in("gpu_seconds"), [(w.used_in("requests"), w.used_in("tokens"), w.used_in("money"), w.used_in("gpu_seconds")) for w in s.windows]]
                    for s in got.scopes] == [[x[0], x[2], x[3], [(w[0], w[1], w[2], w[4]) for w in x[4]]]
                                             for x in _ref_scopes(want, final)]
        finally:
            for s in stores:
                await s.close()

    asyncio.run(run())


def spawn(tmp: Path, name: str, seed: int, limits: list[dict], n: int = 100, prompt: int = 100,
          max_tokens: int = 400) -> subprocess.Popen:
    """A separate process running `n` concurrent requests through the real BudgetStage (tests/budget/_worker.py)
    as a worker of `gateway serve --workers 2` would: GATEWAY_WORKERS=2, budgets.store left to `auto`."""
    spec = {"name": name, "dir": str(tmp), "seed": seed, "n": n, "prompt": prompt, "max_tokens": max_tokens,
            "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / f"spool-{name}.jsonl"),
                        "ledger_flush_s": 0.05, "prices": {"m1": {"input": 2.0, "output": 8.0}}},
            "limits": limits}
    return subprocess.Popen([sys.executable, "-m", "tests.budget._worker", json.dumps(spec)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "GATEWAY_WORKERS": "2"})


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    outs = []
    for p in procs:
        so, se = p.communicate(timeout=180)
        assert p.returncode == 0, se[-3000:]
        outs.append(json.loads(so.strip().splitlines()[-1]))
    return outs


def test_two_worker_processes_never_overspend_one_token_budget(tmp_path):
    limit, prompt, maxt = 20_000, 100, 400  # worst case 500 per request: ~40 fit at once, 200 try
    outs = collect([spawn(tmp_path, n, i, [{"window": "day", "scope": "team", "tokens": limit}])
                    for i, n in enumerate(["a", "b"])])
    ok = sum(o["ok"] for o in outs)
    settled = sum(o["settled_tokens"] for o in outs)
    assert sum(o["unavailable"] for o in outs) == 0 and ok + sum(o["quota"] for o in outs) == 200
    assert settled <= limit + prompt + maxt  # the bound: one request's worst case past the limit
    assert ok >= limit // (prompt + maxt) and all(o["ok"] for o in outs)  # both processes were served
    # the counters are the SQLite store's, beside the ledger's file (no memory snapshot anywhere), and the
    # ledger has every settled request
    counters, ledger = sqlite3.connect(tmp_path / "budgets-counters.db"), sqlite3.connect(tmp_path / "budgets.db")
    try:
        assert counters.execute("select count(*) from budget_counters").fetchone()[0] > 0
        assert ledger.execute("select count(*) from sqlite_master where name='budget_state'").fetchone()[0] == 0
        assert ledger.execute("select count(*), sum(total_tokens) from budget_ledger").fetchone() == (ok, settled)
    finally:
        counters.close()
        ledger.close()


def test_two_worker_processes_count_requests_exactly(tmp_path):
    rpm = 37
    outs = collect([spawn(tmp_path, n, i, [{"window": "minute", "scope": "tenant", "requests": rpm}],
                          prompt=10, max_tokens=10) for i, n in enumerate(["a", "b"])])
    assert sum(o["ok"] for o in outs) == rpm
    assert sum(o["rate"] for o in outs) == 200 - rpm and sum(o["unavailable"] for o in outs) == 0


def _service(tmp: Path, sqlite_path: Path, clock) -> BudgetService:
    cfg = parse_config(yaml.safe_dump({"budgets": {
        "store": "sqlite", "sqlite_path": str(sqlite_path), "spool_path": str(tmp / "spool.jsonl"),
        "ledger": "sqlite", "redis_retry_s": 1.0}}), "t.yaml", base_dir=tmp)
    return BudgetService(cfg, clock=clock)


async def test_a_database_another_process_keeps_locked_is_a_503_then_recovers(tmp_path):
    now = [T0]
    svc = _service(tmp_path, tmp_path / "budgets.db", lambda: now[0])
    assert isinstance(svc.primary, SqliteBudgetStore)
    svc.primary.BUSY_TIMEOUT_S = 0.2  # type: ignore[misc]
    await svc.start()
    p = Principal(id="key:k", kind="api_key", tenant="acme", key_id="k")
    specs = (BudgetSpec(window="day", scope="tenant", tokens=1000),)
    try:
        out = await svc.reserve("r0", p, specs, ("m1",), 10, 10)
        await svc.settle(out.reservation, _usage(10, 5), "m1")
        # another process holds the write lock past the busy timeout (a stuck worker, a backup tool)
        other = subprocess.Popen([sys.executable, "-c", (
            "import sqlite3, sys, time\n"
            f"db = sqlite3.connect({str(tmp_path / 'budgets-counters.db')!r}, isolation_level=None)\n"
            "db.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.readline()\n")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert other.stdout is not None and other.stdout.readline().strip() == "locked"
        with pytest.raises(GatewayError) as ei:
            await svc.reserve("r1", p, specs, ("m1",), 10, 10)
        assert ei.value.status == 503 and ei.value.code == "budget_store_unavailable"
        assert ei.value.headers["retry-after"] == "1"
        other.communicate("\n", timeout=30)  # it lets go
        now[0] += 2  # past redis_retry_s: the store is tried again
        out = await svc.reserve("r2", p, specs, ("m1",), 10, 10)
        assert out.evidence["limits"][0]["before"]["tokens"] == 15  # r0's settled spend, r1 never counted
    finally:
        await svc.close()


async def test_a_write_lock_held_elsewhere_hands_the_operation_to_the_stores_thread(tmp_path):
    """The event loop never waits on another process's transaction past FAST_WAIT_S: the operation goes to the
    store's thread, which waits for the lock and applies it once it is free."""
    s = SqliteBudgetStore(tmp_path / "c.db")
    await s.start()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys\n"
        f"db = sqlite3.connect({str(tmp_path / 'c.db')!r}, isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE'); print('locked', flush=True); sys.stdin.readline()\n"
        "db.execute('COMMIT')\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        lim = {"key": {"day": (1000, None, None, None)}}
        task = asyncio.create_task(s.reserve(reserve_args("r", T0, T0 + 30, 90, 10, 0, 5, 5, 0, plan(T0, lim))))
        while s.stats["handed_over"] == 0:  # the loop is free meanwhile: this very coroutine runs
            await asyncio.sleep(0.001)
        assert not task.done()
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        r = await task
        assert r.ok and r.scopes[0].held_in("tokens") == 0 and r.completion == 5
        assert s.stats["handed_over"] == 1
        # the next one, the lock free, runs on the event loop again, and sees the first one's hold
        r = await s.reserve(reserve_args("r2", T0, T0 + 30, 90, 10, 0, 5, 5, 0, plan(T0, lim)))
        assert r.ok and r.scopes[0].held_in("tokens") == 15 and s.stats["fast"] >= 1
    finally:
        holder.communicate(timeout=30)
        await s.close()


async def test_a_path_that_cannot_be_a_database_is_a_503_not_a_500(tmp_path):
    (tmp_path / "budgets-counters.db").mkdir()  # where the counters would go
    svc = _service(tmp_path, tmp_path / "budgets.db", lambda: T0)
    await svc.start()  # logs the failure, serves on
    try:
        with pytest.raises(GatewayError) as ei:
            await svc.reserve("r1", Principal(id="key:k", kind="api_key", tenant="acme", key_id="k"),
                              (BudgetSpec(window="day", scope="tenant", tokens=1000),), ("m1",), 10, 10)
        assert ei.value.status == 503 and ei.value.code == "budget_store_unavailable"
    finally:
        await svc.close()


async def test_expired_rows_are_deleted_by_the_cleanup(tmp_path):
    """Expired rows read as absent at once; the cleanup on the store's thread deletes them (by the wall clock,
    which is the service's)."""
    s = SqliteBudgetStore(tmp_path / "c.db")
    await s.start()
    try:
        then, now = time.time() - 3600, time.time()  # an hour ago: past the minute counter's and the hold's expiry
        assert (await s.reserve(reserve_args("r", then, then + 30, 90, 1, 0, 1, 1, 0,
                                            plan(then, {"key": {"minute": (1000, None, None, None)}})))).ok
        assert (await s.reserve(reserve_args("r2", now, now + 30, 90, 1, 0, 1, 1, 0,
                                            plan(now, {"other": {"day": (10, None, None, None)}})))).ok
        db = sqlite3.connect(tmp_path / "c.db")
        assert db.execute("select count(*) from budget_counters").fetchone()[0] == 2
        assert db.execute("select count(*) from budget_holds").fetchone()[0] == 2
        s._next_cleanup = 0.0
        await s._run(s._checkpoint)
        assert [k for (k,) in db.execute("select k from budget_counters")] == [
            "p:other:id:day:" + resolve("day", now, UTC).period]
        assert db.execute("select hk, rid from budget_holds").fetchall() == [("p:other:id:hold", "r2")]
        db.close()
    finally:
        await s.close()


def _usage(prompt: int, completion: int):
    from gateway.types import Usage

    return Usage(prompt, completion)
