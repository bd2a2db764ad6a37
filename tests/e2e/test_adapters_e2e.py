"""End to end (a real gateway process, HTTP, the openai SDK): tenant-owned adapters.

A backend serves `base` and the static LoRA adapter `alpha-lora`; tenant alpha registers `alpha-lora` (the
platform admin granted it `/w/alpha/`). Only alpha's keys may call it: beta gets exactly the 404 an unknown model
gets, does not see it in /v1/models, and a key's `models` list and a policy's `deny.models` apply to the adapter
name like to any model.
The audit record names the adapter. After DELETE the name belongs to nobody again (the config's static model).
"""
from __future__ import annotations


import httpx
import openai
import pytest
import yaml

from tests.support.procs import audit_record, free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e

ADMIN_KEY = "adapters-admin-key-0123456789"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    up, up_port = start_upstream(tmp)
    port = free_port()
    policy = tmp / "policy.yaml"  # a policy rule names the adapter like any model
    policy.write_text(yaml.safe_dump({"version": 1, "rules": [
        {"id": "interns-no-adapters", "match": {"team": "interns"}, "deny": {"models": ["alpha-lora"]},
         "reason": "interns use the base model"}]}))
    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "backends": [{"name": "e1", "kind": "openai", "url": f"http://127.0.0.1:{up_port}/v1",
                      "models": ["base", "alpha-lora"], "lora_adapters": ["alpha-lora"]}],
        # a weighted alias whose canary arm is alpha's adapter: only alpha may ever be sent to it
        "aliases": [{"name": "support", "targets": [{"model": "alpha-lora", "weight": 100},
                                                    {"model": "base", "weight": 0}]}],
        "admin": {"key": ADMIN_KEY},
        "identity": {"sqlite_path": str(tmp / "identity.db"), "cache_ttl_s": 60.0},
        "policy": {"audit_path": str(tmp / "audit.jsonl"), "files": [str(policy)]},
        "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl")},
        "data_dir": str(tmp / "var"),
    }
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc, _ = start_gateway(path)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base
    finally:
        proc.stop()
        up.stop()


def admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN_KEY}"},
                         timeout=10)


def key(base: str, tenant: str, **extra) -> str:
    r = admin(base, "POST", "/admin/keys", {"tenant": tenant, **extra})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def client(base: str, k: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=k, max_retries=0)


def not_found(c: openai.OpenAI, model: str) -> dict:
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model=model, messages=MSG, max_tokens=2)
    return e.value.body  # type: ignore[return-value]


def test_only_the_owner_scope_calls_an_adapter_and_others_learn_nothing(gw):
    for t in ("alpha", "beta"):
        assert admin(gw, "POST", "/admin/tenants", {"id": t}).status_code == 201
    assert admin(gw, "PUT", "/admin/tenants/alpha/adapter_sources", {"prefixes": ["/w/alpha/"]}).status_code == 200
    r = admin(gw, "POST", "/admin/adapters", {"name": "alpha-lora", "base_model": "base", "source": "/w/alpha/l1",
                                               "owner": {"tenant": "alpha"}})
    assert r.status_code == 201, r.text
    alpha, beta = client(gw, key(gw, "alpha")), client(gw, key(gw, "beta"))

    raw = alpha.chat.completions.with_raw_response.create(model="alpha-lora", messages=MSG, max_tokens=2)
    assert raw.parse().choices[0].message.content
    rec = audit_record(gw, raw.headers["x-request-id"], ADMIN_KEY)
    assert rec["evidence"]["adapter"] == {"name": "alpha-lora", "base_model": "base"}
    assert rec["backend_model"] == "alpha-lora"

    # beta: the same 404 as a model that does not exist (only the echoed name differs)
    theirs, unknown = not_found(beta, "alpha-lora"), not_found(beta, "alpha-lorb")
    assert theirs == {**unknown, "message": unknown["message"].replace("alpha-lorb", "alpha-lora")}
    assert theirs["code"] == "model_not_found"
    assert beta.chat.completions.create(model="base", messages=MSG, max_tokens=2).choices  # the base model is open

    assert "alpha-lora" in [m.id for m in alpha.models.list()]
    assert [m.id for m in beta.models.list()] == ["base", "support"]

    # an alias arm that is an adapter: the owner gets it, others the alias's other arms (after the arm is chosen)
    for c, want in ((alpha, "alpha-lora"), (beta, "base")):
        raw = c.chat.completions.with_raw_response.create(model="support", messages=MSG, max_tokens=2)
        rec = audit_record(gw, raw.headers["x-request-id"], ADMIN_KEY)
        assert rec["backend_model"] == want and rec["evidence"]["rollout"]["arm"] == want
        assert raw.headers["x-gateway-rollout-arm"] == want  # beta never hears the adapter's name
    assert [m for m in beta.models.list() if m.id == "support"][0].alias_of == ["base"]  # type: ignore[attr-defined]

    # a key's model list applies to the adapter name like any model
    narrow = client(gw, key(gw, "alpha", models=["base"]))
    with pytest.raises(openai.PermissionDeniedError) as e:
        narrow.chat.completions.create(model="alpha-lora", messages=MSG, max_tokens=2)
    assert e.value.body["code"] == "model_not_allowed"  # type: ignore[index]

    # and so does a policy rule
    assert admin(gw, "POST", "/admin/tenants/alpha/teams", {"id": "interns"}).status_code == 201
    intern = client(gw, key(gw, "alpha", team="interns"))
    with pytest.raises(openai.PermissionDeniedError) as e:
        intern.chat.completions.create(model="alpha-lora", messages=MSG, max_tokens=2)
    assert "interns use the base model" in str(e.value.body)

    # DELETE takes effect at once: the registration is gone, the static model of the config is anybody's again
    assert admin(gw, "DELETE", "/admin/adapters/alpha-lora").json()["deleted"] is True
    assert beta.chat.completions.create(model="alpha-lora", messages=MSG, max_tokens=2).choices
