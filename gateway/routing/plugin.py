"""Routing plugins, llm-d style: the kinds, their one interface each, and the score contract.

A strategy (config `routing.strategy`: a preset name or a list of `{type, weight, params}`) is filters, scorers
and one picker, run per model group of the candidates that survived the hard steps. The hard steps are not
plugins and cannot be configured away: residency/retention of the policy decision, health and capability
(`gateway.routing.candidates`) run before any plugin, and the client's provider preferences
(`candidates.client_order`) and admission run after the picker.

Score contract:

- **Filter** `keep(s, prompt_tokens) -> None | str`: None keeps the candidate, a string drops it with that reason
  (recorded in the audit record's `dropped` with the filter's type as `filter`). Filters run in list order; the
  first that drops a candidate names it. A filter may drop every candidate (the request then gets 503).
- **Scorer** `score(items) -> list[float]`: one finite float per candidate, in the order given, **lower is
  better**. Scores are *not* normalised: each scorer returns its own unit, named by its `unit` attribute (ms of
  predicted TTFT, requests of load, ...), with large finite sentinels (1e6, 1e12) for "cannot judge / over the
  line" so such candidates sort after every judged one. A scorer must be pure over the `EngineView`s and
  candidates it is given (the stage builds them once per request) and must not reorder or drop.
- **Weights**: a candidate's total is `sum(weight_i x score_i)` over the strategy's scorers (weight >= 0,
  default 1). Because units differ, a weight is an exchange rate: with `predicted_ttft` (ms) at 1 and `load`
  (requests) at 20, one more request in flight costs as much as 20 ms of predicted TTFT. The total is written
  to `Candidate.score`; each scorer's raw value to `Scored.scores[type]`.
- **Picker** `order(items) -> list`: every kept candidate, best first (the dispatcher falls back along this
  order, so it must not drop any). `min_score` sorts by total (rounded to 1e-6), ties by load, and lets a
  session's previous engine lead when within its affinity slack of the best; `round_robin` ignores scores.
  A strategy has exactly one picker (`min_score` when a list names none).

A new plugin is one module in `filters/`, `scorers/` or `pickers/` that decorates its class with
`gateway.routing.registry.register` (the registry imports every module of those packages) plus its test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence

from gateway.routing.plan import Candidate

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext
    from gateway.routing.inflight import Flight


@dataclass(slots=True)
class EngineView:
    """One candidate's state at routing time (from telemetry when present, else the gateway's own counts)."""

    inflight: int = 0  # this gateway's requests on the engine
    prefilling_tokens: int = 0  # this gateway's dispatched prompt tokens whose first token has not arrived
    running: float = 0.0  # decoding sequences (max of engine metrics and own view)
    waiting: float = 0.0  # requests queued in the engine (metrics)
    kv_usage: float = 0.0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    ahead_tokens: float = 0.0
    approx_match: float = 0.0  # fraction of the prompt the approximate prefix tree saw sent here
    affinity: bool = False  # the session/trace header was last served here
    ttft_target_ms: float | None = None  # the request's TTFT target (x-ttft-slo-ms / policy / default), if any

    @property
    def load(self) -> float:
        return self.inflight + self.waiting + 0.1 * self.running


@dataclass(slots=True)
class Scored:
    """A candidate with its view, the raw score of each scorer (by type) and the weighted total."""

    cand: Candidate
    view: EngineView
    scores: dict[str, float] = field(default_factory=dict)
    total: float = 0.0


@dataclass(frozen=True, slots=True)
class Param:
    """One configurable parameter of a plugin: its default, a check on the value and the rule it states."""

    default: float
    check: Callable[[float], bool] = lambda v: math.isfinite(v)
    rule: str = "must be a finite number"


class Plugin:
    """What every plugin class declares: `type` (its config name, set by `register`), `kind` and its params
    (constructor keyword arguments, validated by the registry before construction)."""

    type: ClassVar[str] = ""
    kind: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}

    @property
    def name(self) -> str:
        return self.type


class Filter(Plugin):
    kind = "filter"

    def keep(self, s: Scored, prompt_tokens: int) -> str | None:
        """None to keep the candidate, else the reason it is dropped."""
        raise NotImplementedError


class Scorer(Plugin):
    kind = "scorer"
    unit: ClassVar[str] = ""
    weight: float = 1.0

    def score(self, items: Sequence[Scored]) -> list[float]:
        """One float per item, lower is better, in this scorer's `unit`."""
        raise NotImplementedError


class Picker(Plugin):
    kind = "picker"

    def order(self, items: list[Scored]) -> list[Scored]:
        """All items, best first (the Dispatcher falls back along this order)."""
        raise NotImplementedError


class ResponseComplete(Protocol):
    """Told of every request the route stage dispatched once its response is complete (or failed), after the stage
    released what it held (its slot, in-flight count, flow share): what a finished request teaches the router.
    Like the Gateway API Inference Extension's ResponseComplete; the route stage's `on_response` list, in order.
    The request's facts are `ctx` (status, TTFT, usage, evidence) and the flight the stage dispatched it as."""

    name: str

    def response_complete(self, ctx: RequestContext, flight: Flight) -> None: ...


@dataclass
class Strategy:
    """A built strategy: the plugins of one `routing.strategy` value, in the order they run."""

    name: str
    filters: list[Any]
    scorers: list[Any]
    picker: Any

    def run(self, items: list[Scored], prompt_tokens: int) -> tuple[list[Scored], list[tuple[Scored, str, str]]]:
        """Apply filters, scorers and the picker; returns (ordered kept, [(dropped, filter, reason)])."""
        kept: list[Scored] = []
        dropped: list[tuple[Scored, str, str]] = []
        for s in items:
            why = None
            for f in self.filters:
                why = f.keep(s, prompt_tokens)
                if why is not None:
                    dropped.append((s, f.name, why))
                    break
            if why is None:
                kept.append(s)
        for sc in self.scorers:
            for s, v in zip(kept, sc.score(kept)):
                s.scores[sc.name] = v
                s.total += sc.weight * v
        for s in kept:
            s.cand.score = s.total
        return self.picker.order(kept), dropped
