"""The budget store contract: what one reserve/settle asks for and what comes back, plus its pure reference
implementation (`BudgetState`) that the in-process and SQLite stores run and the Redis Lua script mirrors line by line.

The dimensions are the table in gateway/budget/dimensions.py (COUNTED: the window counters, HELD: what a
reservation holds). A reserve is checked and applied over every scope x window of a request in one atomic step:
  concurrency: live holds + 1 <= limit
  a COUNT (requests):    counted in the window + 1 <= limit
  an AMOUNT (tokens, money, GPU-seconds):  settled + held + fixed + c * per_token <= limit   (integer units)
c is the largest value <= max_c that fits every limit; below min_c the request is refused. A capped request
has min_c == max_c; an uncapped one gets whatever fits (the stream is cut there). Holds live per scope with an
expiry, so a crashed replica's reservations lapse after the hold TTL (BudgetService.hold_ttl_s); settle drops
the hold and adds the actual usage to every window of every scope (the request itself was counted at reserve).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from gateway.budget.dimensions import CONCURRENCY, COUNTED, HELD, MICRO, NANO, Kind
from gateway.budget.windows import RollingCounter, pad_sums

__all__ = ["MICRO", "NANO", "COUNTED_AT", "HELD_AT", "by_counted", "by_held", "WindowPlan", "ScopePlan", "ReserveArgs",
           "SettleArgs", "WindowStat", "ScopeStat", "ReserveResult", "BudgetState"]

_NC, _NH = len(COUNTED), len(HELD)
COUNTED_AT = {d.name: i for i, d in enumerate(COUNTED)}  # name -> position in a window's limits and sums
HELD_AT = {d.name: j for j, d in enumerate(HELD)}  # name -> position in a hold's amounts
_UNLIMITED: tuple[int | None, ...] = (None,) * _NC
_NO_HOLDS = (0,) * _NH
_CODES = tuple(d.code for d in COUNTED)
_NAME_OF_CODE = {d.code: d.name for d in COUNTED}
# per counted dimension: (position, name, position among the held ones or None for a COUNT)
_CHECKS = tuple((i, d.name, HELD_AT.get(d.name)) for i, d in enumerate(COUNTED))
_AT_RESERVE = [1 if d.kind is Kind.COUNT else 0 for d in COUNTED]  # what a reserve adds to each counter


def by_counted(values: Mapping[str, int | None]) -> tuple[int | None, ...]:
    """A value per counted dimension in table order (window limits), None where `values` has none."""
    return tuple(values.get(d.name) for d in COUNTED)


def by_held(values: Mapping[str, int]) -> tuple[int, ...]:
    """An amount per held dimension in table order, 0 where `values` has none."""
    return tuple(values.get(d.name, 0) for d in HELD)


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """One window counter of one scope, with its limits (None: that dimension is counted only)."""

    window: str
    key: str  # full store key of the counter
    rolling: bool
    bucket: int = 0  # rolling: current bucket index
    buckets: int = 0  # rolling: window length in buckets
    bucket_s: int = 0
    end: float = math.inf  # calendar: when the period resets
    ttl_s: int = 0  # store key expiry (0 = none)
    limits: tuple[int | None, ...] = _UNLIMITED  # per counted dimension (by_counted), store units

    def limit(self, name: str) -> int | None:
        return self.limits[COUNTED_AT[name]]

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.rolling:
            d["b"] = self.bucket
            d["n"] = self.buckets
        if self.ttl_s:
            d["x"] = self.ttl_s
        lim = {c: v for c, v in zip(_CODES, self.limits) if v is not None}
        if lim:
            d["l"] = lim
        return d


@dataclass(frozen=True, slots=True)
class ScopePlan:
    scope: str  # "key" | "project" | "team" | "tenant" | "partner"
    scope_id: str
    hold_key: str  # prefix of the hold keys (":z" sorted set by expiry, ":h" amounts)
    concurrency: int | None
    windows: tuple[WindowPlan, ...]

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"w": [w.to_wire() for w in self.windows]}
        if self.concurrency is not None:
            d["c"] = self.concurrency
        return d


def _keys(scopes: tuple[ScopePlan, ...]) -> list[str]:
    out: list[str] = []
    for s in scopes:
        out.append(s.hold_key + ":z")
        out.append(s.hold_key + ":h")
        out.extend(w.key for w in s.windows)
    return out


@dataclass(frozen=True, slots=True)
class ReserveArgs:
    rid: str
    now: float
    expires: float  # hold expiry (now + BudgetService.hold_ttl_s)
    hold_ttl_s: int
    max_completion: int
    min_completion: int
    scopes: tuple[ScopePlan, ...]
    # per held dimension (by_held), store units rounded up: held whatever the completion (the prompt's part), and
    # per completion token granted. Tokens hold the prompt and 1 per completion token.
    fixed: tuple[int, ...] = _NO_HOLDS
    per_token: tuple[int, ...] = _NO_HOLDS

    def keys(self) -> list[str]:
        return _keys(self.scopes)

    def held(self, completion: int) -> tuple[int, ...]:
        """What the reservation holds per held dimension when `completion` tokens are granted."""
        return tuple([f + completion * p for f, p in zip(self.fixed, self.per_token)])

    def to_wire(self) -> dict[str, Any]:
        return {"op": "r", "now": self.now, "rid": self.rid, "exp": self.expires, "hx": self.hold_ttl_s,
                "maxc": self.max_completion, "minc": self.min_completion, "f": self.fixed, "p": self.per_token,
                "s": [s.to_wire() for s in self.scopes]}


@dataclass(frozen=True, slots=True)
class SettleArgs:
    rid: str
    now: float
    amounts: tuple[int, ...]  # per held dimension (by_held): what the request used, store units
    scopes: tuple[ScopePlan, ...]  # windows resolved at settle time
    # idempotency marker: a settle whose reply was lost (store died after executing it) is replayed later;
    # the marker makes the replay a no-op instead of charging the usage twice. "" = no marker.
    done_key: str = ""
    done_ttl_s: int = 0

    def keys(self) -> list[str]:
        out = _keys(self.scopes)
        if self.done_key:
            out.append(self.done_key)
        return out

    def to_wire(self) -> dict[str, Any]:
        d = {"op": "s", "now": self.now, "rid": self.rid, "a": self.amounts, "s": [s.to_wire() for s in self.scopes]}
        if self.done_key:
            d["dx"] = self.done_ttl_s
        return d


@dataclass(slots=True)
class WindowStat:
    used: tuple[int, ...]  # per counted dimension: what the window counted (settled; requests: at reserve)
    oldest_bucket: int  # rolling: oldest bucket holding data

    def used_in(self, name: str) -> int:
        return self.used[COUNTED_AT[name]]


@dataclass(slots=True)
class ScopeStat:
    holds: int  # live reservations
    held: tuple[int, ...]  # per held dimension: what they hold
    windows: list[WindowStat] = field(default_factory=list)

    def held_in(self, name: str) -> int:
        return self.held[HELD_AT[name]]


@dataclass(slots=True)
class ReserveResult:
    ok: bool
    completion: int  # completion tokens granted (meaningful when ok)
    fail_scope: int  # 0-based scope index of the limit that refused (-1 when ok)
    fail_window: int  # 0-based window index, -1 for concurrency
    fail_kind: str  # the refusing dimension ("concurrency", "requests", "tokens", ...) or ""
    scopes: list[ScopeStat]

    @classmethod
    def from_flat(cls, flat: list[Any], args: ReserveArgs) -> "ReserveResult":
        """Decode the flat reply every store produces: header (ok, completion, scope, window, kind), then per scope
        its live holds and what they hold per held dimension, and per window its sum per counted dimension and its
        oldest bucket. The stores answer integers (Redis: the script's numbers as integer replies)."""
        ok, comp, fs, fw, fk = int(flat[0]), int(flat[1]), int(flat[2]), int(flat[3]), flat[4]
        if isinstance(fk, bytes):
            fk = fk.decode()
        fk = _NAME_OF_CODE.get(fk, fk)  # the Lua script answers a dimension's code
        i = 5
        stats: list[ScopeStat] = []
        for s in args.scopes:
            st = ScopeStat(flat[i], tuple(flat[i + 1:i + 1 + _NH]))
            i += 1 + _NH
            for _ in s.windows:
                st.windows.append(WindowStat(tuple(flat[i:i + _NC]), flat[i + _NC]))
                i += _NC + 1
            stats.append(st)
        return cls(ok == 1, comp, fs - 1, fw - 1, str(fk), stats)


Hold = tuple  # (expires, units per held dimension...)


class BudgetState:
    """Pure in-memory reference model of the store (same algorithm as the Lua script)."""

    def __init__(self) -> None:
        self.holds: dict[str, dict[str, Hold]] = {}  # hold_key -> rid -> (expires, *units per held dimension)
        self.rolling: dict[str, RollingCounter] = {}
        self.fixed: dict[str, list[int]] = {}  # calendar/lifetime key -> sums per counted dimension
        self.expiry: dict[str, float] = {}  # counter key -> when it may be dropped
        self.done: dict[str, float] = {}  # settle idempotency marker -> when it may be dropped

    # -- helpers mirroring the Lua functions
    def _purge(self, hk: str, now: float) -> dict[str, Hold]:
        h = self.holds.setdefault(hk, {})
        for rid in [r for r, v in h.items() if v[0] <= now]:
            del h[rid]
        return h

    def _counter(self, w: WindowPlan, now: float) -> tuple[tuple[int, ...], int]:
        """(sum per counted dimension, oldest bucket holding data)."""
        if w.rolling:
            c = self.rolling.get(w.key)
            if c is None or c.n != w.buckets:
                c = self.rolling[w.key] = RollingCounter(w.buckets)
            return c.totals(w.bucket), c.oldest(w.bucket)
        v = self.fixed.get(w.key)
        return (tuple(v) if v is not None else (0,) * _NC), 0

    def _add(self, w: WindowPlan, now: float, vals: list[int]) -> None:
        if w.rolling:
            c = self.rolling.get(w.key)
            if c is None:
                c = self.rolling[w.key] = RollingCounter(w.buckets)
            c.add(w.bucket, *vals)
        else:
            v = self.fixed.setdefault(w.key, [0] * _NC)
            for i, x in enumerate(vals):
                v[i] += x
        if w.ttl_s:
            self.expiry[w.key] = now + w.ttl_s

    def gc(self, now: float) -> None:
        """Drop counters whose key expiry passed (what Redis EXPIRE does)."""
        for k in [k for k, e in self.expiry.items() if e <= now]:
            self.rolling.pop(k, None)
            self.fixed.pop(k, None)
            del self.expiry[k]
        for k in [k for k, e in self.done.items() if e <= now]:
            del self.done[k]

    # -- the two operations
    def reserve(self, a: ReserveArgs) -> list[Any]:
        out: list[Any] = []
        ok, c, fs, fw, fk = 1, a.max_completion, 0, 0, ""
        cap_s, cap_w, cap_k = 0, 0, ""
        fixed, per = a.fixed, a.per_token
        for si, s in enumerate(a.scopes, 1):
            h = self._purge(s.hold_key, a.now)
            held = list(map(sum, zip(*h.values())))[1:] if h else _NO_HOLDS  # per held dimension, over its holds
            nh = len(h)
            out.append(nh)
            out += held
            if s.concurrency is not None and nh + 1 > s.concurrency and ok == 1:
                ok, fs, fw, fk = 0, si, 0, CONCURRENCY.name
            for wi, w in enumerate(s.windows, 1):
                sums, old = self._counter(w, a.now)
                out += sums
                out.append(old)
                if ok != 1:
                    continue
                for (i, name, j), lim in zip(_CHECKS, w.limits):
                    if lim is None:
                        continue
                    if j is None:  # a COUNT: this request is one more
                        if sums[i] + 1 > lim:
                            ok, fs, fw, fk = 0, si, wi, name
                            break
                        continue
                    room = lim - sums[i] - held[j] - fixed[j]
                    p = per[j]
                    cap = room // p if p > 0 else (c if room >= 0 else -1)
                    if cap < c:
                        c, cap_s, cap_w, cap_k = cap, si, wi, name
        if ok == 1 and c < a.min_completion:
            ok, fs, fw, fk = 0, cap_s, cap_w, cap_k
        if ok == 1:
            hold = (a.expires, *a.held(c))
            for s in a.scopes:
                self.holds[s.hold_key][a.rid] = hold
                for w in s.windows:
                    self._add(w, a.now, _AT_RESERVE)
        return [ok, c if ok == 1 else 0, fs, fw, fk] + out

    def settle(self, a: SettleArgs) -> int:
        """Returns 1 when applied, 0 when this settle (same done_key) was applied before: a replay."""
        if a.done_key:
            if self.done.get(a.done_key, -math.inf) > a.now:
                return 0
            self.done[a.done_key] = a.now + a.done_ttl_s
        amounts = a.amounts
        vals = [0 if j is None else amounts[j] for _, _, j in _CHECKS]
        for s in a.scopes:
            h = self._purge(s.hold_key, a.now)
            h.pop(a.rid, None)
            for w in s.windows:
                self._counter(w, a.now)
                self._add(w, a.now, vals)
        return 1

    # -- persistence (the in-process store snapshots this to SQLite)
    def to_state(self) -> dict[str, Any]:
        return {
            "holds": {k: {r: list(v) for r, v in h.items()} for k, h in self.holds.items() if h},
            "rolling": {k: c.to_state() for k, c in self.rolling.items()},
            "fixed": self.fixed,
            "expiry": self.expiry,
            "done": self.done,
        }

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "BudgetState":
        st = cls()
        # a snapshot written before a dimension existed lacks its amounts: they start at 0
        st.holds = {k: {r: (float(v[0]), *pad_sums(v[1:], _NH)) for r, v in h.items()}
                    for k, h in d["holds"].items()}
        st.rolling = {k: RollingCounter.from_state(v) for k, v in d["rolling"].items()}
        st.fixed = {k: pad_sums(v) for k, v in d["fixed"].items()}
        st.expiry = {k: float(v) for k, v in d["expiry"].items()}
        st.done = {k: float(v) for k, v in d.get("done", {}).items()}
        return st
