"""The SQLite store: one node, survives a restart (`cache.store: sqlite`, `cache.sqlite_path`).

Exact lookups by primary key. The semantic tier is a brute-force cosine scan over the vectors of one partition
(one matrix product; candidates with other request parameters masked out), bounded: a partition keeps at most
`cache.max_partition_entries` candidate vectors (the least recently used lose theirs first; their entries stay
for exact lookups). Each process keeps a copy of a partition's vectors while the partition's version (bumped
when a candidate is added or trimmed) is unchanged, so a lookup reads one row instead of every vector. sqlite-vec is not used: Python's sqlite3 here is built without `enable_load_extension`,
so the extension cannot be loaded (docs/cache.md#stores).

Every row carries the namespace of the config that created it (a fingerprint of backends, aliases, policy and
cache settings): after a restart with another config, older rows are never served (and are purged at start).
Calls run inline on the event loop: WAL, `synchronous=NORMAL`, a local file, microseconds per query.
"""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gateway.stores.sql import enable_wal
from gateway.cache.store import (Entry, SharedStoreSettings, VectorCache, entry_body, entry_from, location_allows, ranked,
                                  vector_bytes)

if TYPE_CHECKING:
    pass

SCHEMA = """
create table if not exists cache_entries (
  key text primary key,
  ns text not null,
  partition text not null,
  tenant text not null,
  model text not null,
  params text not null,
  created_at real not null,
  expires_at real not null,
  used_at real not null,
  body blob not null,
  vector blob
);
create index if not exists cache_part on cache_entries(ns, partition, used_at);
create index if not exists cache_exp on cache_entries(expires_at);
create index if not exists cache_used on cache_entries(used_at);
create table if not exists cache_versions (
  ns text not null,
  partition text not null,
  version integer not null,
  primary key (ns, partition)
);
"""
_COLS = "key, partition, tenant, model, params, created_at, expires_at, body, vector"


