"""Unit economics of one finished request: what it cost the platform (apportioned engine time x the backend's
GPU-hour price, or the partner's token prices), what it was charged, and what the cache, batching, aborted or
cut streams, retries and early rejections saved or wasted. Pure functions over plain values."""
from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from gateway.budget.pricing import convert
from gateway.cost.config import BackendCost, CostConfig

# the one category each request falls in (records, ledger rows, /metrics, `gateway report`)
CATEGORIES = ("served", "batch", "cache_hit", "aborted", "cut", "error", "rejected")
WASTE = frozenset({"aborted", "cut", "error"})  # engine time spent on an answer the client did not get whole


def backend_cost(cfg: CostConfig, backend: str | None) -> BackendCost | None:
    if backend is None:
        return cfg.default
    return cfg.backends.get(backend, cfg.default)


def gpu_cost(gpu_seconds: float | None, bc: BackendCost | None, currency: str,
             fx_rates: Mapping[str, float]) -> float | None:
    """Money for GPU-seconds at the backend's GPU-hour price, in `currency`; None when not priced by time."""
    if gpu_seconds is None or bc is None or bc.gpu_hour is None:
        return None
    return convert(gpu_seconds * bc.gpu_hour / 3600.0, bc.currency, currency, fx_rates)


def token_cost(prompt: int, cached: int, completion: int, bc: BackendCost | None, currency: str,
               fx_rates: Mapping[str, float]) -> float | None:
    """Money a partner charges for the tokens, in `currency`; None when the backend has no token prices."""
    if bc is None or (bc.input is None and bc.output is None):
        return None
    cached = min(max(cached, 0), prompt)
    pin = bc.input or 0.0
    pc = pin if bc.cached_input is None else bc.cached_input
    amount = ((prompt - cached) * pin + cached * pc + completion * (bc.output or 0.0)) / 1_000_000
    return convert(amount, bc.currency, currency, fx_rates)


class Outcome(NamedTuple):
    """What the classification needs from a finished request (built from its RequestContext). A NamedTuple:
    built once per request, and a frozen dataclass's __init__ sets each field through object.__setattr__."""

    dispatched: bool  # an engine or partner saw it
    status: int
    cache_hit: bool
    batch: bool
    cut: bool  # cut by the budget or at the drain deadline
    retries: int  # failed attempts before the one that answered (or all of them)


def category(o: Outcome) -> str:
    if o.cache_hit:
        return "cache_hit"
    if not o.dispatched:
        return "rejected" if o.status >= 400 else "served"
    if o.status == 499:
        return "aborted"
    if o.cut:
        return "cut"
    if o.status >= 400:
        return "error"
    return "batch" if o.batch else "served"


def savings_and_waste(cat: str, gpu_seconds: float | None, cached_prefill_s: float,
                      cache_hit_estimate_s: float | None, retry_s: float = 0.0
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """GPU-seconds saved and wasted, by reason. Saved: prompt tokens the engine's prefix cache served (their
    prefill at the learned cost per token), a response-cache hit (what a like request cost on the engines).
    Wasted: all engine time of an aborted, cut or failed request (the answer was not delivered whole), and
    the engine time of failed attempts before the one that answered (`retry`)."""
    saved: dict[str, float] = {}
    wasted: dict[str, float] = {}
    if cached_prefill_s > 0:
        saved["prefix_cache"] = cached_prefill_s
    if cat == "cache_hit" and cache_hit_estimate_s:
        saved["response_cache"] = cache_hit_estimate_s
    if cat in WASTE and gpu_seconds:
        wasted[cat] = gpu_seconds
    if retry_s > 0:  # engine time of failed attempts before the one that answered (or of all of them)
        wasted["retry"] = retry_s
    return saved, wasted


def margin(charged: float | None, cost: float | None) -> float | None:
    if charged is None or cost is None:
        return None
    return charged - cost
