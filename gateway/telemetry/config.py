"""Config section `telemetry:` (owned by KV-event telemetry and metrics scraping)."""
from __future__ import annotations

import msgspec


class TelemetryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_events: bool = True
    kv_topic: str = "kv"
    scrape_interval_s: float = 1.0
    tokenizer: str = "auto"  # auto | engine | approx | path to tokenizer.json
    max_pending_batches: int = 10000
