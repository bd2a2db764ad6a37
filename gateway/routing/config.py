"""Config section `routing:` (owned by routing and admission)."""
from __future__ import annotations

import msgspec


class RoutingConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    strategy: str = "predicted_ttft"  # predicted_ttft | least_loaded | round_robin | prefix_hash
    default_ttft_slo_ms: float | None = None
    admission: bool = True
    batch_queue_size: int = 256
    batch_queue_timeout_s: float = 30.0
    affinity_headers: list[str] = msgspec.field(default_factory=lambda: ["x-session-id", "x-opper-trace-id"])
