"""Adapters and source grants, kept in the identity store (SQLite by default, PostgreSQL for replicas).

The tables live beside the identity tables and use the identity store's transactions, so a change publishes its
event ("adapter:<name>", "adapter_sources:<tenant>") in the same transaction, and every replica listening on
the identity store hears it (Postgres LISTEN/NOTIFY; SQLite in-process). The tables are created idempotently
under the store's migration lock, apart from the identity migrations' version list.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from gateway.adapters.model import Adapter
from gateway.identity.model import Conflict, NotFound
from gateway.identity.store import Row, SqlIdentityStore, Tx, _lock_row, _notify

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS lora_adapters (
        name TEXT PRIMARY KEY, base_model TEXT NOT NULL, source TEXT NOT NULL, tenant TEXT NOT NULL,
        team TEXT, project TEXT, rank INTEGER, description TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS lora_adapters_tenant ON lora_adapters (tenant, name)",
    """CREATE TABLE IF NOT EXISTS adapter_source_grants (
        tenant TEXT NOT NULL, prefix TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (tenant, prefix))""",
]
_COLS = "name, base_model, source, tenant, team, project, rank, description, created_at, updated_at"
EDITABLE = ("source", "rank", "description")


def _adapter(r: Row) -> Adapter:
    return Adapter(name=r["name"], base_model=r["base_model"], source=r["source"], tenant=r["tenant"],
                   team=r["team"], project=r["project"], rank=r["rank"], description=r["description"],
                   created_at=r["created_at"], updated_at=r["updated_at"])


class AdapterStore:
    """Adapter rows and per-tenant source prefixes over an identity store's connection."""

    def __init__(self, store: SqlIdentityStore) -> None:
        self.store = store

    async def migrate(self) -> None:
        await self.store.ensure_tables(SCHEMA)
        # deleting a tenant: its adapters refuse it (409 resource_in_use, like its teams: DELETE each adapter
        # first, which unloads it from the engines); its source grants go with it in the same transaction, so a
        # tenant created again under that id starts without them
        self.store.on_tenant_delete(refuse=("adapters", "lora_adapters"),
                                    cascade=("adapter_source_grants", "adapter_sources:{tenant}"))

    # ---- source grants
    async def set_prefixes(self, tenant: str, prefixes: list[str]) -> list[str]:
        """Replace a tenant's granted source prefixes (NotFound if the tenant does not exist)."""
        async with self.store._tx() as tx:
            if not await _lock_row(tx, "tenants", "id = ?", tenant):
                raise NotFound(f"tenant {tenant!r} does not exist")
            await tx.execute("DELETE FROM adapter_source_grants WHERE tenant = ?", tenant)
            now = time.time()
            for p in sorted(set(prefixes)):
                await tx.execute("INSERT INTO adapter_source_grants (tenant, prefix, created_at) VALUES (?, ?, ?)",
                                 tenant, p, now)
            await _notify(tx, f"adapter_sources:{tenant}")
        return sorted(set(prefixes))

    async def prefixes(self, tenant: str) -> list[str]:
        async with self.store._tx() as tx:
            rows = await tx.fetch("SELECT prefix FROM adapter_source_grants WHERE tenant = ? ORDER BY prefix", tenant)
        return [r["prefix"] for r in rows]

    # ---- adapters
    async def create(self, a: Adapter, check: Any = None) -> Adapter:
        """Insert an adapter; `check(tx)` runs first in the same transaction (owner records exist, the source
        is granted), so a grant revoked or a team deleted meanwhile cannot slip in between. Conflict if taken."""
        try:
            async with self.store._tx() as tx:
                if check is not None:
                    await check(tx)
                await tx.execute(f"INSERT INTO lora_adapters ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 a.name, a.base_model, a.source, a.tenant, a.team, a.project, a.rank,
                                 a.description, a.created_at, a.updated_at)
                await _notify(tx, f"adapter:{a.name}")
        except Exception as e:
            if await self.store._is_unique_violation(e):
                raise Conflict("already exists") from None
            raise
        return a

    async def get(self, name: str) -> Adapter | None:
        async with self.store._tx() as tx:
            rows = await tx.fetch(f"SELECT {_COLS} FROM lora_adapters WHERE name = ?", name)
        return _adapter(rows[0]) if rows else None

    async def list(self, tenant: str | None = None) -> list[Adapter]:
        async with self.store._tx() as tx:
            if tenant is None:
                rows = await tx.fetch(f"SELECT {_COLS} FROM lora_adapters ORDER BY name")
            else:
                rows = await tx.fetch(f"SELECT {_COLS} FROM lora_adapters WHERE tenant = ? ORDER BY name", tenant)
        return [_adapter(r) for r in rows]

    async def update(self, name: str, changes: Mapping[str, Any], check: Any = None) -> Adapter | None:
        """Set editable columns (source, rank, description); `check(tx, current)` runs first. None if absent."""
        bad = set(changes) - set(EDITABLE)
        if bad:
            raise ValueError(f"not editable: {sorted(bad)}")
        async with self.store._tx() as tx:
            rows = await tx.fetch(f"SELECT {_COLS} FROM lora_adapters WHERE name = ?", name)
            if not rows:
                return None
            if check is not None:
                await check(tx, _adapter(rows[0]))
            if not changes:
                return _adapter(rows[0])
            sets = ", ".join(f"{c} = ?" for c in changes)
            rows = await tx.fetch(f"UPDATE lora_adapters SET {sets}, updated_at = ? WHERE name = ? RETURNING {_COLS}",
                                  *changes.values(), time.time(), name)
            await _notify(tx, f"adapter:{name}")
        return _adapter(rows[0])

    async def delete(self, name: str) -> bool:
        async with self.store._tx() as tx:
            rows = await tx.fetch("DELETE FROM lora_adapters WHERE name = ? RETURNING name", name)
            if rows:
                await _notify(tx, f"adapter:{name}")
        return bool(rows)


async def granted(tx: Tx, tenant: str) -> list[str]:
    """The tenant's prefixes, read inside a caller's transaction."""
    return [r["prefix"] for r in await tx.fetch(
        "SELECT prefix FROM adapter_source_grants WHERE tenant = ? ORDER BY prefix", tenant)]
