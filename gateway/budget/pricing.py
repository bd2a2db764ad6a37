"""Cost of one request from per-model prices: input, cached input and output per million tokens, plus
GPU-seconds for self-hosted engines. Pure; the result is in the price's currency unless fx rates convert it."""
from __future__ import annotations

from typing import Mapping

import msgspec

from gateway.budget.config import ModelPrice
from gateway.types import Usage


def find_price(model: str, prices: Mapping[str, ModelPrice], backend: str | None = None,
               batch: bool = False, cache_hit: bool = False) -> ModelPrice | None:
    """`backend:model` wins over `model`, so one model can be priced differently per engine or partner. With
    `batch` (a batch-lane line) the price's batch_input/batch_output replace input/output where set. With
    `cache_hit` (an answer from the response cache: no backend, no GPU) the price is its `cache_hit` rate for
    prompt and completion tokens alike, nothing per GPU-second; `backend` is ignored (a hit has none)."""
    if cache_hit:
        hp = prices.get(model)
        if hp is None:
            return None
        return msgspec.structs.replace(hp, input=hp.cache_hit, cached_input=None, output=hp.cache_hit,
                                       gpu_second=None, batch_input=None, batch_output=None)
    p = prices.get(f"{backend}:{model}") if backend is not None else None
    if p is None:
        p = prices.get(model)
    if batch and p is not None and (p.batch_input is not None or p.batch_output is not None):
        bi = p.input if p.batch_input is None else p.batch_input
        ci = None if p.cached_input is None else min(p.cached_input, bi)
        p = msgspec.structs.replace(p, input=bi, cached_input=ci,
                                    output=p.output if p.batch_output is None else p.batch_output)
    return p


def cost(model: str, usage: Usage, prices: Mapping[str, ModelPrice], gpu_seconds: float | None = None,
         backend: str | None = None, batch: bool = False, cache_hit: bool = False) -> float:
    """Money for `usage` of `model`; 0.0 for an unpriced model. Cached prompt tokens are billed at
    cached_input (input when unset); GPU-seconds add gpu_second * seconds when both are known. `cache_hit`:
    a response-cache hit, every token at the price's `cache_hit` rate (find_price)."""
    p = find_price(model, prices, backend, batch, cache_hit)
    if p is None:
        return 0.0
    cached = min(max(usage.cached_tokens or 0, 0), usage.prompt_tokens)
    fresh = usage.prompt_tokens - cached
    cached_rate = p.input if p.cached_input is None else p.cached_input
    c = (fresh * p.input + cached * cached_rate + usage.completion_tokens * p.output) / 1_000_000
    if gpu_seconds is not None and p.gpu_second is not None:
        c += gpu_seconds * p.gpu_second
    return c


def convert(amount: float, from_ccy: str, to_ccy: str, fx_rates: Mapping[str, float]) -> float:
    """Convert with `fx_rates` (1 unit of X = rate units of the budget currency). Raises on an unknown pair."""
    if from_ccy == to_ccy:
        return amount
    if from_ccy in fx_rates and to_ccy not in fx_rates:
        return amount * fx_rates[from_ccy]
    if to_ccy in fx_rates and from_ccy not in fx_rates:
        return amount / fx_rates[to_ccy]
    if from_ccy in fx_rates and to_ccy in fx_rates:
        return amount * fx_rates[from_ccy] / fx_rates[to_ccy]
    raise ValueError(f"no fx rate to convert {from_ccy} to {to_ccy}; add budgets.fx_rates.{from_ccy}")
