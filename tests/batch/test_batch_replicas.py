"""End to end: two gateway replicas on one PostgreSQL (identity + batch state) share one batch job.

A file uploaded through replica A is used by a batch created through B; both replicas lease and run its lines
(each replica's audit log holds some of them), and the output file holds every custom_id exactly once.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import uuid

import pytest

from backends.sim.fleet import FleetProcess
from tests.batch.test_batch_e2e import client, lines, new_key, wait_done, write_config
from tests.conftest import require_service
from tests.support.procs import free_port, start_gateway
from tests.support.wait import wait_until

pytestmark = pytest.mark.e2e
PG_DSN = os.environ.get("GATEWAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
N = 300


def _pg(sql: str | None = None) -> bool:
    import asyncpg

    async def go() -> bool:
        c = await asyncpg.connect(PG_DSN, timeout=3)
        try:
            if sql:
                await c.execute(sql)
        finally:
            await c.close()
        return True

    try:
        return asyncio.run(go())
    except Exception:
        return False


def test_two_replicas_share_one_job_exactly_once(tmp_path):
    require_service(_pg(), f"PostgreSQL at {PG_DSN}")
    schema = f"e2e_batch_{uuid.uuid4().hex[:10]}"
    fleet = FleetProcess(["--engines", "2", "--profile", "h200-8b", "--base-port", "0"], tmp_path / "fleet.json")
    man = fleet.start()
    procs = []
    try:
        bases = []
        for name in ("a", "b"):
            d = tmp_path / name
            d.mkdir()
            port = free_port()
            cfg = write_config(d, man["engines"], port, {
                "identity": {"store": "postgres", "postgres_dsn": PG_DSN, "postgres_schema": schema,
                             "cache_ttl_s": 0.5, "auth_fail_limit_per_minute": 100000},
                "batch": {"lease_s": 2.0, "max_concurrency": 8}})
            gw, _ = start_gateway(cfg)
            procs.append(gw)
            bases.append(f"http://127.0.0.1:{port}")
        _, key = new_key(bases[0], "shared")
        ca, cb = client(bases[0], key), client(bases[1], key)
        f = ca.files.create(file=("in.jsonl", io.BytesIO(lines(N, "replica " * 10, max_tokens=20))), purpose="batch")
        b = cb.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_done(ca, b.id, 120)
        assert done.status == "completed" and done.request_counts.completed == N, done
        assert ca.batches.retrieve(b.id).output_file_id == cb.batches.retrieve(b.id).output_file_id
        out = [json.loads(x) for x in cb.files.content(done.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(N))

        def served() -> list[set[str]]:  # the custom ids each replica's audit log records as served
            per = []
            for name in ("a", "b"):
                recs = [json.loads(x) for x in (tmp_path / name / "audit.jsonl").read_text().splitlines()]
                per.append({r["batch"]["custom_id"] for r in recs
                            if r.get("batch") and r["batch"]["batch_id"] == b.id and r["status"] == 200})
            return per

        wait_until(lambda: len(set.union(*served())) >= N, what=f"the audit writers flushing all {N} lines")
        per = served()
        print(f"\nlines served per replica: a={len(per[0])} b={len(per[1])}")
        assert per[0] and per[1]  # both replicas worked on the one job
        assert not per[0] & per[1] and len(per[0] | per[1]) == N  # and no line ran on both
    finally:
        for p in procs:
            p.stop()
        fleet.stop()
        _pg(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
