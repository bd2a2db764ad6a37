"""One engine's load as the router sees it: a pure function shared by the stage and the DES benchmark.

Why a model and not a count: a request this gateway dispatched keeps "prefilling" until its first token, but the
engine works its prompt off in chunks of up to `budget` tokens per step from the moment it arrives. Counting the
full uncached prompt of every such request as still queued overstated the work ahead by thousands of tokens
under load. `engine_view` instead drains the engine's in-flight prefill work (first come, first served) since
each dispatch at the engine's learned rate, step by step: a step prefills up to `budget` tokens alongside the
running decodes and costs `step_s + s_per_token * tokens`. A metrics scrape (how other gateway replicas' load
is seen) is aged the same way: its queued work drains since the scrape and own dispatches after it are added.
O(in-flight requests on the engine) per call, no allocation beyond the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from gateway.routing.plugins import EngineView


@dataclass(frozen=True, slots=True)
class Drain:
    """How an engine works off queued prefill: `budget` tokens per step at most, each step costing `step_s`
    (overhead + the decodes that share it) plus `s_per_token` per prefill token."""

    step_s: float
    s_per_token: float
    budget: int

    def remaining(self, tokens: float, dt: float) -> float:
        """Prefill tokens left of `tokens` queued after `dt` seconds of work (full chunks, then the last one)."""
        if tokens <= 0.0 or dt <= 0.0:
            return max(0.0, tokens)
        b = float(max(1, self.budget))
        if tokens > b:
            full_step = self.step_s + self.s_per_token * b
            t_full = (tokens - b) / b * full_step  # time to bring the queue down to one chunk
            if dt < t_full:
                return tokens - dt * b / full_step
            dt -= t_full
            tokens = b
        last = self.step_s + self.s_per_token * tokens
        return 0.0 if dt >= last else tokens * (1.0 - dt / last)


@dataclass(frozen=True, slots=True)
class Scrape:
    """The engine's metrics as last scraped, `age_s` seconds before now."""

    running: float
    waiting: float
    kv_usage: float
    age_s: float


def engine_view(flights: Iterable[tuple[float, float, bool]], now: float, drain: Drain | None,
                scrape: Scrape | None = None, avg_uncached: float = 512.0) -> EngineView:
    """The view of one engine. `flights`: this gateway's requests on it as (dispatched_at, uncached prompt
    tokens, still waiting for the first token), in dispatch order, times on the clock of `now`.

    ahead_tokens = max(own prefill work left after draining, the scrape's waiting x avg_uncached drained since
    the scrape + own work dispatched after it); running = max(own decodes, scraped running). Without a drain
    model the own term is the plain sum (the old, overstated count)."""
    n = 0
    decoding = 0
    raw = 0.0  # own uncached tokens of requests without a first token (undrained)
    own = 0.0  # own fluid queue, drained up to t_own
    t_own: float | None = None
    t_scr = now - scrape.age_s if scrape is not None else now
    other = max(0.0, scrape.waiting * avg_uncached) if scrape is not None else 0.0  # the scrape's fluid queue
    t_other = t_scr
    for started, unc, prefilling in flights:
        n += 1
        if not prefilling:
            decoding += 1
            continue
        raw += unc
        if drain is not None:
            if t_own is not None:
                own = drain.remaining(own, started - t_own)
            t_own = started
            if scrape is not None and started > t_scr:
                other = drain.remaining(other, started - t_other) + unc
                t_other = started
        own += unc
    if drain is not None:
        if t_own is not None:
            own = drain.remaining(own, now - t_own)
        if scrape is not None:
            other = drain.remaining(other, now - t_other)
    v = EngineView(inflight=n, prefilling_tokens=int(raw), running=float(decoding), ahead_tokens=own)
    if scrape is not None:
        v.running = max(v.running, scrape.running)
        v.waiting = scrape.waiting
        v.kv_usage = scrape.kv_usage
        v.ahead_tokens = max(own, other)
    return v
