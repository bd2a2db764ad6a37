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
from typing import Any, Callable

from gateway.routing.config import FlowControlConfig
from gateway.routing.flow import (CLASSES, FairQueue, FlowQueueFull, LongFlight, LongLimits, Waiter, _Rate,
                                  engine_open, long_slots, open_in, wait_estimate)
from gateway.routing.view import Drain

__all__ = ["CLASSES", "FlowGate", "FlowQueueFull", "QueueTimeout"]


class QueueTimeout(Exception):
    """The request waited as long as its target allows without an engine opening for it."""


class FlowGate:
    """Fair queues and the prefill guard in front of the engines (see module doc)."""

    def __init__(self, config: Callable[[], FlowControlConfig], clock: Callable[[], float],
                 state: Callable[[str, float], tuple[float, Drain]],
                 long_flights: Callable[[float, Callable[[str], LongLimits]], dict[str, list[LongFlight]]],
                 chunk_budget: Callable[[str], int]) -> None:
        self._config = config
        self.clock = clock
        self._state = state  # engine -> (prefill tokens queued ahead on it now, its drain)
        self._long_flights = long_flights
        self._chunk_budget = chunk_budget
        fc = config()
        self.queue = FairQueue(fc.max_queue_per_flow, fc.prefill_token_weight, fc.decode_token_weight)
        self.rate = _Rate()
        self.releasing: Waiter | None = None
        self._released_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiters: dict[int, Waiter] = {}
        self.refused: dict[tuple[str, str], int] = {}  # (flow, reason) -> requests refused by flow control
        self.waited: dict[str, list[float]] = {c: [0.0, 0.0] for c in CLASSES}  # class -> [sum of waits, count]
        self.stats = {"direct": 0, "queued": 0, "released": 0, "requeued": 0, "timeouts": 0, "full": 0}

    @property
    def cfg(self) -> FlowControlConfig:
        return self._config()

    # ------------------------------------------------------------------------------------------ facts
    def limits(self, engine: str) -> LongLimits:
        fc = self.cfg
        own = fc.engines.get(engine)
        thr = own.long_prompt_tokens if own is not None and own.long_prompt_tokens is not None else \
            fc.long_prompt_tokens if fc.long_prompt_tokens is not None else 2 * self._chunk_budget(engine)
        n = own.max_long_prefills if own is not None and own.max_long_prefills is not None else fc.max_long_prefills
        tok = own.max_long_prefill_tokens if own is not None and own.max_long_prefill_tokens is not None else \
            fc.max_long_prefill_tokens
        return LongLimits(int(thr), max(1, int(n)), tok)

    def long_on(self, uncached: dict[str, int]) -> dict[str, bool]:
        """Per engine: whether the prompt (its uncached tokens there) is long on it."""
        return {e: u >= self.limits(e).long_prompt_tokens for e, u in uncached.items()}

    def may_start(self, uncached: dict[str, int], now: float, _cache: dict[str, Any] | None = None
                  ) -> frozenset[str]:
        """The engines that may start this request now: open (their queued prefill drains within
        `engine_queue_ms`) and, where the prompt is long, with a long-prefill slot for it."""
        queue_s = self.cfg.engine_queue_ms / 1000.0
        cache = _cache if _cache is not None else {}
        opened = cache.setdefault("open", {})
        go: list[str] = []
        longs = self.long_on(uncached)
        long_names = [e for e, lg in longs.items() if lg]
        slots: set[str] = set()
        if long_names:
            flights = cache.get("flights")
            if flights is None:
                flights = cache["flights"] = self._long_flights(now, self.limits)
            fc = self.cfg
            ok, _ = long_slots(long_names, max(uncached[e] for e in long_names), flights, self.limits,
                               fc.long_engine_share, fc.long_context_engines)
            slots = set(ok)
        for e in uncached:
            o = opened.get(e)
            if o is None:
                ahead, drain = self._state(e, now)
                o = opened[e] = engine_open(ahead, drain, queue_s)
            if o and (not longs[e] or e in slots):
                go.append(e)
        return frozenset(go)

    def predicted_wait(self, cls: str, flow: str, weight: float, uncached: dict[str, int], now: float
                       ) -> tuple[float, float]:
        """(seconds this request would wait here, prompt tokens the fair order puts ahead of it)."""
        cost = float(min(uncached.values())) if uncached else 0.0
        queue_s = self.cfg.engine_queue_ms / 1000.0
        longs = self.long_on(uncached)
        shorts = [e for e, lg in longs.items() if not lg]
        opens = []
        for e in shorts or list(uncached):
            ahead, drain = self._state(e, now)
            opens.append(open_in(ahead, drain, queue_s))
        open_s = min(opens) if opens else 0.0
        if not shorts:  # long everywhere: also until a long-prefill slot frees
            fc = self.cfg
            ok, free_at = long_slots(list(uncached), cost, self._long_flights(now, self.limits), self.limits,
                                     fc.long_engine_share, fc.long_context_engines)
            if not ok and free_at is not None:
                open_s = max(open_s, free_at - now)
        ahead_tokens = self.queue.ahead(cls, flow, cost, weight)
        rate = self.rate.per_s(now)
        if rate <= 0.0:  # nothing handed out lately: what the engines can prefill (their learned rates)
            rate = sum(1.0 / max(1e-9, d.s_per_token + d.step_s / max(1, d.budget))
                       for d in (self._state(e, now)[1] for e in uncached))
        return wait_estimate(ahead_tokens, rate, open_s), ahead_tokens

    def first_in_line(self, cls: str, flow: str) -> bool:
        return self.releasing is None and self.queue.first_in_line(cls, flow)

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
        self._waiters[id(w)] = w
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
            self._waiters.pop(id(w), None)
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
            go = self.may_start(w.uncached, now, cache) & w.engines
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
        self.queue.charge(flow, prefill_tokens=cost, weight=weight)
        self.rate.add(now, cost)
        if w is not None:
            self.queue.dispatched(w)
            ws = self.waited.setdefault(cls, [0.0, 0.0])
            ws[0] += waited_s
            ws[1] += 1
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
                "releasing": self.releasing is not None,
                "rate_tokens_per_s": round(self.rate.per_s(self.clock()), 1),
                "mean_wait_ms": {c: round(1000 * s / n, 3) if n else 0.0 for c, (s, n) in self.waited.items()},
                "flows": {f: {"share": q.weight.get(f, 1.0), "counter": round(q.counter.get(f, 0.0), 1),
                              "served_prompt_tokens": q.served_prefill.get(f, 0.0),
                              "served_completion_tokens": q.served_decode.get(f, 0.0),
                              "waiting": {c: len(q.queues[c].get(f, ())) for c in CLASSES if q.queues[c].get(f)},
                              "refused": {r: n for (g, r), n in self.refused.items() if g == f}}
                          for f in flows[:200]}}
