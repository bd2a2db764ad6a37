"""The identity store interface and the SQL both implementations share (SQLite and PostgreSQL).

Backends only provide a transaction object (`fetch`, `execute`, `notify`) and the listener; queries,
migrations and row mapping live here once, so both stores behave identically and one test suite covers both.
Change events ("key:<id>", "tenant:<id>", "team:<t>/<id>", "project:<t>/<team>/<id>", "partner:<id>")
are published in the same transaction as the change, so a replica never hears of a change that rolled back.

Referential rules (enforced here, in one transaction per change, identically on both backends):
* creating a record locks its parent rows (`_lock_row`) and fails with NotFound if one is gone;
* deleting a tenant/team/project/partner locks its row, counts what still depends on it (teams, projects,
  partners, keys that are not revoked) and raises InUse instead of deleting while anything does;
* key rows are never deleted (revocation is the delete): they are the audit trail and may outlive their
  tenant/team/project/partner, which is why api_keys has no foreign keys since migration 3.
"""
from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import orjson

from gateway.identity.model import ApiKey, Conflict, InUse, NotEditable, NotFound, Partner, Project, Team, Tenant

EventCallback = Callable[[str], None]

_KEY_COLS = ("id, tenant, secret_hash, team, project, partner, name, purpose, labels, scopes, models, created_at, "
             "expires_at, revoked_at, rotated_from, rotated_to")

# Versioned migrations: (version, name, statements). Append only; never edit an applied one.
MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "identity tables", [
        """CREATE TABLE IF NOT EXISTS tenants (
            id TEXT PRIMARY KEY, name TEXT NOT NULL, labels TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE IF NOT EXISTS teams (
            tenant TEXT NOT NULL REFERENCES tenants(id), id TEXT NOT NULL, name TEXT NOT NULL,
            labels TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, id))""",
        """CREATE TABLE IF NOT EXISTS projects (
            tenant TEXT NOT NULL, team TEXT NOT NULL, id TEXT NOT NULL, name TEXT NOT NULL, labels TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, team, id),
            FOREIGN KEY (tenant, team) REFERENCES teams(tenant, id))""",
        """CREATE TABLE IF NOT EXISTS partners (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(id), name TEXT NOT NULL,
            labels TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE IF NOT EXISTS api_keys (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL REFERENCES tenants(id), secret_hash TEXT NOT NULL,
            team TEXT, project TEXT, partner TEXT REFERENCES partners(id), name TEXT NOT NULL,
            purpose TEXT NOT NULL, labels TEXT NOT NULL, scopes TEXT NOT NULL, models TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION, revoked_at DOUBLE PRECISION,
            rotated_from TEXT, rotated_to TEXT)""",
    ]),
    (2, "key listing index", ["CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant, created_at)"]),
    # Revoked keys stay as the audit trail after their tenant/partner is deleted, so api_keys loses its foreign
    # keys (SQLite cannot drop a constraint: rebuild the table, the same statements on both backends). Live
    # references are guarded by the store instead (parent row locks on create, dependent checks on delete).
    (3, "api_keys outlive deleted tenants and partners", [
        """CREATE TABLE api_keys_v3 (
            id TEXT PRIMARY KEY, tenant TEXT NOT NULL, secret_hash TEXT NOT NULL, team TEXT, project TEXT,
            partner TEXT, name TEXT NOT NULL, purpose TEXT NOT NULL, labels TEXT NOT NULL, scopes TEXT NOT NULL,
            models TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION,
            revoked_at DOUBLE PRECISION, rotated_from TEXT, rotated_to TEXT)""",
        f"INSERT INTO api_keys_v3 ({_KEY_COLS}) SELECT {_KEY_COLS} FROM api_keys",
        "DROP TABLE api_keys",
        "ALTER TABLE api_keys_v3 RENAME TO api_keys",
        "CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant, created_at)",
        "CREATE INDEX IF NOT EXISTS api_keys_partner ON api_keys (partner)",
    ]),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


