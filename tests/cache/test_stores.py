"""Store specifics: the SQLite store survives a restart within its namespace (and drops other namespaces'
rows at start); Redis keys all carry the prefix and the partition; a residency the store's location does not
satisfy is refused by the store itself, whatever the caller."""
from __future__ import annotations

import time

import numpy as np
import pytest

from gateway.cache.config import CacheLocation
from gateway.cache.sqlite_store import SqliteStore
from gateway.cache.store import Entry

pytestmark = pytest.mark.asyncio


def entry(key: str = "p1:k1", partition: str = "p1", residency: list[str] | None = None, ttl: float = 60) -> Entry:
    now = time.time()
    v = np.ones(4, dtype=np.float32) / 2
    return Entry(key=key, partition=partition, tenant="a", model="m", response={"answer": key}, created_by="r1",
                 created_at=now, expires_at=now + ttl, vector=v, params="q", residency=residency)


async def test_sqlite_survives_a_restart_in_its_namespace(tmp_path):
    s = SqliteStore(tmp_path / "c.db", namespace="ns1")
    await s.start()
    assert await s.put(entry())
    await s.close()
    s = SqliteStore(tmp_path / "c.db", namespace="ns1")
    await s.start()
    e = await s.get("p1:k1")
    assert e is not None and e.response == {"answer": "p1:k1"} and e.created_by == "r1"
    got, sim = await s.nearest("p1", "q", np.ones(4, dtype=np.float32) / 2)
    assert got is not None and sim == pytest.approx(1.0)
    await s.close()
    s = SqliteStore(tmp_path / "c.db", namespace="ns2")  # another config: never served, dropped at start
    await s.start()
    assert await s.get("p1:k1") is None and await s.count() == 0
    await s.close()


async def test_every_store_refuses_an_entry_its_location_does_not_satisfy(stores):
    s = stores(location=CacheLocation(country="US"))
    assert not await s.put(entry(residency=["DE", "FR"]))
    assert await s.count() == 0
    assert await s.put(entry(key="p1:k2"))  # unrestricted
    s = stores(location=None)
    assert not await s.put(entry(residency=["DE"]))
    s = stores(location=CacheLocation(country="DE"))
    assert await s.put(entry(residency=["DE", "FR"])) and await s.count() == 1


async def test_nearest_never_leaves_the_partition(stores):
    s = stores()
    await s.put(entry("p1:k1", "p1"))
    got, _ = await s.nearest("p2", "q", np.ones(4, dtype=np.float32) / 2)
    assert got is None
    got, _ = await s.nearest("p1", "other-params", np.ones(4, dtype=np.float32) / 2)
    assert got is None
    got, _ = await s.nearest("p1", "q", np.ones(4, dtype=np.float32) / 2)
    assert got is not None and got.key == "p1:k1"


@pytest.mark.parametrize("stores", ["redis"], indirect=True)  # the Redis key layout
async def test_redis_keys_carry_prefix_namespace_and_partition(stores):
    s = stores(max_partition_entries=5)
    await s.put(entry("p1:k1", "p1"))
    names = sorted(k.decode() for k in await s._scan(f"{s.key_prefix}:*"))
    assert names == [f"{s.key_prefix}:ns:e:p1:k1", f"{s.key_prefix}:ns:exp", f"{s.key_prefix}:ns:lru", f"{s.key_prefix}:ns:v:p1",
                     f"{s.key_prefix}:ns:vver:p1", f"{s.key_prefix}:ns:vz:p1"]
    ttl = await s.client.pttl(f"{s.key_prefix}:ns:e:p1:k1")
    assert 0 < ttl <= 60_000  # Redis expires the entry itself too


async def test_expired_entries_are_swept_and_do_not_count_against_the_bound(stores):
    s = stores(max_entries=2)
    old = entry("p1:old", ttl=60)
    old.created_at -= 120
    old.expires_at -= 120  # already expired when stored
    await s.put(old)
    await s.put(entry("p1:k1"))
    await s.put(entry("p1:k2"))
    assert {e.key for e in await s.all_entries()} == {"p1:k1", "p1:k2"}


async def test_a_failing_store_is_a_bypass_or_a_miss_never_an_error(tmp_path):
    from gateway.cache.redis_store import RedisStore
    from gateway.cache.store import MemoryStore
    from tests.cache.helpers import make_ctx, make_stage, serve, user

    class Broken(MemoryStore):
        async def get(self, key, now=None):
            raise OSError("disk gone")

        async def put(self, e):
            raise OSError("disk gone")

    stage, _, _ = make_stage(stores=lambda *a: Broken(*a[:2]))
    c = make_ctx(user("q"), mode="exact")
    assert await serve(stage, c, "a") == "bypass" and c.evidence["cache"]["reason"] == "store_error"
    down = RedisStore("redis://127.0.0.1:9/0", "gwctest:down", timeout_s=0.2)  # nothing listens there
    stage, _, _ = make_stage(stores=lambda *a: down)
    c = make_ctx(user("q"))
    assert await serve(stage, c, "a") == "miss" and c.evidence["cache"]["stored"] is False
    await down.close()


async def test_sqlite_shared_by_two_processes_on_one_node(tmp_path):
    """Two connections on one file (two gateway processes of one node): an entry and a new semantic candidate
    written by one are seen by the other (its vector copy is reread when the partition's version moved)."""
    a = SqliteStore(tmp_path / "c.db", namespace="ns")
    b = SqliteStore(tmp_path / "c.db", namespace="ns")
    await a.start()
    await b.start()
    q = np.ones(4, dtype=np.float32) / 2
    assert (await b.nearest("p1", "q", q))[0] is None
    await a.put(entry("p1:k1", "p1"))
    assert (await b.get("p1:k1")) is not None
    assert (await b.nearest("p1", "q", q))[0].key == "p1:k1"
    other = entry("p1:k2", "p1")
    other.vector = np.array([1, 0, 0, 0], dtype=np.float32)
    await a.put(other)
    got, sim = await b.nearest("p1", "q", np.array([1, 0, 0, 0], dtype=np.float32))
    assert got.key == "p1:k2" and sim == pytest.approx(1.0)
    assert await a.invalidate(prefix="p1:") == 2 and (await b.nearest("p1", "q", q))[0] is None
    await a.close()
    await b.close()
