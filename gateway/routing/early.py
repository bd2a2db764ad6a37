"""Early refusal: refuse before the request is tokenized (no /tokenize round trip on the path of a refusal) when
a lower bound on every own engine's TTFT is already over the target. The request's own prefill is at least one
token (all the rest cached), or, when the ids of the chat's earlier messages are cached and an engine's chain of
blocks breaks inside that prefix, at least what lies past the break; the work ahead and the running decodes are
known without its tokens. The prediction and its upper bound grow with both (boxed coefficients >= 0), so the
full prediction could only be higher and admission would refuse too.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, NamedTuple

from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.proxy.dialects import telemetry_form
from gateway.routing.admission import Admission, decide
from gateway.routing.pending import PendingCache
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView
from gateway.routing.predictor import Features, Predictor
from gateway.routing.prompt import lora_name, routing_body
from gateway.telemetry.index import RequestKeys

if TYPE_CHECKING:
    from gateway.telemetry.service import TelemetryService

MAX_LEARNING = 64  # background /tokenize of message prefixes at once


def early_refusal(target: float, lower_uppers_ms: list[float], lower_means_ms: list[float]) -> Admission | None:
    """The admission decision on lower bounds of every own engine's prediction (see
    PredictiveRouteStage._refuse_early): the Admission when it is a refusal, else None (decide after tokenizing).
    Realtime/standard traffic without a spill target only: batch queues and spills need the full prediction."""
    if not lower_uppers_ms:
        return None
    adm = decide(target, lower_uppers_ms, lower_means_ms, priority="standard", can_spill=False)
    return adm if adm.action == "reject" else None


def unattainable(best: Candidate, target: float, retry_after_s: float, lower_bound: bool = False) -> GatewayError:
    """429 ttft_slo_unattainable with the best engine's prediction (a lower bound when refused before tokenizing)."""
    at_least = "at least " if lower_bound else ""
    return GatewayError(
        429, f"No allowed engine is predicted to meet the TTFT target of {target:g} ms "
             f"(best predicted {at_least}{best.predicted_ttft_ms:.0f} ms, "
             f"upper {best.predicted_ttft_upper_ms:.0f} ms).",
        code="ttft_slo_unattainable",
        headers={**retry_headers(retry_after_s), "x-predicted-ttft-ms": f"{best.predicted_ttft_ms:.0f}",
                 "x-predicted-ttft-upper-ms": f"{best.predicted_ttft_upper_ms:.0f}",
                 "x-ttft-slo-ms": f"{target:g}"},
        extra={"predicted_ttft_ms": best.predicted_ttft_ms, "ttft_slo_ms": target})


class EarlyRefusal(NamedTuple):
    """A refusal on lower bounds: the own candidates best upper first (predictions set to the bounds), the
    admission decision, and the per-engine uncached-token bounds it used (empty: 1 token everywhere)."""

    cands: list[Candidate]
    admission: Admission
    bounds: dict[str, int]


def refuse_early(own: list[Candidate], target: float, elapsed_s: float, bounds: dict[str, int],
                 views: dict[str, EngineView], predictor: Predictor) -> EarlyRefusal | None:
    """The refusal when every own engine's lower bound (`elapsed_s` + its prediction on `bounds`, else one
    uncached token) is over the target, else None (decide after tokenizing)."""
    lbs: list[tuple[Candidate, float, float, EngineView]] = []
    for c in own:
        v = views[c.backend.name]
        mean, upper = predictor.predict(
            c.backend.name, Features(ahead_tokens=v.ahead_tokens, uncached_tokens=float(bounds.get(
                c.backend.name, 1)), running=v.running))
        lbs.append((c, (elapsed_s + mean) * 1000, (elapsed_s + upper) * 1000, v))
    adm = early_refusal(target, [u for _, _, u, _ in lbs], [m for _, m, _, _ in lbs])
    if adm is None:
        return None
    for c, m, u, v in lbs:
        c.predicted_ttft_ms, c.predicted_ttft_upper_ms = round(m, 3), round(u, 3)
        c.info = {"predicted_ttft_upper_ms": c.predicted_ttft_upper_ms, "lower_bound": True,
                  "uncached_tokens_at_least": int(bounds.get(c.backend.name, 1)),
                  "ahead_tokens": int(v.ahead_tokens), "running": v.running, "waiting": v.waiting,
                  "inflight": v.inflight, "operator": c.backend.operator}
    return EarlyRefusal(sorted(own, key=lambda c: c.predicted_ttft_upper_ms or 0), adm, bounds)


def uncached_lower_bounds(ctx: RequestContext, own: list[Candidate], salt: str | None, now: float,
                          tel: TelemetryService | None,
                          has_telemetry: Callable[[Candidate], bool], pending: PendingCache) -> dict[str, int]:
    """Per engine, a lower bound on the request's uncached prompt tokens without tokenizing it, where one is
    known (else the caller assumes 1): when the ids of the chat's earlier messages are cached
    (TokenSource.cached_prefix) and an engine's chain of blocks (index, then own pending prefill) breaks
    inside that prefix, nothing past the break can be cached there (block keys are chained), so the request
    has at least len(prefix) + tail lower bound - cached-before-the-break uncached tokens there."""
    tc = [c for c in own if has_telemetry(c)]
    if tel is None or not tc or ctx.zero_retention:
        return {}
    ts = tel.tokens
    try:
        hit = ts.cached_prefix(tc[0].backend.server_root, routing_body(ctx), salt)
        if hit is None:
            return {}
        ids, tail_lb = hit
        n_lb = len(ids) + tail_lb
        index = tel.index
        by_lora: dict[str | None, list[str]] = {}
        for c in tc:
            by_lora.setdefault(lora_name(c), []).append(c.backend.name)
        out: dict[str, int] = {}
        for lora, names in by_lora.items():
            rk = RequestKeys(list(ids), salt, lora)
            found = tel.lookup(names, rk, salt=salt, lora=lora)
            for name in names:
                bs = index.block_size(name)
                if not bs:
                    continue
                full = len(ids) // bs
                v = found.get(name)
                # the longest prefix over every tier, in blocks (the full path counts v.tokens as cached)
                held = min(max(int(v.blocks), -(-int(v.tokens) // bs)), full) if v is not None else 0
                n = pending.extend(name, rk.keys(bs), held, full, now) if full else 0
                if n < full:  # the chain breaks inside the known prefix on this engine
                    out[name] = max(1, n_lb - max(n * bs, int(v.tokens) if v is not None else 0))
        return out
    except Exception:  # a bound is an optimisation: trouble means no bound, never a failed request
        return {}


def learn_prefix(ctx: RequestContext, cand: Candidate, toks: list[int], salt: str | None, tel: TelemetryService | None,
                 tasks: set[asyncio.Task]) -> None:
    """Cache the ids of the chat's earlier messages off the request's path (one /tokenize of the prefix,
    once per distinct prefix), for the refusal before tokenizing of later requests sharing it. `tasks` holds
    the running ones (bounded by MAX_LEARNING)."""
    body = routing_body(ctx)
    msgs = body.get("messages")
    if tel is None or ctx.zero_retention or not isinstance(msgs, list) or len(msgs) < 2 \
            or len(tasks) >= MAX_LEARNING:
        return
    ts = tel.tokens
    try:
        form = telemetry_form(cand.backend.kind) or "vllm"
        t = asyncio.get_running_loop().create_task(ts.learn_prefix(cand.backend.server_root, body, toks, salt,
                                                                   form=form))
    except RuntimeError:
        return
    tasks.add(t)
    t.add_done_callback(tasks.discard)
