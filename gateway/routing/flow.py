"""Flow control: what the engines cannot start soon waits in the gateway, in fair queues, and long prompts are
kept from taking every engine's prefill at once.

Why the gateway holds work: an engine serves its waiting queue first come, first served (by priority), so a
tenant sending 3x its share fills every engine's queue and the TTFT predictor then refuses the well-behaved
tenant's requests, whose predicted TTFT is now too high. And a 12k-token prompt occupies an engine's chunked
prefill for many steps: everything behind it waits (vLLM V1 has no partial-prefill concurrency limit).

Three pure parts, driven by the route stage (`gateway/routing/stage.py`), no I/O, injectable time:

- `FairQueue`: per priority class (realtime before standard), one bounded FIFO per flow (a tenant, team,
  project, key or partner: `gateway.routing.flowkey`), served in order of the flows' virtual token counters
  (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI '24): a flow's counter grows by
  (prefill tokens x w_p + decode tokens x w_d) / share for what it is served; the backlogged flow with the
  lowest counter goes next; a flow that becomes backlogged is lifted to the lowest counter of the backlogged
  ones (it cannot bank idle time). Work conserving: a flow alone gets every free slot.
- `engine_open`: an engine takes another request while the prefill already queued on it drains within
  `engine_queue_ms` (its learned rate) and so do the prompts sent to it without a first token yet (observed)
  while more than one flow is being served; with one flow alone, those may fill one chunked-prefill step
  (it batches them, and there is nobody to be fair to). Else the request waits here, where the order is fair.
- `long_slots`: the prefill guard. A prompt is long from `long_prompt_tokens` uncached tokens (default twice the
  engine's chunk budget). An engine prefills at most `max_long_prefills` (and `max_long_prefill_tokens`) long
  prompts at once, and at most `long_engine_share` of a request's allowed engines prefill long prompts at
  once (at least one), so short prompts always find an engine without a long prefill ahead of them; with
  `long_context_engines` long prompts go only to those when any is allowed.

`wait_estimate` is what admission adds to a queued request's predicted TTFT: the time until an engine opens,
plus the work the fair order puts ahead of it at the rate the gateway has been handing work out while
backlogged. A request whose predicted TTFT including that wait misses its target is refused at once (429 +
Retry-After + the prediction), so a flooding flow's requests are the ones refused.
"""
from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from gateway.routing.view import Drain

CLASSES = ("realtime", "standard")  # the priority classes that queue here, served in this order (batch has its own)
# each class has two lanes: short prompts wait for an engine to open, long ones also for a prefill-guard slot, so
# a long prompt waiting for a slot is never ahead of a short one (queues are keyed "standard", "standard/long")
LANES = tuple(c + lane for c in CLASSES for lane in ("", "/long"))


def lane_class(priority: str, long: bool) -> str:
    """The queue a request waits in: its priority class, and its lane."""
    return priority + "/long" if long else priority


def _same_lane(a: str, b: str) -> bool:
    return a.endswith("/long") == b.endswith("/long")
SCAN = 8  # items looked at per flow for one that may go now (a long head must not block its flow's short ones)


class FlowQueueFull(Exception):
    """The flow's queue in this class is at `max_queue_per_flow`."""


@dataclass(slots=True, eq=False)
class Waiter:
    """One request waiting in the gateway."""

    flow: str
    cls: str
    cost: float  # uncached prompt tokens: the counter's prefill charge at dispatch, the queue's work unit
    long: bool
    engines: frozenset[str]  # the own engines it may be sent to
    enqueued: float
    deadline: float
    uncached: dict[str, int] = field(default_factory=dict)  # its uncached prompt tokens per own engine
    fut: asyncio.Future[frozenset[str]] | None = None  # resolved with the engines open for it at release
    seq: int = 0
    predicted_s: float = 0.0  # the wait predicted for it when it queued (the wait's error is learned from it)
    # a request with a TTFT target: when (gate clock) its first token is due, and per own engine the upper bound
    # of its own prefill there with nothing queued; what is left between them is what it may wait in that
    # engine's queue (FlowGate.may_start's `budget`). None: no target
    first_token_by: float | None = None
    own_upper_s: dict[str, float] = field(default_factory=dict)

    def budget(self, now: float) -> dict[str, float] | None:
        """Per engine, the seconds it may still spend in that engine's queue and meet its target."""
        if self.first_token_by is None:
            return None
        left = self.first_token_by - now
        return {e: left - own for e, own in self.own_upper_s.items()}


