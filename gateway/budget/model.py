"""The budget store contract: what one reserve/settle asks for and what comes back, plus its pure reference
implementation (`BudgetState`) that the in-process store runs and the Redis Lua script mirrors line by line.

A reserve is checked and applied over every scope x window of a request in one atomic step:
  concurrency: live holds + 1 <= limit
  requests:    requests counted in the window + 1 <= limit
  tokens:      settled + held + prompt + c <= limit        (c = completion tokens granted)
  money:       settled + held + prompt cost + c * out_price <= limit   (integer nano-units)
  gpu_seconds: settled + held + prompt prefill + c * decode_per_token <= limit   (integer micro-GPU-seconds)
c is the largest value <= max_c that fits every limit; below min_c the request is refused. A capped request
has min_c == max_c; an uncapped one gets whatever fits (the stream is cut there). Holds live per scope with an
expiry, so a crashed replica's reservations lapse after the hold TTL (BudgetService.hold_ttl_s); settle drops
the hold and adds the actual usage to every window of every scope (the request itself was counted at reserve).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.budget.windows import RollingCounter, four_sums

NANO = 1_000_000_000  # money is kept in integer nano-units of the budget currency
MICRO = 1_000_000  # GPU-seconds are kept in integer micro-GPU-seconds


@dataclass(frozen=True, slots=True)
class WindowPlan:
    """One window counter of one scope, with its limits (None = not limited, counted only)."""

    window: str
    key: str  # full store key of the counter
    rolling: bool
    bucket: int = 0  # rolling: current bucket index
    buckets: int = 0  # rolling: window length in buckets
    bucket_s: int = 0
    end: float = math.inf  # calendar: when the period resets
    ttl_s: int = 0  # store key expiry (0 = none)
    tokens: int | None = None
    money: int | None = None  # nano-units
    requests: int | None = None
    gpu: int | None = None  # micro-GPU-seconds

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        if self.rolling:
            d["b"] = self.bucket
            d["n"] = self.buckets
        if self.ttl_s:
            d["x"] = self.ttl_s
        if self.tokens is not None:
            d["t"] = self.tokens
        if self.money is not None:
            d["m"] = self.money
        if self.requests is not None:
            d["r"] = self.requests
        if self.gpu is not None:
            d["g"] = self.gpu
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


@dataclass(frozen=True, slots=True)
class ReserveArgs:
    rid: str
    now: float
    expires: float  # hold expiry (now + BudgetService.hold_ttl_s)
    hold_ttl_s: int
    fixed_tokens: int  # prompt tokens (known or estimated)
    fixed_money: int  # nano-units for the prompt
    max_completion: int
    min_completion: int
    money_per_token: int  # nano-units per completion token (rounded up)
    scopes: tuple[ScopePlan, ...]
    fixed_gpu: int = 0  # micro-GPU-seconds for the prompt's prefill (learned worst case, rounded up)
    gpu_per_token: int = 0  # micro-GPU-seconds per completion token (learned worst case, rounded up)

    def keys(self) -> list[str]:
        out: list[str] = []
        for s in self.scopes:
            out.append(s.hold_key + ":z")
            out.append(s.hold_key + ":h")
            out.extend(w.key for w in s.windows)
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"op": "r", "now": self.now, "rid": self.rid, "exp": self.expires, "hx": self.hold_ttl_s,
                "ft": self.fixed_tokens, "fm": self.fixed_money, "maxc": self.max_completion,
                "minc": self.min_completion, "pm": self.money_per_token, "fg": self.fixed_gpu,
                "pg": self.gpu_per_token, "s": [s.to_wire() for s in self.scopes]}


@dataclass(frozen=True, slots=True)
class SettleArgs:
    rid: str
    now: float
    tokens: int
    money: int
    scopes: tuple[ScopePlan, ...]  # windows resolved at settle time
    # idempotency marker: a settle whose reply was lost (store died after executing it) is replayed later;
    # the marker makes the replay a no-op instead of charging the usage twice. "" = no marker.
    done_key: str = ""
    done_ttl_s: int = 0
    gpu: int = 0  # micro-GPU-seconds apportioned to the request (0: no engine of ours served it)

    def keys(self) -> list[str]:
        out = ReserveArgs.keys(self)  # type: ignore[arg-type]
        if self.done_key:
            out.append(self.done_key)
        return out

    def to_wire(self) -> dict[str, Any]:
        d = {"op": "s", "now": self.now, "rid": self.rid, "t": self.tokens, "m": self.money, "g": self.gpu,
             "s": [s.to_wire() for s in self.scopes]}
        if self.done_key:
            d["dx"] = self.done_ttl_s
        return d


@dataclass(slots=True)
class WindowStat:
    requests: int
    tokens: int
    money: int
    oldest_bucket: int  # rolling: oldest bucket holding data
    gpu: int = 0  # micro-GPU-seconds


@dataclass(slots=True)
class ScopeStat:
    held_tokens: int
    held_money: int
    holds: int
    held_gpu: int = 0  # micro-GPU-seconds
    windows: list[WindowStat] = field(default_factory=list)


@dataclass(slots=True)
class ReserveResult:
    ok: bool
    completion: int  # completion tokens granted (meaningful when ok)
    fail_scope: int  # 0-based scope index of the limit that refused (-1 when ok)
    fail_window: int  # 0-based window index, -1 for concurrency
    fail_kind: str  # "concurrency" | "requests" | "tokens" | "money" | "gpu_seconds" | ""
    scopes: list[ScopeStat]

    @classmethod
    def from_flat(cls, flat: list[Any], args: ReserveArgs) -> "ReserveResult":
        """Decode the flat reply both stores produce: header, then per scope 4 ints (held tokens, held money,
        holds, held GPU) and per window 5 ints (requests, tokens, money, oldest bucket, GPU)."""
        ok, comp, fs, fw, fk = int(flat[0]), int(flat[1]), int(flat[2]), int(flat[3]), flat[4]
        if isinstance(fk, bytes):
            fk = fk.decode()
        i = 5
        stats: list[ScopeStat] = []
        for s in args.scopes:
            st = ScopeStat(int(flat[i]), int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
            i += 4
            for _ in s.windows:
                st.windows.append(WindowStat(int(flat[i]), int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]),
                                             int(flat[i + 4])))
                i += 5
            stats.append(st)
        return cls(ok == 1, comp, fs - 1, fw - 1, str(fk), stats)


class BudgetState:
    """Pure in-memory reference model of the store (same algorithm as the Lua script)."""

    def __init__(self) -> None:
        self.holds: dict[str, dict[str, tuple[float, int, int, int]]] = {}  # hold_key -> rid -> (expires, t, m, g)
        self.rolling: dict[str, RollingCounter] = {}
        self.fixed: dict[str, list[int]] = {}  # calendar/lifetime key -> [requests, tokens, money, gpu]
        self.expiry: dict[str, float] = {}  # counter key -> when it may be dropped
        self.done: dict[str, float] = {}  # settle idempotency marker -> when it may be dropped

    # -- helpers mirroring the Lua functions
    def _purge(self, hk: str, now: float) -> dict[str, tuple[float, int, int, int]]:
        h = self.holds.setdefault(hk, {})
        for rid in [r for r, v in h.items() if v[0] <= now]:
            del h[rid]
        return h

    def _counter(self, w: WindowPlan, now: float) -> tuple[int, int, int, int, int]:
        if w.rolling:
            c = self.rolling.get(w.key)
            if c is None or c.n != w.buckets:
                c = self.rolling[w.key] = RollingCounter(w.buckets)
            r, t, m, g = c.totals(w.bucket)
            return r, t, m, c.oldest(w.bucket), g
        v = self.fixed.get(w.key, [0, 0, 0, 0])
        return v[0], v[1], v[2], 0, v[3]

    def _add(self, w: WindowPlan, now: float, r: int, t: int, m: int, g: int) -> None:
        if w.rolling:
            c = self.rolling.get(w.key)
            if c is None:
                c = self.rolling[w.key] = RollingCounter(w.buckets)
            c.add(w.bucket, r, t, m, g)
        else:
            v = self.fixed.setdefault(w.key, [0, 0, 0, 0])
            v[0] += r
            v[1] += t
            v[2] += m
            v[3] += g
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
        for si, s in enumerate(a.scopes, 1):
            h = self._purge(s.hold_key, a.now)
            ht = sum(v[1] for v in h.values())
            hm = sum(v[2] for v in h.values())
            hg = sum(v[3] for v in h.values())
            nh = len(h)
            out += [ht, hm, nh, hg]
            if s.concurrency is not None and nh + 1 > s.concurrency and ok == 1:
                ok, fs, fw, fk = 0, si, 0, "concurrency"
            for wi, w in enumerate(s.windows, 1):
                R, T, M, old, G = self._counter(w, a.now)
                out += [R, T, M, old, G]
                if ok != 1:
                    continue
                if w.requests is not None and R + 1 > w.requests:
                    ok, fs, fw, fk = 0, si, wi, "requests"
                    continue
                if w.tokens is not None:
                    cap = w.tokens - T - ht - a.fixed_tokens
                    if cap < c:
                        c, cap_s, cap_w, cap_k = cap, si, wi, "tokens"
                if w.money is not None:
                    room = w.money - M - hm - a.fixed_money
                    cap = room // a.money_per_token if a.money_per_token > 0 else (c if room >= 0 else -1)
                    if cap < c:
                        c, cap_s, cap_w, cap_k = cap, si, wi, "money"
                if w.gpu is not None:
                    room = w.gpu - G - hg - a.fixed_gpu
                    cap = room // a.gpu_per_token if a.gpu_per_token > 0 else (c if room >= 0 else -1)
                    if cap < c:
                        c, cap_s, cap_w, cap_k = cap, si, wi, "gpu_seconds"
        if ok == 1 and c < a.min_completion:
            ok, fs, fw, fk = 0, cap_s, cap_w, cap_k
        if ok == 1:
            tok = a.fixed_tokens + c
            mon = a.fixed_money + c * a.money_per_token
            gpu = a.fixed_gpu + c * a.gpu_per_token
            for s in a.scopes:
                self.holds[s.hold_key][a.rid] = (a.expires, tok, mon, gpu)
                for w in s.windows:
                    self._add(w, a.now, 1, 0, 0, 0)
        return [ok, c if ok == 1 else 0, fs, fw, fk] + out

    def settle(self, a: SettleArgs) -> int:
        """Returns 1 when applied, 0 when this settle (same done_key) was applied before: a replay."""
        if a.done_key:
            if self.done.get(a.done_key, -math.inf) > a.now:
                return 0
            self.done[a.done_key] = a.now + a.done_ttl_s
        for s in a.scopes:
            h = self._purge(s.hold_key, a.now)
            h.pop(a.rid, None)
            for w in s.windows:
                self._counter(w, a.now)
                self._add(w, a.now, 0, a.tokens, a.money, a.gpu)
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
        # snapshots written before GPU-seconds were counted lack the 4th amount: it starts at 0
        st.holds = {k: {r: (float(v[0]), int(v[1]), int(v[2]), int(v[3]) if len(v) > 3 else 0)
                        for r, v in h.items()} for k, h in d["holds"].items()}
        st.rolling = {k: RollingCounter.from_state(v) for k, v in d["rolling"].items()}
        st.fixed = {k: four_sums(v) for k, v in d["fixed"].items()}
        st.expiry = {k: float(v) for k, v in d["expiry"].items()}
        st.done = {k: float(v) for k, v in d.get("done", {}).items()}
        return st
