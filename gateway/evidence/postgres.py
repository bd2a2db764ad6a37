"""Optional Postgres sink for audit records (table `audit_decisions`, one row per request, JSONB record)."""
from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
import orjson

_DDL = """
CREATE TABLE IF NOT EXISTS {t} (
    request_id   text PRIMARY KEY,
    ts           timestamptz NOT NULL,
    tenant       text,
    principal_id text,
    allow        boolean,
    backend      text,
    status       integer,
    record       jsonb NOT NULL
);
CREATE INDEX IF NOT EXISTS {t}_ts_idx ON {t} (ts);
CREATE INDEX IF NOT EXISTS {t}_tenant_ts_idx ON {t} (tenant, ts);
ALTER TABLE {t} ADD COLUMN IF NOT EXISTS client_request_id text;
CREATE INDEX IF NOT EXISTS {t}_client_rid_idx ON {t} (client_request_id, ts);
"""


class PostgresSink:
    """Writes batches with one executemany; a re-recorded request id replaces its row (request ids are the
    gateway's own, unique per request; the client's x-request-id is a separate, non-unique column)."""

    def __init__(self, dsn: str, table: str = "audit_decisions") -> None:
        if not table.replace("_", "").isalnum():
            raise ValueError(f"bad table name {table!r}")
        self.dsn, self.table = dsn, table
        self._pool: asyncpg.Pool | None = None

    async def start(self) -> None:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=2)
        async with self._pool.acquire() as c:
            await c.execute(_DDL.format(t=self.table))

    async def write_many(self, recs: list[dict[str, Any]]) -> None:
        assert self._pool is not None, "PostgresSink.start() not called"
        rows = []
        for r in recs:
            p = r.get("principal") or {}
            dec = r.get("decision") or {}
            rows.append((r["request_id"], r.get("client_request_id"), datetime.fromisoformat(r["ts"]), p.get("tenant"),
                         p.get("id"), dec.get("allow"), r.get("backend"), r.get("status"),
                         orjson.dumps(r, default=str, option=orjson.OPT_NON_STR_KEYS).decode()))
        async with self._pool.acquire() as c:
            await c.executemany(
                f"INSERT INTO {self.table} (request_id, client_request_id, ts, tenant, principal_id, allow, backend, "
                "status, record) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb) ON CONFLICT (request_id) DO UPDATE "
                "SET client_request_id = EXCLUDED.client_request_id, ts = EXCLUDED.ts, tenant = EXCLUDED.tenant, principal_id = EXCLUDED.principal_id, "
                "allow = EXCLUDED.allow, backend = EXCLUDED.backend, status = EXCLUDED.status, record = EXCLUDED.record",
                rows)

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """By the gateway's request id, else the newest record carrying it as the client's x-request-id."""
        assert self._pool is not None
        async with self._pool.acquire() as c:
            v = await c.fetchval(f"SELECT record::text FROM {self.table} WHERE request_id = $1", request_id)
            if v is None:
                v = await c.fetchval(f"SELECT record::text FROM {self.table} WHERE client_request_id = $1 "
                                     "ORDER BY ts DESC LIMIT 1", request_id)
        return orjson.loads(v) if v is not None else None

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
