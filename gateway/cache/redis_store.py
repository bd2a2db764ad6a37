"""The Redis store: shared by the gateway's replicas (`cache.store: redis`, `cache.redis_url`).

Redis 7 has no vector search, so the semantic tier compares in the gateway: each partition keeps a bounded
hash of candidate vectors (at most `cache.max_partition_entries`, least recently used out first) that a lookup
reads in one round trip and scores with one matrix product. Keys (P = `cache.redis_key_prefix`, N = the config
namespace, a fingerprint of backends, aliases, policy and cache settings):

- `P:N:e:<partition>:<hash>`  the entry (a hash), with a Redis TTL of the entry's ttl_s;
- `P:N:v:<partition>`         candidate vectors of the partition: field = entry key, value = params|vector;
- `P:N:vz:<partition>`        the same candidates by last use (the bound);
- `P:N:vver:<partition>`      the candidates' version (a process rereads them only when it changed);
- `P:N:lru`                   every entry key by last use (the global `cache.max_entries` bound);
- `P:N:exp`                   every entry key by expiry (swept on each put).

The partition id is part of every key that holds an entry or a candidate, so no lookup can cross it; the
namespace keeps replicas running different configs (a rolling reload) from serving each other's entries.
A store error is a miss (lookups) or a skipped store (puts), never a failed request.
"""
from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.cache.store import (Entry, SharedStoreSettings, VectorCache, entry_body, entry_from, location_allows, ranked,
                                  vector_bytes)

if TYPE_CHECKING:
    pass

log = logging.getLogger("gateway.cache")
_GLOB = re.compile(r"([*?\[\]\\])")


def _glob_escape(s: str) -> str:
    return _GLOB.sub(r"\\\1", s)


