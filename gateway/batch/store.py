"""Durable state of the batch lane: files, jobs and one row per request line (SQLite or PostgreSQL).

The SQL is written once with `?` placeholders; the two backends only supply a transaction (`fetch`,
`execute`, `executemany`) and the blob column type. Exactly-once rests on two rules kept here:
* a line is dispatched only under a lease (`lease_owner`, `lease_until`), taken in one conditional UPDATE, and
  the lease holder renews it while it runs; a crashed replica's leases lapse and another replica takes over;
* a result is recorded only by the holder of a live lease and only while the line is still `leased`, in the
  same transaction that bumps the job's counters. A line whose result was recorded is never dispatched again;
  a line whose result was not recorded (the replica died first) is dispatched again, and only one answer
  ever reaches the output file.
"""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

import orjson

from gateway.stores.sql import to_dollar

OPEN_STATES = ("validating", "in_progress", "finalizing", "cancelling")
TERMINAL_STATES = ("completed", "failed", "expired", "cancelled")
# batch_files.deleted: 0 visible, 1 deleted, 2 an upload still being stored (invisible, but counted against the
# tenant's quota, so concurrent uploads on any worker or replica cannot pass it together)
UPLOADING = 2
STALE_UPLOAD_S = 3600.0  # an upload row left this long unfinished (its process died) is removed


def new_id(prefix: str) -> str:
    """The id of a stored file, job or error line: `prefix` then 24 random hex digits."""
    return prefix + os.urandom(12).hex()


class QuotaExceeded(Exception):
    """A tenant's stored files would pass `batch.max_files_per_tenant` ("files") or
    `batch.max_stored_bytes_per_tenant` ("bytes")."""

    def __init__(self, kind: str, used: int, limit: int) -> None:
        super().__init__(kind)
        self.kind, self.used, self.limit = kind, used, limit


