"""The identity store interface and the SQL both implementations share (SQLite and PostgreSQL).

Backends only provide a transaction object (`fetch`, `execute`, `notify`) and the listener; queries,
migrations and row mapping live here once, so both stores behave identically and one test suite covers both.
Change events ("key:<id>", "tenant:<id>", "team:<t>/<id>", "project:<t>/<team>/<id>", "partner:<id>")
are published in the same transaction as the change, so a replica never hears of a change that rolled back.
"""
from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from typing import Any, Awaitable, Callable, Mapping, Protocol, Sequence

import orjson

from gateway.identity.model import ApiKey, Conflict, NotFound, Partner, Project, Team, Tenant

EventCallback = Callable[[str], None]

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
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


class Tx(Protocol):
    async def fetch(self, sql: str, *args: Any) -> list[Mapping[str, Any]]: ...

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
    async def create_team(self, t: Team) -> Team: ...
    async def get_team(self, tenant: str, team_id: str) -> Team | None: ...
    async def list_teams(self, tenant: str) -> list[Team]: ...
    async def create_project(self, p: Project) -> Project: ...
    async def get_project(self, tenant: str, team: str, project_id: str) -> Project | None: ...
    async def list_projects(self, tenant: str, team: str | None = None) -> list[Project]: ...
    async def create_partner(self, p: Partner) -> Partner: ...
    async def get_partner(self, partner_id: str) -> Partner | None: ...
    async def list_partners(self, tenant: str | None = None) -> list[Partner]: ...
    async def create_key(self, k: ApiKey) -> ApiKey: ...
    async def get_key(self, key_id: str) -> ApiKey | None: ...
    async def list_keys(self, tenant: str | None = None) -> list[ApiKey]: ...
    async def revoke_key(self, key_id: str, at: float) -> ApiKey | None: ...
    async def rotate_key(self, old_id: str, new: ApiKey, old_expires_at: float) -> ApiKey | None: ...


def _j(v: Any) -> str:
    return orjson.dumps(v).decode()


def _l(v: str | None) -> Any:
    return orjson.loads(v) if v else {}


_KEY_COLS = ("id, tenant, secret_hash, team, project, partner, name, purpose, labels, scopes, models, created_at, "
             "expires_at, revoked_at, rotated_from, rotated_to")


def _key(r: Mapping[str, Any]) -> ApiKey:
    return ApiKey(
        id=r["id"], tenant=r["tenant"], secret_hash=r["secret_hash"], team=r["team"], project=r["project"],
        partner=r["partner"], name=r["name"], purpose=r["purpose"], labels=_l(r["labels"]),
        scopes=orjson.loads(r["scopes"]), models=orjson.loads(r["models"]), created_at=r["created_at"],
        expires_at=r["expires_at"], revoked_at=r["revoked_at"], rotated_from=r["rotated_from"],
        rotated_to=r["rotated_to"],
    )


