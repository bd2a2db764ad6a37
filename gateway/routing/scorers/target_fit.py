"""`target_fit`: best-fit placement by the request's TTFT target (off by default; docs/routing.md)."""
from __future__ import annotations

from typing import Sequence

from gateway.routing.plugin import Param, Scored, Scorer
from gateway.routing.registry import register


@register("target_fit")
class TargetFitScorer(Scorer):
    """Target-aware placement (best fit): a request with a TTFT target goes to the engine whose calibrated upper
    prediction meets `fill` x the target with the least slack, so a loose-target request lands on a slower or
    busier engine that still serves it in time and the fast engines' headroom stays for tight targets. Engines
    over that line come after every engine under it, by upper prediction; a request without a target is placed
    by predicted TTFT. Scores are in ms (comparable with the picker's affinity slack)."""

    unit = "ms"
    params = {"fill": Param(0.6, lambda v: 0.0 < v <= 1.0, "must be > 0 and <= 1")}

    def __init__(self, fill: float = 0.6) -> None:
        self.fill = fill

    def score(self, items: Sequence[Scored]) -> list[float]:
        return [target_fit_score(s.cand.predicted_ttft_ms, s.cand.predicted_ttft_upper_ms, s.view.ttft_target_ms,
                                 self.fill) for s in items]


def target_fit_score(mean_ms: float | None, upper_ms: float | None, target_ms: float | None,
                     fill: float = 0.8) -> float:
    """Lower is better: the slack (fill x target - upper) of an engine that meets fill x target; 1e6 + upper for
    one that does not; the mean prediction when the request has no target (or no prediction was made)."""
    if target_ms is None or upper_ms is None:
        return mean_ms if mean_ms is not None else 1e12
    line = fill * target_ms
    return line - upper_ms if upper_ms <= line else 1e6 + upper_ms
