"""Budget dimensions as data: the one table the budget path iterates instead of naming each dimension.

A dimension is what a policy budget limits: requests, tokens, money, GPU-seconds, concurrency. Its row says how a
policy writes a limit, how the stores keep it (integer units under a one-letter code), what a reservation holds and
what a settle charges, how it shows in headers, 429s and evidence, and which ledger column records it. From the
table come:
- the policy schema's `budget` object and the compiler's reading of a rule's `budgets:` (gateway/policy/compiler.py,
  `gateway policy schema --write` rewrites the object in gateway/policy/schema.json; a test keeps the file in step),
  and `BudgetSpec.limits` (gateway/types.py);
- the reservation and settle arithmetic of the reference model (model.py), of the SQLite store (store.py: one hold
  column per held dimension) and of the Redis script (budget.lua, after a prelude of the dimensions' codes that
  store.py generates from the table);
- the service's limits, x-ratelimit-* headers, 429 codes and messages and `budget` evidence (service.py);
- the spend-ledger columns (ledger.py) and the row the stage files (stage.py).

Kinds:
- COUNT: counted once per request in every window at reserve; refused when count + 1 > limit (requests).
- AMOUNT: a reservation holds `fixed + c x per_token` units in every scope (c: the completion tokens granted, the
  largest that fits every limit of the request; below its minimum the request is refused), and the settle replaces
  the hold with what the request used, added to every window of every scope.
- CONCURRENT: per scope, not per window: live holds + 1 <= limit.

Adding a dimension: append a row (never reorder rows or reuse a code: stored counters and holds are positional and
keyed by code), give its `reserve` and `settle` the request facts they read (`ReserveFacts.request` and
`SettleFacts.request` are the request's context), run `gateway policy schema --write`. Replicas sharing one Redis
must all run a version that knows the dimension before a policy limits it (an older script ignores a hold part it
does not know).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, Literal, Mapping

if TYPE_CHECKING:
    from gateway.config import Config
    from gateway.pipeline import RequestContext
    from gateway.types import Usage

Json = Mapping[str, object]  # a JSON Schema, a policy's `budgets:` entry

NANO = 1_000_000_000  # money is kept in integer nano-units of the budget currency
MICRO = 1_000_000  # GPU-seconds are kept in integer micro-GPU-seconds
HOLD_PARTS_MIN = 2  # a Redis hold string keeps its first two amounts even when 0: what scripts before GPU-seconds read


class Kind(Enum):
    COUNT = "count"
    AMOUNT = "amount"
    CONCURRENT = "concurrent"


@dataclass(slots=True)  # not frozen: built per request, and a frozen dataclass costs 4x to build
class ReserveFacts:
    """What a request's worst case is computed from (BudgetService.reserve). Read-only."""

    prompt_tokens: int  # the prompt's upper bound
    price: tuple[float, float, float]  # worst price in nano-units: per prompt token, per completion token, per request
    limited: frozenset[str]  # the dimensions some limit of this request is in
    cache_hit: bool  # an answer from the response cache: its usage is known, no engine runs
    gpu_per_token: Callable[[], tuple[float, float]]  # the cost meter's learned worst case: GPU-seconds per prompt
    # token and per completion token over the engines that may serve the request (raises when no meter runs)
    request: "RequestContext | None" = None  # the request (None when the service is called directly)


@dataclass(slots=True)
class SettleFacts:
    """What a request used (BudgetService.settle; the stage's ledger row for requests without a reservation).
    Read-only."""

    usage: "Usage"
    cost: float  # the price charged, in the budget currency
    apportioned_gpu_seconds: float  # the engine time the cost meter apportioned to it (0: no engine of ours)
    request: "RequestContext | None" = None


def _plain(units: int, currency: str) -> str:
    return str(units)