class SqlIdentityStore:
    """All queries, written once with `?` placeholders; subclasses supply `_tx()` and `listen()`."""

    def _tx(self) -> AbstractAsyncContextManager[Tx]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def _is_unique_violation(self, e: BaseException) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

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

    async def _insert(self, sql: str, args: Sequence[Any], events: Sequence[str]) -> None:
        try:
            async with self._tx() as tx:
                await tx.execute(sql, *args)
                for ev in events:
                    r = tx.notify(ev)
                    if r is not None:
                        await r
        except Exception as e:
            if await self._is_unique_violation(e):
                raise Conflict("already exists") from None
            raise

    async def _one(self, sql: str, *args: Any) -> Mapping[str, Any] | None:
        async with self._tx() as tx:
            rows = await tx.fetch(sql, *args)
        return rows[0] if rows else None

    async def _all(self, sql: str, *args: Any) -> list[Mapping[str, Any]]:
        async with self._tx() as tx:
            return list(await tx.fetch(sql, *args))

    # ---- tenants
    async def create_tenant(self, t: Tenant) -> Tenant:
        await self._insert("INSERT INTO tenants (id, name, labels, created_at) VALUES (?, ?, ?, ?)",
                           (t.id, t.name, _j(t.labels), t.created_at), [f"tenant:{t.id}"])
        return t

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        r = await self._one("SELECT * FROM tenants WHERE id = ?", tenant_id)
        return Tenant(r["id"], r["name"], _l(r["labels"]), r["created_at"]) if r else None

    async def list_tenants(self) -> list[Tenant]:
        return [Tenant(r["id"], r["name"], _l(r["labels"]), r["created_at"])
                for r in await self._all("SELECT * FROM tenants ORDER BY id")]

    async def update_tenant_labels(self, tenant_id: str, labels: dict[str, str]) -> Tenant | None:
        async with self._tx() as tx:
            await tx.execute("UPDATE tenants SET labels = ? WHERE id = ?", _j(labels), tenant_id)
            r = tx.notify(f"tenant:{tenant_id}")
            if r is not None:
                await r
        return await self.get_tenant(tenant_id)

    # ---- teams
    async def create_team(self, t: Team) -> Team:
        if await self.get_tenant(t.tenant) is None:
            raise NotFound(f"tenant {t.tenant!r} does not exist")
        await self._insert("INSERT INTO teams (tenant, id, name, labels, created_at) VALUES (?, ?, ?, ?, ?)",
                           (t.tenant, t.id, t.name, _j(t.labels), t.created_at), [f"team:{t.tenant}/{t.id}"])
        return t

    async def get_team(self, tenant: str, team_id: str) -> Team | None:
        r = await self._one("SELECT * FROM teams WHERE tenant = ? AND id = ?", tenant, team_id)
        return Team(r["tenant"], r["id"], r["name"], _l(r["labels"]), r["created_at"]) if r else None

    async def list_teams(self, tenant: str) -> list[Team]:
        return [Team(r["tenant"], r["id"], r["name"], _l(r["labels"]), r["created_at"])
                for r in await self._all("SELECT * FROM teams WHERE tenant = ? ORDER BY id", tenant)]

    # ---- projects
    async def create_project(self, p: Project) -> Project:
        if await self.get_team(p.tenant, p.team) is None:
            raise NotFound(f"team {p.team!r} does not exist in tenant {p.tenant!r}")
        await self._insert(
            "INSERT INTO projects (tenant, team, id, name, labels, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (p.tenant, p.team, p.id, p.name, _j(p.labels), p.created_at), [f"project:{p.tenant}/{p.team}/{p.id}"])
        return p

    async def get_project(self, tenant: str, team: str, project_id: str) -> Project | None:
        r = await self._one("SELECT * FROM projects WHERE tenant = ? AND team = ? AND id = ?", tenant, team, project_id)
        return Project(r["tenant"], r["team"], r["id"], r["name"], _l(r["labels"]), r["created_at"]) if r else None

    async def list_projects(self, tenant: str, team: str | None = None) -> list[Project]:
        if team is None:
            rows = await self._all("SELECT * FROM projects WHERE tenant = ? ORDER BY team, id", tenant)
        else:
            rows = await self._all("SELECT * FROM projects WHERE tenant = ? AND team = ? ORDER BY id", tenant, team)
        return [Project(r["tenant"], r["team"], r["id"], r["name"], _l(r["labels"]), r["created_at"]) for r in rows]

    # ---- partners
    async def create_partner(self, p: Partner) -> Partner:
        if await self.get_tenant(p.tenant) is None:
            raise NotFound(f"tenant {p.tenant!r} does not exist")
        await self._insert("INSERT INTO partners (id, tenant, name, labels, created_at) VALUES (?, ?, ?, ?, ?)",
                           (p.id, p.tenant, p.name, _j(p.labels), p.created_at), [f"partner:{p.id}"])
        return p

    async def get_partner(self, partner_id: str) -> Partner | None:
        r = await self._one("SELECT * FROM partners WHERE id = ?", partner_id)
        return Partner(r["id"], r["tenant"], r["name"], _l(r["labels"]), r["created_at"]) if r else None

    async def list_partners(self, tenant: str | None = None) -> list[Partner]:
        if tenant is None:
            rows = await self._all("SELECT * FROM partners ORDER BY id")
        else:
            rows = await self._all("SELECT * FROM partners WHERE tenant = ? ORDER BY id", tenant)
        return [Partner(r["id"], r["tenant"], r["name"], _l(r["labels"]), r["created_at"]) for r in rows]

    # ---- keys
    async def create_key(self, k: ApiKey) -> ApiKey:
        await self._check_parents(k)
        await self._insert(f"INSERT INTO api_keys ({_KEY_COLS}) VALUES ({', '.join('?' * 16)})",
                           self._key_args(k), [f"key:{k.id}"])
        return k

    async def _check_parents(self, k: ApiKey) -> None:
        if await self.get_tenant(k.tenant) is None:
            raise NotFound(f"tenant {k.tenant!r} does not exist")
        if k.team is not None and await self.get_team(k.tenant, k.team) is None:
            raise NotFound(f"team {k.team!r} does not exist in tenant {k.tenant!r}")
        if k.project is not None and (k.team is None or await self.get_project(k.tenant, k.team, k.project) is None):
            raise NotFound(f"project {k.project!r} does not exist in team {k.team!r}")
        if k.partner is not None:
            p = await self.get_partner(k.partner)
            if p is None or p.tenant != k.tenant:
                raise NotFound(f"partner {k.partner!r} does not exist in tenant {k.tenant!r}")

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
        async with self._tx() as tx:
            await tx.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", at, key_id)
            r = tx.notify(f"key:{key_id}")
            if r is not None:
                await r
        return await self.get_key(key_id)

    async def rotate_key(self, old_id: str, new: ApiKey, old_expires_at: float) -> ApiKey | None:
        """Insert `new` and cut the old key's life to `old_expires_at`, in one transaction."""
        await self._check_parents(new)
        async with self._tx() as tx:
            rows = await tx.fetch("SELECT rotated_to, revoked_at, expires_at FROM api_keys WHERE id = ?", old_id)
            if not rows or rows[0]["revoked_at"] is not None or rows[0]["rotated_to"] is not None:
                return None
            exp = rows[0]["expires_at"]
            new_exp = old_expires_at if exp is None else min(exp, old_expires_at)
            await tx.execute(f"INSERT INTO api_keys ({_KEY_COLS}) VALUES ({', '.join('?' * 16)})", *self._key_args(new))
            await tx.execute("UPDATE api_keys SET expires_at = ?, rotated_to = ? WHERE id = ?", new_exp, new.id, old_id)
            for ev in (f"key:{old_id}", f"key:{new.id}"):
                r = tx.notify(ev)
                if r is not None:
                    await r
        return new
