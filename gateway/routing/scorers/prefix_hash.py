"""`prefix_hash`: SGLang-router style cache-aware placement on the gateway's approximate prefix tree."""
from __future__ import annotations

from typing import Sequence

from gateway.routing.plugin import Param, Scored, Scorer
from gateway.routing.registry import register


@register("prefix_hash")
class PrefixHashScorer(Scorer):
    """Longest approximate prefix match if the best covers `threshold` of the prompt (-1000 x match + load),
    else least load."""

    unit = "requests (-1000 per fraction of prompt matched)"
    params = {"threshold": Param(0.5, lambda v: 0.0 <= v <= 1.0, "must be between 0 and 1")}

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = threshold

    def score(self, items: Sequence[Scored]) -> list[float]:
        best = max((s.view.approx_match for s in items), default=0.0)
        if best >= self.threshold:
            return [-s.view.approx_match * 1000 + s.view.load for s in items]
        return [s.view.load for s in items]