@dataclass(slots=True)
class _Rate:
    """Prompt tokens handed out per second over the last `window_s` (the queue's service rate)."""

    window_s: float = 2.0
    events: deque[tuple[float, float]] = field(default_factory=deque)
    total: float = 0.0

    def add(self, now: float, tokens: float) -> None:
        self.events.append((now, tokens))
        self.total += tokens
        self._trim(now)

    def _trim(self, now: float) -> None:
        ev = self.events
        while ev and ev[0][0] < now - self.window_s:
            self.total -= ev.popleft()[1]

    def per_s(self, now: float) -> float:
        self._trim(now)
        if not self.events:
            return 0.0
        span = max(self.window_s / 4, now - self.events[0][0])
        return self.total / span


class FairQueue:
    """Bounded per-flow FIFOs per priority class, served by lowest virtual token counter (see module doc)."""

    def __init__(self, max_per_flow: int = 128, prefill_weight: float = 1.0, decode_weight: float = 1.0,
                 classes: tuple[str, ...] = LANES) -> None:
        self.max_per_flow = max_per_flow
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.classes = classes
        self.queues: dict[str, dict[str, deque[Waiter]]] = {c: {} for c in classes}
        self.queued_cost: dict[str, dict[str, float]] = {c: {} for c in classes}
        self.counter: dict[str, float] = {}  # flow -> virtual tokens served / share
        self.weight: dict[str, float] = {}
        self.served_prefill: dict[str, float] = {}  # flow -> prompt tokens dispatched (metrics)
        self.served_decode: dict[str, float] = {}  # flow -> completion tokens served
        self.vtime = 0.0  # the counter of the last flow served from the queue (a newly backlogged flow's floor)
        self._seq = 0
        self.n = 0  # requests waiting, all classes

    # ------------------------------------------------------------------------------------------ state
    def __len__(self) -> int:
        return self.n

    def depth(self) -> dict[tuple[str, str], int]:
        """(class, flow) -> requests waiting."""
        return {(c, f): len(q) for c, qs in self.queues.items() for f, q in qs.items() if q}

    def backlogged(self, cls: str) -> list[str]:
        return [f for f, q in self.queues[cls].items() if q]

    def _floor(self, cls: str, flow: str) -> float:
        """The counter a flow that becomes backlogged in `cls` starts from: the lowest backlogged counter."""
        others = [self.counter.get(f, 0.0) for f in self.backlogged(cls) if f != flow]
        return min(others) if others else self.vtime

    def lifted(self, cls: str, flow: str) -> float:
        """The flow's counter as it would stand in `cls` now (lifted if it is not backlogged there)."""
        v = self.counter.get(flow, 0.0)
        q = self.queues[cls].get(flow)
        return v if q else max(v, self._floor(cls, flow))

    # ------------------------------------------------------------------------------------------ changes
    def push(self, w: Waiter, weight: float = 1.0) -> None:
        """Queue `w` at the back of its flow (raises FlowQueueFull); a newly backlogged flow is lifted."""
        qs = self.queues[w.cls]
        q = qs.get(w.flow)
        if q is not None and len(q) >= self.max_per_flow:
            raise FlowQueueFull()
        self.weight[w.flow] = weight if weight > 0 else 1.0
        if not q:
            self.counter[w.flow] = max(self.counter.get(w.flow, 0.0), self._floor(w.cls, w.flow))
            q = qs[w.flow] = deque()
        self._seq += 1
        w.seq = self._seq
        q.append(w)
        self.n += 1
        qc = self.queued_cost[w.cls]
        qc[w.flow] = qc.get(w.flow, 0.0) + w.cost

    def push_front(self, w: Waiter) -> None:
        """Put a released request back at the head of its flow (it found no engine open after all)."""
        q = self.queues[w.cls].setdefault(w.flow, deque())
        q.appendleft(w)
        self.n += 1
        qc = self.queued_cost[w.cls]
        qc[w.flow] = qc.get(w.flow, 0.0) + w.cost

    def remove(self, w: Waiter) -> bool:
        """Take `w` out (released, timed out or cancelled); False when it was not queued."""
        q = self.queues[w.cls].get(w.flow)
        if not q:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        self.n -= 1
        qc = self.queued_cost[w.cls]
        qc[w.flow] = max(0.0, qc.get(w.flow, 0.0) - w.cost)
        if not q:
            del self.queues[w.cls][w.flow]
            qc.pop(w.flow, None)
        return True

    def charge(self, flow: str, prefill_tokens: float = 0.0, decode_tokens: float = 0.0,
               weight: float | None = None) -> None:
        """Count service to `flow`: prompt tokens at dispatch, completion tokens as they are served."""
        if weight is not None and weight > 0:
            self.weight[flow] = weight
        w = self.weight.get(flow, 1.0)
        cost = prefill_tokens * self.prefill_weight + decode_tokens * self.decode_weight
        self.counter[flow] = self.counter.get(flow, 0.0) + cost / w
        if prefill_tokens:
            self.served_prefill[flow] = self.served_prefill.get(flow, 0.0) + prefill_tokens
        if decode_tokens:
            self.served_decode[flow] = self.served_decode.get(flow, 0.0) + decode_tokens

    def serve(self, flow: str, cls: str, prefill_tokens: float, weight: float | None = None) -> None:
        """A request of `flow` went to an engine (from the queue or straight away): a flow with nothing waiting
        in `cls` is lifted first, as when it queues (a flow served while alone carries no debt into contention
        and one that was idle banks nothing); the system's virtual time follows it; then its prompt is charged."""
        if not self.queues[cls].get(flow):
            self.counter[flow] = max(self.counter.get(flow, 0.0), self._floor(cls, flow))
        self.vtime = max(self.vtime, self.counter.get(flow, 0.0))
        self.charge(flow, prefill_tokens=prefill_tokens, weight=weight)

    def prune(self, keep: int = 4096) -> None:
        """Forget counters of idle flows at or below the virtual time (a lift would restore them anyway)."""
        if len(self.counter) <= keep:
            return
        busy = {f for qs in self.queues.values() for f, q in qs.items() if q}
        for f in [f for f, v in self.counter.items() if f not in busy and v <= self.vtime]:
            self.counter.pop(f, None)
            self.weight.pop(f, None)

    # ------------------------------------------------------------------------------------------ order
    def order(self) -> Iterator[Waiter]:
        """Waiting requests in the order they may go: class by class; within a class the flows by counter
        (ties: fewer waiting first, then the older head), up to SCAN items of each flow in FIFO order."""
        for c in self.classes:
            qs = self.queues[c]
            if not qs:
                continue
            # ties (a flow just lifted to the lowest counter) go to the flow with less waiting, then the oldest
            flows = sorted((f for f, q in qs.items() if q),
                           key=lambda f: (self.counter.get(f, 0.0), len(qs[f]), qs[f][0].seq))
            for f in flows:
                for i, w in enumerate(list(qs[f])):
                    if i >= SCAN:
                        break
                    yield w

    def pick(self, may_go: Callable[[Waiter], bool]) -> Waiter | None:
        """The first request in fair order that may go now (`may_go`: an engine of its is open for it)."""
        for w in self.order():
            if may_go(w):
                return w
        return None

    def ahead(self, cls: str, flow: str, cost: float, weight: float = 1.0) -> float:
        """Prompt tokens the fair order serves before a new request of `flow` costing `cost` would go: every
        queued request of a higher class in its lane, its own flow's queue, and of each other flow in its class
        what finishes (in virtual time) before it would."""
        total = 0.0
        for c in self.classes:
            if c == cls:
                break
            if _same_lane(c, cls):
                total += sum(self.queued_cost[c].values())
        w = weight if weight > 0 else 1.0
        mine = self.queued_cost[cls].get(flow, 0.0)
        finish = self.lifted(cls, flow) + (mine + cost) * self.prefill_weight / w
        total += mine
        for g, qcost in self.queued_cost[cls].items():
            if g == flow or qcost <= 0:
                continue
            room = (finish - self.counter.get(g, 0.0)) * self.weight.get(g, 1.0) / max(1e-9, self.prefill_weight)
            total += min(qcost, max(0.0, room))
        return total

    def first_in_line(self, cls: str, flow: str) -> bool:
        """Whether a new request of `flow` would go before everything waiting in its class and above (a flow
        lifted to the lowest backlogged counter ties with it, and goes first: it has nothing queued)."""
        if not self.n:
            return True
        for c in self.classes:
            if c == cls:
                break
            if self.queues[c] and _same_lane(c, cls):
                return False
        v = self.lifted(cls, flow)
        return all(v <= self.counter.get(g, 0.0) for g in self.backlogged(cls) if g != flow) and \
            not self.queues[cls].get(flow)


