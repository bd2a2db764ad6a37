"""Delegate the policy decision (or part of it) to Open Policy Agent over its REST data API.

Input document (docs/policy.md, "OPA"): {"principal": {...}, "request": {model, headers (credentials removed),
max_tokens, stream, time: {unix (floored to the minute), weekday, hour (UTC)}}, "local_decision": {...}|null}.
OPA's result at `path` is either a boolean (allow) or an object {allow, reason, rule, jurisdiction, retention,
priority, ttft_slo_ms, long_ttft_slo_ms, max_tokens, max_context, cache_isolation, share, share_scope}. An undefined result is a deny; a timeout or
any error is a deny with status 503 (fail-closed). Answers are cached for `cache_ttl_s` per distinct input.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any, Callable
from urllib.parse import urlsplit

import orjson

from gateway.policy.config import OPAConfig
from gateway.policy.eea import JURISDICTIONS
from gateway.policy.engine import CompiledPolicy, _jurisdiction_label
from gateway.policy.model import RequestAttrs
from gateway.types import Decision, Principal

_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key",
                             "openai-api-key"})
# Per-request transport and tracing headers: different on every request, meaningless to a policy, and part of
# the decision cache's key (the whole input) - with them in, the cache never hit on real traffic.
_VOLATILE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "accept-encoding", "te", "host",
                               "x-request-id", "traceparent", "tracestate", "baggage", "x-amzn-trace-id",
                               "x-b3-traceid", "x-b3-spanid", "x-b3-parentspanid", "x-b3-sampled", "b3",
                               "x-stainless-retry-count", "x-stainless-read-timeout", "x-stainless-timeout"})
_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_SHARE_SCOPES = ("key", "project", "team", "tenant", "partner")  # the flow levels of gateway/routing/flowkey.py


def build_input(principal: Principal, request: RequestAttrs, local: Decision | None) -> dict[str, Any]:
    """The documented OPA input document; no credentials and no prompt content ever go in."""
    minute = int(request.now // 60 * 60)
    t = datetime.fromtimestamp(minute, timezone.utc)
    p = principal.to_evidence()
    p["scopes"] = list(principal.scopes)
    p["allowed_models"] = list(principal.allowed_models)
    return {
        "principal": p,
        "request": {
            "model": request.model,
            "headers": {k: v for k, v in request.headers.items()
                        if k not in _SECRET_HEADERS and k not in _VOLATILE_HEADERS},
            "max_tokens": request.max_tokens,
            "stream": request.stream,
            "time": {"unix": minute, "weekday": _DAYS[t.weekday()], "hour": t.hour},
        },
        "local_decision": local.to_evidence() if local is not None else None,
    }


def _countries(v: Any) -> frozenset[str]:
    out: set[str] = set()
    for item in (v if isinstance(v, list) else [v]):
        s = str(item).upper()
        out |= JURISDICTIONS.get(s, frozenset({s}))
    return frozenset(out)


def _valid_field(key: str, v: Any) -> Any:
    """OPA's value for a Decision field in the type the request path relies on, or None when it is not."""
    if key == "priority":
        v = "batch" if v == "sheddable" else v
        return v if v in ("realtime", "standard", "batch") else None
    if key == "share_scope":
        return v if v in _SHARE_SCOPES else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= 0:
        return None
    if key in ("ttft_slo_ms", "long_ttft_slo_ms", "share"):
        return float(v)
    return int(v) if float(v).is_integer() else None  # max_tokens, max_context: whole token counts


