"""Cache stores. Every store satisfies `CacheStore`: exact lookups by key, a nearest-vector lookup within one
partition, put, invalidate, TTL and an LRU bound. Three exist (docs/cache.md#stores):

- `MemoryStore` (default): in process, bounded (LRU + TTL), per replica.
- `SqliteStore` (gateway/cache/sqlite_store.py): one node, survives a restart.
- `RedisStore` (gateway/cache/redis_store.py): shared by replicas.

A store has a `location` (`cache.location`): where its entries physically live. An entry is stored only where
that location satisfies the residency of the request that created it: the stage checks `allows(decision)`
before a lookup and before storing, and `put` checks the entry's own residency again (refusing, not raising).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import numpy as np
import orjson

if TYPE_CHECKING:
    from gateway.cache.config import CacheConfig
    from gateway.types import Decision


@dataclass(slots=True)
class Entry:
    key: str
    partition: str
    tenant: str
    model: str
    response: dict[str, Any]  # the completion object as a non-streamed client would have received it
    created_by: str  # the request id that produced it
    created_at: float
    expires_at: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float | None = None
    currency: str | None = None
    vector: np.ndarray | None = None
    params: str = ""
    guards: dict[str, Any] = field(default_factory=dict)
    hits: int = 0
    residency: list[str] | None = None  # the creating decision's allowed countries (None: unrestricted)


def entry_body(e: Entry) -> bytes:
    """What a persistent store serialises besides key / partition / tenant / model / params / times / vector."""
    return orjson.dumps({"response": e.response, "created_by": e.created_by, "prompt_tokens": e.prompt_tokens,
                         "completion_tokens": e.completion_tokens, "cost": e.cost, "currency": e.currency,
                         "guards": e.guards, "hits": e.hits, "residency": e.residency})


def entry_from(key: str, partition: str, tenant: str, model: str, params: str, created_at: float,
               expires_at: float, body: bytes | str, vector: bytes | None) -> Entry:
    d = orjson.loads(body)
    vec = np.frombuffer(vector, dtype=np.float32).copy() if vector else None
    return Entry(key=key, partition=partition, tenant=tenant, model=model, params=params, created_at=created_at,
                 expires_at=expires_at, vector=vec, **d)


def vector_bytes(v: np.ndarray | None) -> bytes | None:
    return None if v is None else np.asarray(v, dtype=np.float32).tobytes()


def location_allows(location: Any, countries: Iterable[str] | None) -> bool:
    """Does a store at `location` satisfy a residency restriction (None: unrestricted)?"""
    if countries is None:
        return True
    return location is not None and location.country in set(countries)


def best_of(candidates: list[Any], mat: np.ndarray, vector: np.ndarray) -> list[tuple[int, float]]:
    """(index, cosine) of the best few rows of `mat` (unit vectors) for `vector`, best first."""
    if mat.shape[0] == 0 or mat.shape[1] != vector.shape[0]:
        return []
    sims = mat @ vector
    order = np.argsort(-sims)[:8]
    return [(int(i), float(sims[i])) for i in order]


class VectorCache:
    """This process's copy of partitions' candidate vectors for the persistent stores, so a semantic lookup
    reads one version number instead of every vector: refreshed when the store's version of the partition
    changed (a candidate was added or trimmed), dropped when a candidate turned out gone. Bounded by rows."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._d: OrderedDict[str, tuple[Any, list[str], np.ndarray, np.ndarray]] = OrderedDict()
        self._rows = 0

    def get(self, partition: str, version: Any) -> tuple[list[str], np.ndarray, np.ndarray] | None:
        hit = self._d.get(partition)
        if hit is None or hit[0] != version:
            return None
        self._d.move_to_end(partition)
        return hit[1], hit[2], hit[3]

    def put(self, partition: str, version: Any, keys: list[str], params: list[str], mat: np.ndarray) -> None:
        self.drop(partition)
        if len(keys) > self.max_rows:
            return
        self._d[partition] = (version, keys, np.array(params, dtype=object), mat)
        self._rows += len(keys)
        while self._rows > self.max_rows:
            self.drop(next(iter(self._d)))

    def drop(self, partition: str) -> None:
        old = self._d.pop(partition, None)
        if old is not None:
            self._rows -= len(old[1])

    def clear(self) -> None:
        self._d.clear()
        self._rows = 0


def ranked(keys: list[str], params: np.ndarray, mat: np.ndarray, want: str,
           vector: np.ndarray) -> list[tuple[str, float]]:
    """(key, cosine) of the best few candidates with the wanted parameters, best first."""
    if not keys or mat.shape[1] != vector.shape[0]:
        return []
    sims = mat @ vector
    sims = np.where(params == want, sims, -np.inf)
    return [(keys[int(i)], float(sims[i])) for i in np.argsort(-sims)[:8] if sims[i] > -np.inf]


