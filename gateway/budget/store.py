"""Budget stores: where counters and holds live. One atomic reserve and one atomic settle per request.

`MemoryBudgetStore` runs the pure reference model in-process (single replica) and snapshots it to SQLite;
`SqliteBudgetStore` runs it over rows of a SQLite table, one transaction per call, so the worker processes of
one host sharing the file see one budget; `RedisBudgetStore` runs the same algorithm as one Lua script (one
EVALSHA round trip per call) so every replica sharing the Redis sees one budget. All raise `StoreUnavailable`
when they cannot answer.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import orjson

from gateway.budget.dimensions import COUNTED, HELD, HOLD_PARTS_MIN
from gateway.budget.model import BudgetState, ReserveArgs, ReserveResult, SettleArgs
from gateway.budget.windows import RollingCounter, pad_sums
from gateway.stores.sql import enable_wal, is_locked

log = logging.getLogger("gateway.budget.store")


def _lua() -> str:
    """budget.lua (package data) after a prelude of the budget dimensions as Lua constants (see the script's
    header), generated from the table: the script iterates whatever dimensions the table declares."""
    held = [d.code for d in HELD]

    def arr(xs: list) -> str:
        return "{" + ", ".join(f"'{x}'" if isinstance(x, str) else str(x) for x in xs) + "}"

    prelude = (f"local W, TOT, AT, HT, HM = {arr([d.code for d in COUNTED])}, "
               f"{arr([d.code.upper() for d in COUNTED])}, "
               f"{arr([held.index(d.code) + 1 if d.code in held else 0 for d in COUNTED])}, "
               f"{arr(['_' + c for c in held])}, {HOLD_PARTS_MIN}\n")
    return prelude + (resources.files("gateway.budget") / "budget.lua").read_text(encoding="utf-8")


LUA = _lua()
# the SQLite store's holds: one integer column per held budget dimension, named by its code
_HOLD_COLS = tuple(d.code for d in HELD)
_HOLD_SUMS = ", ".join(f"sum({c})" for c in _HOLD_COLS)
_HOLD_INSERT = (f"INSERT OR REPLACE INTO budget_holds (hk, rid, x, {', '.join(_HOLD_COLS)}) "
                f"VALUES ({', '.join('?' * (3 + len(_HOLD_COLS)))})")
_NC = len(COUNTED)


class StoreUnavailable(Exception):
    """The store could not be reached or answered an error; the service applies fail-closed/open."""


class BudgetStore(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def reserve(self, args: ReserveArgs) -> ReserveResult: ...

    async def settle(self, args: SettleArgs) -> bool:
        """True when applied; False when a settle with the same idempotency marker was applied before."""
        ...


class MemoryBudgetStore:
    """Single-replica store: the reference model in memory, snapshotted to SQLite every interval and at close.

    Operations are synchronous Python between awaits, so each reserve/settle is atomic on the event loop.
    """

    def __init__(self, sqlite_path: Path | None = None, snapshot_interval_s: float = 5.0, name: str = "memory") -> None:
        self.path = sqlite_path
        self.interval = snapshot_interval_s
        self.name = name
        self.state = BudgetState()
        self._task: asyncio.Task[None] | None = None
        self._dirty = False

    async def start(self) -> None:
        if self.path is not None:
            loaded = await asyncio.to_thread(self._load)
            if loaded is not None:
                self.state = BudgetState.from_state(loaded)
            self._task = asyncio.create_task(self._snapshot_loop(), name="budget-snapshot")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.path is not None:
            await self.snapshot()

    async def reserve(self, args: ReserveArgs) -> ReserveResult:
        self._dirty = True
        return ReserveResult.from_flat(self.state.reserve(args), args)

    async def settle(self, args: SettleArgs) -> bool:
        self._dirty = True
        return self.state.settle(args) == 1

    async def snapshot(self) -> None:
        """Write the whole state as one row (small: counters are bucketed, holds are short-lived)."""
        if self.path is None:
            return
        self.state.gc(time.time())
        blob = orjson.dumps(self.state.to_state())
        self._dirty = False
        await asyncio.to_thread(self._save, blob)

    def _connect(self) -> sqlite3.Connection:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=5.0)
        enable_wal(db)
        db.execute("CREATE TABLE IF NOT EXISTS budget_state (name TEXT PRIMARY KEY, state BLOB, saved_at REAL)")
        return db

    def _save(self, blob: bytes) -> None:
        db = self._connect()
        try:
            with db:
                db.execute("INSERT INTO budget_state VALUES (?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                           "state=excluded.state, saved_at=excluded.saved_at", (self.name, blob, time.time()))
        finally:
            db.close()

    def _load(self) -> dict[str, Any] | None:
        db = self._connect()
        try:
            row = db.execute("SELECT state FROM budget_state WHERE name=?", (self.name,)).fetchone()
        finally:
            db.close()
        return orjson.loads(row[0]) if row else None

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if self._dirty:
                try:
                    await self.snapshot()
                except Exception:
                    log.exception("budget snapshot to %s failed; will retry", self.path)


class _Busy(Exception):
    """Another process holds the database's write lock longer than the event loop may wait for it."""