def _s(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


class RedisStore(SharedStoreSettings):
    name = "redis"

    def __init__(self, url: str, key_prefix: str = "gwcache", max_entries: int = 10000, location: Any = None,
                 max_partition_entries: int = 1000, timeout_s: float = 0.5, namespace: str = "") -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.key_prefix = key_prefix
        self.max_entries = max_entries
        self.max_partition_entries = max_partition_entries
        self.location = location
        self.namespace = namespace or "0"
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._vectors = VectorCache(max(max_entries, max_partition_entries))

    def set_namespace(self, ns: str) -> None:
        self.namespace = ns or "0"
        self._vectors.clear()

    @property
    def _p(self) -> str:
        return f"{self.key_prefix}:{self.namespace}"

    def _e(self, key: str) -> str:
        return f"{self._p}:e:{key}"

    async def start(self) -> None:
        try:
            await self.client.ping()
        except Exception as e:  # start anyway: every lookup is a miss until Redis answers
            log.warning("cache redis %s unreachable at start: %s", self.url.split("@")[-1], e)

    async def close(self) -> None:
        await self.client.aclose()

    async def _read(self, key: str, now: float) -> Entry | None:
        """The entry and its LRU bump in one round trip (ZADD XX touches only existing members)."""
        t = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self._e(key))
        pipe.zadd(f"{self._p}:lru", {key: t}, xx=True)
        pipe.zadd(f"{self._p}:vz:{key.rsplit(':', 1)[0]}", {key: t}, xx=True)
        h: dict[bytes, bytes] = (await pipe.execute())[0]
        if not h:
            return None
        e = entry_from(key, _s(h[b"partition"]), _s(h[b"tenant"]), _s(h[b"model"]), _s(h[b"params"]),
                       float(h[b"created_at"]), float(h[b"expires_at"]), h[b"body"], h.get(b"vector") or None)
        if e.expires_at <= now:
            await self._forget([key])
            return None
        return e

    async def get(self, key: str, now: float | None = None) -> Entry | None:
        try:
            return await self._read(key, now if now is not None else time.time())
        except Exception as ex:  # a store outage is a miss
            log.warning("cache redis get failed: %s", ex)
            return None

    async def nearest(self, partition: str, params: str, vector: np.ndarray,
                      now: float | None = None) -> tuple[Entry | None, float]:
        """Cosine over the partition's candidates: this process's copy while the partition's version is
        unchanged (one GET), else one HGETALL of the partition's bounded candidate hash."""
        now = now if now is not None else time.time()
        try:
            version = await self.client.get(f"{self._p}:vver:{partition}")
            if version is None:
                return None, -1.0
            vec = vector.astype(np.float32)
            cached = self._vectors.get(partition, version)
            if cached is None:
                cands: dict[bytes, bytes] = await self.client.hgetall(  # type: ignore[misc,assignment]
                    f"{self._p}:v:{partition}")
                keys: list[str] = []
                pars: list[str] = []
                rows: list[bytes] = []
                for k, v in cands.items():
                    pb, _, vb = v.partition(b"|")
                    if len(vb) == vec.nbytes:
                        keys.append(_s(k))
                        pars.append(_s(pb))
                        rows.append(vb)
                mat = np.frombuffer(b"".join(rows), dtype=np.float32).reshape(len(rows), vec.shape[0])
                self._vectors.put(partition, version, keys, pars, mat)
                cached = (keys, np.array(pars, dtype=object), mat)
            keys, par, mat = cached
            for key, sim in ranked(keys, par, mat, params, vec):
                e = await self._read(key, now)
                if e is not None and e.partition == partition:
                    return e, sim
                await self._forget([key], partition)  # expired or evicted: drop its candidate
                self._vectors.drop(partition)
            return None, -1.0
        except Exception as ex:
            log.warning("cache redis nearest failed: %s", ex)
            return None, -1.0

    async def put(self, e: Entry) -> bool:
        if not location_allows(self.location, e.residency):
            return False
        ttl_ms = max(1, int((e.expires_at - e.created_at) * 1000))
        t = time.time()
        fields: dict[Any, Any] = {"partition": e.partition, "tenant": e.tenant, "model": e.model, "params": e.params,
                                  "created_at": repr(e.created_at), "expires_at": repr(e.expires_at),
                                  "body": entry_body(e)}
        vb = vector_bytes(e.vector)
        if vb is not None:
            fields["vector"] = vb
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(self._e(e.key), mapping=fields)
            pipe.pexpire(self._e(e.key), ttl_ms)
            pipe.zadd(f"{self._p}:lru", {e.key: t})
            pipe.zadd(f"{self._p}:exp", {e.key: e.expires_at})
            if vb is not None:
                v, vz = f"{self._p}:v:{e.partition}", f"{self._p}:vz:{e.partition}"
                ver = f"{self._p}:vver:{e.partition}"
                pipe.hset(v, e.key, e.params.encode() + b"|" + vb)
                pipe.zadd(vz, {e.key: t})
                pipe.incr(ver)
                for k in (v, vz, ver):  # the candidate list lives as long as its longest-lived entry
                    pipe.pexpire(k, ttl_ms, nx=True)
                    pipe.pexpire(k, ttl_ms, gt=True)
                pipe.zcard(vz)
            pipe.zcard(f"{self._p}:lru")
            res = await pipe.execute()
            n_all = int(res[-1])
            if vb is not None and int(res[-2]) > self.max_partition_entries:
                vz = f"{self._p}:vz:{e.partition}"
                old = await self.client.zrange(vz, 0, int(res[-2]) - self.max_partition_entries - 1)
                if old:
                    pipe = self.client.pipeline(transaction=True)
                    pipe.hdel(f"{self._p}:v:{e.partition}", *old)
                    pipe.zrem(vz, *old)
                    pipe.incr(f"{self._p}:vver:{e.partition}")
                    await pipe.execute()
            expired = await self.client.zrangebyscore(f"{self._p}:exp", "-inf", e.created_at, start=0, num=100)
            if expired:  # swept here so expired entries do not count against the LRU bound
                await self._forget([_s(k) for k in expired])
                n_all -= len(expired)
            if n_all > self.max_entries:
                old = await self.client.zrange(f"{self._p}:lru", 0, n_all - self.max_entries - 1)
                await self._forget([_s(k) for k in old])
            return True
        except Exception as ex:
            log.warning("cache redis put failed: %s", ex)
            return False

    async def _forget(self, keys: list[str], partition: str | None = None) -> None:
        """Remove entries and their index members (the partition is the key's part before its last ':')."""
        if not keys:
            return
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            part = partition or k.rsplit(":", 1)[0]
            pipe.unlink(self._e(k))
            pipe.zrem(f"{self._p}:lru", k)
            pipe.zrem(f"{self._p}:exp", k)
            pipe.hdel(f"{self._p}:v:{part}", k)
            pipe.zrem(f"{self._p}:vz:{part}", k)
        await pipe.execute()

    async def _scan(self, match: str) -> list[bytes]:
        return [k async for k in self.client.scan_iter(match=match, count=1000)]

    async def invalidate(self, tenant: str | None = None, model: str | None = None, prefix: str | None = None) -> int:
        """Drop matching entries in every namespace of this prefix (all of them when no filter is given)."""
        base = _glob_escape(self.key_prefix)
        if tenant is None and model is None and prefix is None:
            entries = await self._scan(f"{base}:*:e:*")
            every = await self._scan(f"{base}:*")
            for i in range(0, len(every), 500):
                await self.client.unlink(*every[i:i + 500])
            self._vectors.clear()
            return len(entries)
        match = f"{base}:*:e:" + (_glob_escape(prefix) if prefix else "") + "*"
        names = await self._scan(match)
        n = 0
        for i in range(0, len(names), 500):
            chunk = names[i:i + 500]
            pipe = self.client.pipeline(transaction=False)
            for name in chunk:
                pipe.hmget(name, "tenant", "model")
            gone: dict[str, list[str]] = {}
            for name, (t, m) in zip(chunk, await pipe.execute()):
                if t is None or (tenant is not None and _s(t) != tenant) or (model is not None and _s(m) != model):
                    continue
                ns, key = _s(name)[len(self.key_prefix) + 1:].split(":e:", 1)
                gone.setdefault(ns, []).append(key)
            for ns, keys in gone.items():
                saved, self.namespace = self.namespace, ns
                try:
                    await self._forget(keys)
                finally:
                    self.namespace = saved
                n += len(keys)
        return n

    async def count(self) -> int:
        return len(await self._scan(f"{_glob_escape(self._p)}:e:*"))

    async def all_entries(self) -> list[Entry]:
        out = []
        for name in await self._scan(f"{_glob_escape(self._p)}:e:*"):
            e = await self._read(_s(name).split(":e:", 1)[1], 0.0)
            if e is not None:
                out.append(e)
        return out

    async def dump(self) -> bytes:
        """Every key under the prefix and every value it holds (tests grep it for canaries)."""
        out = []
        for name in await self._scan(f"{_glob_escape(self.key_prefix)}:*"):
            kind = _s(await self.client.type(name))
            val: Any = None
            if kind == "hash":
                val = await self.client.hgetall(name)
            elif kind == "zset":
                val = await self.client.zrange(name, 0, -1)
            elif kind == "string":
                val = await self.client.get(name)
            out.append(name + b"=" + repr(val).encode())
        return b"\n".join(out)
