"""`load`: the engine's load in requests (own in flight + engine waiting + 0.1 x running decodes)."""
from __future__ import annotations

from typing import Sequence

from gateway.routing.plugin import Scored, Scorer
from gateway.routing.registry import register


@register("load")
class LoadScorer(Scorer):
    """`EngineView.load`: least loaded first."""

    unit = "requests"

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [s.view.load for s in items]