class SqliteBudgetStore:
    """One host's shared store: the reference model's state kept per store key in a SQLite table (WAL), each
    reserve and settle one `BEGIN IMMEDIATE` transaction that reads the request's keys, runs the reference model
    (`BudgetState`, the algorithm the Lua script mirrors) over them and writes back what changed. SQLite lets one
    writer at a time into a database, so the worker processes of `gateway serve --workers N` sharing the file
    see one budget, exactly as replicas sharing a Redis do, without a server or a network round trip.

    Where it runs: a transaction takes tens of microseconds of CPU, less than handing it to a thread costs in a
    busy process (the thread waits for the GIL the event loop holds), so it runs on the event loop's thread, on a connection
    of its own that never waits on SQLite's busy handler: when another process holds the write lock the
    operation yields to the event loop and tries again (a transaction holds the lock for tens of microseconds;
    the loop serves other requests meanwhile), for at most FAST_WAIT_S, then hands it to the store's thread,
    whose connection waits up to BUSY_TIMEOUT_S (then StoreUnavailable: the service's 503 or fail-open). WAL checkpoints (which fsync) run on that thread too, every CHECKPOINT_EVERY writes, never on
    the event loop; so does the cleanup of expired rows (every CLEANUP_S).

    The file must be on a local disk of the host (WAL needs shared memory between the processes; not NFS).
    `synchronous=NORMAL`: a committed operation survives a process crash; a power loss may lose the last
    commits (Redis with `appendfsync everysec` may lose the last second). A key's row carries its expiry (`x`,
    what Redis EXPIRE does): a row past it reads as absent.
    """

    BUSY_TIMEOUT_S = 5.0  # the thread's connection waits this long for another process's transaction
    FAST_WAIT_S = 0.05  # the event loop's connection retries the write lock this long (yielding), then hands over
    CHECKPOINT_EVERY = 500  # writes on the event loop's connection between WAL checkpoints on the thread
    CLEANUP_S = 60.0

    def __init__(self, path: Path, name: str = "sqlite") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.path = path
        self.name = name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="budget-sqlite")
        self._db: sqlite3.Connection | None = None  # the store thread's (waits on the busy handler)
        self._fast: sqlite3.Connection | None = None  # the event loop's (never waits)
        self._writes = 0
        self._housekeeping: asyncio.Task[None] | None = None
        self._next_cleanup = 0.0
        self.stats = {"fast": 0, "retried": 0, "handed_over": 0}

    async def start(self) -> None:
        try:
            await self._run(self._open)
        except StoreUnavailable as e:  # start anyway: every call retries the open; the failure mode decides meanwhile
            log.warning("budget sqlite store %s cannot be opened at start: %s", self.path, e)

    async def close(self) -> None:
        if self._housekeeping is not None:
            try:
                await self._housekeeping
            except Exception:
                pass
        if self._fast is not None:
            self._fast.close()
            self._fast = None

        def shut() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(shut)
        self._pool.shutdown(wait=True)

    async def reserve(self, args: ReserveArgs) -> ReserveResult:
        return ReserveResult.from_flat(await self._call(args, True), args)

    async def settle(self, args: SettleArgs) -> bool:
        return bool(await self._call(args, False) == 1)

    async def _call(self, args: ReserveArgs | SettleArgs, reserve: bool) -> Any:
        fast = self._fast
        deadline, pause = 0.0, 0.0
        while fast is not None:
            try:
                out = self._fast_op(fast, args, reserve)
            except _Busy:  # another process's transaction: let the loop run, then try again
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.FAST_WAIT_S
                elif now >= deadline:
                    self.stats["handed_over"] += 1
                    break
                self.stats["retried"] += 1
                await asyncio.sleep(pause)
                pause = min(max(pause * 2, 0.00005), 0.002)
                fast = self._fast
                continue
            except (sqlite3.Error, OSError) as e:
                raise StoreUnavailable(f"budget sqlite {self.path}: {type(e).__name__}: {e}") from e
            self.stats["fast"] += 1
            self._writes += 1
            if self._writes >= self.CHECKPOINT_EVERY and self._housekeeping is None:
                self._writes = 0
                self._housekeeping = asyncio.create_task(self._housekeep(), name="budget-sqlite-checkpoint")
            return out
        out = await self._run(self._op, None, args, reserve)
        if self._fast is None and self._db is not None:  # the database opened late: the fast path from now on
            self._fast = self._connect(0.0)
        return out

    async def _run(self, fn: Any, *a: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *a)
        except (sqlite3.Error, OSError) as e:
            raise StoreUnavailable(f"budget sqlite {self.path}: {type(e).__name__}: {e}") from e

    async def _housekeep(self) -> None:
        try:
            await self._run(self._checkpoint)
        except StoreUnavailable as e:
            log.warning("%s", e)
        finally:
            self._housekeeping = None

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA synchronous=NORMAL")
            if not busy_timeout_s:
                db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints fsync: the store's thread runs them
        except BaseException:
            db.close()
            raise
        return db

    # -- on the store's thread
    def _open(self) -> sqlite3.Connection:
        if self._db is not None:
            return self._db
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=self.BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        try:
            enable_wal(db)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("CREATE TABLE IF NOT EXISTS budget_counters (k TEXT PRIMARY KEY, v BLOB NOT NULL, x REAL) "
                       "WITHOUT ROWID")  # window counters (JSON) and settle markers; x: when the key expires
            db.execute("CREATE TABLE IF NOT EXISTS budget_holds (hk TEXT NOT NULL, rid TEXT NOT NULL, x REAL NOT NULL, "
                       + "".join(f"{c} INTEGER NOT NULL DEFAULT 0, " for c in _HOLD_COLS)
                       + "PRIMARY KEY (hk, rid)) WITHOUT ROWID")  # a row per live reservation: expiry and amounts
            have = {r[1] for r in db.execute("PRAGMA table_info(budget_holds)")}
            for c in _HOLD_COLS:  # a dimension added since the file was created
                if c not in have:
                    db.execute(f"ALTER TABLE budget_holds ADD COLUMN {c} INTEGER NOT NULL DEFAULT 0")
            fast = self._connect(0.0) if self._fast is None else None
        except BaseException:
            db.close()
            raise
        self._db = db
        if fast is not None:
            self._fast = fast
        return db

    def _checkpoint(self) -> None:
        db = self._open()
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        if time.monotonic() >= self._next_cleanup:
            self._next_cleanup = time.monotonic() + self.CLEANUP_S
            now = time.time()
            db.execute("BEGIN IMMEDIATE")  # expired rows read as absent already; this only frees their space
            try:
                db.execute("DELETE FROM budget_counters WHERE x IS NOT NULL AND x <= ?", (now,))
                db.execute("DELETE FROM budget_holds WHERE x <= ?", (now,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _op(self, db: sqlite3.Connection | None, args: ReserveArgs | SettleArgs, reserve: bool) -> Any:
        """One operation in one transaction; on the store's thread (`db` None: its connection, waiting for the
        write lock on SQLite's busy handler)."""
        if db is None:
            db = self._open()
        db.execute("BEGIN IMMEDIATE")  # the write lock now: nothing read below changes before COMMIT
        return self._body(db, args, reserve)

    # -- on the event loop's thread
    def _fast_op(self, db: sqlite3.Connection, args: ReserveArgs | SettleArgs, reserve: bool) -> Any:
        """One try, never waiting: _Busy when another connection holds the write lock (nothing applied)."""
        try:
            db.execute("BEGIN IMMEDIATE")
            return self._body(db, args, reserve)
        except sqlite3.OperationalError as e:
            if is_locked(e):  # rolled back (or never begun): nothing applied
                raise _Busy() from e
            raise

    # -- either
    def _body(self, db: sqlite3.Connection, args: ReserveArgs | SettleArgs, reserve: bool) -> Any:
        """The transaction begun by the caller: read the request's counters and its scopes' live holds (their
        count and sums, aggregated by SQLite), run the model, write what changed, COMMIT (any error rolls it
        back: nothing applied)."""
        try:
            now = args.now
            holds = [s.hold_key for s in args.scopes]
            wins = {w.key: w for s in args.scopes for w in s.windows}
            done = args.done_key if isinstance(args, SettleArgs) else ""
            keys = [*wins, *([done] if done else [])]
            st = _SqlState()
            for k in holds:
                st.holds[k] = _HoldSums()  # type: ignore[assignment]
            if reserve:  # settle only drops its own hold: it reads none
                marks = ",".join("?" * len(holds))
                for k, n, *sums in db.execute(
                        f"SELECT hk, count(*), {_HOLD_SUMS} FROM budget_holds WHERE hk IN ({marks}) "
                        "AND x > ? GROUP BY hk", [*holds, now]):
                    st.holds[k] = _HoldSums(n, sums)  # type: ignore[assignment]
            for k, v, x in db.execute(
                    f"SELECT k, v, x FROM budget_counters WHERE k IN ({','.join('?' * len(keys))})", keys):
                if x is not None and x <= now:
                    continue  # expired: absent, as in Redis
                if k == done:
                    st.done[k] = x
                    continue
                d = orjson.loads(v)
                if isinstance(d, dict):
                    st.rolling[k] = _rolling(d)
                else:  # a sum per counted dimension (fewer: written before a dimension was added)
                    st.fixed[k] = d if len(d) == _NC else pad_sums(d)
                if x is not None:
                    st.expiry[k] = x
            if reserve:
                assert isinstance(args, ReserveArgs)
                out: Any = st.reserve(args)
                changed = out[0] == 1  # a refusal changes nothing
            else:
                assert isinstance(args, SettleArgs)
                out = st.settle(args)
                changed = out == 1
            if changed:
                up: list[tuple[str, bytes, float | None]] = []
                for k in wins:
                    c = st.rolling.get(k)
                    if c is not None:
                        up.append((k, orjson.dumps(c.to_state()), st.expiry.get(k)))
                    elif k in st.fixed:
                        up.append((k, orjson.dumps(st.fixed[k]), st.expiry.get(k)))
                if done and done in st.done:
                    up.append((done, b"1", st.done[done]))
                db.executemany("INSERT INTO budget_counters (k, v, x) VALUES (?, ?, ?) ON CONFLICT(k) DO UPDATE "
                               "SET v=excluded.v, x=excluded.x", up)
                sums = [(k, st.holds[k]) for k in holds]
                added = [(k, rid, *v) for k, h in sums for rid, v in h.added.items()]
                if added:
                    db.executemany(_HOLD_INSERT, added)
                removed = [(k, rid) for k, h in sums for rid in h.removed]
                if removed:
                    db.executemany("DELETE FROM budget_holds WHERE hk=? AND rid=?", removed)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        return out


def _rolling(d: dict[str, Any]) -> RollingCounter:
    """RollingCounter.from_state for the rows this store wrote (ints, a sum per counted dimension already): a
    minute window has up to 60 buckets, and this runs on every operation."""
    if len(d["tot"]) != _NC:  # written before a dimension was added: pad every bucket
        return RollingCounter.from_state(d)
    c = RollingCounter(d["n"])
    c.lo = d["lo"]
    c.buckets = {int(b): v for b, v in d["b"].items()}
    c.tot = d["tot"]
    return c


class _HoldSums:
    """One scope's live holds as the reference model reads them (`BudgetState.reserve`: their sums over
    `values()` and their number, `len()`; `settle`: `pop(rid)`), aggregated by SQLite instead of decoded one by
    one: the hold the model adds and the one it drops are recorded for the write. Equivalence with the model is
    pinned by tests/budget/test_sqlite_store.py."""

    __slots__ = ("n", "sums", "added", "removed")

    def __init__(self, n: int = 0, sums: list[int] | None = None) -> None:
        self.n = n
        self.sums = (0.0, *(sums or (0,) * len(_HOLD_COLS)))  # shaped like a hold: (expiry, amounts...)
        self.added: dict[str, tuple] = {}
        self.removed: list[str] = []

    def values(self) -> tuple[tuple, ...]:
        return (self.sums,)

    def __len__(self) -> int:
        return self.n

    def __setitem__(self, rid: str, hold: tuple) -> None:
        self.added[rid] = hold

    def pop(self, rid: str, default: Any = None) -> Any:
        self.removed.append(rid)
        return default


class _SqlState(BudgetState):
    """The reference model over one request's rows: holds already purged by the query (only live ones are
    summed), so `_purge` only hands the model the scope's sums."""

    def _purge(self, hk: str, now: float) -> Any:
        return self.holds[hk]


class RedisBudgetStore:
    """Multi-replica store: the Lua script over all keys of a request, one EVALSHA per reserve/settle.

    redis-py's Script reloads the script after NOSCRIPT (e.g. a restarted Redis) transparently.
    """

    def __init__(self, url: str, timeout_s: float = 1.0, max_connections: int = 64) -> None:
        import redis.asyncio as aioredis

        self.url = url
        # a blocking pool: a burst waits for a free connection instead of failing as "store unavailable"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=max_connections,
            timeout=5.0, retry_on_timeout=False, health_check_interval=0)
        self.client = aioredis.Redis(connection_pool=pool)
        self.script = self.client.register_script(LUA)

    async def start(self) -> None:
        try:
            await self.client.script_load(LUA)
        except Exception as e:  # start anyway: the service's failure mode decides, and recovery is automatic
            log.warning("budget redis %s unreachable at start: %s", _safe_url(self.url), e)

    async def close(self) -> None:
        await self.client.aclose()

    async def reserve(self, args: ReserveArgs) -> ReserveResult:
        flat = await self._call(args.keys(), args.to_wire())
        return ReserveResult.from_flat(flat, args)

    async def settle(self, args: SettleArgs) -> bool:
        return int(await self._call(args.keys(), args.to_wire())) == 1

    async def _call(self, keys: list[str], wire: dict[str, Any]) -> Any:
        from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

        try:
            return await self.script(keys=keys, args=[orjson.dumps(wire)])
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            # no blind retry here: a reserve whose reply was lost must not hold twice (the caller answers 503);
            # settles are replayed by the service, made idempotent by their marker key.
            # Drop pooled sockets so the next call after a Redis restart starts on fresh connections.
            if isinstance(e, (RedisConnectionError, OSError)):
                await self.client.connection_pool.disconnect(inuse_connections=False)
            raise StoreUnavailable(f"budget redis: {type(e).__name__}: {e}") from e


def _safe_url(url: str) -> str:
    """A Redis URL without its password, for logs."""
    if "@" in url:
        scheme, rest = url.split("://", 1) if "://" in url else ("", url)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url
