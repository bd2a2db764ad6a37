"""What makes two requests the same: the partition (who may share an entry) and the exact key (what was asked).

The partition is authorization, not a namespace: tenant (and team/project where the rule says), the partner
calling in, model, the decision's residency and retention, every decision value that changes the request sent
upstream or who may answer it (caps, context limit, priority, cache isolation, partner spill, model and
provider restrictions) with what the policy stage already changed (its body overrides, the model chain it
left), the endpoint, the system prompt and the tools. Two requests in different partitions never see each
other's entries, whatever the key or similarity.
"""
from __future__ import annotations

import hashlib
from typing import Any

import orjson

# body fields that do not change the answer (delivery, accounting, routing hints): left out of the exact key
_NOT_CONTENT = frozenset({"stream", "stream_options", "user", "metadata", "provider", "store", "service_tier"})


def _h(obj: Any) -> str:
    return hashlib.sha256(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)).hexdigest()


def system_prompt(body: dict[str, Any]) -> list[Any]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return []
    return [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") in ("system", "developer")]


def partition(ctx: Any, scope: str = "tenant") -> str:
    """The partition id of a request: every field that must be equal for two requests to share an entry."""
    p, d, body = ctx.principal, ctx.decision, ctx.body
    parts: dict[str, Any] = {
        "tenant": p.tenant,
        "team": p.team if scope in ("team", "project") else None,
        "project": p.project if scope == "project" else None,
        "partner": p.partner,  # a partner's entries are not its tenant's keys' (nor the other way round)
        "endpoint": ctx.endpoint,
        "model": ctx.model,
        "residency": sorted(d.allowed_countries) if d.allowed_countries is not None else None,
        "retention": d.retention,
        "decision": decision_values(d),
        # what the policy stage did to this request with them: the max_tokens it capped or lowered, the
        # model chain it filtered (an entry made under other values was made from another upstream request)
        "overrides": ctx.body_overrides,
        "chain": list(ctx.model_chain),
        "system": system_prompt(body),
        "tools": [body.get("tools"), body.get("functions"), body.get("tool_choice")],
    }
    return _h(parts)[:32]


def decision_values(d: Any) -> dict[str, Any]:
    """The decision's values that change what is sent upstream or who may serve it (issue 35, finding 6):
    the max_tokens cap and context limit (the answer's length), the priority (sent to engines that schedule by
    it), cache isolation (the engine's cache_salt), partner spill and the model and provider restrictions
    (which backend and model answer). Admission and fairness values (TTFT targets, share, budgets) only decide
    whether and when it is sent: two requests that differ only there share entries."""
    return {
        "max_tokens_cap": d.max_tokens_cap,
        "max_context": d.max_context,
        "priority": d.priority,
        "cache_isolation": d.cache_isolation,
        "spill_to_partner": d.spill_to_partner,
        "allowed_models": sorted(d.allowed_models),
        "denied_models": sorted(d.denied_models),
        "providers_only": sorted(d.providers_only) if d.providers_only is not None else None,
        "providers_ignored": sorted(d.providers_ignored),
        "providers_order": list(d.providers_order),
        "no_fallbacks": d.no_fallbacks,
    }


def content_body(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in _NOT_CONTENT}


def exact_key(partition_id: str, body: dict[str, Any]) -> str:
    """The exact key: the partition plus the whole normalised request (every message, tools, response format,
    sampling parameters); only delivery fields (stream, user, metadata) are left out."""
    return partition_id + ":" + _h(content_body(body))[:40]


def params_key(body: dict[str, Any]) -> str:
    """Everything but the conversation: a semantic match must agree on all of it (sampling, format, limits)."""
    rest = {k: v for k, v in content_body(body).items() if k not in ("messages", "prompt")}
    return _h(rest)[:24]


def temperature(body: dict[str, Any]) -> float:
    t = body.get("temperature")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 1.0
