"""Is an engine's KV-event stream alive? Silence after work the engine must have published is an alarm.

An engine that computed at least one new full block publishes a `BlockStored` (vLLM's block pool emits it
when a block becomes cached; `vllm/distributed/kv_events.py`). So when the gateway knows the engine did such
work (a request it served there with >= one block of uncached prompt, the engine's scraped
`prefix_cache_queries - hits` growing by >= one block, or frames arriving that are not usable batches) and no
KV batch on the gateway's topic arrived within `telemetry.kv_silence_grace_s`, the engine's KV view is stale:

- `decode`: frames on our topic arrived but did not decode as a KVEventBatch (or were not 3 frames);
- `wrong_topic`: frames arrived on other topics only (vLLM's `KVEventsConfig.topic` defaults to "", and a
  gateway that names another topic receives nothing usable);
- `no_events`: nothing usable arrived at all (events off, wrong endpoint, prefix caching off, network).

An idle engine is never stale. Any applied batch makes the stream fresh again. `StreamWatch` holds the
evidence; `silence_reason` is the pure decision the watch and the tests call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REASONS = ("no_events", "wrong_topic", "decode")
MAX_TOPICS = 8  # distinct other topics remembered per engine (bounded: a topic is whatever a peer sends)


def silence_reason(now: float, grace_s: float, activity_at: float | None, other_topic_frames: int,
                   decode_errors: int) -> str | None:
    """The stale reason for a stream, or None when fresh. `activity_at`: when the earliest work not yet
    followed by a batch was seen (None: none pending); the counts are of frames since the last batch."""
    if activity_at is None or now - activity_at < grace_s:
        return None
    if decode_errors:
        return "decode"
    if other_topic_frames:
        return "wrong_topic"
    return "no_events"


@dataclass
class StreamWatch:
    """Evidence about one engine's stream (monotonic clock) and its current state (`reason`)."""

    grace_s: float
    topic: str = ""
    batches: int = 0
    last_batch_at: float | None = None
    activity_at: float | None = None
    activity_source: str | None = None
    other_topic_frames: int = 0  # all time
    other_topics: dict[str, int] = field(default_factory=dict)
    other_since_batch: int = 0
    decode_errors_since_batch: int = 0
    last_decode_error: str | None = None
    reason: str | None = None
    changed_at: float | None = None  # monotonic time of the last state change

    def on_batch(self, now: float) -> None:
        self.batches += 1
        self.last_batch_at = now
        self.activity_at = self.activity_source = None
        self.other_since_batch = self.decode_errors_since_batch = 0

    def on_activity(self, now: float, source: str) -> None:
        """The engine did work that must produce a batch (a served request, metrics growth, frames)."""
        if self.activity_at is None:
            self.activity_at, self.activity_source = now, source

    def on_other_topic(self, now: float, topic: bytes) -> None:
        self.other_topic_frames += 1
        self.other_since_batch += 1
        name = topic[:64].decode("utf-8", "replace")
        if name in self.other_topics or len(self.other_topics) < MAX_TOPICS:
            self.other_topics[name] = self.other_topics.get(name, 0) + 1
        if self.batches == 0:
            # Frames on another topic while ours never carried a batch: the engine publishes, we filter it out.
            # (Once our topic has carried batches, other topics are another publisher's and prove nothing.)
            self.on_activity(now, "other_topic_frames")

    def on_decode_error(self, now: float, why: str) -> None:
        self.decode_errors_since_batch += 1
        self.last_decode_error = why[:200]
        self.on_activity(now, "undecodable_frames")

    def evaluate(self, now: float) -> bool:
        """Recompute the state; True when it changed (the caller logs once per change)."""
        r = silence_reason(now, self.grace_s, self.activity_at, self.other_since_batch,
                           self.decode_errors_since_batch)
        if r == self.reason:
            return False
        self.reason, self.changed_at = r, now
        return True

    def detail(self, now: float) -> str | None:
        """One line saying why the stream is stale and what to check (None when fresh)."""
        if self.reason is None:
            return None
        waited = f"{now - self.activity_at:.1f} s" if self.activity_at is not None else "the grace period"
        seen = f"after {self.activity_source or 'work'} {waited} ago"
        if self.reason == "decode":
            return (f"{self.decode_errors_since_batch} frame(s) on topic {self.topic!r} failed to decode {seen} "
                    f"({self.last_decode_error}); is the publisher vLLM's KVEventBatch format?")
        if self.reason == "wrong_topic":
            tops = ", ".join(repr(t) for t in sorted(self.other_topics))
            return (f"frames arrive on topic(s) {tops} but the gateway takes only {self.topic!r} {seen}: set "
                    f"telemetry.kv_topic (or the backend's kv_topic) to the engine's --kv-events-config topic, "
                    f"or to \"\" (every topic, vLLM's default)")
        return (f"no KV batch {seen}; check the engine's --kv-events-config (enable_kv_cache_events, publisher "
                f"zmq, endpoint), --enable-prefix-caching, and that the gateway reaches the endpoint")

    def snapshot(self, now: float) -> dict[str, Any]:
        return {"stream_stale": self.reason is not None, "stream_reason": self.reason,
                "stream_detail": self.detail(now), "subscribed_topic": self.topic,
                "last_batch_age_s": round(now - self.last_batch_at, 3) if self.last_batch_at is not None else None,
                "pending_activity_age_s": round(now - self.activity_at, 3) if self.activity_at is not None else None,
                "pending_activity_source": self.activity_source,
                "other_topic_frames": self.other_topic_frames, "other_topics": dict(self.other_topics),
                "silence_grace_s": self.grace_s}
