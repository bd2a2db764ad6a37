"""The routing stage's output: an ordered list of candidate (backend, model) pairs with their predictions."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a candidate carries the backend's config; plan never builds one (the config loader imports
    from gateway.config import BackendConfig  # the routing registry, which imports this module)


@dataclass(slots=True)
class Candidate:
    backend: BackendConfig
    model: str  # our model name (the upstream name is backend.upstream_model(model))
    predicted_ttft_ms: float | None = None
    predicted_ttft_upper_ms: float | None = None
    cached_tokens: int | None = None
    score: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None  # modelled | pass_through (gateway/routing/mode.py); None: not judged
    mode_reason: str | None = None

    def to_evidence(self) -> dict[str, Any]:
        loc = self.backend.location
        extra = {"mode": self.mode, "mode_reason": self.mode_reason} if self.mode is not None else {}
        return {
            "backend": self.backend.name,
            "model": self.model,
            "country": loc.country if loc else None,
            "predicted_ttft_ms": self.predicted_ttft_ms,
            "predicted_cached_tokens": self.cached_tokens,
            **self.info,
            **extra,
        }


@dataclass(slots=True)
class RoutePlan:
    candidates: list[Candidate]
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {"backend", "model", "reason"}
