"""Issue 35, finding 6: the cache partition holds every decision value that changes the answer, and the partner.

An intern key whose policy caps max_tokens at 16 used to get the 62-token answer an uncapped key of the same
tenant had cached (the exact key is the client's body; the cap is an override the body does not show), and a
partner shared entries with its tenant's own keys. End to end through the gateway wired like `gateway serve`
(real policy files, the decide and cache stages, a simulated engine), then field by field on the partition.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
import yaml

from backends.sim.fleet import start_fleet
from gateway.app import Gateway, build_app
from gateway.cache.keys import partition
from gateway.config import load_config
from gateway.wiring import wire
from gateway.types import Principal
from tests.cache.helpers import make_ctx, user

KEY = "cache-part-key-0123456789"
INTERN = "cache-part-intern-0123456789"
PARTNER = "cache-part-partner-0123456789"
CTX = "cache-part-ctx-0123456789"
ADMIN_KEY = "cache-part-admin-0123456789"
POLICY = """
version: 1
defaults: {allow: true}
rules:
  - id: acme-cache
    match: {tenant: acme}
    set: {cache: {mode: exact, ttl_s: 600}}
  - id: interns-are-capped
    match: {key.scopes: intern}
    set: {max_tokens: 16}
  - id: short-context
    match: {key.scopes: short}
    set: {max_context: 4000}
"""


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        (tmp_path / "policy.yaml").write_text(POLICY)
        e = fleet.manifest()["engines"][0]
        cfg = {"server": {"host": "127.0.0.1", "port": 0},
               "backends": [{"name": "sim0", "url": e["url"], "kind": "vllm", "models": ["sim-model"],
                             "location": {"country": "DE"}, "retention": "zero"}],
               "keys": [{"name": "plain", "key": KEY, "tenant": "acme"},
                        {"name": "intern", "key": INTERN, "tenant": "acme", "scopes": ["intern"]},
                        {"name": "short", "key": CTX, "tenant": "acme", "scopes": ["short"]},
                        {"name": "opper", "key": PARTNER, "tenant": "acme", "partner": "opper"}],
               "admin": {"key": ADMIN_KEY},
               "cache": {"location": {"country": "DE"}, "max_temperature": 1.0},
               "policy": {"files": [str(tmp_path / "policy.yaml")], "audit_path": str(tmp_path / "audit.jsonl")},
               "identity": {"sqlite_path": str(tmp_path / "gw.db")},
               "budgets": {"sqlite_path": str(tmp_path / "budgets.db")},
               "data_dir": str(tmp_path)}
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        g = Gateway(load_config(path))
        wire(g)
        app = build_app(g)
        await g.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                yield c
        finally:
            await g.close()


async def chat(c: httpx.AsyncClient, key: str, **body: Any) -> httpx.Response:
    r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                     json={"model": "sim-model", "messages": [{"role": "user", "content": "Tell me about Orion"}],
                           **body})
    assert r.status_code == 200, r.text
    return r


async def test_a_capped_key_never_gets_an_uncapped_keys_longer_answer(gw) -> None:
    first = await chat(gw, KEY, max_tokens=62)
    assert first.headers["x-gateway-cache"] == "miss" and first.json()["usage"]["completion_tokens"] > 16
    assert (await chat(gw, KEY, max_tokens=62)).headers["x-gateway-cache"] == "hit"  # the control
    capped = await chat(gw, INTERN, max_tokens=62)
    assert capped.headers["x-gateway-cache"] == "miss"
    assert capped.json()["usage"]["completion_tokens"] <= 16
    assert (await chat(gw, INTERN, max_tokens=62)).headers["x-gateway-cache"] == "hit"  # its own entry
    short = await chat(gw, CTX, max_tokens=62)  # a context limit is a different decision: its own entries
    assert short.headers["x-gateway-cache"] == "miss"


async def test_a_partner_does_not_share_entries_with_its_tenants_keys(gw) -> None:
    assert (await chat(gw, KEY, max_tokens=8)).headers["x-gateway-cache"] == "miss"
    assert (await chat(gw, PARTNER, max_tokens=8)).headers["x-gateway-cache"] == "miss"
    assert (await chat(gw, PARTNER, max_tokens=8)).headers["x-gateway-cache"] == "hit"
    assert (await chat(gw, KEY, max_tokens=8)).headers["x-gateway-cache"] == "hit"  # each its own


# the decision's fields that change what is sent upstream or who serves it, with a value other than the default
CHANGES_THE_REQUEST = {"max_tokens_cap": 16, "max_context": 4000, "priority": "realtime", "cache_isolation": True,
                       "spill_to_partner": True, "allowed_models": ("m",), "denied_models": ("x*",),
                       "providers_only": frozenset({"a"}), "providers_ignored": frozenset({"b"}),
                       "providers_order": ("a",), "no_fallbacks": True}
# the ones that only decide whether and when it is sent (admission, fairness, evidence)
ADMISSION_ONLY = {"ttft_slo_ms": 500.0, "long_ttft_slo_ms": 900.0, "share": 3.0, "share_scope": "key",
                  "matched_rules": ("r",), "reason": "x", "jurisdiction": "DE", "residency_rule": "r",
                  "retention_rule": "r"}


@pytest.mark.parametrize("field,value", sorted(CHANGES_THE_REQUEST.items()))
def test_each_decision_value_that_changes_the_request_partitions(field: str, value: Any) -> None:
    base = make_ctx(user("q"), mode="exact")
    other = make_ctx(user("q"), mode="exact")
    other.decision = dataclasses.replace(other.decision, **{field: value})
    assert partition(base) != partition(other)


@pytest.mark.parametrize("field,value", sorted(ADMISSION_ONLY.items()))
def test_admission_only_values_do_not(field: str, value: Any) -> None:
    base = make_ctx(user("q"), mode="exact")
    other = make_ctx(user("q"), mode="exact")
    other.decision = dataclasses.replace(other.decision, **{field: value})
    assert partition(base) == partition(other)


def test_every_decision_field_is_classified() -> None:
    """A new Decision field must be put in one list or the other (and, if it changes the request, in
    gateway/cache/keys.py `decision_values`)."""
    from gateway.types import Decision

    known = set(CHANGES_THE_REQUEST) | set(ADMISSION_ONLY) | {
        "allow", "deny_rule", "deny_status",  # a denied request never reaches the cache
        "allowed_countries", "retention",  # in the partition already (residency, retention)
        "budgets",  # enforced by the budget stage (a binding allowance: docs/cache.md)
        "cache"}  # the cache spec itself: mode, TTL, scope
    assert {f.name for f in dataclasses.fields(Decision)} == known


def test_policy_overrides_and_the_filtered_chain_partition() -> None:
    base = make_ctx(user("q"), mode="exact")
    capped = make_ctx(user("q"), mode="exact")
    capped.body_overrides["max_tokens"] = 16
    chain = make_ctx(user("q"), mode="exact")
    chain.model_chain = ("m", "fallback")
    assert len({partition(base), partition(capped), partition(chain)}) == 3


def test_a_partner_partitions_apart_from_its_tenant() -> None:
    own = make_ctx(user("q"), mode="exact")
    partner = make_ctx(user("q"), mode="exact")
    partner.principal = Principal(id="key:p", kind="partner", tenant="a", partner="opper")
    assert partition(own) != partition(partner)