# ------------------------------------------------------------------------------------------ engines
def drain_seconds(drain: Drain, tokens: float) -> float:
    """How long the engine takes to work off `tokens` of queued prefill: full chunks, then the last one."""
    if tokens <= 0:
        return 0.0
    b = float(max(1, drain.budget))
    full = math.floor(tokens / b)
    rest = tokens - full * b
    return full * (drain.step_s + drain.s_per_token * b) + (drain.step_s + drain.s_per_token * rest if rest else 0.0)


def engine_open(ahead_tokens: float, unfirst_tokens: float, drain: Drain, queue_s: float,
                strict: bool = True) -> bool:
    """An engine takes another request while what is queued on it drains within `queue_s` by the drain model,
    and the prompts sent to it that have no first token yet (observed, so a hard cap when the model is off)
    drain within `queue_s` too (`strict`: several flows are being served, and what one flow queues inside an
    engine another waits behind) or fit one chunked-prefill step (one flow alone: nobody to be fair to, and
    a full step batches its prompts)."""
    if drain_seconds(drain, ahead_tokens) > queue_s:
        return False
    return drain_seconds(drain, unfirst_tokens) <= queue_s if strict else unfirst_tokens <= drain.budget


def open_in(ahead_tokens: float, unfirst_tokens: float, drain: Drain, queue_s: float, strict: bool = True) -> float:
    """Seconds until `engine_open` holds again (0 when it does), on the same two terms."""
    cap = queue_s if strict else drain_seconds(drain, drain.budget)
    return max(0.0, drain_seconds(drain, ahead_tokens) - queue_s, drain_seconds(drain, unfirst_tokens) - cap)


