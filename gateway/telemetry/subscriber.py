"""One engine's KV-event stream: ZMQ SUB -> bounded queue -> in-order apply, with gap replay and resets.

Frames follow vLLM's ZmqEventPublisher (`vllm/distributed/kv_events.py`): PUB sends (topic, seq 8-byte BE,
payload); the ROUTER replay socket answers a DEALER's [b"", start_seq] with one [b"", seq, payload] per
buffered batch and ends with [b"", END_SEQ, b""]. The receive task only copies frames into a bounded queue
(a flood drops batches, which then look like a gap and are replayed), and the apply task yields to the event
loop after every batch, so the request path is never blocked for long.

Topics: the SUB socket subscribes to every topic and the topic is checked here, exactly. vLLM's
`KVEventsConfig.topic` (vllm/config/kv_events.py) defaults to "" and `ZmqEventPublisher` sends it as the first
frame, so a gateway that filtered on its own topic in ZMQ would see nothing and could not say why; frames of
other topics are counted instead (`StreamWatch`, gateway/telemetry/stream_health.py), and a configured topic
of "" takes every frame.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from gateway.telemetry.index import KVIndex
from gateway.telemetry.kv_events import END_SEQ, AllBlocksCleared, decode_batch
from gateway.telemetry.stream_health import StreamWatch

log = logging.getLogger(__name__)


class KVEventSubscriber:
    """Keeps `index`'s view of one engine in step with the engine's KV events."""

    def __init__(self, engine_name: str, endpoint: str, replay_endpoint: str | None, topic: str, index: KVIndex,
                 *, max_pending: int = 10000, replay_timeout_s: float = 2.0,
                 ctx: zmq.asyncio.Context | None = None, drop_filter: Callable[[int], bool] | None = None,
                 silence_grace_s: float = 10.0) -> None:
        self.engine = engine_name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic_b = topic.encode("utf-8")
        self.watch = StreamWatch(silence_grace_s, topic)  # silence / wrong topic / undecodable frames
        self.index = index
        self.max_pending = max_pending
        self.replay_timeout_s = replay_timeout_s
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._drop_filter = drop_filter  # test hook: simulate batch loss on the wire (seq -> drop?)
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=max_pending)
        self._tasks: list[asyncio.Task[Any]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self.last_seq: int | None = None
        self.last_batch_ts: float | None = None  # engine clock of the newest applied batch (restart detection)
        self.stale = False
        self.stale_reason: str | None = None
        self.stale_since: float | None = None
        self.counters: dict[str, int] = {k: 0 for k in (
            "batches", "block_events", "gaps", "replayed_batches", "replays_ok", "replays_failed",
            "unrecoverable_gaps", "restarts", "clears", "dropped_overflow", "duplicates", "decode_errors")}
        self.last_event_at: float | None = None
        self._overflowed = False
        self.applied = asyncio.Event()  # set after each applied batch (tests and readiness wait on it)

    # ------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.max_pending)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: filtered (and other topics counted) in _recv_loop
        sub.connect(self.endpoint)
        self._sub = sub
        self._tasks = [asyncio.create_task(self._recv_loop(), name=f"kv-recv-{self.engine}"),
                       asyncio.create_task(self._apply_loop(), name=f"kv-apply-{self.engine}")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    # ------------------------------------------------------------------------------ loops
    async def _recv_loop(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if self._topic_b and frames[0] != self._topic_b:
                self.watch.on_other_topic(time.monotonic(), frames[0])
                continue
            if len(frames) != 3:
                self.counters["decode_errors"] += 1
                self.watch.on_decode_error(time.monotonic(), f"{len(frames)} frames, expected 3 (topic, seq, payload)")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self._drop_filter is not None and self._drop_filter(seq):
                continue
            try:
                self._queue.put_nowait((seq, frames[2]))
            except asyncio.QueueFull:
                self.counters["dropped_overflow"] += 1  # becomes a gap, recovered by replay
                self._overflowed = True

    async def _apply_loop(self) -> None:
        while True:
            seq, payload = await self._queue.get()
            try:
                await self._handle(seq, payload)
            except Exception:  # never let one bad batch kill the stream
                log.exception("kv events: engine %s: failed to apply batch %s", self.engine, seq)
            if self._overflowed and self._queue.empty():
                await self._catch_up()  # the newest batches may have been dropped: no later seq would show it
            await asyncio.sleep(0)

    async def _catch_up(self) -> None:
        self._overflowed = False
        if self.last_seq is None or not self.replay_endpoint:
            return
        got = await self.replay(self.last_seq + 1)
        for s, p in got or []:
            if s == self.last_seq + 1:
                self._apply(s, p)
                self.counters["replayed_batches"] += 1

    async def _handle(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is None:
            if seq > 0:  # joined mid-stream: fetch the engine's history from the replay buffer
                await self._recover(0, seq, initial=True)
            self._apply(seq, payload)
            return
        if seq == last + 1:
            self._apply(seq, payload)
        elif seq > last + 1:
            self.counters["gaps"] += 1
            await self._recover(last + 1, seq)
            self._apply(seq, payload)
        elif seq == 0 or last - seq > self.max_pending or self._newer_than_applied(payload):
            # the sequence went backwards: a new publisher (engine restart) started counting from 0. Its seq 0
            # may have been lost on reconnect (ZMQ drops what is sent before the subscription is re-made), so a
            # backwards seq whose batch is *newer* than the last applied one is a restart too; a replayed
            # batch's live copy is older and stays a duplicate.
            self.counters["restarts"] += 1
            self.index.reset(self.engine)
            self.last_batch_ts = None  # the new engine's clock is the baseline from here
            self._clear_stale()
            if seq > 0:
                await self._recover(0, seq, initial=True)
            self._apply(seq, payload)
        else:
            self.counters["duplicates"] += 1  # already applied (live copy of a replayed batch)

    def _newer_than_applied(self, payload: bytes) -> bool:
        if self.last_batch_ts is None:
            return False
        try:
            return decode_batch(payload).ts > self.last_batch_ts
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.counters["decode_errors"] += 1
            self.watch.on_decode_error(time.monotonic(), f"seq {seq}: {type(e).__name__}: {e}")
            self.last_seq = seq
            return
        if self.stale and any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self._clear_stale()  # a full reset on the engine: our rebuilt view is exact again
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self.counters["clears"] += 1
        self.counters["block_events"] += self.index.apply(self.engine, batch)
        self.counters["batches"] += 1
        self.last_seq = seq
        self.last_batch_ts = max(self.last_batch_ts or 0.0, batch.ts)
        self.last_event_at = time.time()
        self.watch.on_batch(time.monotonic())
        self.applied.set()

    # ------------------------------------------------------------------------------ replay
    async def _recover(self, start: int, until: int, initial: bool = False) -> None:
        """Fill [start, until) from the replay socket; if it cannot, mark stale and rebuild from scratch."""
        got = await self.replay(start) if self.replay_endpoint else None
        need = [(s, p) for s, p in (got or []) if start <= s < until]
        if got is not None and need and need[0][0] == start and len(need) == until - start:
            self.counters["replays_ok"] += 1
            for s, p in need:
                self._apply(s, p)
                self.counters["replayed_batches"] += 1
            return
        if initial and start == 0 and got is None and not self.replay_endpoint:
            reason = f"joined at seq {until} without a replay socket; blocks cached before are unknown"
        else:
            self.counters["replays_failed"] += 1
            self.counters["unrecoverable_gaps"] += 1
            have = f"{need[0][0]}..{need[-1][0]}" if need else "nothing"
            reason = (f"gap {start}..{until - 1}: replay returned {have}" if got is not None
                      else f"gap {start}..{until - 1}: replay socket unavailable")
        self._mark_stale(reason)
        # rebuild: start from an empty view, then apply what the buffer still has (newest history first kept)
        self.index.reset(self.engine)
        for s, p in need:
            if s >= (until - len(need)):
                self._apply(s, p)

    async def replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the engine's ROUTER for every buffered batch with seq >= start; None on timeout/error."""
        assert self.replay_endpoint
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(left * 1000):
                    return None
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # tolerate publishers that also send the topic
                    frames = frames[1:]
                if len(frames) != 2:
                    return None
                seq_b, payload = frames
                if seq_b == END_SEQ or seq_b == b"":
                    return out
                out.append((int.from_bytes(seq_b, "big"), payload))
        except zmq.ZMQError:
            return None
        finally:
            sock.close(linger=0)

    # ------------------------------------------------------------------------------ state
    def _mark_stale(self, reason: str) -> None:
        log.warning("kv events: engine %s view is stale: %s", self.engine, reason)
        self.stale = True
        self.stale_reason = reason
        self.stale_since = time.time()

    def _clear_stale(self) -> None:
        self.stale = False
        self.stale_reason = None
        self.stale_since = None

    def mark_fresh(self) -> None:
        """Called once agreement with the engine is back (see TelemetryService.observe_cached)."""
        self._clear_stale()

    def retune(self, topic: str, silence_grace_s: float) -> None:
        """Hot reload: take another topic (the socket already receives every topic) or grace period. A new
        topic starts a new watch: what was judged against the old one no longer says anything."""
        if topic != self.topic:
            self.topic, self._topic_b = topic, topic.encode("utf-8")
            self.watch = StreamWatch(silence_grace_s, topic)
        self.watch.grace_s = silence_grace_s

    @property
    def stream_stale(self) -> bool:
        return self.watch.reason is not None

    def evaluate_stream(self, now: float | None = None) -> bool:
        """Re-judge the stream's silence state; logs one warning per change (stale, other reason, fresh)."""
        now = time.monotonic() if now is None else now
        was = self.watch.reason
        if not self.watch.evaluate(now):
            return False
        if self.watch.reason is None:
            log.warning("kv events: engine %s KV stream is fresh again (was %s): a batch arrived on topic %r",
                        self.engine, was, self.topic)
        else:
            log.warning("kv events: engine %s KV view is stale (%s): %s", self.engine, self.watch.reason,
                        self.watch.detail(now))
        return True

    def snapshot(self) -> dict[str, Any]:
        return {**self.watch.snapshot(time.monotonic()), "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "topic": self.topic,
                "last_seq": self.last_seq, "stale": self.stale, "stale_reason": self.stale_reason,
                "stale_since": self.stale_since, "last_event_at": self.last_event_at,
                "queued": self._queue.qsize(), **self.counters}