@dataclass(frozen=True, slots=True)
class Dimension:
    """One row of the table. Limits are kept in integer store units: `unit` per policy unit."""

    name: str  # the policy key, BudgetSpec limit, evidence key and refusal `kind`
    kind: Kind
    schema: Mapping[str, Json]  # policy key -> JSON Schema of its value (several keys: aliases, the last read wins)
    description: str
    code: str = ""  # COUNT/AMOUNT: store field letter (Redis hash fields, script arguments, SQLite hold column)
    unit: int = 1
    number: type = int  # how a policy value is read (int or float)
    currency: bool = False  # limits are in BudgetSpec.currency, converted to budgets.currency with fx_rates
    # AMOUNT: (units held whatever the completion, units per completion token granted), rounded up
    reserve: Callable[[ReserveFacts], tuple[int, int]] | None = None
    settle: Callable[[SettleFacts], float] | None = None  # AMOUNT: what the request used, in policy units
    # the 429's code: insufficient_quota when "always", or "calendar" and the window is a calendar/lifetime one
    quota: Literal["never", "calendar", "always"] = "never"
    header: str | None = None  # x-ratelimit-{limit,remaining,reset}-<header> of the binding limit
    text: Callable[[int, str], str] = _plain  # (units, budget currency) -> a limit in headers and messages
    ledger: str | None = None  # the spend-ledger column recording the settled amount (created when new)
    worst_case: str | None = None  # evidence key showing a non-zero learned worst case (prompt, per token)
    needs: Callable[["Config"], str | None] | None = None  # config -> why a limit cannot be enforced; None: it can
    read: Callable[[Json], tuple[float | None, str | None]] | None = None  # policy reader override

    def value(self, units: int) -> float:
        """Store units as policy units (evidence): integers stay integers."""
        return units if self.unit == 1 else units / self.unit

    def policy_value(self, budget: Json) -> tuple[float | None, str | None]:
        """The limit a policy `budgets:` entry sets in this dimension, and the currency it names (or None);
        ValueError when the value cannot be read."""
        if self.read is not None:
            return self.read(budget)
        v = budget.get(self.name)
        return (None if v is None else self.number(v)), None


def parse_money(v: object) -> tuple[float, str | None]:
    """A money value: a number, or "2000 EUR" (the currency optional)."""
    if isinstance(v, (int, float)):
        return float(v), None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]{3})?\s*", str(v))
    if not m:
        raise ValueError(f"money must look like '2000 EUR', got {v!r}")
    return float(m.group(1)), (m.group(2).upper() if m.group(2) else None)


def _read_money(b: Json) -> tuple[float | None, str | None]:
    value, currency = None, None
    for key in ("limit", "money"):
        if key in b:
            value, cur = parse_money(b[key])
            currency = currency or cur
    return value, currency


def _money_reserve(f: ReserveFacts) -> tuple[int, int]:
    per_prompt, per_completion, per_request = f.price
    return math.ceil(f.prompt_tokens * per_prompt + per_request), math.ceil(per_completion)


def _gpu_reserve(f: ReserveFacts) -> tuple[int, int]:
    """Held only when a GPU-second limit applies (the worst case needs the cost meter's learners)."""
    if f.cache_hit or "gpu_seconds" not in f.limited:
        return 0, 0
    per_prompt, per_completion = f.gpu_per_token()
    return math.ceil(f.prompt_tokens * per_prompt * MICRO), math.ceil(per_completion * MICRO)


def gpu_s(micro: int, currency: str = "") -> str:
    """Micro-GPU-seconds as seconds for a header or message: "3600", "12.5", "0.001"."""
    return f"{micro / MICRO:.3f}".rstrip("0").rstrip(".")


def _needs_cost_meter(config: "Config") -> str | None:
    if config.raw.cost.enabled:
        return None
    return ("needs the cost meter (cost.enabled: true); without it no GPU-seconds are apportioned and the limit "
            "could never bind")


_POSITIVE_INT = {"type": "integer", "minimum": 1}

