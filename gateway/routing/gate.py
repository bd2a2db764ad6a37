"""The flow gate: the stateful side of flow control (`gateway/routing/flow.py` holds the pure parts).

It owns the fair queue, the waiting requests' futures, the one release in transit and the tick that re-checks
the engines while requests wait. The route stage asks it, per request, which engines may start the request
now (`may_start`), whether the request may go before the queue (`first_in_line`), how long it would wait
(`predicted_wait`); queues it (`wait`), and tells it when a request was dispatched (`started`) or finished
(`finished`). Releases are one at a time: the released request re-scores and dispatches (so its work is in
the engines' views) before the next one is looked at, else one open engine would take the whole queue.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Callable

from gateway.routing.config import FlowControlConfig
from gateway.routing.flow import (CLASSES, LANES, FairQueue, FlowQueueFull, LongFlight, LongLimits, Waiter, _Rate,
                                  engine_open, long_slots, open_in, wait_estimate)
from gateway.routing.view import Drain

__all__ = ["CLASSES", "FlowGate", "FlowQueueFull", "QueueTimeout"]

log = logging.getLogger("gateway.routing.flow")

CONTENTION_S = 2.0  # a flow served this recently counts as active (gate.contended)
DEFAULT_SMALL_BUDGET = 2048  # vLLM's --max-num-batched-tokens for an OpenAI server on a GPU under 70 GiB


WAIT_ERROR_WINDOW = 64
WAIT_ERROR_MIN = 8  # fewer observed waits: the predicted wait is its own bound
WAIT_QUANTILE = 0.9


class QueueTimeout(Exception):
    """The request waited as long as its target allows without an engine opening for it."""


class FlowGate:
    """Fair queues and the prefill guard in front of the engines (see module doc)."""

    def __init__(self, config: Callable[[], FlowControlConfig], clock: Callable[[], float],
                 state: Callable[[str, float], tuple[float, float, float, Drain]],
                 long_flights: Callable[[float, Callable[[str], LongLimits]], dict[str, list[LongFlight]]],
                 chunk_budget: Callable[[str], tuple[int, str]],
                 predict: Callable[[str, float, float, float], float] | None = None,
                 room: Callable[[str, float], tuple[int, int]] | None = None) -> None:
        self._config = config
        self.clock = clock
        # engine -> (prefill tokens ahead (drained), own tokens without a first token, running decodes, drain)
        self._state = state
        self._predict = predict  # (engine, tokens ahead, uncached tokens, running) -> mean TTFT (s)
        self._long_flights = long_flights
        # engine -> (requests in flight on it now, the most it served in the last minute without its TTFT rising):
        # the harmful-hold check (gateway/routing/room.py)
        self._room = room
        self.holding_with_room: set[str] = set()  # engines the model called closed while they had room
        # the wait's own error, seconds (waited - predicted) of the last requests dispatched from the queue or
        # timed out in it: the upper bound admission holds a waiting request to adds its upper quantile
        self.wait_errors: deque[float] = deque(maxlen=WAIT_ERROR_WINDOW)
        self._chunk_budget = chunk_budget
        fc = config()
        self.queue = FairQueue(fc.max_queue_per_flow, fc.prefill_token_weight, fc.decode_token_weight)
        self.rate = _Rate()
        self.releasing: Waiter | None = None
        self._released_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.refused: dict[tuple[str, str], int] = {}  # (flow, reason) -> requests refused by flow control
        self.waited: dict[str, list[float]] = {c: [0.0, 0.0] for c in LANES}  # queue -> [sum of waits, count]
        self.last_served: dict[str, float] = {}  # flow -> when it was last dispatched (contention)
        self._limits: dict[str, tuple[float, LongLimits, FlowControlConfig]] = {}  # engine -> (at, limits, config)
        self.stats = {"direct": 0, "queued": 0, "released": 0, "requeued": 0, "timeouts": 0, "full": 0,
                      "late": 0, "overflow": 0, "harmful_holds": 0}

    @property
    def cfg(self) -> FlowControlConfig:
        return self._config()

    # ------------------------------------------------------------------------------------------ facts
    def limits(self, engine: str) -> LongLimits:
        """The engine's guard limits, memoised for a second (the learned chunk budget moves rarely; this is
        read several times per request)."""
        now = self.clock()
        fc = self._config()
        hit = self._limits.get(engine)
        if hit is not None and now - hit[0] < 1.0 and hit[2] is fc:
            return hit[1]
        lim = self._limits_now(engine)
        if len(self._limits) > 4096:
            self._limits.clear()
        self._limits[engine] = (now, lim, fc)
        return lim

    def _limits_now(self, engine: str) -> LongLimits:
        fc = self.cfg
        own = fc.engines.get(engine)
        thr = own.long_prompt_tokens if own is not None and own.long_prompt_tokens is not None else \
            fc.long_prompt_tokens if fc.long_prompt_tokens is not None else self._default_long(engine)
        n = own.max_long_prefills if own is not None and own.max_long_prefills is not None else fc.max_long_prefills
        tok = own.max_long_prefill_tokens if own is not None and own.max_long_prefill_tokens is not None else \
            fc.max_long_prefill_tokens
        return LongLimits(int(thr), max(1, int(n)), tok)

    def _default_long(self, engine: str) -> int:
        """Twice the engine's chunked-prefill budget (a prompt that takes three steps or more) once the budget
        is configured or learned; until then twice vLLM's smallest default budget (2048): the assumed budget
        (routing.prefill_token_budget, 8192) would call a 12k-token prompt short on an engine of 2048."""
        budget, source = self._chunk_budget(engine)
        return 2 * budget if source != "assumed" else 2 * DEFAULT_SMALL_BUDGET

    def contended(self, now: float) -> bool:
        """More than one flow was served within the last `CONTENTION_S` or is waiting: the gate is strict."""
        active: set[str] = set()
        for f, t in self.last_served.items():  # up to 4096 flows: stop at the second active one
            if now - t <= CONTENTION_S:
                if active:
                    return True
                active.add(f)
        if not self.queue.n:
            return False
        return len(active | {f for qs in self.queue.queues.values() for f, q in qs.items() if q}) > 1

    def alone(self, flow: str, now: float) -> bool:
        """No flow but `flow` was served within the last `CONTENTION_S` or is waiting: nobody to be fair to."""
        for f, t in self.last_served.items():
            if f != flow and now - t <= CONTENTION_S:
                return False
        return not any(q for qs in self.queue.queues.values() for f, q in qs.items() if q and f != flow)

    def long_on(self, uncached: dict[str, int]) -> dict[str, bool]:
        """Per engine: whether the prompt (its uncached tokens there) is long on it."""
        return {e: u >= self.limits(e).long_prompt_tokens for e, u in uncached.items()}

    def _flights(self, now: float, cache: dict[str, Any]) -> dict[str, list[LongFlight]]:
        flights = cache.get("flights")
        if flights is None:
            flights = cache["flights"] = self._long_flights(now, self.limits)
        return flights

    def may_start(self, uncached: dict[str, int], now: float, _cache: dict[str, Any] | None = None,
                  longs: dict[str, bool] | None = None, budget: dict[str, float] | None = None) -> frozenset[str]:
        """The engines that may start this request now: for a short prompt, those without a long prefill in
        progress (the drain model's estimate of a long prefill's end is not trusted with a short prompt's TTFT);
        for a long prompt, those with a long-prefill slot for it. Of those, the open ones (`engine_open`); while
        some are closed, only the open ones whose predicted TTFT for it is within `engine_queue_ms` of waiting
        for the best closed one (until it opens, then its prediction with nothing queued): a slow engine under
        many decodes opens first, but waiting a moment for a fast one is the shorter way. `_cache` may hold
        the engines' states already taken ({"state": {engine: state}}) and is filled for reuse.

        `budget` (a request with a TTFT target): per engine, how long it may wait in that engine's queue and
        still meet its target. While one flow alone is served (not `strict`: nobody to be fair to) an engine is
        open for it while its queue drains within that budget, not only within `engine_queue_ms`: holding it in
        the gateway would only spend its target (the early refusal on arrival sheds what cannot meet it). With
        several flows the engines' queues stay short, so the fair queue decides who goes first."""
        queue_s = self.cfg.engine_queue_ms / 1000.0
        cache = _cache if _cache is not None else {}
        opened = cache.setdefault("open", {})
        strict = cache.get("strict")
        if strict is None:
            strict = cache["strict"] = self.contended(now)
        if longs is None:
            longs = self.long_on(uncached)
        flights = self._flights(now, cache)
        long_names = [e for e, lg in longs.items() if lg]
        slots: set[str] = set()
        if long_names:
            fc = self.cfg
            ok, _ = long_slots(long_names, max(uncached[e] for e in long_names), flights, self.limits,
                               fc.long_engine_share, fc.long_context_engines)
            slots = set(ok)
        states = cache.setdefault("state", {})
        lane_ok: list[str] = []
        for e in uncached:
            if e in slots if longs[e] else not flights.get(e):
                lane_ok.append(e)
        opens: list[str] = []
        for e in lane_ok:
            o = opened.get(e)
            if o is None:
                ahead, unfirst, _, drain = self._st(e, now, states)
                o = engine_open(ahead, unfirst, drain, queue_s, strict)
                o = opened[e] = self._room_check(e, now, o)
            if not o and not strict and budget is not None and budget.get(e, 0.0) > queue_s:
                ahead, unfirst, _, drain = self._st(e, now, states)  # the target's own budget (see above)
                o = engine_open(ahead, unfirst, drain, budget[e], True)
            if o:
                opens.append(e)
        predict = self._predict
        closed = [e for e in lane_ok if e not in opens]
        if predict is None or not opens or not closed:
            return frozenset(opens)  # the strategy orders the open ones
        # open now, or a moment's wait for a closed one: a slow engine under many decodes opens first, but is
        # no option when waiting for a fast one is predicted shorter by more than engine_queue_ms
        alt = min(open_in(a, u, d, queue_s, strict) + predict(e, 0.0, uncached[e], r)
                  for e in closed for a, u, r, d in (self._st(e, now, states),))
        go = []
        for e in opens:
            ahead, unfirst, running, _ = self._st(e, now, states)
            if predict(e, max(ahead, unfirst), uncached[e], running) <= alt + queue_s:
                go.append(e)
        return frozenset(go)

    def _room_check(self, e: str, now: float, model_open: bool) -> bool:
        """Whether `e` may take another request: the model says open, or (the harmful-hold check) the engine has
        fewer in flight than it recently served without its TTFT rising, and holding for it would be a defect:
        it opens, and the change of state is logged and counted once."""
        room = False
        n = peak = 0
        if not model_open and self._room is not None:
            n, peak = self._room(e, now)
            room = n < peak
        was = e in self.holding_with_room
        if room and not was:
            self.holding_with_room.add(e)
            self.stats["harmful_holds"] += 1
            log.warning("flow control: the model holds requests for %s while it has room (%d in flight, %d served "
                        "in the last minute without its TTFT rising): releasing them", e, n, peak)
        elif was and not room:
            self.holding_with_room.discard(e)
            log.info("flow control: %s no longer held with room (%s)", e,
                     "the model opens it" if model_open else f"{n} in flight, recent healthy peak {peak}")
        return model_open or room

    def _st(self, e: str, now: float, states: dict[str, Any]) -> tuple[float, float, float, Drain]:
        st = states.get(e)
        if st is None:
            st = states[e] = self._state(e, now)
        return st

    def predicted_wait(self, cls: str, flow: str, weight: float, uncached: dict[str, int], now: float
                       ) -> tuple[float, float]:
        """(seconds this request would wait here, prompt tokens the fair order puts ahead of it)."""
        cost = float(min(uncached.values())) if uncached else 0.0
        queue_s = self.cfg.engine_queue_ms / 1000.0
        longs = self.long_on(uncached)
        flights = self._long_flights(now, self.limits)
        shorts = [e for e, lg in longs.items() if not lg]
        opens = []
        strict = self.contended(now)
        for e in shorts or list(uncached):
            ahead, unfirst, _, drain = self._state(e, now)
            o = open_in(ahead, unfirst, drain, queue_s, strict)
            if shorts and flights.get(e):  # a short prompt waits out the long prefill there
                o = max(o, min(f.ends_at for f in flights[e]) - now)
            opens.append(o)
        open_s = min(opens) if opens else 0.0
        if not shorts:  # long everywhere: also until a long-prefill slot frees
            fc = self.cfg
            ok, free_at = long_slots(list(uncached), cost, flights, self.limits, fc.long_engine_share,
                                     fc.long_context_engines)
            if not ok and free_at is not None:
                open_s = max(open_s, free_at - now)
        ahead_tokens = self.queue.ahead(cls, flow, cost, weight)
        rate = self.rate.per_s(now)
        if rate <= 0.0:  # nothing handed out lately: what the engines can prefill (their learned rates)
            rate = sum(1.0 / max(1e-9, d.s_per_token + d.step_s / max(1, d.budget))
                       for d in (self._state(e, now)[3] for e in uncached))
        return wait_estimate(ahead_tokens, rate, open_s), ahead_tokens

    def queue_floor(self, cls: str, flow: str, weight: float) -> tuple[float, float]:
        """(seconds, prompt tokens) of work the fair order already puts ahead of any new request of `flow` in
        the short lane of `cls`, at the recent service rate; (0, 0) when nothing was handed out lately."""
        ahead = self.queue.ahead(cls, flow, 0.0, weight)
        rate = self.rate.per_s(self.clock())
        if ahead <= 0.0 or rate <= 0.0:
            return 0.0, ahead
        return ahead / rate, ahead

    def first_in_line(self, cls: str, flow: str) -> bool:
        return self.releasing is None and self.queue.first_in_line(cls, flow)

    def observe_wait(self, w: Waiter, waited_s: float) -> None:
        """A queued request left the queue after `waited_s` (dispatched, or its slack ran out: then the true wait
        was longer, so this is a lower bound on the error, still counted)."""
        self.wait_errors.append(waited_s - w.predicted_s)

    def wait_margin(self) -> float:
        """Seconds to add to a predicted wait for its upper bound: the WAIT_QUANTILE of the recent waits' errors
        (0 until WAIT_ERROR_MIN were seen, never negative)."""
        e = self.wait_errors
        if len(e) < WAIT_ERROR_MIN:
            return 0.0
        s = sorted(e)
        k = min(len(s) - 1, int(WAIT_QUANTILE * (len(s) + 1)))
        return max(0.0, s[k])

    # ------------------------------------------------------------------------------------------ waiting
    async def wait(self, w: Waiter, weight: float, front: bool = False) -> frozenset[str]:
        """Queue `w` until the gate releases it (returns the engines open for it then). Raises FlowQueueFull
        at once, QueueTimeout at its deadline. `front`: `w` was released but found no engine open after all;
        it goes back to the head of its flow."""
        fc = self.cfg
        q = self.queue
        q.max_per_flow, q.prefill_weight, q.decode_weight = (fc.max_queue_per_flow, fc.prefill_token_weight,
                                                             fc.decode_token_weight)
        if front:
            self.requeue(w)
        else:
            try:
                self.queue.push(w, weight)
            except FlowQueueFull:
                self.stats["full"] += 1
                raise
            self.stats["queued"] += 1
        w.fut = asyncio.get_running_loop().create_future()
        self.pump()
        try:
            left = w.deadline - self.clock()
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(asyncio.shield(w.fut), left)
        except TimeoutError:
            if w.fut.done() and not w.fut.cancelled():
                return w.fut.result()
            self.stats["timeouts"] += 1
            raise QueueTimeout() from None
        finally:
            if self.queue.remove(w):  # timed out or cancelled while queued
                self._schedule()
            elif self.releasing is w and not (w.fut.done() and not w.fut.cancelled()):
                self.done(w)

    def requeue(self, w: Waiter) -> None:
        """A released request found no engine open for it after all: back to the head of its flow."""
        self.stats["requeued"] += 1
        if self.releasing is w:
            self.releasing = None
        self.queue.push_front(w)

    def done(self, w: Waiter | None) -> None:
        """The released request `w` dispatched (or gave up): the next may be released."""
        if w is not None and self.releasing is w:
            self.releasing = None
        self.pump()

    def pump(self) -> None:
        """Release the first waiting request in fair order that an engine may start now."""
        self._timer = None
        now = self.clock()
        if self.releasing is not None:
            if now - self._released_at < 0.25:  # the released one is re-scoring; it calls done()
                self._schedule()
                return
            self.releasing = None  # it never came back (cancelled mid-flight): do not stall the queue
        if not len(self.queue):
            return
        cache: dict[str, Any] = {}
        picked: list[frozenset[str]] = []

        def may_go(w: Waiter) -> bool:
            budget = w.budget(now) if w.first_token_by is not None and self.alone(w.flow, now) else None
            go = self.may_start(w.uncached, now, cache, budget=budget) & w.engines
            if go:
                picked.append(go)
            return bool(go)

        w = self.queue.pick(may_go)
        if w is not None and w.fut is not None and not w.fut.done():
            self.queue.remove(w)
            self.releasing = w
            self._released_at = now
            self.stats["released"] += 1
            w.fut.set_result(picked[-1])
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is not None or not len(self.queue):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(max(0.001, self.cfg.tick_ms / 1000.0), self.pump)

    # ------------------------------------------------------------------------------------------ accounting
    def started(self, flow: str, weight: float, cost: float, w: Waiter | None, waited_s: float, cls: str) -> None:
        """A request of `flow` was dispatched (from the queue when `w`): its prompt is charged to the flow."""
        now = self.clock()
        self.last_served[flow] = now
        if len(self.last_served) > 4096:
            self.last_served = {f: t for f, t in self.last_served.items() if now - t <= CONTENTION_S}
        self.queue.serve(flow, cls, cost, weight)
        self.rate.add(now, cost)
        if w is not None:
            ws = self.waited.setdefault(cls, [0.0, 0.0])
            ws[0] += waited_s
            ws[1] += 1
            self.observe_wait(w, waited_s)
            self.done(w)
        else:
            self.stats["direct"] += 1
        self.queue.prune()

    def finished(self, flow: str, completion_tokens: int) -> None:
        if completion_tokens:
            self.queue.charge(flow, decode_tokens=completion_tokens)
        if len(self.queue):
            self.pump()

    def refuse(self, flow: str, reason: str) -> None:
        k = (flow, reason)
        self.refused[k] = self.refused.get(k, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """For /admin/routing and the dashboard: queue depth per class and flow, counters, served tokens."""
        q = self.queue
        flows = sorted(set(q.counter) | set(q.served_prefill) | {f for f, _ in self.refused})
        return {"enabled": self.cfg.enabled, "waiting": len(q), "stats": dict(self.stats),
                "holding_with_room": sorted(self.holding_with_room),
                "wait_margin_ms": round(self.wait_margin() * 1000, 3),
                "contended": self.contended(self.clock()),
                "releasing": self.releasing is not None,
                "rate_tokens_per_s": round(self.rate.per_s(self.clock()), 1),
                "mean_wait_ms": {c: round(1000 * s / n, 3) if n else 0.0 for c, (s, n) in self.waited.items()},
                "flows": {f: {"share": q.weight.get(f, 1.0), "counter": round(q.counter.get(f, 0.0), 1),
                              "served_prompt_tokens": q.served_prefill.get(f, 0.0),
                              "served_completion_tokens": q.served_decode.get(f, 0.0),
                              "waiting": {c: len(q.queues[c].get(f, ())) for c in LANES if q.queues[c].get(f)},
                              "refused": {r: n for (g, r), n in self.refused.items() if g == f}}
                          for f in flows[:200]}}
