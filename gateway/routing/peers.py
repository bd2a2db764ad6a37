"""The peer bus: gateway replicas (and the worker processes of one host) route as one.

Each replica publishes what changes an engine's view the moment it happens: a dispatch (the engine, its
uncached prefill tokens, when it started, the predicted prefill time), the first token of a stream, the finish,
the TTFT learner's sample (so N replicas learn as fast as one) and session affinity. The others hold those as
remote flights (`inflight.RemoteFlight`), kept apart from their own flights (flow control and the learner's
feedback only ever see their own requests) but counted by the view as work ahead and running decodes.

The request path never awaits: `publish` appends to a list; one background task sends the batch every
`flush_ms` (and a heartbeat every `heartbeat_s`, so a crashed replica's flights lapse after `peer_timeout_s`).
Transports: Redis pub/sub on the store the gateway already has, or Unix datagram sockets in a directory for
the workers of one host (`GATEWAY_PEER_DIR`, set by `gateway serve --workers N`). Events are msgpack arrays.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union

import msgspec

from gateway.routing.inflight import Flight, InFlight, RemoteFlight
from gateway.routing.predictor import Features, Predictor

if TYPE_CHECKING:
    from gateway.config import Config

log = logging.getLogger("gateway.routing.peers")
MAX_QUEUED = 10_000  # events waiting for the sender (a stuck transport): past it new ones are dropped, counted
MAX_EVENTS_PER_BATCH = 64  # keeps a datagram far below the Unix socket's limit (~200 KB) with long session ids
RECV_BYTES = 1 << 17


# ---------------------------------------------------------------- events (msgpack arrays, tag first)
class Dispatch(msgspec.Struct, array_like=True, tag="d", frozen=True):
    """A request dispatched to `engine`: prefill work ahead there from `started` (wall clock, seconds)."""

    key: int  # the flight's id within its replica (never the client's request id)
    engine: str
    uncached: int  # uncached prompt tokens: the prefill it adds
    prompt: int  # prompt tokens
    started: float  # time.time() at dispatch
    predicted_s: float  # predicted prefill time after dispatch (a non-streamed request prefills this long)
    stream: bool


class FirstToken(msgspec.Struct, array_like=True, tag="t", frozen=True):
    key: int
    ttft_s: float


class Finish(msgspec.Struct, array_like=True, tag="f", frozen=True):
    key: int


class Sample(msgspec.Struct, array_like=True, tag="s", frozen=True):
    """One TTFT learner sample: the features the request was predicted with and the engine part it took."""

    engine: str
    ahead: float
    uncached: float
    running: float
    ttft_s: float


class Remember(msgspec.Struct, array_like=True, tag="a", frozen=True):
    """Session affinity: `session` (tenant|header|id) last used `engine`."""

    session: str
    engine: str


Event = Union[Dispatch, FirstToken, Finish, Sample, Remember]


class Batch(msgspec.Struct, array_like=True, frozen=True):
    """What one send carries: the sender, its clock, its events (none: a heartbeat)."""

    replica: str
    sent: float  # time.time() at send
    events: list[Event]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Batch)


def encode(batch: Batch) -> bytes:
    return _encoder.encode(batch)


def decode(data: bytes) -> Batch:
    """Raises msgspec.ValidationError / DecodeError on anything but a well-formed batch."""
    return _decoder.decode(data)


# ---------------------------------------------------------------- remote state
class PeerState:
    """What the other replicas told us: their remote flights (in the shared InFlight), when each was last
    heard, and the counters /admin/routing shows. Pure (no I/O): the unit tests drive it with a fake clock."""

    def __init__(self, inflight: InFlight, clock: Callable[[], float], *, peer_timeout_s: float = 3.0,
                 flight_ttl_s: float = 600.0, predictor: Predictor | None = None,
                 affinity: Any = None, wall: Callable[[], float] = time.time) -> None:
        self.inflight = inflight
        self.clock = clock
        self.wall = wall
        self.peer_timeout_s = peer_timeout_s
        self.flight_ttl_s = flight_ttl_s
        self.predictor = predictor
        self.affinity = affinity
        self.last_seen: dict[str, float] = {}  # replica -> local clock of its last batch
        self.lag_ms: dict[str, float] = {}  # replica -> last batch's send-to-receive time (wall clocks)
        self.counts = {"events_in": 0, "batches_in": 0, "bad_in": 0, "samples_in": 0, "expired": 0}

    def apply(self, b: Batch) -> None:
        now = self.clock()
        wall = self.wall()
        self.last_seen[b.replica] = now
        self.lag_ms[b.replica] = round(max(0.0, wall - b.sent) * 1000.0, 3)
        self.counts["batches_in"] += 1
        self.counts["events_in"] += len(b.events)
        for ev in b.events:
            if isinstance(ev, Dispatch):
                age = min(max(0.0, wall - ev.started), self.flight_ttl_s)  # another host's clock: bounded
                self.inflight.add_remote(RemoteFlight(f"{b.replica}/{ev.key}", b.replica, ev.engine, ev.uncached,
                                                      now - age, ev.predicted_s, ev.stream, now + self.flight_ttl_s))
            elif isinstance(ev, FirstToken):
                rf = self.inflight.remote_by_key.get(f"{b.replica}/{ev.key}")
                if rf is not None:
                    rf.first_token = True
            elif isinstance(ev, Finish):
                self.inflight.pop_remote(f"{b.replica}/{ev.key}")
            elif isinstance(ev, Sample):
                if self.predictor is not None:
                    self.counts["samples_in"] += 1
                    self.predictor.observe(ev.engine, Features(ev.ahead, ev.uncached, ev.running), ev.ttft_s)
            elif isinstance(ev, Remember):
                if self.affinity is not None:
                    self.affinity.remember(ev.session, ev.engine)

    def expire(self) -> int:
        """Drop the flights of replicas not heard for `peer_timeout_s` (crashed, partitioned) and flights past
        their TTL (a lost finish); returns how many went."""
        now = self.clock()
        gone = {r for r, t in self.last_seen.items() if now - t > self.peer_timeout_s}
        n = 0
        for rf in list(self.inflight.remote_by_key.values()):
            if rf.replica in gone or now >= rf.expires:
                self.inflight.pop_remote(rf.key)
                n += 1
        for r in gone:
            self.last_seen.pop(r, None)
            self.lag_ms.pop(r, None)
        self.counts["expired"] += n
        return n

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        engines: dict[str, dict[str, Any]] = {}
        for name, fls in self.inflight.remote.items():
            if fls:
                engines[name] = {"flights": len(fls),
                                 "prefilling": sum(1 for f in fls.values() if f.prefilling(now)),
                                 "prefilling_tokens": sum(f.uncached for f in fls.values() if f.prefilling(now))}
        return {"peers": {r: {"last_heard_s": round(now - t, 3), "lag_ms": self.lag_ms.get(r)}
                          for r, t in sorted(self.last_seen.items())},
                "remote_flights": engines, **self.counts}


# ---------------------------------------------------------------- transports
class Transport(Protocol):
    """How batches reach the other replicas: `send` one encoded batch of at most `max_events` events (False:
    not delivered), `on_data` called with each batch heard; `status` what /admin/routing shows of its health."""

    name: str
    max_events: int

    async def start(self, on_data: Callable[[bytes], None]) -> None: ...

    async def send(self, data: bytes) -> bool: ...

    async def close(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class RedisTransport:
    """Redis pub/sub on one channel: every replica (and worker) publishes there and hears the others."""

    name = "redis"
    max_events = MAX_EVENTS_PER_BATCH

    def __init__(self, url: str, channel: str) -> None:
        self.url = url
        self.channel = channel
        self._client: Any = None  # publishes, with a timeout: a dead Redis costs the sender a second, not forever
        self._sub: Any = None  # subscribes, without one: an idle channel is no error
        self._task: asyncio.Task | None = None
        self.connected = False
        self._warned = False

    def status(self) -> dict[str, Any]:
        return {"connected": self.connected}

    async def start(self, on_data: Callable[[bytes], None]) -> None:
        import redis.asyncio as aioredis

        self._client = aioredis.from_url(self.url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._sub = aioredis.from_url(self.url, socket_timeout=None, socket_connect_timeout=2.0)
        self._task = asyncio.create_task(self._listen(on_data))

    async def _listen(self, on_data: Callable[[bytes], None]) -> None:
        while True:
            ps = self._sub.pubsub(ignore_subscribe_messages=True)
            try:
                await ps.subscribe(self.channel)
                self.connected = True
                async for msg in ps.listen():
                    if msg.get("type") == "message":
                        on_data(msg["data"])
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Redis away: retry; until then this replica routes on its own view
                if self.connected or not self._warned:  # once per outage, not once a second
                    log.warning("peer bus: Redis subscription lost (%s); retrying each second", e)
                    self._warned = True
                self.connected = False
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await ps.aclose()

    async def send(self, data: bytes) -> bool:
        try:
            await self._client.publish(self.channel, data)
            return True
        except Exception:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for c in (self._client, self._sub):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.aclose()


class PostgresTransport:
    """Postgres LISTEN/NOTIFY on one channel, for replicas whose shared store is Postgres (identity.store) and
    no Redis. A payload is text under 8000 bytes: batches are base64 and at most `max_events` events."""

    name = "postgres"
    max_events = 12  # 12 events of the longest kind (a 256-char session id) stay under NOTIFY's 8000 bytes

    def __init__(self, dsn: str, channel: str) -> None:
        self.dsn = dsn
        self.channel = channel[:63]  # Postgres truncates identifiers at 63 bytes; say so by doing it here
        self._conn: Any = None
        self._task: asyncio.Task | None = None
        self.connected = False
        self._warned = False

    def status(self) -> dict[str, Any]:
        return {"connected": self.connected}

    async def start(self, on_data: Callable[[bytes], None]) -> None:
        self._task = asyncio.create_task(self._run(on_data))

    async def _run(self, on_data: Callable[[bytes], None]) -> None:
        import asyncpg

        def heard(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            try:
                on_data(base64.b64decode(payload))
            except ValueError:
                on_data(b"")  # counted as bad by the bus

        while True:
            conn = None
            try:
                conn = await asyncpg.connect(self.dsn, timeout=2.0)
                closed = asyncio.Event()
                conn.add_termination_listener(lambda _c: closed.set())
                await conn.add_listener(self.channel, heard)
                self._conn, self.connected = conn, True
                await closed.wait()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Postgres away: retry; until then this replica routes on its own view
                if self.connected or not self._warned:  # once per outage
                    log.warning("peer bus: Postgres LISTEN lost (%s); retrying each second", e)
                    self._warned = True
            finally:
                self._conn, self.connected = None, False
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close(timeout=1.0)
            await asyncio.sleep(1.0)

    async def send(self, data: bytes) -> bool:
        conn = self._conn
        if conn is None:
            return False
        try:
            await conn.execute("SELECT pg_notify($1, $2)", self.channel, base64.b64encode(data).decode("ascii"),
                               timeout=1.0)
            return True
        except Exception:
            return False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


class UnixTransport:
    """Unix datagram sockets in one directory (the workers of one host): this worker binds `w<id>.sock` and
    sends each batch to every other `w*.sock` there. A peer that is restarting (no socket, refused, full) just
    misses the batch: its flights are rebuilt from the next ones and lapse by heartbeat."""

    name = "unix"
    max_events = MAX_EVENTS_PER_BATCH

    def __init__(self, directory: str | Path, worker_id: str) -> None:
        self.dir = Path(directory)
        self.path = self.dir / f"w{worker_id}.sock"
        self._sock: socket.socket | None = None
        self._peers: list[str] = []
        self._listed = 0.0
        self.dropped = 0

    def status(self) -> dict[str, Any]:
        return {"send_failures": self.dropped}

    async def start(self, on_data: Callable[[bytes], None]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a previous run of this worker id
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        s.bind(str(self.path))
        self._sock = s

        def readable() -> None:
            while True:
                try:
                    data = s.recv(RECV_BYTES)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    return
                on_data(data)

        asyncio.get_running_loop().add_reader(s.fileno(), readable)

    def _peer_paths(self) -> list[str]:
        now = time.monotonic()
        if now - self._listed > 1.0:  # new workers show up within a second
            self._listed = now
            mine = self.path.name
            try:
                self._peers = [str(p) for p in self.dir.glob("w*.sock") if p.name != mine]
            except OSError:
                self._peers = []
        return self._peers

    async def send(self, data: bytes) -> bool:
        s = self._sock
        if s is None:
            return False
        ok = True
        for p in self._peer_paths():
            try:
                s.sendto(data, p)
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.EWOULDBLOCK,
                                   errno.ENOTSOCK, errno.ENOBUFS):
                    log.debug("peer bus: send to %s failed: %s", p, e)
                self.dropped += 1
                ok = False
        return ok

    async def close(self) -> None:
        s = self._sock
        if s is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(s.fileno())
        s.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sock = None


# ---------------------------------------------------------------- the bus
class PeerBus:
    """A gateway service: publishes this replica's events and applies the others' (PeerState)."""

    def __init__(self, transport: Transport, state: PeerState, replica: str, *, flush_ms: float = 2.0,
                 heartbeat_s: float = 0.5, share_learning: bool = True, share_affinity: bool = True,
                 first_token_poll_ms: float = 10.0) -> None:
        self.transport = transport
        self.state = state
        self.replica = replica
        self.flush_s = max(0.0005, flush_ms / 1000.0)
        self.heartbeat_s = heartbeat_s
        self.poll_s = max(self.flush_s, first_token_poll_ms / 1000.0)
        self.share_learning = share_learning
        self.share_affinity = share_affinity
        self._out: list[Event] = []
        self._ids: dict[str, int] = {}  # own request id -> flight key it was published under
        self._watch: dict[int, Flight] = {}  # own streamed flights waiting for their first token
        self._next = 0
        self._waiter: asyncio.Future | None = None  # the sender's sleep; the first event ends it
        self._task: asyncio.Task | None = None
        self._sweep: asyncio.Task | None = None
        self.counts = {"events_out": 0, "batches_out": 0, "dropped_out": 0}

    # ---- the request path: append, never await
    def _push(self, ev: Event) -> None:
        if len(self._out) >= MAX_QUEUED:
            self.counts["dropped_out"] += 1
            return
        self._out.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def dispatched(self, fl: Flight) -> None:
        key = self._next
        self._next += 1
        self._ids[fl.ctx.request_id] = key
        stream = bool(fl.ctx.stream)
        n_prompt = fl.uncached + fl.cached.get(fl.engine, 0)
        self._push(Dispatch(key, fl.engine, int(fl.uncached), int(n_prompt),
                            time.time() - max(0.0, self.state.clock() - fl.started), float(fl.predicted_s), stream))
        if stream:
            self._watch[key] = fl

    def finished(self, request_id: str, sample: tuple[str, Features, float] | None) -> None:
        key = self._ids.pop(request_id, None)
        if key is not None:
            self._watch.pop(key, None)
            self._push(Finish(key))
        if sample is not None and self.share_learning:
            engine, f, y = sample
            self._push(Sample(engine, float(f.ahead_tokens), float(f.uncached_tokens), float(f.running), float(y)))

    def remembered(self, session: str, engine: str) -> None:
        if self.share_affinity:
            self._push(Remember(session, engine))

    # ---- the receive path
    def on_data(self, data: bytes) -> None:
        try:
            b = decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.state.counts["bad_in"] += 1
            return
        if b.replica == self.replica:  # Redis echoes our own messages
            return
        self.state.apply(b)

    # ---- the background sender
    def _first_tokens(self) -> None:
        for key, fl in list(self._watch.items()):
            if fl.ctx.ttft_s is not None:
                del self._watch[key]
                self._out.append(FirstToken(key, float(fl.ctx.ttft_s)))

    async def _send_loop(self) -> None:
        last = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if not self._out:  # sleep until the next event, the next first-token check or the heartbeat
                fut = self._waiter = loop.create_future()  # a future and a timer: cheaper than wait_for's task
                h = loop.call_later(self.poll_s if self._watch else self.heartbeat_s, _wake, fut)
                try:
                    await fut
                finally:
                    h.cancel()
                    self._waiter = None
            if self._out:
                await asyncio.sleep(self.flush_s)  # gather what the next requests add: one send for all
            self._first_tokens()
            now = time.monotonic()
            if not self._out and now - last < self.heartbeat_s:
                continue
            out, self._out = self._out, []
            last = now
            k = self.transport.max_events
            chunks = [out[i:i + k] for i in range(0, len(out), k)] or [[]]
            for evs in chunks:
                ok = await self.transport.send(encode(Batch(self.replica, time.time(), evs)))
                self.counts["batches_out"] += 1
                self.counts["events_out" if ok else "dropped_out"] += len(evs)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self.state.expire()

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: the transport and its intervals are chosen at startup."""

    async def start(self) -> None:
        await self.transport.start(self.on_data)
        self._task = asyncio.create_task(self._send_loop())
        self._sweep = asyncio.create_task(self._sweep_loop())

    async def close(self) -> None:
        for t in (self._task, self._sweep):
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        await self.transport.close()

    def snapshot(self) -> dict[str, Any]:
        s = self.state.snapshot()
        return {"transport": self.transport.name, "replica": self.replica, **s, **self.counts,
                **self.transport.status()}


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def replica_id() -> str:
    """This process's name on the bus: host, worker (when a supervisor started it) and a random suffix, so a
    restarted process is a new peer (its predecessor's flights lapse by heartbeat)."""
    wid = os.environ.get("GATEWAY_WORKER_ID")
    base = socket.gethostname()[:32] + (f"/w{wid}" if wid is not None else "")
    return f"{base}/{uuid.uuid4().hex[:6]}"


