"""One engine's load as the router sees it: a pure function shared by the stage and the DES benchmark.

Why a model and not a count: a request this gateway dispatched keeps "prefilling" until its first token, but the
engine works its prompt off in chunks of up to `budget` tokens per step from the moment it arrives. Counting the
full uncached prompt of every such request as still queued overstated the work ahead by thousands of tokens
under load. `engine_view` instead drains the engine's in-flight prefill work (first come, first served) since
each dispatch at the engine's learned rate, step by step: a step prefills up to `budget` tokens alongside the
running decodes and costs `step_s + s_per_token * tokens`. A metrics scrape (how other gateway replicas' load
is seen) is aged the same way: its queued work drains since the scrape and own dispatches after it are added.
O(in-flight requests on the engine) per call: one list of the requests still prefilling and the result.
"""
from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Iterable, Sequence

from gateway.routing.plugin import EngineView


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
    raw = 0.0
    queue: list[tuple[float, float]] = []
    for started, unc, prefilling in flights:
        n += 1
        if prefilling:
            queue.append((started, unc))
            raw += unc
    return queue_view(n, queue, raw, now, drain, scrape, avg_uncached)


def queue_view(n: int, queue: Sequence[tuple[float, float]], raw: float, now: float, drain: Drain | None,
               scrape: Scrape | None = None, avg_uncached: float = 512.0) -> EngineView:
    """`engine_view` once the flights are split: `n` requests in flight, `queue` the (dispatched_at, uncached
    tokens) of those still prefilling, in dispatch order, and `raw` the sum of their tokens (the stage's
    InFlight.queue builds these without a tuple per request)."""
    own = drained(queue, now, drain) if drain is not None else raw
    v = EngineView(inflight=n, prefilling_tokens=int(raw), running=float(n - len(queue)), ahead_tokens=own)
    if scrape is not None:
        t_scr = t_other = now - scrape.age_s
        other = max(0.0, scrape.waiting * avg_uncached)  # the scrape's fluid queue, own work after it added
        if drain is not None:
            for started, unc in queue:
                if started > t_scr:
                    other = drain.remaining(other, started - t_other) + unc
                    t_other = started
            other = drain.remaining(other, now - t_other)
        v.running = max(v.running, scrape.running)
        v.waiting = scrape.waiting
        v.kv_usage = scrape.kv_usage
        v.ahead_tokens = max(own, other)
    return v


def drained(queue: Iterable[tuple[float, float]], now: float, drain: Drain) -> float:
    """Prefill tokens left at `now` of the work queued as (at, tokens), first come first served: from each
    arrival to the next `drain.remaining` of what is queued, plus the new tokens; then to `now`.

    `Drain.remaining` written out in the loop, with the drain's constants taken once: the same operations in
    the same order, so the same floats, without a method call per request (the view runs once per candidate
    per request, over every request in flight on the engine)."""
    b = float(max(1, drain.budget))
    step, per = drain.step_s, drain.s_per_token
    full_step = step + per * b
    left = 0.0
    t: float | None = None
    for started, unc in itertools.chain(queue, ((now, 0.0),)):  # `now` last: the drain up to it, no tokens
        if t is not None:
            dt = started - t
            if left <= 0.0 or dt <= 0.0:
                left = left if left > 0.0 else 0.0
            elif left > b and dt < (left - b) / b * full_step:  # still above one chunk at the end of dt
                left = left - dt * b / full_step
            else:
                if left > b:  # down to one chunk, then into the last one
                    dt -= (left - b) / b * full_step
                    left = b
                last = step + per * left
                left = 0.0 if dt >= last else left * (1.0 - dt / last)
        t = started
        left += unc
    return left
