"""`min_score`: lowest weighted total first, ties by load; a session's previous engine leads within a slack."""
from __future__ import annotations

import math

from gateway.routing.plugin import Param, Picker, Scored
from gateway.routing.registry import register


@register("min_score")
class MinScorePicker(Picker):
    """Lowest weighted score first; ties broken by load; a session-affinity engine wins when within
    max(affinity_slack_ms, affinity_rel x |best|) of the best total (both 0 by default: no affinity; the
    predicted presets take them from routing.affinity_slack_ms / affinity_rel)."""

    params = {"affinity_slack_ms": Param(0.0, lambda v: math.isfinite(v) and v >= 0, "must be a number >= 0"),
              "affinity_rel": Param(0.0, lambda v: math.isfinite(v) and v >= 0, "must be a number >= 0")}

    def __init__(self, affinity_slack_ms: float = 0.0, affinity_rel: float = 0.0) -> None:
        self.affinity_slack = affinity_slack_ms
        self.affinity_rel = affinity_rel

    def order(self, items: list[Scored]) -> list[Scored]:
        out = sorted(items, key=lambda s: (round(s.total, 6), s.view.load))
        if out and (self.affinity_slack > 0 or self.affinity_rel > 0):
            best = out[0].total
            for i, s in enumerate(out):
                if s.view.affinity and s.total <= best + max(self.affinity_slack, abs(best) * self.affinity_rel):
                    if i:
                        out.insert(0, out.pop(i))
                    break
        return out