class Row(Protocol):
    """A result row, its columns read by name: asyncpg.Record and sqlite3.Row both are one (neither is a Mapping)."""

    def __getitem__(self, key: str, /) -> Any: ...

    def keys(self) -> Any: ...


class Tx(Protocol):
    async def fetch(self, sql: str, *args: Any) -> list[Row]: ...

    async def execute(self, sql: str, *args: Any) -> None: ...

    def notify(self, event: str) -> Awaitable[None] | None: ...


class IdentityStore(Protocol):
    """What the identity service needs from persistence."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def migrate(self) -> int: ...
    async def listen(self, callback: EventCallback) -> None: ...
    async def create_tenant(self, t: Tenant) -> Tenant: ...
    async def get_tenant(self, tenant_id: str) -> Tenant | None: ...
    async def list_tenants(self) -> list[Tenant]: ...
    async def update_tenant_labels(self, tenant_id: str, labels: dict[str, str]) -> Tenant | None: ...
    async def update_tenant(self, tenant_id: str, changes: Mapping[str, Any]) -> Tenant | None: ...
    async def delete_tenant(self, tenant_id: str) -> bool: ...
    async def create_team(self, t: Team) -> Team: ...
    async def get_team(self, tenant: str, team_id: str) -> Team | None: ...
    async def list_teams(self, tenant: str) -> list[Team]: ...
    async def update_team(self, tenant: str, team_id: str, changes: Mapping[str, Any]) -> Team | None: ...
    async def delete_team(self, tenant: str, team_id: str) -> bool: ...
    async def create_project(self, p: Project) -> Project: ...
    async def get_project(self, tenant: str, team: str, project_id: str) -> Project | None: ...
    async def list_projects(self, tenant: str, team: str | None = None) -> list[Project]: ...
    async def update_project(self, tenant: str, team: str, project_id: str,
                             changes: Mapping[str, Any]) -> Project | None: ...
    async def delete_project(self, tenant: str, team: str, project_id: str) -> bool: ...
    async def create_partner(self, p: Partner) -> Partner: ...
    async def get_partner(self, partner_id: str) -> Partner | None: ...
    async def list_partners(self, tenant: str | None = None) -> list[Partner]: ...
    async def update_partner(self, partner_id: str, changes: Mapping[str, Any]) -> Partner | None: ...
    async def delete_partner(self, partner_id: str) -> bool: ...
    async def create_key(self, k: ApiKey) -> ApiKey: ...
    async def get_key(self, key_id: str) -> ApiKey | None: ...
    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]: ...
    async def revoke_key(self, key_id: str, at: float) -> ApiKey | None: ...
    async def rotate_key(self, old_id: str, new: ApiKey, old_expires_at: float) -> ApiKey | None: ...
    async def update_key(self, key_id: str, changes: Mapping[str, Any]) -> ApiKey | None: ...


def _j(v: Any) -> str:
    return orjson.dumps(v).decode()


def _l(v: str | None) -> Any:
    return orjson.loads(v) if v else {}


def _key(r: Row) -> ApiKey:
    return ApiKey(
        id=r["id"], tenant=r["tenant"], secret_hash=r["secret_hash"], team=r["team"], project=r["project"],
        partner=r["partner"], name=r["name"], purpose=r["purpose"], labels=_l(r["labels"]),
        scopes=orjson.loads(r["scopes"]), models=orjson.loads(r["models"]), created_at=r["created_at"],
        expires_at=r["expires_at"], revoked_at=r["revoked_at"], rotated_from=r["rotated_from"],
        rotated_to=r["rotated_to"],
    )


def _tenant(r: Row) -> Tenant:
    return Tenant(r["id"], r["name"], _l(r["labels"]), r["created_at"])


def _team(r: Row) -> Team:
    return Team(r["tenant"], r["id"], r["name"], _l(r["labels"]), r["created_at"])


def _project(r: Row) -> Project:
    return Project(r["tenant"], r["team"], r["id"], r["name"], _l(r["labels"]), r["created_at"])


def _partner(r: Row) -> Partner:
    return Partner(r["id"], r["tenant"], r["name"], _l(r["labels"]), r["created_at"])


# Columns an update may set, per table, and how a value is stored. Column names in SQL come only from here.
_HIER_EDITABLE: dict[str, Callable[[Any], Any]] = {"name": str, "labels": _j}
_KEY_EDITABLE: dict[str, Callable[[Any], Any]] = {
    "name": str, "labels": _j, "scopes": _j, "models": _j,
    "expires_at": lambda v: None if v is None else float(v),
}

Check = Callable[[Tx], Awaitable[None]]


async def _notify(tx: Tx, *events: str) -> None:
    for ev in events:
        r = tx.notify(ev)
        if r is not None:
            await r


async def _lock_row(tx: Tx, table: str, where: str, *args: Any) -> bool:
    """Lock a row for the rest of the transaction (and say whether it exists) with portable SQL: a no-op
    UPDATE takes Postgres' row lock, so a concurrent create under this parent and a delete of it serialise;
    SQLite transactions are serialised already (BEGIN IMMEDIATE)."""
    return bool(await tx.fetch(f"UPDATE {table} SET name = name WHERE {where} RETURNING id", *args))


def _is_fk_violation(e: BaseException) -> bool:
    """A foreign-key violation on either backend (asyncpg's SQLSTATE, sqlite3's extended error name)."""
    return getattr(e, "sqlstate", None) == "23503" or getattr(e, "sqlite_errorname", None) == \
        "SQLITE_CONSTRAINT_FOREIGNKEY"


def _sets(changes: Mapping[str, Any], editable: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    bad = set(changes) - set(editable)
    if bad:  # the service validates first; this keeps column names out of reach of callers
        raise ValueError(f"not editable: {sorted(bad)}")
    return {c: editable[c](v) for c, v in changes.items()}


class SqlIdentityStore:
    """All queries, written once with `?` placeholders; subclasses supply `_tx()` and `listen()`."""

    def _tx(self) -> AbstractAsyncContextManager[Tx]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def _is_unique_violation(self, e: BaseException) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    # What deleting a tenant also does in its transaction, added by subsystems keeping tables in this store
    # (gateway/adapters/store.py): `(label, table)` pairs whose rows of the tenant refuse the delete (InUse, like
    # its teams), and `(table, event)` pairs whose rows of the tenant are deleted with it (the event published,
    # `{tenant}` in it replaced by the tenant's id).
    _tenant_refusers: tuple[tuple[str, str], ...] = ()
    _tenant_cascade: tuple[tuple[str, str], ...] = ()

    def on_tenant_delete(self, *, refuse: tuple[str, str] | None = None, cascade: tuple[str, str] | None = None) -> None:
        """Register a table with a `tenant` column for tenant deletion (idempotent): `refuse=(label, table)`,
        `cascade=(table, event)`."""
        if refuse is not None and refuse not in self._tenant_refusers:
            self._tenant_refusers = (*self._tenant_refusers, refuse)
        if cascade is not None and cascade not in self._tenant_cascade:
            self._tenant_cascade = (*self._tenant_cascade, cascade)

    async def _migrate_lock(self, tx: Tx) -> None:
        """Serialise concurrent migrators (Postgres: advisory lock; SQLite: the write transaction)."""

    async def migrate(self) -> int:
        """Apply pending migrations in order, each recorded in schema_migrations. Returns the version."""
        async with self._tx() as tx:
            await self._migrate_lock(tx)
            await tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                             "name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)")
            done = {r["version"] for r in await tx.fetch("SELECT version FROM schema_migrations")}
            for version, name, stmts in MIGRATIONS:
                if version in done:
                    continue
                for s in stmts:
                    await tx.execute(s)
                await tx.execute("INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                                 version, name, time.time())
            rows = await tx.fetch("SELECT MAX(version) AS v FROM schema_migrations")
        return int(rows[0]["v"])

    async def ensure_tables(self, statements: Sequence[str]) -> None:
        """Idempotent DDL of a subsystem keeping its tables in this store (adapters, rollouts), run under the
        migration lock, outside the identity migrations' version list."""
        async with self._tx() as tx:
            await self._migrate_lock(tx)
            for s in statements:
                await tx.execute(s)

    async def _insert(self, sql: str, args: Sequence[Any], events: Sequence[str], check: Check | None = None) -> None:
        """Insert one row; `check` runs first in the same transaction (parent locks and existence)."""
        try:
            async with self._tx() as tx:
                if check is not None:
                    await check(tx)
                await tx.execute(sql, *args)
                await _notify(tx, *events)
        except Exception as e:
            if await self._is_unique_violation(e):
                raise Conflict("already exists") from None
            if _is_fk_violation(e):
                raise NotFound("a parent record does not exist") from None
            raise

    async def _one(self, sql: str, *args: Any) -> Row | None:
        async with self._tx() as tx:
            rows = await tx.fetch(sql, *args)
        return rows[0] if rows else None

    async def _all(self, sql: str, *args: Any) -> list[Row]:
        async with self._tx() as tx:
            return list(await tx.fetch(sql, *args))

    async def _update(self, table: str, where: str, args: Sequence[Any], changes: Mapping[str, Any],
                      editable: Mapping[str, Callable[[Any], Any]], event: str) -> Row | None:
        """Set the given columns of one row and publish `event`; the row as it is now, or None if absent."""
        sets = _sets(changes, editable)
        async with self._tx() as tx:
            if not sets:
                rows = await tx.fetch(f"SELECT * FROM {table} WHERE {where}", *args)
                return rows[0] if rows else None
            cols = ", ".join(f"{c} = ?" for c in sets)
            rows = await tx.fetch(f"UPDATE {table} SET {cols} WHERE {where} RETURNING *", *sets.values(), *args)
            if rows:
                await _notify(tx, event)
        return rows[0] if rows else None

    async def _delete(self, table: str, where: str, args: Sequence[Any],
                      dependents: Sequence[tuple[str, str, Sequence[Any]]], event: str,
                      cascade: Sequence[tuple[str, Sequence[Any], str]] = ()) -> bool:
        """Delete one row unless something still depends on it (InUse, nothing changed). False if absent.
        `cascade`: (DELETE statement, args, event) run first in the same transaction, each event published."""
        try:
            async with self._tx() as tx:
                if not await _lock_row(tx, table, where, *args):
                    return False
                found: dict[str, int] = {}
                for label, sql, dargs in dependents:
                    n = int((await tx.fetch(sql, *dargs))[0]["n"])
                    if n:
                        found[label] = n
                if found:
                    raise InUse(found)
                for sql, cargs, cevent in cascade:
                    await tx.execute(sql, *cargs)
                    await _notify(tx, cevent)
                await tx.execute(f"DELETE FROM {table} WHERE {where}", *args)
                await _notify(tx, event)
        except Exception as e:
            if _is_fk_violation(e):  # a dependent written behind the store's back
                raise InUse({"dependent records": 1}) from None
            raise
        return True

    # ---- tenants
    async def create_tenant(self, t: Tenant) -> Tenant:
        await self._insert("INSERT INTO tenants (id, name, labels, created_at) VALUES (?, ?, ?, ?)",
                           (t.id, t.name, _j(t.labels), t.created_at), [f"tenant:{t.id}"])
        return t

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        r = await self._one("SELECT * FROM tenants WHERE id = ?", tenant_id)
        return _tenant(r) if r else None

    async def list_tenants(self) -> list[Tenant]:
        return [_tenant(r) for r in await self._all("SELECT * FROM tenants ORDER BY id")]

    async def update_tenant_labels(self, tenant_id: str, labels: dict[str, str]) -> Tenant | None:
        return await self.update_tenant(tenant_id, {"labels": labels})

    async def update_tenant(self, tenant_id: str, changes: Mapping[str, Any]) -> Tenant | None:
        r = await self._update("tenants", "id = ?", (tenant_id,), changes, _HIER_EDITABLE, f"tenant:{tenant_id}")
        return _tenant(r) if r else None

    async def delete_tenant(self, tenant_id: str) -> bool:
        return await self._delete("tenants", "id = ?", (tenant_id,), [
            ("teams", "SELECT COUNT(*) AS n FROM teams WHERE tenant = ?", (tenant_id,)),
            ("projects", "SELECT COUNT(*) AS n FROM projects WHERE tenant = ?", (tenant_id,)),
            ("partners", "SELECT COUNT(*) AS n FROM partners WHERE tenant = ?", (tenant_id,)),
            ("unrevoked keys", "SELECT COUNT(*) AS n FROM api_keys WHERE tenant = ? AND revoked_at IS NULL",
             (tenant_id,)),
            *((label, f"SELECT COUNT(*) AS n FROM {t} WHERE tenant = ?", (tenant_id,))
              for label, t in self._tenant_refusers),
        ], f"tenant:{tenant_id}",
            [(f"DELETE FROM {t} WHERE tenant = ?", (tenant_id,), ev.replace("{tenant}", tenant_id))
             for t, ev in self._tenant_cascade])

    # ---- teams
    async def create_team(self, t: Team) -> Team:
        async def check(tx: Tx) -> None:
            if not await _lock_row(tx, "tenants", "id = ?", t.tenant):
                raise NotFound(f"tenant {t.tenant!r} does not exist")

        await self._insert("INSERT INTO teams (tenant, id, name, labels, created_at) VALUES (?, ?, ?, ?, ?)",
                           (t.tenant, t.id, t.name, _j(t.labels), t.created_at), [f"team:{t.tenant}/{t.id}"], check)
        return t

    async def get_team(self, tenant: str, team_id: str) -> Team | None:
        r = await self._one("SELECT * FROM teams WHERE tenant = ? AND id = ?", tenant, team_id)
        return _team(r) if r else None

    async def list_teams(self, tenant: str) -> list[Team]:
        return [_team(r) for r in await self._all("SELECT * FROM teams WHERE tenant = ? ORDER BY id", tenant)]

    async def update_team(self, tenant: str, team_id: str, changes: Mapping[str, Any]) -> Team | None:
        r = await self._update("teams", "tenant = ? AND id = ?", (tenant, team_id), changes, _HIER_EDITABLE,
                               f"team:{tenant}/{team_id}")
        return _team(r) if r else None

    async def delete_team(self, tenant: str, team_id: str) -> bool:
        return await self._delete("teams", "tenant = ? AND id = ?", (tenant, team_id), [
            ("projects", "SELECT COUNT(*) AS n FROM projects WHERE tenant = ? AND team = ?", (tenant, team_id)),
            ("unrevoked keys", "SELECT COUNT(*) AS n FROM api_keys WHERE tenant = ? AND team = ? "
                               "AND revoked_at IS NULL", (tenant, team_id)),
        ], f"team:{tenant}/{team_id}")

    # ---- projects
    async def create_project(self, p: Project) -> Project:
        async def check(tx: Tx) -> None:
            if not await _lock_row(tx, "teams", "tenant = ? AND id = ?", p.tenant, p.team):
                raise NotFound(f"team {p.team!r} does not exist in tenant {p.tenant!r}")

        await self._insert(
            "INSERT INTO projects (tenant, team, id, name, labels, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (p.tenant, p.team, p.id, p.name, _j(p.labels), p.created_at), [f"project:{p.tenant}/{p.team}/{p.id}"],
            check)
        return p

    async def get_project(self, tenant: str, team: str, project_id: str) -> Project | None:
        r = await self._one("SELECT * FROM projects WHERE tenant = ? AND team = ? AND id = ?", tenant, team, project_id)
        return _project(r) if r else None

    async def list_projects(self, tenant: str, team: str | None = None) -> list[Project]:
        if team is None:
            rows = await self._all("SELECT * FROM projects WHERE tenant = ? ORDER BY team, id", tenant)
        else:
            rows = await self._all("SELECT * FROM projects WHERE tenant = ? AND team = ? ORDER BY id", tenant, team)
        return [_project(r) for r in rows]

    async def update_project(self, tenant: str, team: str, project_id: str,
                             changes: Mapping[str, Any]) -> Project | None:
        r = await self._update("projects", "tenant = ? AND team = ? AND id = ?", (tenant, team, project_id), changes,
                               _HIER_EDITABLE, f"project:{tenant}/{team}/{project_id}")
        return _project(r) if r else None

    async def delete_project(self, tenant: str, team: str, project_id: str) -> bool:
        return await self._delete("projects", "tenant = ? AND team = ? AND id = ?", (tenant, team, project_id), [
            ("unrevoked keys", "SELECT COUNT(*) AS n FROM api_keys WHERE tenant = ? AND team = ? AND project = ? "
                               "AND revoked_at IS NULL", (tenant, team, project_id)),
        ], f"project:{tenant}/{team}/{project_id}")

    # ---- partners
    async def create_partner(self, p: Partner) -> Partner:
        async def check(tx: Tx) -> None:
            if not await _lock_row(tx, "tenants", "id = ?", p.tenant):
                raise NotFound(f"tenant {p.tenant!r} does not exist")

        await self._insert("INSERT INTO partners (id, tenant, name, labels, created_at) VALUES (?, ?, ?, ?, ?)",
                           (p.id, p.tenant, p.name, _j(p.labels), p.created_at), [f"partner:{p.id}"], check)
        return p

    async def get_partner(self, partner_id: str) -> Partner | None:
        r = await self._one("SELECT * FROM partners WHERE id = ?", partner_id)
        return _partner(r) if r else None

    async def list_partners(self, tenant: str | None = None) -> list[Partner]:
        if tenant is None:
            rows = await self._all("SELECT * FROM partners ORDER BY id")
        else:
            rows = await self._all("SELECT * FROM partners WHERE tenant = ? ORDER BY id", tenant)
        return [_partner(r) for r in rows]

    async def update_partner(self, partner_id: str, changes: Mapping[str, Any]) -> Partner | None:
        r = await self._update("partners", "id = ?", (partner_id,), changes, _HIER_EDITABLE, f"partner:{partner_id}")
        return _partner(r) if r else None

    async def delete_partner(self, partner_id: str) -> bool:
        return await self._delete("partners", "id = ?", (partner_id,), [
            ("unrevoked keys", "SELECT COUNT(*) AS n FROM api_keys WHERE partner = ? AND revoked_at IS NULL",
             (partner_id,)),
        ], f"partner:{partner_id}")

    # ---- keys
    async def create_key(self, k: ApiKey) -> ApiKey:
        async def check(tx: Tx) -> None:
            await self._check_parents(tx, k)

        await self._insert(f"INSERT INTO api_keys ({_KEY_COLS}) VALUES ({', '.join('?' * 16)})",
                           self._key_args(k), [f"key:{k.id}"], check)
        return k

    @staticmethod
    async def _check_parents(tx: Tx, k: ApiKey) -> None:
        """Every record the key names exists, locked until the transaction ends (so it cannot be deleted
        between this check and the insert). Lock order tenant -> partner -> team -> project."""
        if not await _lock_row(tx, "tenants", "id = ?", k.tenant):
            raise NotFound(f"tenant {k.tenant!r} does not exist")
        if k.partner is not None and not await _lock_row(tx, "partners", "id = ? AND tenant = ?", k.partner, k.tenant):
            raise NotFound(f"partner {k.partner!r} does not exist in tenant {k.tenant!r}")
        if k.team is not None and not await _lock_row(tx, "teams", "tenant = ? AND id = ?", k.tenant, k.team):
            raise NotFound(f"team {k.team!r} does not exist in tenant {k.tenant!r}")
        if k.project is not None and (k.team is None or not await _lock_row(
                tx, "projects", "tenant = ? AND team = ? AND id = ?", k.tenant, k.team, k.project)):
            raise NotFound(f"project {k.project!r} does not exist in team {k.team!r}")

    @staticmethod
    def _key_args(k: ApiKey) -> tuple[Any, ...]:
        return (k.id, k.tenant, k.secret_hash, k.team, k.project, k.partner, k.name, k.purpose, _j(k.labels),
                _j(k.scopes), _j(k.models), k.created_at, k.expires_at, k.revoked_at, k.rotated_from, k.rotated_to)

    async def get_key(self, key_id: str) -> ApiKey | None:
        r = await self._one(f"SELECT {_KEY_COLS} FROM api_keys WHERE id = ?", key_id)
        return _key(r) if r else None

    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]:
        if tenant is None:
            rows = await self._all(f"SELECT {_KEY_COLS} FROM api_keys ORDER BY created_at, id")
        else:
            rows = await self._all(f"SELECT {_KEY_COLS} FROM api_keys WHERE tenant = ? ORDER BY created_at, id", tenant)
        return [_key(r) for r in rows]

    async def revoke_key(self, key_id: str, at: float) -> ApiKey | None:
        """Idempotent: a key already revoked keeps its first revoked_at."""
        async with self._tx() as tx:
            await tx.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", at, key_id)
            await _notify(tx, f"key:{key_id}")
        return await self.get_key(key_id)

    async def update_key(self, key_id: str, changes: Mapping[str, Any]) -> ApiKey | None:
        """Edit a key's name/labels/scopes/models/expires_at (never its secret or place in the hierarchy).
        NotEditable for a revoked key, and for the expiry of a key that was rotated (rotation set its end);
        the condition is part of the UPDATE, so a concurrent revoke or rotate cannot slip in between."""
        sets = _sets(changes, _KEY_EDITABLE)
        async with self._tx() as tx:
            rows: list[Row] = []
            if sets:
                cond = "revoked_at IS NULL" + (" AND rotated_to IS NULL" if "expires_at" in sets else "")
                cols = ", ".join(f"{c} = ?" for c in sets)
                rows = await tx.fetch(f"UPDATE api_keys SET {cols} WHERE id = ? AND {cond} RETURNING {_KEY_COLS}",
                                      *sets.values(), key_id)
            if rows:
                await _notify(tx, f"key:{key_id}")
                return _key(rows[0])
            cur = await tx.fetch(f"SELECT {_KEY_COLS} FROM api_keys WHERE id = ?", key_id)
        if not cur:
            return None
        k = _key(cur[0])
        if k.revoked_at is not None:
            raise NotEditable(f"API key {key_id} is revoked; a revoked key cannot be changed.")
        if sets:
            raise NotEditable(f"API key {key_id} was rotated; its expiry was set by the rotation (revoke it to "
                              "end it now).")
        return k

    async def rotate_key(self, old_id: str, new: ApiKey, old_expires_at: float) -> ApiKey | None:
        """Insert `new` and cut the old key's life to `old_expires_at`, in one transaction."""
        async with self._tx() as tx:
            rows = await tx.fetch("SELECT rotated_to, revoked_at, expires_at FROM api_keys WHERE id = ?", old_id)
            if not rows or rows[0]["revoked_at"] is not None or rows[0]["rotated_to"] is not None:
                return None
            await self._check_parents(tx, new)
            exp = rows[0]["expires_at"]
            new_exp = old_expires_at if exp is None else min(exp, old_expires_at)
            await tx.execute(f"INSERT INTO api_keys ({_KEY_COLS}) VALUES ({', '.join('?' * 16)})", *self._key_args(new))
            await tx.execute("UPDATE api_keys SET expires_at = ?, rotated_to = ? WHERE id = ?", new_exp, new.id, old_id)
            await _notify(tx, f"key:{old_id}", f"key:{new.id}")
        return new