def merge_result(local: Decision | None, result: Any, defined: bool) -> Decision:
    """Combine the local decision with OPA's answer: deny wins, jurisdictions intersect, OPA sets values."""
    base = local or Decision()
    rules = base.matched_rules + ("opa",)
    if not defined:
        return Decision(allow=False, deny_rule="opa", reason="OPA returned no decision (undefined is a deny)",
                        matched_rules=rules)
    if isinstance(result, bool):
        result = {"allow": result}
    if not isinstance(result, dict):
        return Decision(allow=False, deny_rule="opa", reason=f"OPA result is not an object: {type(result).__name__}",
                        matched_rules=rules)
    if base.allow is False:
        return base
    if result.get("allow") is not True:
        rule = f"opa:{result['rule']}" if result.get("rule") else "opa"
        return Decision(allow=False, deny_rule=rule, reason=result.get("reason") or "denied by OPA policy",
                        matched_rules=rules)
    countries = base.allowed_countries
    residency_rule = base.residency_rule
    if result.get("jurisdiction") is not None:
        c = _countries(result["jurisdiction"])
        countries = c if countries is None else countries & c
        residency_rule = f"{residency_rule},opa" if residency_rule else "opa"
    retention, retention_rule = base.retention, base.retention_rule
    if result.get("retention") == "zero" and retention != "zero":
        retention, retention_rule = "zero", "opa"
    fields: dict[str, Any] = {}
    for k, dk in (("priority", "priority"), ("ttft_slo_ms", "ttft_slo_ms"), ("long_ttft_slo_ms", "long_ttft_slo_ms"),
                  ("max_tokens", "max_tokens_cap"), ("max_context", "max_context"), ("share", "share"),
                  ("share_scope", "share_scope")):
        if result.get(k) is not None:
            v = _valid_field(k, result[k])
            if v is None:  # a malformed answer fails closed, with the reason (never a 500 later on)
                return Decision(allow=False, deny_rule="opa", matched_rules=rules,
                                reason=f"OPA result field '{k}' is invalid: {result[k]!r:.80}")
            fields[dk] = v
    if countries is not None and not countries:
        return Decision(allow=False, deny_rule="opa", matched_rules=rules,
                        reason="contradictory residency between local policy and OPA: no country left")
    return Decision(
        allow=True, matched_rules=rules, allowed_countries=countries,
        jurisdiction=_jurisdiction_label(countries) if countries is not None else None,
        residency_rule=residency_rule, retention=retention, retention_rule=retention_rule,
        max_tokens_cap=fields.get("max_tokens_cap", base.max_tokens_cap),
        max_context=fields.get("max_context", base.max_context),
        priority=fields.get("priority", base.priority), ttft_slo_ms=fields.get("ttft_slo_ms", base.ttft_slo_ms),
        long_ttft_slo_ms=fields.get("long_ttft_slo_ms", base.long_ttft_slo_ms),
        share=fields.get("share", base.share), share_scope=fields.get("share_scope", base.share_scope),
        budgets=base.budgets, cache_isolation=base.cache_isolation or bool(result.get("cache_isolation")),
        spill_to_partner=base.spill_to_partner, allowed_models=base.allowed_models, denied_models=base.denied_models,
    )


class OPAPolicy:
    """Same role as CompiledPolicy, but asks OPA (via opa-python-client's AsyncOpaClient). Use `adecide`."""

    is_remote = True

    def __init__(self, config: OPAConfig, local: Callable[[], CompiledPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._local = local if config.mode == "merge" else None
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, Decision]] = OrderedDict()
        self._client: Any = None
        self._lock = asyncio.Lock()
        self.stats = {"queries": 0, "cache_hits": 0, "errors": 0, "undefined": 0}

    async def start(self) -> None:
        from opa_client import AsyncOpaClient

        u = urlsplit(self.config.url)
        token = os.environ.get(self.config.token_env) if self.config.token_env else None
        client = AsyncOpaClient(host=u.hostname or "127.0.0.1", port=u.port or (443 if u.scheme == "https" else 8181),
                                ssl=u.scheme == "https", token=token, retries=0,
                                timeout=self.config.timeout_ms / 1000.0)
        await client.__aenter__()
        self._client = client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close_connection()
            self._client = None

    def setting_rule(self, decision: Decision, key: str) -> str | None:
        """Which rule set the single value `key` of a decision this policy made: the local rule when its value
        is the one in force (merge mode), else "opa" (OPA overrode it, or replace mode)."""
        local = self._local() if self._local is not None else None
        rid = local.setting_rule(decision, key) if local is not None else None
        if rid is not None and local is not None and local.rule(rid).sets.get(key) == getattr(decision, key):
            return rid
        return "opa" if "opa" in decision.matched_rules else rid

    async def adecide(self, principal: Principal, request: RequestAttrs) -> Decision:
        local = self._local().decide(principal, request) if self._local is not None else None
        if local is not None and not local.allow:
            return local  # deny wins; no need to ask OPA
        doc = build_input(principal, request, local)
        key = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key)
            self.stats["cache_hits"] += 1
            return hit[1]
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    await self.start()
        self.stats["queries"] += 1
        try:
            resp = await asyncio.wait_for(self._client.query_rule(doc, self.config.path.strip("/")),
                                          timeout=self.config.timeout_ms / 1000.0)
        except Exception as e:  # timeout, connection refused, HTTP 4xx/5xx, bad JSON: fail closed, never cache
            self.stats["errors"] += 1
            what = "timed out" if isinstance(e, (asyncio.TimeoutError, TimeoutError)) else type(e).__name__
            return Decision(allow=False, deny_rule="opa", deny_status=503,
                            reason=f"OPA {what} after {self.config.timeout_ms:g} ms; failing closed",
                            matched_rules=(local.matched_rules if local else ()) + ("opa",))
        defined = isinstance(resp, dict) and "result" in resp
        if not defined:
            self.stats["undefined"] += 1
        d = merge_result(local, resp.get("result") if defined else None, defined)
        self._cache[key] = (now + self.config.cache_ttl_s, d)
        if len(self._cache) > self.config.cache_size:
            self._cache.popitem(last=False)
        return d
