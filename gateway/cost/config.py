"""Config section `cost:` (owned by gateway/cost): what each backend costs the platform, per GPU-hour for
engines the platform runs, per million tokens for partner routes. docs/cost.md explains the figures."""
from __future__ import annotations

import msgspec


class BackendCost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    gpu_hour: float | None = None  # price of one GPU-hour of this engine (self-hosted); None: not priced by time
    gpus: int = 1  # GPUs one engine of this backend occupies (tensor parallel): GPU-seconds = engine-seconds x gpus
    input: float | None = None  # partner routes: what the partner charges per million prompt tokens
    cached_input: float | None = None  # partner routes: per million cached prompt tokens; None = input
    output: float | None = None  # partner routes: per million completion tokens
    currency: str = "EUR"


class CostConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True  # apportion engine time to requests and record it (audit, ledger, /metrics)
    currency: str = "EUR"  # currency of the recorded cost; other currencies convert with budgets.fx_rates
    default: BackendCost | None = None  # the cost model of a backend without an entry in `backends`
    backends: dict[str, BackendCost] = msgspec.field(default_factory=dict)  # backend name -> its cost model