class CacheStore(Protocol):
    """What the stage and the service need of a store (all I/O is async; `allows` is not)."""

    name: str
    location: Any
    max_entries: int

    def allows(self, decision: Decision | None) -> bool: ...

    def retune(self, cc: CacheConfig, namespace: str) -> None:
        """A reload that keeps the store: its bounds, location and (shared stores) namespace from `cc`."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def get(self, key: str, now: float | None = None) -> Entry | None: ...

    async def nearest(self, partition: str, params: str, vector: np.ndarray,
                      now: float | None = None) -> tuple[Entry | None, float]: ...

    async def put(self, e: Entry) -> bool: ...

    async def invalidate(self, tenant: str | None = None, model: str | None = None,
                         prefix: str | None = None) -> int: ...

    async def count(self) -> int: ...

    async def all_entries(self) -> list[Entry]: ...

    async def dump(self) -> bytes: ...


class SharedStoreSettings:
    """The settings a shared store (Redis, SQLite) takes from the config and keeps across reloads: where it is
    (residency) and its bounds, plus its namespace. A subclass sets them in its constructor and has
    `set_namespace`."""

    location: Any
    max_entries: int
    max_partition_entries: int

    def set_namespace(self, namespace: str) -> None:  # pragma: no cover - the stores' own
        raise NotImplementedError

    def allows(self, decision: Decision | None) -> bool:
        """May an entry created under this decision live here (residency of the store's location)?"""
        return location_allows(self.location, decision.allowed_countries if decision is not None else None)

    def retune(self, cc: CacheConfig, namespace: str) -> None:
        self.max_entries = cc.max_entries
        self.location = cc.location
        self.max_partition_entries = cc.max_partition_entries
        self.set_namespace(namespace)


class MemoryStore:
    """In process: bounded (LRU + TTL), partitioned, with a per-partition vector matrix for the semantic tier.
    Local to the gateway's node and lost on restart."""

    name = "memory"

    def __init__(self, max_entries: int = 10000, location: Any = None) -> None:
        self.max_entries = max_entries
        self.location = location
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._by_partition: dict[str, dict[str, Entry]] = {}
        self._index: dict[str, tuple[list[Entry], np.ndarray]] = {}  # partition -> (entries, vectors)

    def __len__(self) -> int:
        return len(self._entries)

    def allows(self, decision: Decision | None) -> bool:
        """May an entry created under this decision live here (residency of the store's location)?"""
        return location_allows(self.location, decision.allowed_countries if decision is not None else None)

    def retune(self, cc: CacheConfig, namespace: str) -> None:
        """In process, one config at a time (a reload purges it): no namespace of its own."""
        self.max_entries = cc.max_entries
        self.location = cc.location

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._clear()

    async def get(self, key: str, now: float | None = None) -> Entry | None:
        e = self._entries.get(key)
        if e is None:
            return None
        if e.expires_at <= (now if now is not None else time.time()):
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return e

    async def nearest(self, partition: str, params: str, vector: np.ndarray,
                      now: float | None = None) -> tuple[Entry | None, float]:
        """The most similar live entry of the partition with the same parameters, and its cosine similarity
        (one matrix product over the partition's vectors, rebuilt only after the partition changed)."""
        now = now if now is not None else time.time()
        part = self._by_partition.get(partition)
        if not part:
            return None, -1.0
        idx = self._index.get(partition)
        if idx is None:
            with_vec = [(e, e.vector) for e in part.values() if e.vector is not None]
            dims = {v.shape for _, v in with_vec}
            if not with_vec or len(dims) != 1:
                return None, -1.0
            idx = self._index[partition] = ([e for e, _ in with_vec], np.stack([v for _, v in with_vec]))
        live, mat = idx
        for i, sim in best_of(live, mat, vector):  # the best live entry with the same parameters among the top few
            e = live[i]
            if e.expires_at <= now:
                self._drop(e.key)
                continue
            if e.params == params and e.key in self._entries:
                self._entries.move_to_end(e.key)
                return e, sim
        return None, -1.0

    async def put(self, e: Entry) -> bool:
        if not location_allows(self.location, e.residency):
            return False
        self._drop(e.key)
        self._entries[e.key] = e
        self._by_partition.setdefault(e.partition, {})[e.key] = e
        self._index.pop(e.partition, None)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._index.pop(e.partition, None)
            part = self._by_partition.get(e.partition)
            if part is not None:
                part.pop(key, None)
                if not part:
                    del self._by_partition[e.partition]

    def _clear(self) -> None:
        self._entries.clear()
        self._by_partition.clear()
        self._index.clear()

    async def invalidate(self, tenant: str | None = None, model: str | None = None, prefix: str | None = None) -> int:
        """Drop entries matching every given filter (all entries when none is given); returns how many."""
        gone = [k for k, e in self._entries.items()
                if (tenant is None or e.tenant == tenant) and (model is None or e.model == model)
                and (prefix is None or k.startswith(prefix))]
        for k in gone:
            self._drop(k)
        return len(gone)

    async def count(self) -> int:
        return len(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    async def all_entries(self) -> list[Entry]:
        return self.entries()

    async def dump(self) -> bytes:
        """Every byte the store holds, serialised (tests grep it for canaries)."""
        return orjson.dumps([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in asdict(e).items()}
                             for e in self._entries.values()])
