"""Engine time apportioned to the requests it served. Pure arithmetic; no I/O, injectable times.

A continuous-batching engine runs one step after another while it has work; each step computes the prefill
chunks of some sequences (cost per prompt token) and one token of every decoding one (the weights read once
per step, shared by the batch). `EngineClock` replays that from what the gateway sees of one engine:

* busy time: the engine is busy while any request of this gateway is on it (dispatch to response end);
* prefill by tokens: a request owes its uncached prompt tokens x the engine's learned prefill cost per token
  (the router's step model, gateway/routing/predictor.py); busy time pays what the requests on the engine
  owe first, in proportion to what each owes (prefill is scheduled ahead of the decodes' share);
* the rest of each instant is shared equally by every request on the engine then (a processor-sharing
  clock: V(t) = integral of dt_shared / n(t); a request's share is V(end) - V(begin)).

Conservation holds by construction: every instant of busy time goes to someone, so once no request is in
flight the charges sum to the busy time exactly, and each request's charge is final when it ends (n(t)
counts requests still running too). What remains is whether this gateway's busy time is the engine's: it
includes the HTTP exchange around each request; bench/cost_apportion.py and tests/cost compare it with the
simulator's true busy time (the modelled time of every step), within 5%.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Charge:
    """One request's apportioned engine time, in engine-seconds (x the backend's GPUs for GPU-seconds)."""

    seconds: float
    prefill_s: float  # busy time that went to this request's prefill
    shared_s: float  # its share of the rest of the steps it was in (weights read, decode)


@dataclass
class EngineClock:
    """The engine as this gateway sees it: requests begin (dispatch, with their expected prefill time) and end
    (response complete, failed or cut); `now` is any monotonic time. Every instant of busy time (>= 1 request
    on the engine) goes first to the prefill still owed by requests on it (split in proportion to what each
    owes), the rest is shared equally by every request on it (a processor-sharing virtual clock).

    O(1) per event whatever the number of requests on the engine: paying in proportion to what each owes
    shrinks every debt by the same factor, so one running factor `_s` stands for all of them (a debt of `o`
    made when the factor was `s0` is `o * _s / s0` now). When the whole debt is paid at once the factor would be
    0: a new generation starts instead (every older debt is paid in full). The per-debt loop it replaces was
    O(requests in flight) per event (bench/cost_apportion.py; docs/benchmarks.md, "Hot path choices": cost meter)."""

    n: int = 0  # requests on the engine now
    v: float = 0.0  # virtual time: integral of shared dt / n over busy time
    busy_s: float = 0.0  # total busy time seen (monotone)
    t: float | None = None  # time of the last event
    prefill_paid_s: float = 0.0  # busy time that went to prefill (monotone)
    charged_s: float = 0.0  # all charges made (= busy_s whenever no request is in flight)
    # token -> (prefill owed at begin, the factor then, the generation then, v at begin)
    _open: dict[int, tuple[float, float, int, float]] = field(default_factory=dict)
    _s: float = 1.0  # the common factor debts have shrunk by since the generation began
    _gen: int = 0
    _w: float = 0.0  # sum of owed / factor-at-begin over this generation's open debts: owed now = _s * _w
    _paid_renorm: dict[int, float] = field(default_factory=dict)  # token -> paid before a renormalisation
    _next: int = 0

    @property
    def owed_s(self) -> float:
        """Prefill still owed by the requests on the engine."""
        return max(0.0, self._s * self._w)

    def _owed(self, o: float, s0: float, gen: int) -> float:
        return o * self._s / s0 if gen == self._gen else 0.0

    def _advance(self, now: float) -> None:
        if self.t is not None and now > self.t and self.n > 0:
            dt = now - self.t
            self.busy_s += dt
            owed = self.owed_s
            dp = min(dt, owed)
            if dp > 0:
                self.prefill_paid_s += dp
                if dp >= owed:  # everything owed is paid: the next debts start a new generation
                    self._gen += 1
                    self._s, self._w = 1.0, 0.0
                else:
                    self._s *= 1.0 - dp / owed
                    if self._s < 1e-30:  # renormalise before the factor underflows (rare: O(open requests))
                        self._renormalise()
            self.v += (dt - dp) / self.n
        if self.t is None or now > self.t:
            self.t = now

    def _renormalise(self) -> None:
        w = 0.0
        for k, (o, s0, gen, mark) in self._open.items():
            owed = self._owed(o, s0, gen)
            # what was paid so far is kept in the debt's base: at end it pays base - owed
            self._open[k] = (owed, 1.0, self._gen, mark) if gen == self._gen else (o, s0, gen, mark)
            if gen == self._gen:
                w += owed
                self._paid_renorm[k] = self._paid_renorm.get(k, 0.0) + (o - owed)
        self._s, self._w = 1.0, w

    def begin(self, now: float, prefill_s: float = 0.0) -> int:
        """A request arrived on the engine and will prefill about `prefill_s`; returns its token for `end`."""
        self._advance(now)
        self.n += 1
        k = self._next
        self._next += 1
        o = max(0.0, prefill_s) if math.isfinite(prefill_s) else 0.0
        self._open[k] = (o, self._s, self._gen, self.v)
        self._w += o / self._s
        return k

    def end(self, now: float, token: int) -> Charge:
        """The request left: its charge is the prefill it was given plus its share of the rest. Prefill it still
        owed is forgiven (the estimate was high, or it was cut before its prompt was done)."""
        self._advance(now)
        self.n = max(0, self.n - 1)
        entry = self._open.pop(token, None)
        if entry is None:
            return Charge(0.0, 0.0, 0.0)
        o, s0, gen, mark = entry
        owed = self._owed(o, s0, gen)
        if gen == self._gen:
            self._w = max(0.0, self._w - o / s0)
            if self.n == 0:
                self._w = 0.0  # no debt is left: drop the float residue of the sums
        paid = max(0.0, o - owed)
        if self._paid_renorm:
            paid += self._paid_renorm.pop(token, 0.0)
        shared = max(0.0, self.v - mark)
        self.charged_s += paid + shared
        return Charge(paid + shared, paid, shared)

    def prefill_share(self) -> float:
        """Share of the busy time seen that went to prefill."""
        return self.prefill_paid_s / self.busy_s if self.busy_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Span:
    """One request's time on one engine (for the offline `apportion`)."""

    rid: str
    start: float
    end: float
    prefill_s: float = 0.0


@dataclass
class Apportioned:
    charges: dict[str, Charge] = field(default_factory=dict)
    busy_s: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(c.seconds for c in self.charges.values())


def apportion(spans: Iterable[Span]) -> Apportioned:
    """Replay spans of one engine through an EngineClock in event order (ends before begins at equal times):
    what the online meter computes, as a pure function over a finished timeline."""
    events: list[tuple[float, int, int, Span]] = []
    for i, s in enumerate(spans):
        if s.end < s.start:
            raise ValueError(f"span {s.rid} ends before it starts")
        events.append((s.start, 1, i, s))
        events.append((s.end, 0, i, s))
    # at equal times ends go first, except the end of a zero-length span, which follows its own begin
    events.sort(key=lambda e: (e[0], 2 if e[1] == 0 and e[3].end == e[3].start else e[1], e[2]))
    clock = EngineClock()
    tokens: dict[int, int] = {}
    out = Apportioned()
    for t, kind, i, s in events:
        if kind == 1:
            tokens[i] = clock.begin(t, s.prefill_s)
        else:
            out.charges[s.rid] = clock.end(t, tokens.pop(i))
    out.busy_s = clock.busy_s
    return out


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of intervals (the busy time a set of spans implies)."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total