DIMENSIONS: tuple[Dimension, ...] = (
    Dimension("concurrency", Kind.CONCURRENT, {"concurrency": _POSITIVE_INT},
              "Requests in flight per scope, whatever the window."),
    Dimension("requests", Kind.COUNT, {"requests": _POSITIVE_INT},
              "Requests per window (RPM with window minute).", code="r", header="requests"),
    Dimension("tokens", Kind.AMOUNT, {"tokens": _POSITIVE_INT},
              "Prompt + completion tokens per window (TPM with window minute).", code="t",
              reserve=lambda f: (f.prompt_tokens, 1), settle=lambda f: f.usage.total_tokens, quota="calendar",
              header="tokens", ledger="total_tokens"),
    Dimension("money", Kind.AMOUNT,
              {"limit": {"oneOf": [{"type": "number", "exclusiveMinimum": 0},
                                   {"type": "string", "pattern": "^\\s*[0-9]+(\\.[0-9]+)?\\s*([A-Za-z]{3})?\\s*$"}],
                         "description": "Money, e.g. 2000 EUR."},
               "money": {"oneOf": [{"type": "number", "exclusiveMinimum": 0}, {"type": "string"}]}},
              "Price charged per window, in `currency` (converted to budgets.currency).", code="m", unit=NANO,
              number=float, currency=True, reserve=_money_reserve, settle=lambda f: f.cost, quota="always",
              text=lambda units, ccy: f"{units / NANO:.2f} {ccy}", ledger="cost", read=_read_money),
    Dimension("gpu_seconds", Kind.AMOUNT,
              {"gpu_seconds": {"type": "number", "exclusiveMinimum": 0,
                               "description": "Engine GPU-seconds apportioned to the requests (needs cost.enabled). "
                                              "See docs/budgets.md."}},
              "Engine GPU-seconds apportioned to the requests (gateway/cost).", code="g", unit=MICRO, number=float,
              reserve=_gpu_reserve, settle=lambda f: max(0.0, f.apportioned_gpu_seconds), quota="calendar",
              header="gpu-seconds", text=gpu_s, worst_case="gpu_worst_case", needs=_needs_cost_meter),
    # the cost meter records the apportioned GPU-seconds in the ledger (gpu_seconds_apportioned): no column here
)

BY_NAME: dict[str, Dimension] = {d.name: d for d in DIMENSIONS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
COUNTED: tuple[Dimension, ...] = tuple(d for d in DIMENSIONS if d.kind is not Kind.CONCURRENT)  # window counters
HELD: tuple[Dimension, ...] = tuple(d for d in DIMENSIONS if d.kind is Kind.AMOUNT)  # reservation holds
CONCURRENCY: Dimension = next(d for d in DIMENSIONS if d.kind is Kind.CONCURRENT)
LEDGERED: tuple[Dimension, ...] = tuple(d for d in HELD if d.ledger)


def _check(dims: tuple[Dimension, ...]) -> None:
    """The invariants the stores rely on (at import: a bad row fails every test, not one replica)."""
    codes = [d.code for d in COUNTED]
    assert len(set(NAMES)) == len(NAMES), "dimension names must be unique"
    assert all(re.fullmatch("[a-z]", c) for c in codes) and len(set(codes)) == len(codes), \
        "counted dimensions need unique one-letter lower-case codes"
    assert COUNTED and COUNTED[0].kind is Kind.COUNT, \
        "the first counted dimension marks a rolling bucket as present (every reserve counts it): a COUNT"
    assert all(d.reserve is not None and d.settle is not None for d in HELD), "AMOUNT dimensions reserve and settle"
    assert sum(d.kind is Kind.CONCURRENT for d in dims) == 1, "one concurrency limit per scope"
    assert len(HELD) >= HOLD_PARTS_MIN


_check(DIMENSIONS)


def settled_values(facts: SettleFacts) -> dict[str, float]:
    """What a request used in every held dimension, in policy units."""
    return {d.name: d.settle(facts) for d in HELD}  # type: ignore[misc]