def _schema(blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS batch_files (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, tenant TEXT NOT NULL, purpose TEXT NOT NULL,
            filename TEXT NOT NULL, bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION, deleted INTEGER NOT NULL DEFAULT 0, content {blob})""",
        "CREATE INDEX IF NOT EXISTS batch_files_owner ON batch_files (owner, created_at)",
        "CREATE INDEX IF NOT EXISTS batch_files_tenant ON batch_files (tenant, deleted)",
        # an uploaded input file, one row per line as the upload's scan validated it (blank lines too, so the
        # content is these lines joined by newlines, byte for byte): a batch's lines are copied from here without
        # parsing the file again, and the models it names are read from here
        """CREATE TABLE IF NOT EXISTS batch_file_lines (
            file_id TEXT NOT NULL, line_no INTEGER NOT NULL, raw TEXT NOT NULL, custom_id TEXT, url TEXT,
            model TEXT, prefix_key TEXT, PRIMARY KEY (file_id, line_no))""",
        """CREATE TABLE IF NOT EXISTS batch_jobs (
            id TEXT PRIMARY KEY, owner TEXT NOT NULL, tenant TEXT NOT NULL, principal TEXT NOT NULL,
            principal_valid_until DOUBLE PRECISION, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL, metadata TEXT, status TEXT NOT NULL, errors TEXT,
            created_at DOUBLE PRECISION NOT NULL, in_progress_at DOUBLE PRECISION, expires_at DOUBLE PRECISION NOT NULL,
            finalizing_at DOUBLE PRECISION, completed_at DOUBLE PRECISION, failed_at DOUBLE PRECISION,
            expired_at DOUBLE PRECISION, cancelling_at DOUBLE PRECISION, cancelled_at DOUBLE PRECISION,
            output_file_id TEXT, error_file_id TEXT, total INTEGER NOT NULL DEFAULT 0,
            completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
            zero_retention INTEGER NOT NULL DEFAULT 0, delete_files_at DOUBLE PRECISION, stop_reason TEXT)""",
        "CREATE INDEX IF NOT EXISTS batch_jobs_owner ON batch_jobs (owner, created_at)",
        "CREATE INDEX IF NOT EXISTS batch_jobs_status ON batch_jobs (status)",
        """CREATE TABLE IF NOT EXISTS batch_lines (
            batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT,
            prefix_key TEXT NOT NULL, state TEXT NOT NULL, lease_owner TEXT, lease_until DOUBLE PRECISION,
            tries INTEGER NOT NULL DEFAULT 0, dispatches INTEGER NOT NULL DEFAULT 0, result TEXT,
            finished_at DOUBLE PRECISION, PRIMARY KEY (batch_id, line_no))""",
        "CREATE INDEX IF NOT EXISTS batch_lines_state ON batch_lines (batch_id, state, prefix_key, line_no)",
    ]


# Columns added after the tables above first shipped: added by `migrate` where missing (a NULL in an old row is
# its default). `restriction`: the decision an input file was uploaded under, and the copy its batches run under
# (gateway/batch/scope.py); NULL for rows written before it (they were decided by their creator alone).
ADDED_COLUMNS = (("batch_files", "restriction", "TEXT"), ("batch_jobs", "restriction", "TEXT"))


def _j(v: Any) -> str | None:
    return None if v is None else orjson.dumps(v).decode()


def _l(v: Any) -> Any:
    return None if v is None else orjson.loads(v)


@dataclass(slots=True)
class Line:
    batch_id: str
    line_no: int
    custom_id: str
    body: dict[str, Any]
    tries: int
    dispatches: int


class _SqliteTx:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Mapping[str, Any]]:
        async with self.conn.execute(sql, args) as cur:
            return [dict(r) for r in await cur.fetchall()]

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(sql, args)

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(sql, rows)


class _PgTx:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def fetch(self, sql: str, *args: Any) -> list[Mapping[str, Any]]:
        return [dict(r) for r in await self.conn.fetch(to_dollar(sql), *args)]

    async def execute(self, sql: str, *args: Any) -> None:
        await self.conn.execute(to_dollar(sql), *args)

    async def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        await self.conn.executemany(to_dollar(sql), rows)


class BatchStore:
    """All queries of the batch lane; `SqliteBatchStore` and `PostgresBatchStore` supply the connection."""

    blob = "BLOB"
    skip_locked = ""  # Postgres: FOR UPDATE SKIP LOCKED (replicas claiming lines at once never block each other)
    for_update = ""  # Postgres: FOR UPDATE (SQLite transactions are serialised already)

    def _tx(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def migrate(self) -> None:
        async with self._tx() as tx:
            await self._migrate_lock(tx)
            for s in _schema(self.blob):
                await tx.execute(s)
            for table, col, typ in ADDED_COLUMNS:
                if col not in await self._columns(tx, table):
                    await tx.execute(f"ALTER TABLE {table} ADD COLUMN {col} {typ}")

    async def _migrate_lock(self, tx: Any) -> None:
        return None

    async def _columns(self, tx: Any, table: str) -> set[str]:
        rows = await tx.fetch(f"PRAGMA table_info({table})")
        return {r["name"] for r in rows}

    # ------------------------------------------------------------------ files
    async def insert_file(self, row: dict[str, Any]) -> None:
        async with self._tx() as tx:
            await tx.execute("INSERT INTO batch_files (id, owner, tenant, purpose, filename, bytes, created_at, "
                             "expires_at, deleted, content, restriction) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
                             row["id"], row["owner"], row["tenant"], row["purpose"], row["filename"], row["bytes"],
                             row["created_at"], row.get("expires_at"), row["content"], _j(row.get("restriction")))

    async def get_file(self, file_id: str, owner: str) -> dict[str, Any] | None:
        async with self._tx() as tx:
            rows = await tx.fetch("SELECT id, owner, tenant, purpose, filename, bytes, created_at, expires_at FROM "
                                  "batch_files WHERE id = ? AND owner = ? AND deleted = 0", file_id, owner)
        return rows[0] if rows else None

    async def file_content(self, file_id: str, owner: str) -> bytes | None:
        async with self._tx() as tx:
            rows = await tx.fetch("SELECT content FROM batch_files WHERE id = ? AND owner = ? AND deleted = 0",
                                  file_id, owner)
            if not rows:
                return None
            if rows[0]["content"] is not None:  # output and error files, and inputs stored before batch_file_lines
                return bytes(rows[0]["content"])
            lines = await tx.fetch("SELECT raw FROM batch_file_lines WHERE file_id = ? ORDER BY line_no", file_id)
        return "\n".join(r["raw"] for r in lines).encode() if lines else None

    # ------------------------------------------------------------------ uploads and quotas
    async def usage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant stores: inputs, outputs and error files, uploads being stored included."""
        async with self._tx() as tx:
            return await self._usage(tx, tenant)

    async def _usage(self, tx: Any, tenant: str) -> tuple[int, int]:
        rows = await tx.fetch("SELECT COUNT(*) AS n, COALESCE(SUM(bytes), 0) AS b FROM batch_files WHERE tenant = ? "
                              f"AND deleted IN (0, {UPLOADING})", tenant)
        return int(rows[0]["n"]), int(rows[0]["b"])

    async def _quota_lock(self, tx: Any, tenant: str) -> None:
        """Serialise the quota checks of one tenant (SQLite: BEGIN IMMEDIATE serialises every writer already)."""
        return None

    async def reserve_file(self, row: dict[str, Any], max_files: int, max_bytes: int) -> None:
        """Insert an upload's file row, invisible until `commit_file`, if the tenant stays within its quota, else
        raise QuotaExceeded. The check and the insert are one transaction serialised per tenant, and the row
        counts from then on, so uploads racing on several workers or replicas cannot pass the quota together."""
        async with self._tx() as tx:
            await self._quota_lock(tx, row["tenant"])
            files, used = await self._usage(tx, row["tenant"])
            if files + 1 > max_files:
                raise QuotaExceeded("files", files, max_files)
            if used + int(row["bytes"]) > max_bytes:
                raise QuotaExceeded("bytes", used, max_bytes)
            await tx.execute("INSERT INTO batch_files (id, owner, tenant, purpose, filename, bytes, created_at, "
                             "expires_at, deleted, content, restriction) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, "
                             f"{UPLOADING}, NULL, ?)", row["id"], row["owner"], row["tenant"], row["purpose"],
                             row["filename"], row["bytes"], row["created_at"], _j(row.get("restriction")))

    async def add_file_lines(self, file_id: str, rows: Sequence[tuple[Any, ...]]) -> None:
        """Lines of an upload being stored: (line_no, raw text, custom_id, url, model, prefix_key), a blank line
        with custom_id None."""
        async with self._tx() as tx:
            await tx.executemany("INSERT INTO batch_file_lines (file_id, line_no, raw, custom_id, url, model, "
                                 "prefix_key) VALUES (?, ?, ?, ?, ?, ?, ?)", [(file_id, *r) for r in rows])

    async def commit_file(self, file_id: str) -> bool:
        """The upload is stored: the file becomes visible."""
        async with self._tx() as tx:
            rows = await tx.fetch(f"UPDATE batch_files SET deleted = 0 WHERE id = ? AND deleted = {UPLOADING} "
                                  "RETURNING id", file_id)
        return bool(rows)

    async def drop_upload(self, file_id: str) -> None:
        """An upload that failed while being stored: its row and lines go."""
        async with self._tx() as tx:
            await tx.execute(f"UPDATE batch_files SET deleted = 1 WHERE id = ? AND deleted = {UPLOADING}", file_id)
            await tx.execute("DELETE FROM batch_file_lines WHERE file_id = ?", file_id)

    async def file_models(self, file_id: str, owner: str) -> list[str] | None:
        """The models an uploaded input file names, from its scanned lines; None for a file stored without them
        (before batch_file_lines), whose content is read instead."""
        async with self._tx() as tx:
            rows = await tx.fetch("SELECT DISTINCT l.model AS model FROM batch_file_lines l JOIN batch_files f ON "
                                  "f.id = l.file_id WHERE l.file_id = ? AND f.owner = ? AND f.deleted = 0 AND "
                                  "l.custom_id IS NOT NULL", file_id, owner)
        return sorted(r["model"] for r in rows) if rows else None

    async def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int) -> list[dict[str, Any]]:
        async with self._tx() as tx:
            where, args = "owner = ? AND deleted = 0", [owner]
            if purpose:
                where += " AND purpose = ?"
                args.append(purpose)
            if after:
                cur = await tx.fetch("SELECT created_at FROM batch_files WHERE id = ? AND owner = ?", after, owner)
                if not cur:
                    raise LookupError(after)
                if cur:
                    where += " AND (created_at < ? OR (created_at = ? AND id < ?))"
                    args += [cur[0]["created_at"], cur[0]["created_at"], after]
            return await tx.fetch(f"SELECT id, owner, tenant, purpose, filename, bytes, created_at, expires_at FROM "
                                  f"batch_files WHERE {where} ORDER BY created_at DESC, id DESC LIMIT ?",
                                  *args, limit)

    async def delete_file(self, file_id: str, owner: str) -> bool:
        async with self._tx() as tx:
            rows = await tx.fetch("UPDATE batch_files SET deleted = 1, content = NULL WHERE id = ? AND owner = ? "
                                  "AND deleted = 0 RETURNING id", file_id, owner)
            if rows:
                await tx.execute("DELETE FROM batch_file_lines WHERE file_id = ?", file_id)
        return bool(rows)

    # ------------------------------------------------------------------ jobs (API side)
    async def insert_job(self, row: dict[str, Any]) -> None:
        """A new job in `validating`. It takes its input file's recorded decision (whoever creates it), and is
        zero-retention when its creator's decision or the file's says so."""
        async with self._tx() as tx:
            f = await tx.fetch("SELECT restriction FROM batch_files WHERE id = ?", row["input_file_id"])
            restriction = _l(f[0]["restriction"]) if f else None
            zero = bool(row.get("zero_retention")) or bool((restriction or {}).get("zero_retention"))
            await tx.execute(
                "INSERT INTO batch_jobs (id, owner, tenant, principal, principal_valid_until, endpoint, input_file_id, "
                "completion_window, metadata, status, created_at, expires_at, zero_retention, restriction) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                row["id"], row["owner"], row["tenant"], _j(row["principal"]), row.get("principal_valid_until"),
                row["endpoint"], row["input_file_id"], row["completion_window"], _j(row.get("metadata")),
                row["created_at"], row["expires_at"], 1 if zero else 0, _j(restriction))

    async def get_job(self, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
        async with self._tx() as tx:
            if owner is None:
                rows = await tx.fetch("SELECT * FROM batch_jobs WHERE id = ?", batch_id)
            else:
                rows = await tx.fetch("SELECT * FROM batch_jobs WHERE id = ? AND owner = ?", batch_id, owner)
        return _job(rows[0]) if rows else None

    async def list_jobs(self, owner: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        async with self._tx() as tx:
            where, args = "owner = ?", [owner]
            if after:
                cur = await tx.fetch("SELECT created_at FROM batch_jobs WHERE id = ? AND owner = ?", after, owner)
                if not cur:
                    raise LookupError(after)
                if cur:
                    where += " AND (created_at < ? OR (created_at = ? AND id < ?))"
                    args += [cur[0]["created_at"], cur[0]["created_at"], after]
            rows = await tx.fetch(f"SELECT * FROM batch_jobs WHERE {where} ORDER BY created_at DESC, id DESC LIMIT ?",
                                  *args, limit)
        return [_job(r) for r in rows]

    async def cancel_job(self, batch_id: str, owner: str, now: float) -> dict[str, Any] | None:
        """validating/in_progress -> cancelling; lines not yet dispatched are cancelled at once."""
        async with self._tx() as tx:
            rows = await tx.fetch("UPDATE batch_jobs SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND "
                                  "owner = ? AND status IN ('validating', 'in_progress') RETURNING id", now, batch_id,
                                  owner)
            if rows:
                await self._end_pending(tx, batch_id, now, "batch_cancelled",
                                        "The batch was cancelled before this request was sent.")
            got = await tx.fetch("SELECT * FROM batch_jobs WHERE id = ? AND owner = ?", batch_id, owner)
        return _job(got[0]) if got else None

    # ------------------------------------------------------------------ jobs (runner side)
    async def jobs_in(self, states: Sequence[str]) -> list[dict[str, Any]]:
        """The jobs in these states. A row whose JSON columns cannot be read comes back with `corrupt` set
        (`_job`) instead of failing the whole list: the lane fails that job alone."""
        marks = ", ".join("?" for _ in states)
        async with self._tx() as tx:
            rows = await tx.fetch(f"SELECT * FROM batch_jobs WHERE status IN ({marks}) ORDER BY expires_at, id",
                                  *states)
        return [_job(r) for r in rows]

    async def list_jobs_admin(self, tenant: str | None, status: str | None, after: str | None,
                              limit: int) -> list[dict[str, Any]]:
        """Every owner's jobs (of one tenant when given), newest first: the admin plane's view."""
        async with self._tx() as tx:
            where, args = ["1 = 1"], []
            if tenant is not None:
                where.append("tenant = ?")
                args.append(tenant)
            if status is not None:
                where.append("status = ?")
                args.append(status)
            if after:
                cur = await tx.fetch("SELECT created_at FROM batch_jobs WHERE id = ?" +
                                     (" AND tenant = ?" if tenant is not None else ""),
                                     after, *([tenant] if tenant is not None else []))
                if not cur:
                    raise LookupError(after)
                where.append("(created_at < ? OR (created_at = ? AND id < ?))")
                args += [cur[0]["created_at"], cur[0]["created_at"], after]
            rows = await tx.fetch(f"SELECT * FROM batch_jobs WHERE {' AND '.join(where)} ORDER BY created_at DESC, "
                                  "id DESC LIMIT ?", *args, limit)
        return [_job(r) for r in rows]

    async def start_job(self, batch_id: str, lines: list[tuple[int, str, dict[str, Any], str]], now: float) -> bool:
        """validating -> in_progress with its lines, in one transaction (False: another replica did it)."""
        async with self._tx() as tx:
            rows = await tx.fetch("UPDATE batch_jobs SET status = 'in_progress', in_progress_at = ?, total = ? "
                                  "WHERE id = ? AND status = 'validating' RETURNING id", now, len(lines), batch_id)
            if not rows:
                return False
            await tx.executemany(
                "INSERT INTO batch_lines (batch_id, line_no, custom_id, body, prefix_key, state) "
                "VALUES (?, ?, ?, ?, ?, 'pending')",
                [(batch_id, n, cid, _j(body), pk) for n, cid, body, pk in lines])
        return True

    async def start_job_from_file(self, batch_id: str, file_id: str, endpoint: str,
                                  now: float) -> tuple[str, list[dict[str, Any]]]:
        """validating -> in_progress with the lines the upload scan stored (batch_file_lines), copied in one
        statement without parsing anything. Returns ("started" | "raced" | "not_scanned" | "mismatched", errors):
        raced: another replica started it; not_scanned: the file was stored whole before batch_file_lines (the
        caller parses its content); mismatched: lines whose url is not the batch's endpoint (up to 100)."""
        async with self._tx() as tx:
            n = await tx.fetch("SELECT COUNT(*) AS n FROM batch_file_lines WHERE file_id = ? AND custom_id IS NOT "
                               "NULL", file_id)
            total = int(n[0]["n"])
            if not total:
                return "not_scanned", []
            bad = await tx.fetch("SELECT line_no, url FROM batch_file_lines WHERE file_id = ? AND custom_id IS NOT "
                                 "NULL AND url <> ? ORDER BY line_no LIMIT 100", file_id, endpoint)
            if bad:
                return "mismatched", [
                    {"code": "mismatched_endpoint", "message": f"Line {r['line_no']}: url {r['url']} does not match "
                     f"the batch's endpoint {endpoint}.", "param": "url", "line": r["line_no"]} for r in bad]
            rows = await tx.fetch("UPDATE batch_jobs SET status = 'in_progress', in_progress_at = ?, total = ? "
                                  "WHERE id = ? AND status = 'validating' RETURNING id", now, total, batch_id)
            if not rows:
                return "raced", []
            # `body` holds the whole input line here; `claim` hands out its `body` field (see _line_body)
            await tx.execute("INSERT INTO batch_lines (batch_id, line_no, custom_id, body, prefix_key, state) "
                             "SELECT ?, line_no, custom_id, raw, prefix_key, 'pending' FROM batch_file_lines "
                             "WHERE file_id = ? AND custom_id IS NOT NULL", batch_id, file_id)
        return "started", []

    async def fail_open_job(self, batch_id: str, now: float, code: str, message: str) -> None:
        """Stop an in-progress or cancelling job that cannot go on (the lane failed on it): every line not
        answered, in flight included, ends with `code`; finalizing then writes the output and error files and
        ends the job `failed` with the reason in `errors`."""
        async with self._tx() as tx:
            await self._end_pending(tx, batch_id, now, code, message, include_leased=True)
            await tx.execute("UPDATE batch_jobs SET stop_reason = ? WHERE id = ?",
                             _j({"code": code, "message": message, "status": "failed"}), batch_id)

    async def abort_job(self, batch_id: str, errors: list[dict[str, Any]], now: float) -> bool:
        """End a job `failed` at once, without output files (finalizing it failed): its open lines end, their
        bodies are cleared."""
        async with self._tx() as tx:
            marks = ", ".join("?" for _ in OPEN_STATES)
            rows = await tx.fetch(f"UPDATE batch_jobs SET status = 'failed', failed_at = ?, finalizing_at = ?, "
                                  f"errors = ? WHERE id = ? AND status IN ({marks}) RETURNING id", now, now,
                                  _j({"object": "list", "data": errors}), batch_id, *OPEN_STATES)
            if rows:
                n = await tx.fetch("SELECT COUNT(*) AS n FROM batch_lines WHERE batch_id = ? AND state IN "
                                   "('pending', 'leased')", batch_id)
                await tx.execute("UPDATE batch_lines SET state = 'failed', lease_owner = NULL, finished_at = ? "
                                 "WHERE batch_id = ? AND state IN ('pending', 'leased')", now, batch_id)
                await tx.execute("UPDATE batch_lines SET body = NULL, result = NULL WHERE batch_id = ?", batch_id)
                await tx.execute("UPDATE batch_jobs SET failed = failed + ? WHERE id = ?", int(n[0]["n"]), batch_id)
        return bool(rows)

    async def fail_job(self, batch_id: str, errors: list[dict[str, Any]], now: float,
                       from_states: Sequence[str] = ("validating",)) -> bool:
        marks = ", ".join("?" for _ in from_states)
        async with self._tx() as tx:
            rows = await tx.fetch(f"UPDATE batch_jobs SET status = 'failed', failed_at = ?, errors = ? WHERE id = ? "
                                  f"AND status IN ({marks}) RETURNING id", now,
                                  _j({"object": "list", "data": errors}), batch_id, *from_states)
        return bool(rows)

    async def stop_job(self, batch_id: str, now: float, code: str, message: str, status: str | None = None,
                       response: dict[str, Any] | None = None) -> None:
        """End every line not yet finished with `code` (a revoked key, an exhausted budget); with `status`
        the job ends that way (failed + errors) once finalized, else it finalizes as completed."""
        async with self._tx() as tx:
            await self._end_pending(tx, batch_id, now, code, message, response, include_leased=False)
            await tx.execute("UPDATE batch_jobs SET stop_reason = ? WHERE id = ? AND stop_reason IS NULL",
                             _j({"code": code, "message": message, "status": status}), batch_id)

    async def _end_pending(self, tx: Any, batch_id: str, now: float, code: str, message: str,
                           response: dict[str, Any] | None = None, include_leased: bool = False) -> int:
        states = "('pending', 'leased')" if include_leased else "('pending')"
        # locked (Postgres) so a replica recording or claiming one of these lines meanwhile waits and then finds it
        # ended, instead of the two writes both counting
        rows = await tx.fetch(f"SELECT line_no, custom_id FROM batch_lines WHERE batch_id = ? AND state IN {states}"
                              f"{self.for_update}", batch_id)
        if not rows:
            return 0
        await tx.executemany(
            "UPDATE batch_lines SET state = 'failed', result = ?, lease_owner = NULL, finished_at = ?, body = NULL "
            "WHERE batch_id = ? AND line_no = ?",
            [(_j(error_line(r["custom_id"], code, message, response)), now, batch_id, r["line_no"]) for r in rows])
        await tx.execute("UPDATE batch_jobs SET failed = failed + ? WHERE id = ?", len(rows), batch_id)
        return len(rows)

    async def claim(self, batch_id: str, owner: str, now: float, lease_s: float, n: int) -> list[Line]:
        """Lease up to `n` lines of an in-progress job (pending, or leased by a replica whose lease lapsed),
        lines sharing a prompt prefix together (prefix_key order)."""
        async with self._tx() as tx:
            live = await tx.fetch("SELECT id FROM batch_jobs WHERE id = ? AND status = 'in_progress' AND "
                                  "stop_reason IS NULL", batch_id)
            if not live:
                return []
            # pick first, then lease exactly those rows (Postgres may re-run a LIMIT subquery inside IN)
            picked = await tx.fetch(
                "SELECT line_no FROM batch_lines WHERE batch_id = ? AND (state = 'pending' OR (state = 'leased' "
                f"AND lease_until < ?)) ORDER BY prefix_key, line_no LIMIT ?{self.skip_locked}", batch_id, now, n)
            if not picked:
                return []
            marks = ", ".join("?" for _ in picked)
            rows = await tx.fetch(
                "UPDATE batch_lines SET state = 'leased', lease_owner = ?, lease_until = ?, dispatches = dispatches + 1 "
                f"WHERE batch_id = ? AND line_no IN ({marks}) RETURNING line_no, custom_id, body, tries, dispatches",
                owner, now + lease_s, batch_id, *[r["line_no"] for r in picked])
        rows.sort(key=lambda r: r["line_no"])
        return [Line(batch_id, r["line_no"], r["custom_id"], _line_body(r["body"]), r["tries"], r["dispatches"])
                for r in rows]

    async def renew(self, owner: str, now: float, lease_s: float, lines: Sequence[tuple[str, int]]) -> None:
        """Extend this worker's leases of the lines it is running (only those: a line whose task is gone lapses)."""
        by_batch: dict[str, list[int]] = {}
        for bid, n in lines:
            by_batch.setdefault(bid, []).append(n)
        if not by_batch:
            return
        async with self._tx() as tx:
            for bid, nums in by_batch.items():
                marks = ", ".join("?" for _ in nums)
                await tx.execute(f"UPDATE batch_lines SET lease_until = ? WHERE lease_owner = ? AND state = 'leased' "
                                 f"AND batch_id = ? AND line_no IN ({marks})", now + lease_s, owner, bid, *nums)

    async def record(self, line: Line, owner: str, ok: bool, result: dict[str, Any], now: float,
                     keep_body: bool = False) -> bool:
        """Record a line's answer if this replica still holds its lease; False: it does not (discarded)."""
        async with self._tx() as tx:
            rows = await tx.fetch(
                "UPDATE batch_lines SET state = ?, result = ?, lease_owner = NULL, finished_at = ?"
                f"{'' if keep_body else ', body = NULL'} WHERE batch_id = ? AND line_no = ? AND state = 'leased' "
                "AND lease_owner = ? RETURNING line_no", "done" if ok else "failed", _j(result), now, line.batch_id,
                line.line_no, owner)
            if not rows:
                return False
            col = "completed" if ok else "failed"
            await tx.execute(f"UPDATE batch_jobs SET {col} = {col} + 1 WHERE id = ?", line.batch_id)
        return True

    async def release(self, line: Line, owner: str, retried: bool) -> None:
        """Give a leased line back (deferred: the fleet had no room; or a retryable failure: tries + 1)."""
        async with self._tx() as tx:
            await tx.execute("UPDATE batch_lines SET state = 'pending', lease_owner = NULL, lease_until = NULL, "
                             f"tries = tries + {1 if retried else 0} WHERE batch_id = ? AND line_no = ? AND "
                             "state = 'leased' AND lease_owner = ?", line.batch_id, line.line_no, owner)

    async def release_all(self, owner: str) -> int:
        """Shutdown: every line this worker still holds goes back to pending (no result was recorded for it),
        so a restart resumes at once instead of after the lease."""
        async with self._tx() as tx:
            rows = await tx.fetch("UPDATE batch_lines SET state = 'pending', lease_owner = NULL, lease_until = NULL "
                                  "WHERE lease_owner = ? AND state = 'leased' RETURNING line_no", owner)
        return len(rows)

    async def expire(self, batch_id: str, now: float) -> None:
        async with self._tx() as tx:
            await self._end_pending(tx, batch_id, now, "batch_expired",
                                    "This request could not be executed before the batch's completion window ended.",
                                    include_leased=True)
            await tx.execute("UPDATE batch_jobs SET stop_reason = ? WHERE id = ? AND stop_reason IS NULL",
                             _j({"code": "batch_expired", "status": "expired"}), batch_id)

    async def finalize(self, job: dict[str, Any], now: float, files: Any, delete_after_s: float = 0.0) -> str | None:
        """Write the output and error files and end the job, in one transaction, when no line is open.
        `files(kind, jsonl_bytes) -> file row`. Returns the final status, or None (lines still open / done)."""
        bid = job["id"]
        async with self._tx() as tx:
            open_ = await tx.fetch("SELECT COUNT(*) AS n FROM batch_lines WHERE batch_id = ? AND state IN "
                                   "('pending', 'leased')", bid)
            if int(open_[0]["n"]):
                return None
            # lines only ever leave the open states, so none is open now or later. The conditional UPDATE takes
            # the job row's lock (Postgres): a second replica finalizing at once waits, then finds it done.
            cur = await tx.fetch("UPDATE batch_jobs SET finalizing_at = ? WHERE id = ? AND status IN "
                                 "('in_progress', 'cancelling') RETURNING status, stop_reason", now, bid)
            if not cur:
                return None
            stop = _l(cur[0]["stop_reason"]) or {}
            final = ("cancelled" if cur[0]["status"] == "cancelling" else
                     stop.get("status") or "completed")
            rows = await tx.fetch("SELECT state, result FROM batch_lines WHERE batch_id = ? AND state IN "
                                  "('done', 'failed') ORDER BY line_no", bid)
            out = b"".join(r["result"].encode() + b"\n" for r in rows if r["state"] == "done")
            err = b"".join(r["result"].encode() + b"\n" for r in rows if r["state"] == "failed")
            out_id = err_id = None
            for kind, data in (("output", out), ("error", err)):
                if not data:
                    continue
                frow = files(kind, data)
                await tx.execute("INSERT INTO batch_files (id, owner, tenant, purpose, filename, bytes, created_at, "
                                 "expires_at, deleted, content) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
                                 frow["id"], frow["owner"], frow["tenant"], frow["purpose"], frow["filename"],
                                 frow["bytes"], frow["created_at"], frow.get("expires_at"), frow["content"])
                if kind == "output":
                    out_id = frow["id"]
                else:
                    err_id = frow["id"]
            at_col = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
                      "cancelled": "cancelled_at"}[final]
            errors = None
            if final == "failed" and stop.get("code"):
                errors = _j({"object": "list", "data": [{"code": stop["code"], "message": stop.get("message"),
                                                         "param": None, "line": None}]})
            delete_at = now + delete_after_s if job["zero_retention"] else None
            await tx.execute(
                f"UPDATE batch_jobs SET status = ?, finalizing_at = ?, {at_col} = ?, output_file_id = ?, "
                "error_file_id = ?, errors = COALESCE(?, errors), delete_files_at = ? WHERE id = ?",
                final, now, now, out_id, err_id, errors, delete_at, bid)
            # the answers now live in the output and error files: the line rows keep only their bookkeeping
            await tx.execute("UPDATE batch_lines SET body = NULL, result = NULL WHERE batch_id = ?", bid)
            if job["zero_retention"]:  # the input goes now; the output and error files at delete_files_at
                await tx.execute("UPDATE batch_files SET deleted = 1, content = NULL WHERE id = ?",
                                 job["input_file_id"])
                await tx.execute("DELETE FROM batch_file_lines WHERE file_id = ?", job["input_file_id"])
                await tx.execute("UPDATE batch_files SET expires_at = ? WHERE id IN (?, ?)", delete_at,
                                 out_id or "", err_id or "")
        return final

    async def purge_expired_files(self, now: float) -> int:
        """Delete files whose retention window ended (zero-retention batches' output and error files), and
        uploads left unfinished for STALE_UPLOAD_S (the process storing them died)."""
        async with self._tx() as tx:
            rows = await tx.fetch("UPDATE batch_files SET deleted = 1, content = NULL WHERE (deleted = 0 AND "
                                  "expires_at IS NOT NULL AND expires_at <= ?) OR (deleted = ? AND created_at < ?) "
                                  "RETURNING id", now, UPLOADING, now - STALE_UPLOAD_S)
            for r in rows:
                await tx.execute("DELETE FROM batch_file_lines WHERE file_id = ?", r["id"])
        return len(rows)


def _job(r: Mapping[str, Any]) -> dict[str, Any]:
    """A job row with its JSON columns decoded. A column that cannot be decoded reads as None and the job
    carries `corrupt` (why): its owner still gets the batch object, and the lane fails that job alone."""
    d = dict(r)
    for col in ("principal", "metadata", "errors", "stop_reason", "restriction"):
        try:
            d[col] = _l(d.get(col))
        except (ValueError, TypeError) as e:
            d[col] = None
            d["corrupt"] = f"{col}: {type(e).__name__}"
    return d


def _line_body(text: str | None) -> dict[str, Any]:
    """A claimed line's request. `batch_lines.body` holds either the request itself (lines stored before
    batch_file_lines, validated to have `model`) or the whole input line copied from batch_file_lines (validated
    to have exactly custom_id, method, url and body, so never `model`): the one is told from the other by that."""
    obj = _l(text)
    if isinstance(obj, dict) and "model" not in obj and isinstance(obj.get("body"), dict):
        return obj["body"]
    return obj  # type: ignore[no-any-return]


def error_line(custom_id: str, code: str, message: str, response: dict[str, Any] | None = None) -> dict[str, Any]:
    """An error-file line for a request that got no engine answer (OpenAI's shape: response null, error set)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": response,
            "error": {"code": code, "message": message}}


class SqliteBatchStore(BatchStore):
    """Single replica: one connection, transactions serialised (BEGIN IMMEDIATE), WAL."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        from gateway.stores.sql import open_sqlite

        self._conn = await open_sqlite(self.path, "synchronous=NORMAL")

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[_SqliteTx]:
        assert self._conn is not None, "batch store not opened"
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield _SqliteTx(self._conn)
            except BaseException:
                await self._conn.execute("ROLLBACK")
                raise
            await self._conn.execute("COMMIT")


class PostgresBatchStore(BatchStore):
    """Several replicas on one database: lines are claimed with FOR UPDATE SKIP LOCKED."""

    blob = "BYTEA"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    for_update = " FOR UPDATE"

    def __init__(self, dsn: str, schema: str | None = None) -> None:
        self.dsn = dsn
        self.schema = schema
        self._pool: Any = None

    async def open(self) -> None:
        import asyncpg

        settings = {"search_path": self.schema} if self.schema else {}
        if self.schema:
            conn = await asyncpg.connect(self.dsn)
            try:
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            except asyncpg.UniqueViolationError:
                pass
            finally:
                await conn.close()
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=8, server_settings=settings)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def _migrate_lock(self, tx: Any) -> None:
        await tx.conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"gw_batch_migrate:{self.schema}")

    async def _quota_lock(self, tx: Any, tenant: str) -> None:
        await tx.conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"gw_batch_quota:{self.schema}:{tenant}")

    async def _columns(self, tx: Any, table: str) -> set[str]:
        rows = await tx.fetch("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                              "current_schema() AND table_name = ?", table)
        return {r["column_name"] for r in rows}

    @asynccontextmanager
    async def _tx(self) -> AsyncIterator[_PgTx]:
        assert self._pool is not None, "batch store not opened"
        async with self._pool.acquire() as conn, conn.transaction():
            yield _PgTx(conn)
