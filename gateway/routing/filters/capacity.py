"""`capacity`: the prompt must fit the backend's context window (when the backend declares one)."""
from __future__ import annotations

from gateway.routing.plugin import Filter, Scored
from gateway.routing.registry import register


@register("capacity")
class ContextFilter(Filter):
    """Drops a backend whose `context_window` the prompt's token count reaches."""

    def keep(self, s: Scored, prompt_tokens: int) -> str | None:
        cw = s.cand.backend.context_window
        if cw is not None and prompt_tokens >= cw:
            return f"prompt of ~{prompt_tokens} tokens exceeds context window {cw}"
        return None