@dataclass(frozen=True, slots=True)
class LongLimits:
    """One engine's prefill-guard limits (config defaults with the engine's own overrides applied)."""

    long_prompt_tokens: int
    max_long_prefills: int
    max_long_prefill_tokens: int | None


@dataclass(frozen=True, slots=True)
class LongFlight:
    """A long prompt this gateway dispatched that has not had its first token: its uncached tokens and when
    its prefill is predicted to end (clock of `now`)."""

    uncached: float
    ends_at: float


def long_slots(engines: Iterable[str], cost: float, flights: dict[str, list[LongFlight]],
               limits: Callable[[str], LongLimits], share: float, designated: Iterable[str] = ()
               ) -> tuple[list[str], float | None]:
    """The engines a long prompt of `cost` uncached tokens may start on now, and (when none) the soonest a
    slot frees, as a time on the flights' clock (None: no long prompt is prefilling to wait for).

    A slot is an engine under its own count and token caps whose start keeps the engines with a long prefill
    within `share` of `engines` (at least one); with `designated` engines among `engines`, only those."""
    pool = list(engines)
    des = [e for e in pool if e in set(designated)]
    if des:
        pool = des
    cap = max(1, math.floor(share * len(pool) + 1e-9))
    busy = [e for e in pool if flights.get(e)]
    ok: list[str] = []
    for e in pool:
        lf = flights.get(e, [])
        lim = limits(e)
        if len(lf) >= lim.max_long_prefills:
            continue
        if lim.max_long_prefill_tokens is not None and lf and sum(f.uncached for f in lf) + cost > lim.max_long_prefill_tokens:
            continue
        if not lf and len(busy) >= cap:
            continue
        ok.append(e)
    if ok:
        return ok, None
    ends = [f.ends_at for e in pool for f in flights.get(e, [])]
    return [], (min(ends) if ends else None)


def wait_estimate(ahead_tokens: float, rate_tokens_per_s: float, open_in_s: float) -> float:
    """Seconds a queued request is predicted to wait: until an engine opens, then the work ahead of it at the
    queue's service rate."""
    if ahead_tokens <= 0:
        return open_in_s
    return open_in_s + ahead_tokens / max(1e-6, rate_tokens_per_s)
