"""End to end (the simulated fleet, a real gateway process, the openai SDK): registered adapters placed on
engines that load LoRA adapters at run time (docs/adapters.md, "Placement").

Two sim engines with runtime LoRA and `--max-loras 2`, both declared `lora: {dynamic: true, max_loras: 2}` for the
base model. Tenant alpha registers five adapters no engine was started with. The first call of each loads it
(the audit record says `loaded: true` and the engine), a second call finds it resident; four adapters fill the
four slots, the fifth unloads the least recently used one of the engine it goes to; an adapter unloaded behind the
gateway's back (the engine's 404), or lost by an engine restart, is loaded again and the request retried. DELETE unloads the adapter's copy.
`lora.refresh_s` is long here so the gateway re-reads an engine only on first contact and after a 404.
"""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.support.lora_stack import lora_stack
from tests.support.procs import audit_record

pytestmark = pytest.mark.e2e

ADMIN = "placement-admin-key-0123456789"
MSG = [{"role": "user", "content": "hi"}]
NAMES = ["ad-1", "ad-2", "ad-3", "ad-4", "ad-5"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with lora_stack(tmp_path_factory.mktemp("placement"), ADMIN) as st:
        yield st


def admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


def resident(root: str) -> set[str]:
    cards = httpx.get(root + "/v1/models", timeout=5).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def call(base: str, c: openai.OpenAI, model: str) -> dict:
    raw = c.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=2)
    assert raw.parse().choices[0].message.content is not None
    return audit_record(base, raw.headers["x-request-id"], ADMIN)["evidence"]["adapter"]


def placements(base: str) -> dict[tuple[str, str], float]:
    text = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=5).text
    out = {}
    for line in text.splitlines():
        if line.startswith("gateway_adapter_placements_total{"):
            labels, value = line[len("gateway_adapter_placements_total{"):].split("} ")
            kv = dict(p.split("=", 1) for p in labels.split(","))
            out[(kv["backend"].strip('"'), kv["op"].strip('"'))] = float(value)
    return out


def test_adapters_are_loaded_where_used_unloaded_lru_and_reloaded_after_loss(stack):
    base, engines = stack["base"], stack["engines"]
    assert admin(base, "POST", "/admin/tenants", {"id": "alpha"}).status_code == 201
    assert admin(base, "PUT", "/admin/tenants/alpha/adapter_sources", {"prefixes": ["/w/alpha/"]}).status_code == 200
    for n in NAMES:
        r = admin(base, "POST", "/admin/adapters", {"name": n, "base_model": "base", "source": f"/w/alpha/{n}",
                                                    "owner": {"tenant": "alpha"}})
        assert r.status_code == 201, r.text
    k = admin(base, "POST", "/admin/keys", {"tenant": "alpha"}).json()["key"]
    c = openai.OpenAI(base_url=base + "/v1", api_key=k, max_retries=0)
    assert [m.id for m in c.models.list()] == ["base", *NAMES]  # the owner's adapters, placed where used
    assert admin(base, "POST", "/admin/tenants", {"id": "beta"}).status_code == 201
    kb = admin(base, "POST", "/admin/keys", {"tenant": "beta"}).json()["key"]
    beta = openai.OpenAI(base_url=base + "/v1", api_key=kb, max_retries=0)
    assert [m.id for m in beta.models.list()] == ["base"]
    with pytest.raises(openai.NotFoundError) as e:  # another tenant: the unknown model's 404, nothing loaded
        beta.chat.completions.create(model="ad-1", messages=MSG, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert all(resident(u) == set() for u in engines.values())

    # first use loads it; the second finds it resident on the same engine
    first = call(base, c, "ad-1")
    assert first["loaded"] is True and first["name"] == "ad-1" and first["base_model"] == "base"
    where = {"ad-1": first["engine"]}
    assert "ad-1" in resident(engines[first["engine"]])
    again = call(base, c, "ad-1")
    assert again["loaded"] is False and again["engine"] == first["engine"]

    # four adapters fill the four slots (a free slot is taken before anything is unloaded)
    for n in NAMES[1:4]:
        ev = call(base, c, n)
        assert ev["loaded"] is True
        where[n] = ev["engine"]
    assert {e: resident(u) for e, u in engines.items()} == {
        e: {n for n, w in where.items() if w == e} for e in engines}
    assert all(len(resident(u)) == 2 for u in engines.values())

    # the fifth unloads the least recently used adapter of the engine it goes to (never more than max_loras)
    ev = call(base, c, "ad-5")
    assert ev["loaded"] is True
    e5 = ev["engine"]
    lru = [n for n in NAMES[:4] if where[n] == e5][0]  # each used in NAMES order; ad-1 twice, still first on its
    assert resident(engines[e5]) == {n for n, w in where.items() if w == e5 and n != lru} | {"ad-5"}
    m = placements(base)
    assert m[(e5, "unload")] == 1.0
    assert sum(v for (_, op), v in m.items() if op == "load") == 5.0

    # unloaded behind the gateway's back (as a restart loses it): the engine's 404 -> reload and retry
    r = httpx.post(engines[e5] + "/v1/unload_lora_adapter", json={"lora_name": "ad-5"}, timeout=5)
    assert r.status_code == 200
    ev = call(base, c, "ad-5")
    assert ev["loaded"] is True and ev["reloaded"] is True and ev["engine"] == e5
    assert "ad-5" in resident(engines[e5])

    # the engine restarts (a new process loses every runtime adapter): the same recovery
    assert httpx.post(engines[e5] + "/sim/restart", timeout=5).status_code == 200
    for _ in range(200):  # until the new process answers (it holds no adapter)
        try:
            if resident(engines[e5]) == set():
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    assert resident(engines[e5]) == set()
    ev = call(base, c, "ad-5")
    assert ev["loaded"] is True and ev["reloaded"] is True and ev["engine"] == e5
    assert "ad-5" in resident(engines[e5])

    # DELETE: refused at once, and its copy is unloaded (no request holds it now)
    assert admin(base, "DELETE", "/admin/adapters/ad-5").status_code == 200
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="ad-5", messages=MSG, max_tokens=2)
    assert "ad-5" not in resident(engines[e5])