def resolve_transport(cfg: Any, env: dict[str, str] | None = None) -> Transport | None:
    """The transport `routing.peers` asks for, or None (no shared store and no worker directory: each replica
    routes on its own view, as before). auto: Redis when a URL is configured or the budgets already use Redis,
    else Postgres LISTEN/NOTIFY when the identity store is Postgres, else the local Unix-datagram bus when a
    supervisor gave the workers a directory (GATEWAY_PEER_DIR)."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    pc = cfg.raw.routing.peers
    if pc.mode == "off":
        return None
    b = cfg.raw.budgets
    url = pc.redis_url or (b.redis_url if b.store == "redis" else None)
    if pc.mode == "redis" and url is None:
        url = b.redis_url
    if url is not None and pc.mode in ("auto", "redis"):
        return RedisTransport(url, pc.channel or f"{b.key_prefix}:peers")
    ic = cfg.raw.identity
    dsn = (ic.postgres_dsn or (env.get(ic.postgres_dsn_env) if ic.postgres_dsn_env else None)  # type: ignore[union-attr]
           ) if ic.store == "postgres" else None
    if dsn and pc.mode in ("auto", "postgres"):
        return PostgresTransport(dsn, pc.channel or f"{b.key_prefix}_peers")
    peer_dir = env.get("GATEWAY_PEER_DIR")  # type: ignore[union-attr]
    if peer_dir and pc.mode in ("auto", "local"):
        return UnixTransport(peer_dir, env.get("GATEWAY_WORKER_ID", str(os.getpid())))  # type: ignore[union-attr]
    return None
