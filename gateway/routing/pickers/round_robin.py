"""`round_robin`: rotate the candidates by one per request, ignoring scores."""
from __future__ import annotations

import itertools

from gateway.routing.plugin import Picker, Scored
from gateway.routing.registry import register


@register("round_robin")
class RoundRobinPicker(Picker):
    """Every candidate, starting one further each request (the counter lives as long as the strategy)."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def order(self, items: list[Scored]) -> list[Scored]:
        if not items:
            return items
        k = next(self._n) % len(items)
        return items[k:] + items[:k]
