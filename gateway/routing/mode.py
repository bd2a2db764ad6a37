"""Which upstreams the gateway has a model of, and so which mechanisms may act on them.

First, do no harm: prediction, admission refusals, holding requests in the fair queue and the prefill guard are
only as good as the model behind them. An upstream is **modelled** when all of these hold:

1. its kind publishes what the model reads (the dialect registry's kinds with KV events and engine metrics:
   `vllm`, `sim`, `sglang`); a partner API or any other OpenAI-compatible service (`openai`, `anthropic`) has no
   prefill queue the gateway can observe;
2. its telemetry is live: a healthy metrics scrape younger than `telemetry_fresh_s`, and its KV-event stream
   not stale (rebuilding after lost events, silent, undecodable);
3. its learned fit is valid: at least `min_observations` out-of-sample TTFT observations since the learner's
   last reset (the conformal bound is no longer the cold margin), and their median absolute relative error
   (MdARE) inside `max_mdare`. A modelled engine leaves the state only past `max_mdare x exit_factor`
   (hysteresis: a fit hovering at the band's edge does not flap).

Everything else is **pass-through**: routed load-aware (fewest in flight, the cache score where the index knows
it), never held in the gateway and never refused on a prediction, only by a limit the operator set
(`backends[].max_inflight`) or by a certainty (the time already spent is past the target).

`decide_mode` is pure (the tests drive it directly); `ModeBook` keeps each upstream's current mode and says so
once per change (log, `gateway_upstream_mode` gauge, `/admin/routing`, the dashboard).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gateway.proxy.dialects import TELEMETRY_KINDS
from gateway.routing.config import ModelValidity

if TYPE_CHECKING:
    from gateway.routing.plan import Candidate
    from gateway.routing.plugin import Scored

log = logging.getLogger("gateway.routing.mode")

MODELLED_KINDS = TELEMETRY_KINDS  # kinds whose queue, cache and prefill the gateway observes (dialect registry)


@dataclass(frozen=True, slots=True)
class Observed:
    """What the gateway can observe about one upstream now (the input of `decide_mode`)."""

    kind: str
    telemetry: bool = False  # a telemetry service runs
    scrape_age_s: float | None = None  # seconds since the last healthy metrics scrape (None: never)
    scrape_error: str | None = None  # the last scrape failed with this
    kv_stale: bool = False  # the KV-event stream is rebuilding, silent or undecodable
    observations: int = 0  # out-of-sample TTFT observations since the learner's last reset
    mdare: float | None = None  # their median absolute relative error


@dataclass(frozen=True, slots=True)
class Mode:
    """An upstream's mode and the one-line reason for it (shown in evidence, /admin/routing, the dashboard)."""

    modelled: bool
    reason: str

    @property
    def name(self) -> str:
        return "modelled" if self.modelled else "pass_through"

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.name, "reason": self.reason}


def decide_mode(obs: Observed, v: ModelValidity, was_modelled: bool = False) -> Mode:
    """The mode an upstream is in, from what is observed about it (module doc); `was_modelled`: its mode until
    now (the band's exit is wider than its entry)."""
    if obs.kind not in MODELLED_KINDS:
        return Mode(False, f"kind {obs.kind}: no queue or prefill the gateway can observe")
    if not obs.telemetry:
        return Mode(False, "no telemetry service")
    if obs.scrape_age_s is None:
        why = f"metrics scrape failing ({obs.scrape_error})" if obs.scrape_error else "no metrics scraped yet"
        return Mode(False, why)
    if obs.scrape_age_s > v.telemetry_fresh_s:
        return Mode(False, f"metrics stale (last healthy scrape {obs.scrape_age_s:.1f} s ago)")
    if obs.kv_stale:
        return Mode(False, "KV-event stream stale")
    if obs.observations < v.min_observations:
        return Mode(False, f"model not learned yet ({obs.observations} of {v.min_observations} observations)")
    band = v.max_mdare * (v.exit_factor if was_modelled else 1.0)
    if obs.mdare is not None and obs.mdare > band:
        return Mode(False, f"fit outside its band (MdARE {obs.mdare:.2f} > {band:.2f})")
    md = f"{obs.mdare:.2f}" if obs.mdare is not None else "n/a"
    return Mode(True, f"telemetry live, fit valid ({obs.observations} observations, MdARE {md})")


class ModeBook:
    """Each upstream's current mode; a change is logged once and counted (`on_change(name, mode)`)."""

    def __init__(self, on_change: Callable[[str, Mode], None] | None = None) -> None:
        self.modes: dict[str, Mode] = {}
        self.changes = 0
        self._on_change = on_change

    def update(self, name: str, obs: Observed, v: ModelValidity) -> Mode:
        prev = self.modes.get(name)
        m = decide_mode(obs, v, prev is not None and prev.modelled)
        if prev is None or prev.modelled != m.modelled:
            self.modes[name] = m
            if prev is not None:
                self.changes += 1
                log.warning("upstream %s is now %s: %s", name, m.name, m.reason)
            if self._on_change is not None:
                self._on_change(name, m)
        elif prev.reason != m.reason:
            self.modes[name] = m  # same mode, a fresher reason (no log: not a change of state)
        return m

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {n: m.to_dict() for n, m in sorted(self.modes.items())}


def load_order(cands: list["Candidate"], modelled: set[str], items: list["Scored"]) -> None:
    """Order the pass-through candidates load-aware, in place: within each model group they keep the places the
    strategy gave them, filled fewest in flight first (the session's previous engine one lighter), then most
    cached tokens (where the index knows it), then the strategy's order."""
    # the session's previous engine (affinity) counts one request lighter: it holds the conversation's prefix
    inflight = {s.cand.backend.name: s.view.inflight - (1 if s.view.affinity else 0) for s in items}
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(cands):
        if c.backend.name not in modelled:
            groups.setdefault(c.model, []).append(i)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        ordered = sorted((cands[i] for i in idx),
                         key=lambda c: (inflight.get(c.backend.name, 0), -(c.cached_tokens or 0)))
        for i, c in zip(idx, ordered):
            cands[i] = c
