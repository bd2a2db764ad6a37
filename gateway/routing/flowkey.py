"""Which fair-queue flow a request belongs to, and its weight there: pure functions of principal and decision.

A policy rule's `set.share: N` weighs the flow of the rule's own scope (the most specific of key, project, team,
tenant, partner it matches on, else tenant: gateway/policy/compiler.py `_rule_scope`), carried on the Decision as
`share` and `share_scope`. Without a share rule a request's flow is its tenant with weight 1. The same id is sent
to a Gateway API Inference Extension / llm-d upstream as `x-gateway-inference-fairness-id`
(gateway/proxy/forward.py), so the two fair queues agree on who a flow is.
"""
from __future__ import annotations

from gateway.types import Decision, Principal

ANONYMOUS = "anonymous"


def flow_id(principal: Principal | None, decision: Decision | None) -> str:
    """The flow id: the tenant (default); "tenant/team" or "tenant/team/project" for team and project shares
    (as budgets name those scopes), "key:<id>" and "partner:<name>" for key and partner shares. A level the
    principal lacks falls back to its tenant; no principal is "anonymous"."""
    if principal is None:
        return ANONYMOUS
    tenant = principal.tenant or ANONYMOUS
    scope = decision.share_scope if decision is not None else "tenant"
    if scope == "team" and principal.team:
        return f"{tenant}/{principal.team}"
    if scope == "project" and principal.project:
        return f"{tenant}/{principal.team}/{principal.project}"
    if scope == "key" and principal.key_id:
        return f"key:{principal.key_id}"
    if scope == "partner" and principal.partner:
        return f"partner:{principal.partner}"
    return tenant


def flow_weight(decision: Decision | None) -> float:
    """The request's weight in its flow's fair share: the policy's `share`, 1.0 without one."""
    if decision is None or decision.share is None:
        return 1.0
    return float(decision.share)
