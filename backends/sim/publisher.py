"""ZMQ KV-event publisher with vLLM's frames, replay ROUTER, and injectable delay/loss faults.

Mirrors `ZmqEventPublisher` (vllm/distributed/kv_events.py): PUB frames `(topic, seq 8-byte BE, payload)`,
seq from 0 per publisher instance, a bounded replay buffer served by a ROUTER socket that answers
`(identity, b"", topic, seq, payload)` per buffered batch with seq >= start and ends with `(identity, b"", b"",
END_SEQ, b"")` (vLLM 0.32 as captured from a live engine; older sources had no topic frame; SGLang 0.5.23's
ZmqEventPublisher sends and replays exactly these frames, so only the payload differs with `wire`). Runs on the asyncio loop (zmq.asyncio) instead of a thread. A "lost" batch consumes its seq and stays
in the replay buffer but never reaches PUB subscribers, which is exactly a gap a subscriber must repair.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque

import zmq
import zmq.asyncio

from backends.sim.kv_wire import END_SEQ, Event, Wire, WireForm, encode_batch, seq_bytes

log = logging.getLogger(__name__)


def _bind(sock: zmq.Socket, host: str, port: int) -> int:
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


class KVEventPublisher:
    """One engine's PUB + replay ROUTER; `publish(events)` is cheap and never blocks."""

    # topic "": vLLM's default (vllm/config/kv_events.py `KVEventsConfig.topic`, ZmqEventPublisher(topic=""))
    def __init__(self, host: str = "127.0.0.1", port: int = 0, replay_port: int = 0, topic: str = "",
                 buffer_steps: int = 10_000, data_parallel_rank: int = 0, batch_form: WireForm = "array",
                 event_form: WireForm = "map", ctx: zmq.asyncio.Context | None = None, wire: Wire = "vllm") -> None:
        self.host = host
        self.topic = topic
        self._topic_b = topic.encode("utf-8")
        self._dp = data_parallel_rank
        self._forms = (batch_form, event_form)
        self.wire = wire
        self._salts: dict[int, str] = {}  # SGLang's wire: block hash -> its chain's salt (kv_wire.sglang_events)
        self._ctx = ctx or zmq.asyncio.Context.instance()
        # PUB is a plain socket: a non-blocking send needs no future, and it is cheaper per batch.
        self._pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(100_000)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self.port = _bind(self._pub, host, port)
            self.replay_port = _bind(self._router, host, replay_port)
        except zmq.ZMQError:
            self._pub.close(0)
            self._router.close(0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.delay_s = 0.0
        self.loss = 0.0
        self.dropped = 0
        self._rng = random.Random(0)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[Event], ts: float | None = None) -> int:
        """Encode and send one batch; returns its seq."""
        payload = encode_batch(time.time() if ts is None else ts, events, self._dp, *self._forms, wire=self.wire,
                               salts=self._salts)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self.loss and self._rng.random() < self.loss:
            self.dropped += 1
            return seq
        frames = (self._topic_b, seq_bytes(seq), payload)
        if self.delay_s > 0:
            asyncio.get_running_loop().call_later(self.delay_s, self._send, frames)
        else:
            self._send(frames)
        return seq

    def _send(self, frames: tuple[bytes, bytes, bytes]) -> None:
        if self._closed:
            return
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB at its high-water mark drops, as in vLLM
            self.dropped += 1

    async def _serve_replay(self) -> None:
        while not self._closed:
            try:
                frame = await self._router.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frame) != 3:
                log.warning("invalid replay request with %d frames", len(frame))
                continue
            client_id, _, start_b = frame
            start = int.from_bytes(start_b, "big")
            try:
                for seq, buf in list(self._buffer):
                    if seq >= start:
                        await self._router.send_multipart((client_id, b"", self._topic_b, seq_bytes(seq), buf))
                await self._router.send_multipart((client_id, b"", b"", END_SEQ, b""))
            except zmq.ZMQError:
                if self._closed:
                    return

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._pub.close(linger=0)
        self._router.close(linger=0)
