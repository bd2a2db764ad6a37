"""`gateway config check --probe`: does each engine's KV-event stream reach the gateway, on its topic, decodable?

For every backend of a kind that publishes KV events (vllm, sim, sglang: the dialect registry) with `kv_events`,
subscribe to every topic (as the running gateway does), ask the replay socket for its buffer from seq 0, and
wait (bounded) for one batch on the gateway's topic that decodes. vLLM 0.32's replay answers
`[b"", topic, seq, payload]` per buffered batch (ZmqEventPublisher `_service_replay`,
vllm/distributed/kv_events.py; SGLang 0.5.23's does the same, sglang/srt/disaggregation/kv_events.py), so an
engine that published anything before is judged at once, and an idle one is judged by what arrives live within
the timeout. Verdicts use the running gateway's reasons (gateway/telemetry/stream_health.py): ok, wrong_topic,
decode, no_events.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from gateway.telemetry.kv_events import END_SEQ, decode_batch

if TYPE_CHECKING:
    from gateway.config import Config


@dataclass
class ProbeResult:
    backend: str
    endpoint: str
    topic: str
    status: str = "no_events"  # ok | wrong_topic | decode | no_events
    message: str = ""
    other_topics: dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    replay: str = "not configured"  # what the replay socket said

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def line(self) -> str:
        return (f"probe {self.backend} ({self.endpoint}, topic {self.topic!r}): "
                f"{'ok' if self.ok else 'FAIL ' + self.status}: {self.message}")


class _Judge:
    """Classifies frames as they come (live or replayed) into the result."""

    def __init__(self, r: ProbeResult) -> None:
        self.r = r
        self.topic_b = r.topic.encode("utf-8")
        self.last_error = ""

    def frame(self, topic: bytes | None, seq: int, payload: bytes, source: str) -> bool:
        """True once a usable batch was seen (the probe can stop)."""
        if self.topic_b and topic is not None and topic != self.topic_b:
            name = topic[:64].decode("utf-8", "replace")
            self.r.other_topics[name] = self.r.other_topics.get(name, 0) + 1
            return False
        try:
            b = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.r.decode_errors += 1
            self.last_error = f"seq {seq}: {type(e).__name__}: {e}"[:200]
            return False
        self.r.status = "ok"
        self.r.message = f"batch seq {seq} decoded ({len(b.events)} events, from the {source})"
        return True

    def verdict(self, waited_s: float) -> None:
        r = self.r
        if r.ok:
            return
        if r.decode_errors:
            r.status = "decode"
            r.message = (f"{r.decode_errors} frame(s) on topic {r.topic!r} failed to decode ({self.last_error}); "
                         "is the publisher vLLM's or SGLang's KVEventBatch format?")
        elif r.other_topics:
            tops = ", ".join(repr(t) for t in sorted(r.other_topics))
            r.status = "wrong_topic"
            r.message = (f"frames arrive on topic(s) {tops} but the gateway takes only {r.topic!r}: set "
                         "telemetry.kv_topic (or the backend's kv_topic) to the engine's --kv-events-config topic, "
                         "or to \"\" (every topic, vLLM's default)")
        else:
            r.status = "no_events"
            hint = ("the engine has published nothing yet: send it a request during the probe"
                    if r.replay == "answered with an empty buffer" else
                    "check the engine's --kv-events-config (enable_kv_cache_events, publisher zmq, endpoint) "
                    "and that this host reaches the endpoint")
            r.message = f"nothing arrived in {waited_s:.1f} s (replay socket {r.replay}); {hint}"


async def probe_stream(backend: str, endpoint: str, replay: str | None, topic: str, timeout_s: float = 5.0,
                       ctx: zmq.asyncio.Context | None = None) -> ProbeResult:
    """Probe one engine's stream; never raises for network trouble (the result says what happened)."""
    ctx = ctx or zmq.asyncio.Context.instance()
    r = ProbeResult(backend, endpoint, topic)
    judge = _Judge(r)
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dealer = None
    try:
        sub.connect(endpoint)
        if replay:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay)
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            r.replay = "did not answer"
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        if dealer is not None:
            poller.register(dealer, zmq.POLLIN)
        replay_batches = 0
        while (left := deadline - time.monotonic()) > 0:
            events = dict(await poller.poll(left * 1000))
            if sub in events:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    if not judge.topic_b or frames[0] == judge.topic_b:
                        r.decode_errors += 1
                        judge.last_error = f"{len(frames)} frames, expected 3 (topic, seq, payload)"
                    else:
                        judge.frame(frames[0], -1, b"", "live stream")
                elif judge.frame(frames[0], int.from_bytes(frames[1], "big", signed=True), frames[2], "live stream"):
                    break
            if dealer is not None and dealer in events:
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[1] == END_SEQ or len(frames) == 2 and frames[0] == END_SEQ:
                    r.replay = (f"answered {replay_batches} buffered batch(es)" if replay_batches
                                else "answered with an empty buffer")
                    poller.unregister(dealer)
                    if replay_batches and (r.other_topics or r.decode_errors):
                        break  # the engine's whole buffer was on another topic or undecodable: conclusive
                    continue
                replay_batches += 1
                tpc: bytes | None  # the replay answer is [topic, seq, payload], or [seq, payload] from older engines
                if len(frames) == 3:
                    tpc, seq_b, payload = frames
                else:
                    tpc, (seq_b, payload) = None, frames[:2]
                if judge.frame(tpc, int.from_bytes(seq_b, "big", signed=True), payload, "replay buffer"):
                    r.replay = f"answered (batch seq {int.from_bytes(seq_b, 'big', signed=True)} decoded)"
                    break
    except zmq.ZMQError as e:
        r.status, r.message = "no_events", f"cannot connect: {e}"
        return r
    finally:
        sub.close(linger=0)
        if dealer is not None:
            dealer.close(linger=0)
    judge.verdict(time.monotonic() - t0)
    return r


async def probe_config(cfg: Config, timeout_s: float = 5.0) -> list[ProbeResult]:
    """Probe every KV-event-publishing backend with kv_events, all at once (the wait is shared)."""
    tc = cfg.raw.telemetry
    if not tc.kv_events:
        return []
    from gateway.proxy.dialects import publishes_kv_events

    todo = [(b, b.kv_events) for b in cfg.backends if publishes_kv_events(b) and b.kv_events]
    return list(await asyncio.gather(*(
        probe_stream(b.name, endpoint, b.replay, b.kv_topic if b.kv_topic is not None else tc.kv_topic,
                     timeout_s) for b, endpoint in todo)))
