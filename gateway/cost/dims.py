"""Cost dimensions beyond backend and model: the tenant-owned LoRA adapter a request used and the weighted
alias's arm it was routed to (docs/cost.md#per-adapter-and-per-arm).

Both come from the request's typed facts: `ctx.adapter` (gateway/adapters/stage.py: set only for a registered
adapter the caller may use) and `ctx.rollout` (gateway/rollouts/stage.py: the alias and the arm chosen; a shadow
copy's has `shadow` set, gateway/rollouts/shadow.py). The arm a request counts for is the one whose engine time it
was charged: the arm that answered (`backend_model`, when it is one of the alias's chain: the chosen arm failed
and a fallback arm answered), else the arm chosen (refused or failed before any arm answered). The ledger columns `adapter` and `arm` and the /metrics
counters below carry them; label values are bounded: adapters are registered names, aliases and arms come from
the config (and /admin/aliases, which only reweights configured arms)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

SHADOW_SUFFIX = " (shadow)"


def adapter_of(ctx: RequestContext) -> str | None:
    return ctx.adapter.name if ctx.adapter is not None else None


def arm_of(ctx: RequestContext) -> tuple[str, str, bool] | None:
    """(alias, arm model, shadow copy) of a request routed through a weighted alias, else None (also when the
    arm the caller may use was dropped and none was left: `arm` None)."""
    ro = ctx.rollout
    if ro is None or not ro.arm:
        return None
    arm = ro.arm
    answered = ctx.backend_model
    if answered and answered != arm and answered in ctx.model_chain:
        arm = answered  # a fallback arm answered: its engine time, its row (as the model dimension)
    return ro.alias, arm, ro.shadow


def arm_label(alias: str, arm: str, shadow: bool) -> str:
    """The report's `arm` value: `<alias>:<arm model>`, a shadow copy's with ` (shadow)` after it."""
    return f"{alias}:{arm}{SHADOW_SUFFIX if shadow else ''}"


def ledger_dims(ctx: RequestContext) -> dict[str, str | None]:
    """The ledger columns `adapter` and `arm` of a request (None: not an adapter / not through an arm)."""
    a = arm_of(ctx)
    return {"adapter": adapter_of(ctx), "arm": arm_label(*a) if a is not None else None}


class DimCounters:
    """GPU-seconds apportioned per adapter and per arm on /metrics, on the gateway's registry (the same counter
    class as the meter's other series, so workers' values add up under PROMETHEUS_MULTIPROC_DIR)."""

    def __init__(self, registry: Any) -> None:
        from gateway.metrics import _Counter

        self.adapter = _Counter("gateway_cost_adapter_gpu_seconds_total", "GPU-seconds apportioned to requests "
                                "for a tenant-owned LoRA adapter (docs/adapters.md)", ["adapter"], registry=registry)
        self.arm = _Counter("gateway_cost_arm_gpu_seconds_total", "GPU-seconds apportioned to requests routed "
                            "through a weighted alias, by the arm chosen; shadow copies apart (docs/rollouts.md)",
                            ["alias", "arm", "shadow"], registry=registry)
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric._name, *labels)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 10_000:  # bounded: label values are bounded, this is a safety net
                self._children.clear()
            c = self._children[key] = metric.labels(*labels)
        return c

    def observe(self, adapter: str | None, arm: tuple[str, str, bool] | None, gpu_seconds: float) -> None:
        """Count a finished request (its series exists from its first request, 0 GPU-seconds included)."""
        if adapter is not None:
            self._child(self.adapter, adapter).inc(gpu_seconds)
        if arm is not None:
            alias, model, shadow = arm
            self._child(self.arm, alias, model, "true" if shadow else "false").inc(gpu_seconds)
