"""The in-process store: bounded (LRU + TTL), partitioned, with a per-partition vector list for the semantic
tier. Local to the gateway's node; its location is declared in config (`cache.location`) so residency can be
checked before anything is put in it."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import orjson


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


class MemoryStore:
    name = "memory"

    def __init__(self, max_entries: int = 10000, location: Any = None) -> None:
        self.max_entries = max_entries
        self.location = location
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._by_partition: dict[str, dict[str, Entry]] = {}
        self._index: dict[str, tuple[list[Entry], np.ndarray]] = {}  # partition -> (entries, vectors)

    def __len__(self) -> int:
        return len(self._entries)

    def allows(self, decision: Any) -> bool:
        """May an entry created under this decision live here (residency of the store's location)?"""
        countries = getattr(decision, "allowed_countries", None)
        if countries is None:
            return True
        return self.location is not None and self.location.country in countries

    def get(self, key: str, now: float | None = None) -> Entry | None:
        e = self._entries.get(key)
        if e is None:
            return None
        if e.expires_at <= (now if now is not None else time.time()):
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return e

    def nearest(self, partition: str, params: str, vector: np.ndarray,
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
        if mat.shape[1] != vector.shape[0]:
            return None, -1.0
        sims = mat @ vector
        for i in np.argsort(-sims)[:8]:  # the best live entry with the same parameters among the top few
            e = live[int(i)]
            if e.expires_at <= now:
                self._drop(e.key)
                continue
            if e.params == params and e.key in self._entries:
                self._entries.move_to_end(e.key)
                return e, float(sims[i])
        return None, -1.0

    def put(self, e: Entry) -> None:
        self._drop(e.key)
        self._entries[e.key] = e
        self._by_partition.setdefault(e.partition, {})[e.key] = e
        self._index.pop(e.partition, None)
        while len(self._entries) > self.max_entries:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._index.pop(e.partition, None)
            part = self._by_partition.get(e.partition)
            if part is not None:
                part.pop(key, None)
                if not part:
                    del self._by_partition[e.partition]

    def invalidate(self, tenant: str | None = None, model: str | None = None, prefix: str | None = None) -> int:
        """Drop entries matching every given filter (all entries when none is given); returns how many."""
        gone = [k for k, e in self._entries.items()
                if (tenant is None or e.tenant == tenant) and (model is None or e.model == model)
                and (prefix is None or k.startswith(prefix))]
        for k in gone:
            self._drop(k)
        return len(gone)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def dump(self) -> bytes:
        """Every byte the store holds, serialised (tests grep it for canaries)."""
        return orjson.dumps([{k: (v.tolist() if isinstance(v, np.ndarray) else v)
                              for k, v in ((f, getattr(e, f)) for f in Entry.__slots__)}
                             for e in self._entries.values()])
