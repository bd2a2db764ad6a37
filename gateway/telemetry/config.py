"""Config section `telemetry:` (owned by KV-event telemetry and metrics scraping)."""
from __future__ import annotations

import msgspec


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_events: bool = True
    # "" = every topic, vLLM's own default (vllm/config/kv_events.py `KVEventsConfig.topic: str = ""`, which
    # ZmqEventPublisher sends as the first frame); name one only if the engines set `topic` in --kv-events-config
    kv_topic: str = ""  # "" = every topic (vLLM's default); else only frames on exactly this topic
    kv_silence_grace_s: float = 10.0  # engine served work but no KV batch for this long: its view is stale
    scrape_interval_s: float = 1.0
    scrape_timeout_s: float = 1.0
    tokenizer: str = "auto"  # auto | engine | approx | path to tokenizer.json (or its folder)
    tokenize_timeout_s: float = 0.5
    token_cache_size: int = 4096
    max_pending_batches: int = 10000  # per engine; beyond it batches are dropped and recovered by replay
    replay_timeout_s: float = 2.0
    agreement_window: int = 200  # requests per engine used to judge recovery of a stale view
    agreement_recovered: float = 0.99  # token agreement over the window that clears "stale"
