"""Store fixtures: the store-level tests run against every store (memory, sqlite, redis).

Redis is the shared one at 127.0.0.1:6379 under a fresh key prefix per test (cleaned up after; never a
FLUSHALL); a missing Redis skips locally and FAILS under CI=true (tests/conftest.py)."""
from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import pytest

from gateway.cache.store import MemoryStore
from tests.conftest import require_service

REDIS_URL = "redis://127.0.0.1:6379/0"
STORES = ["memory", "sqlite", "redis"]


def redis_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def redis_url() -> str:
    require_service(redis_up(), "Redis at 127.0.0.1:6379")
    return REDIS_URL


@pytest.fixture
def redis_prefix() -> str:
    return f"gwctest:{uuid.uuid4().hex[:10]}"


async def redis_clean(prefix: str) -> None:
    """Delete every key under the prefix (and check nothing is left)."""
    from gateway.cache.redis_store import RedisStore

    s = RedisStore(REDIS_URL, prefix)
    try:
        await s.invalidate()
        assert not await s._scan(f"{prefix}:*")
    finally:
        await s.close()


class Stores:
    """Makes fresh stores of one kind; remembers them for the canary grep and the cleanup."""

    def __init__(self, kind: str, tmp: Path, redis_prefix: str) -> None:
        self.kind = kind
        self.tmp = tmp
        self.redis_prefix = redis_prefix
        self.made: list[Any] = []

    def __call__(self, max_entries: int = 10000, location: Any = None, max_partition_entries: int = 1000) -> Any:
        n = len(self.made)
        s: Any
        if self.kind == "memory":
            s = MemoryStore(max_entries, location)
        elif self.kind == "sqlite":
            from gateway.cache.sqlite_store import SqliteStore

            s = SqliteStore(self.tmp / f"cache{n}.db", max_entries, location, max_partition_entries, "ns")
        else:
            from gateway.cache.redis_store import RedisStore

            s = RedisStore(REDIS_URL, f"{self.redis_prefix}:{n}", max_entries, location, max_partition_entries,
                           namespace="ns")
        self.made.append(s)
        return s

    async def raw_bytes(self) -> bytes:
        """Everything every store made here holds: the SQLite files themselves, every Redis key and value."""
        out = b""
        for s in self.made:
            out += await s.dump()
        if self.kind == "sqlite":
            for p in self.tmp.glob("cache*.db*"):
                out += p.read_bytes()
        return out


@pytest.fixture(params=STORES)
async def stores(request: Any, tmp_path: Path, redis_prefix: str) -> AsyncIterator[Callable[..., Any]]:
    if request.param == "redis":
        require_service(redis_up(), "Redis at 127.0.0.1:6379")
    st = Stores(request.param, tmp_path, redis_prefix)
    try:
        yield st
    finally:
        for s in st.made:
            await s.close()
        if request.param == "redis":
            await redis_clean(redis_prefix)
