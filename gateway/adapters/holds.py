"""Adapter holds shared by gateway replicas, so two of them never fight over one engine's adapter slots.

Each process (a replica, or a worker of `server.workers`) publishes, per (engine, adapter) it placed, how many of
its requests hold the adapter there and when it last used it, in a table of the identity store all of them
share (`adapter_holds`, beside the adapter registry: PostgreSQL for replicas, the SQLite file for the workers
of one host). A row with requests in flight counts only while its lease (`expires_at`) is fresh: a process
renews its leases every `RENEW_S` and a crashed one's lapse after `LEASE_S`. Before a process unloads an
adapter to make room it reads the other processes' rows for that engine: an adapter another process holds is
never unloaded, and the least recently used is judged by the latest use of any process.

Writes are on a process's transitions only (its first request holding an adapter on an engine, awaited before
the request is sent, so another process reading afterwards sees it; its last one finishing, in the background)
and the renewal, so a hot adapter costs no write per request. What is left between one process's read and its
unload (another's first request for that adapter in those milliseconds) is caught by the engine's 404 for it:
that request re-reads, loads the adapter again and is retried there (gateway/adapters/placement.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable, NamedTuple

from gateway.identity.store import SqlIdentityStore

LEASE_S = 15.0  # a row's requests in flight count this long after its last renewal
RENEW_S = 5.0
FORGET_S = 600.0  # rows unused this long are deleted (their use time no longer matters to an LRU choice)
log = logging.getLogger(__name__)

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS adapter_holds (
        engine TEXT NOT NULL, adapter TEXT NOT NULL, holder TEXT NOT NULL, inflight INTEGER NOT NULL,
        used_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (engine, adapter, holder))""",
]


class Hold(NamedTuple):
    """Other processes' hold on one adapter of one engine."""

    inflight: int  # their requests holding it now (leases fresh)
    used_at: float  # their latest use (wall clock)


class SharedHolds:
    """This process's holds in the shared table, and the others' (see the module doc)."""

    def __init__(self, store: SqlIdentityStore, holder: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.holder = holder or uuid.uuid4().hex
        self.clock = clock
        self._mine: dict[tuple[str, str], tuple[int, float]] = {}  # (engine, adapter) -> (inflight, used_at)
        self._write = asyncio.Lock()  # one write at a time, each of the state at the time it runs
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.store.ensure_tables(SCHEMA)
        self._task = asyncio.create_task(self._renew_loop(), name="adapter-holds-renew")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        try:  # a clean stop gives its leases back at once
            async with self.store._tx() as tx:
                await tx.execute("DELETE FROM adapter_holds WHERE holder = ?", self.holder)
        except Exception as e:  # the store may be closing too: the leases lapse anyway
            log.debug("adapter holds: release at close failed: %s", e)

    def note(self, engine: str, adapter: str, inflight: int) -> bool:
        """Record this process's count; True when it crossed zero (the caller then writes: `flush`)."""
        prev = self._mine.get((engine, adapter), (0, 0.0))[0]
        self._mine[(engine, adapter)] = (inflight, self.clock())
        return (prev > 0) != (inflight > 0)

    async def flush(self, engine: str, adapter: str) -> None:
        """Write this process's current count for (engine, adapter)."""
        async with self._write:
            n, used = self._mine.get((engine, adapter), (0, self.clock()))
            async with self.store._tx() as tx:
                await tx.execute(
                    "INSERT INTO adapter_holds (engine, adapter, holder, inflight, used_at, expires_at) "
                    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (engine, adapter, holder) DO UPDATE SET "
                    "inflight = excluded.inflight, used_at = excluded.used_at, expires_at = excluded.expires_at",
                    engine, adapter, self.holder, n, used, self.clock() + LEASE_S)

    async def others(self, engine: str) -> dict[str, Hold]:
        """The other processes' holds on `engine`'s adapters (requests in flight only under a fresh lease)."""
        now = self.clock()
        async with self.store._tx() as tx:
            rows = await tx.fetch("SELECT adapter, inflight, used_at, expires_at FROM adapter_holds "
                                  "WHERE engine = ? AND holder <> ?", engine, self.holder)
        out: dict[str, Hold] = {}
        for r in rows:
            n = int(r["inflight"]) if r["expires_at"] > now else 0
            h = out.get(r["adapter"])
            out[r["adapter"]] = Hold(n, float(r["used_at"])) if h is None else Hold(h.inflight + n,
                                                                                    max(h.used_at, r["used_at"]))
        return out

    async def forget_adapter(self, adapter: str) -> None:
        """The adapter was deleted: this process's rows for it go."""
        for key in [k for k in self._mine if k[1] == adapter]:
            del self._mine[key]
        async with self.store._tx() as tx:
            await tx.execute("DELETE FROM adapter_holds WHERE adapter = ? AND holder = ?", adapter, self.holder)

    async def renew(self) -> None:
        """Renew the leases of this process's rows with requests in flight; delete long-unused rows."""
        now = self.clock()
        async with self._write:
            async with self.store._tx() as tx:
                await tx.execute("UPDATE adapter_holds SET expires_at = ? WHERE holder = ? AND inflight > 0",
                                 now + LEASE_S, self.holder)
                await tx.execute("DELETE FROM adapter_holds WHERE used_at < ? AND expires_at < ?",
                                 now - FORGET_S, now)
        for key, (n, used) in list(self._mine.items()):
            if n <= 0 and used < now - FORGET_S:
                del self._mine[key]

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await self.renew()
            except Exception as e:  # the store away for a moment: the next renewal tries again
                log.warning("adapter holds: renewal failed: %s", e)
