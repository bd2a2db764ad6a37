"""`predicted_ttft`: the candidate's predicted time to first token from arrival (ms; the stage's predictor)."""
from __future__ import annotations

from typing import Sequence

from gateway.routing.plugin import Scored, Scorer
from gateway.routing.registry import register


@register("predicted_ttft")
class PredictedTTFTScorer(Scorer):
    """The mean prediction in ms; 1e12 for a candidate without one (after every predicted candidate)."""

    unit = "ms"

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [s.cand.predicted_ttft_ms if s.cand.predicted_ttft_ms is not None else 1e12 for s in items]