class SqliteStore(SharedStoreSettings):
    name = "sqlite"

    def __init__(self, path: str | Path, max_entries: int = 10000, location: Any = None,
                 max_partition_entries: int = 1000, namespace: str = "") -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self.max_partition_entries = max_partition_entries
        self.location = location
        self.namespace = namespace
        self._db: sqlite3.Connection | None = None
        self._vectors = VectorCache(max(max_entries, max_partition_entries))

    def set_namespace(self, ns: str) -> None:
        self.namespace = ns
        self._vectors.clear()

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=5.0, isolation_level=None)
            enable_wal(db)
            db.execute("pragma synchronous=normal")
            db.execute("pragma secure_delete=on")  # a purged or expired answer does not linger in free pages
            db.executescript(SCHEMA)
            self._db = db
        return self._db

    async def start(self) -> None:
        # rows of another config (a restart after a change) are never served: drop them now
        self.db.execute("delete from cache_entries where ns != ? or expires_at <= ?", (self.namespace, time.time()))
        self.db.execute("delete from cache_versions where ns != ?", (self.namespace,))

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _row(self, r: tuple) -> Entry:
        return entry_from(*r)

    async def get(self, key: str, now: float | None = None) -> Entry | None:
        now = now if now is not None else time.time()
        r = self.db.execute(f"select {_COLS} from cache_entries where key = ? and ns = ?",
                            (key, self.namespace)).fetchone()
        if r is None:
            return None
        if r[6] <= now:
            self.db.execute("delete from cache_entries where key = ?", (key,))
            return None
        self.db.execute("update cache_entries set used_at = ? where key = ?", (time.time(), key))
        return self._row(r)

    async def nearest(self, partition: str, params: str, vector: np.ndarray,
                      now: float | None = None) -> tuple[Entry | None, float]:
        """Cosine over the partition's candidates: this process's copy while the partition's version is
        unchanged (one indexed read), else one query for the partition's vectors."""
        now = now if now is not None else time.time()
        db = self.db
        r = db.execute("select version from cache_versions where ns = ? and partition = ?",
                       (self.namespace, partition)).fetchone()
        if r is None:
            return None, -1.0
        cached = self._vectors.get(partition, r[0])
        if cached is None:
            rows = db.execute(
                "select key, params, vector from cache_entries where ns = ? and partition = ?"
                " and vector is not null order by used_at desc limit ?",
                (self.namespace, partition, self.max_partition_entries)).fetchall()
            dim = vector.shape[0] * 4
            rows = [x for x in rows if len(x[2]) == dim]
            mat = np.frombuffer(b"".join(x[2] for x in rows), dtype=np.float32).reshape(len(rows), vector.shape[0])
            self._vectors.put(partition, r[0], [x[0] for x in rows], [x[1] for x in rows], mat)
            cached = ([x[0] for x in rows], np.array([x[1] for x in rows], dtype=object), mat)
        keys, par, mat = cached
        for key, sim in ranked(keys, par, mat, params, vector.astype(np.float32)):
            e = await self.get(key, now)
            if e is not None:
                return e, sim
            self._vectors.drop(partition)  # a candidate is gone (expired, evicted, purged): reread next time
        return None, -1.0

    async def put(self, e: Entry) -> bool:
        if not location_allows(self.location, e.residency):
            return False
        db = self.db
        now = time.time()
        db.execute("begin immediate")
        try:
            db.execute(f"insert or replace into cache_entries (ns, used_at, {_COLS}) values (?,?,?,?,?,?,?,?,?,?,?)",
                       (self.namespace, now, e.key, e.partition, e.tenant, e.model, e.params, e.created_at,
                        e.expires_at, entry_body(e), vector_bytes(e.vector)))
            db.execute("delete from cache_entries where expires_at <= ?", (e.created_at,))
            if e.vector is not None:  # the partition's candidate list is bounded: the least recently used lose it
                db.execute(
                    "update cache_entries set vector = null where key in (select key from cache_entries"
                    " where ns = ? and partition = ? and vector is not null"
                    " order by used_at desc limit -1 offset ?)",
                    (self.namespace, e.partition, self.max_partition_entries))
                db.execute("insert into cache_versions (ns, partition, version) values (?, ?, 1)"
                           " on conflict (ns, partition) do update set version = version + 1",
                           (self.namespace, e.partition))
            n = db.execute("select count(*) from cache_entries").fetchone()[0]
            if n > self.max_entries:
                db.execute("delete from cache_entries where key in (select key from cache_entries"
                           " order by used_at asc limit ?)", (n - self.max_entries,))
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            raise
        return True

    async def invalidate(self, tenant: str | None = None, model: str | None = None, prefix: str | None = None) -> int:
        where: list[str] = []
        args: list[Any] = []
        if tenant is not None:
            where.append("tenant = ?")
            args.append(tenant)
        if model is not None:
            where.append("model = ?")
            args.append(model)
        if prefix is not None:
            where.append("substr(key, 1, ?) = ?")
            args += [len(prefix), prefix]
        sql = "delete from cache_entries" + (" where " + " and ".join(where) if where else "")
        n = self.db.execute(sql, args).rowcount
        if not where:
            self.db.execute("delete from cache_versions")
            self._vectors.clear()
        return n

    async def count(self) -> int:
        return int(self.db.execute("select count(*) from cache_entries").fetchone()[0])

    async def all_entries(self) -> list[Entry]:
        return [self._row(r) for r in self.db.execute(f"select {_COLS} from cache_entries order by used_at")]

    async def dump(self) -> bytes:
        """The raw bytes of the database file and its WAL (tests grep them for canaries)."""
        self.db.execute("pragma wal_checkpoint(passive)")
        out = b""
        for p in (self.path, Path(str(self.path) + "-wal")):
            if p.exists():
                out += p.read_bytes()
        rows = self.db.execute("select * from cache_entries").fetchall()
        return out + orjson.dumps([[c.hex() if isinstance(c, bytes) else c for c in r] for r in rows])
