"""Live rollout state, kept in the identity store (SQLite by default, PostgreSQL for replicas): per alias, the
weights an admin or a rollback set, and which arms are rolled back and why. Config weights are the initial
state; a row, once written, wins over config across reloads and restarts until it is reset."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.identity.store import SqlIdentityStore

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS alias_rollouts (
        alias TEXT PRIMARY KEY, weights TEXT NOT NULL, rolled_back TEXT NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL)""",
]


@dataclass(frozen=True)
class LiveState:
    weights: dict[str, float]
    rolled_back: dict[str, str] = field(default_factory=dict)  # arm -> why (and its weight is 0)
    updated_at: float = 0.0


class RolloutStore:
    def __init__(self, store: SqlIdentityStore) -> None:
        self.store = store

    async def migrate(self) -> None:
        await self.store.ensure_tables(SCHEMA)

    async def all(self) -> dict[str, LiveState]:
        async with self.store._tx() as tx:
            rows = await tx.fetch("SELECT alias, weights, rolled_back, updated_at FROM alias_rollouts")
        return {r["alias"]: _state(r) for r in rows}

    async def put(self, alias: str, st: LiveState) -> LiveState:
        now = time.time()
        w, rb = orjson.dumps(st.weights).decode(), orjson.dumps(st.rolled_back).decode()
        async with self.store._tx() as tx:
            await tx.execute(
                "INSERT INTO alias_rollouts (alias, weights, rolled_back, updated_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (alias) DO UPDATE SET weights = excluded.weights, rolled_back = excluded.rolled_back, "
                "updated_at = excluded.updated_at", alias, w, rb, now)
        return LiveState(dict(st.weights), dict(st.rolled_back), now)

    async def roll_back(self, alias: str, arm: str, why: str, base: LiveState) -> LiveState:
        """Set `arm`'s weight to 0 with its reason as one read-modify-write, and return the stored state. The first
        rollback of an arm wins: replicas (and workers) judge their own windows and may each roll the same arm back
        with a different reason before their next refresh; a later one leaves the stored reason and the other
        arms' weights as they are. `base` is the writer's state, stored only when the alias has no row yet."""
        async with self.store._tx() as tx:
            w0, rb0 = orjson.dumps(base.weights).decode(), orjson.dumps(base.rolled_back).decode()
            await tx.execute("INSERT INTO alias_rollouts (alias, weights, rolled_back, updated_at) VALUES (?, ?, ?, ?) "
                             "ON CONFLICT (alias) DO NOTHING", alias, w0, rb0, time.time())
            # a no-op UPDATE takes PostgreSQL's row lock for the rest of the transaction (SQLite's BEGIN IMMEDIATE
            # serialises it already): two rollbacks of one alias read and write one after the other
            await tx.execute("UPDATE alias_rollouts SET alias = alias WHERE alias = ?", alias)
            rows = await tx.fetch("SELECT alias, weights, rolled_back, updated_at FROM alias_rollouts WHERE alias = ?",
                                  alias)
            cur = _state(rows[0])
            if arm in cur.rolled_back:
                return cur
            now = time.time()
            new = LiveState({**cur.weights, arm: 0.0}, {**cur.rolled_back, arm: why}, now)
            await tx.execute("UPDATE alias_rollouts SET weights = ?, rolled_back = ?, updated_at = ? WHERE alias = ?",
                             orjson.dumps(new.weights).decode(), orjson.dumps(new.rolled_back).decode(), now, alias)
        return new

    async def delete(self, alias: str) -> None:
        async with self.store._tx() as tx:
            await tx.execute("DELETE FROM alias_rollouts WHERE alias = ?", alias)


def _state(r: Any) -> LiveState:
    return LiveState({k: float(v) for k, v in orjson.loads(r["weights"]).items()},
                     dict(orjson.loads(r["rolled_back"])), float(r["updated_at"]))
