"""End to end (a sim fleet process with runtime LoRA, the real gateway process, the openai SDK, headless Chromium):
the placement view. A request for tenant alpha's adapter places it on an engine; `GET /admin/adapters/placement`
then shows it on that engine, with its owner, to the platform admin and to alpha's admin, while beta's admin sees
the same engines and none of alpha's adapters (no name, no owner); the dashboard's data carries the platform view
and its Adapters panel renders it (engine rows: slots used, learned load time, resident adapters with in-flight
counts and owner). After the adapter's DELETE the view no longer lists it."""
from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import require_service
from tests.observability.test_dashboard import CHROMIUM, DomTable, chromium, fmt
from tests.support.lora_stack import lora_stack
from tests.support.procs import audit_record

pytestmark = pytest.mark.e2e

ADMIN = "placement-view-admin-key-0123456789"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with lora_stack(tmp_path_factory.mktemp("placement-view"), ADMIN) as st:
        yield st


def admin(base: str, method: str, path: str, body: dict | None = None, key: str = ADMIN) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=10)


def test_a_placed_adapter_is_shown_on_its_engine_to_its_tenant_and_the_platform_only(stack):
    base = stack["base"]
    keys = {}
    for t in ("alpha", "beta"):
        assert admin(base, "POST", "/admin/tenants", {"id": t}).status_code == 201
        r = admin(base, "POST", "/admin/keys", {"tenant": t, "purpose": "admin"})
        keys[t] = r.json()["key"]
    assert admin(base, "PUT", "/admin/tenants/alpha/adapter_sources", {"prefixes": ["/w/alpha/"]}).status_code == 200
    r = admin(base, "POST", "/admin/adapters", {"name": "alpha-lora", "base_model": "base",
                                                "source": "/w/alpha/lora"}, key=keys["alpha"])
    assert r.status_code == 201, r.text

    # before any request: both dynamic engines listed, nothing resident
    view = admin(base, "GET", "/admin/adapters/placement").json()["data"]
    assert [(e["backend"], e["adapters"]) for e in view] == [("e1", []), ("e2", [])]

    k = admin(base, "POST", "/admin/keys", {"tenant": "alpha"}).json()["key"]
    c = openai.OpenAI(base_url=base + "/v1", api_key=k, max_retries=0)
    raw = c.chat.completions.with_raw_response.create(model="alpha-lora", messages=MSG, max_tokens=2)
    assert raw.parse().choices[0].message.content is not None
    ev = audit_record(base, raw.headers["x-request-id"], ADMIN)["evidence"]["adapter"]
    assert ev["loaded"] is True
    engine = ev["engine"]

    platform = admin(base, "GET", "/admin/adapters/placement").json()["data"]
    placed = {e["backend"]: [(a["name"], a["inflight"], a["owner"]["tenant"]) for a in e["adapters"]]
              for e in platform}
    assert placed == {n: ([("alpha-lora", 0, "alpha")] if n == engine else []) for n in ("e1", "e2")}
    assert next(e for e in platform if e["backend"] == engine)["load_learned"] is True

    own = admin(base, "GET", "/admin/adapters/placement", key=keys["alpha"])
    assert own.status_code == 200
    assert {e["backend"]: [a["name"] for a in e["adapters"]] for e in own.json()["data"]} == {
        n: (["alpha-lora"] if n == engine else []) for n in ("e1", "e2")}

    other = admin(base, "GET", "/admin/adapters/placement", key=keys["beta"])
    assert other.status_code == 200
    assert [(e["backend"], e["adapters"]) for e in other.json()["data"]] == [("e1", []), ("e2", [])]
    assert "alpha" not in other.text

    # the dashboard: its data carries the platform view, and the Adapters panel renders it
    data = admin(base, "GET", "/admin/ui/data").json()["adapters"]
    assert [(e["backend"], [a["name"] for a in e["adapters"]]) for e in data] == [
        (n, ["alpha-lora"] if n == engine else []) for n in ("e1", "e2")]
    have_chromium = os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)
    if have_chromium:
        dom = chromium(f"{base}/admin/ui#key={ADMIN}", Path(stack["tmp"]), "--dump-dom")
        assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-3000:]
        page = DomTable()
        page.feed(dom.stdout.decode())
        for e in data:
            row = f"adapters:{e['backend']}"
            assert page.cells[(row, "slots")] == f"{len(e['adapters'])} / 2"
            assert page.cells[(row, "load_s")] == fmt(e["load_s"], 3) + ("" if e["load_learned"] else " (prior)")
        assert re.fullmatch(r"alpha-lora \(0 · [0-9.]+ · alpha\)", page.cells[(f"adapters:{engine}", "resident")])
        idle = [e for e in ("e1", "e2") if e != engine][0]
        assert page.cells[(f"adapters:{idle}", "resident")] == "–"

    # DELETE unloads it: the view no longer lists it anywhere
    assert admin(base, "DELETE", "/admin/adapters/alpha-lora", key=keys["alpha"]).status_code == 200
    after = admin(base, "GET", "/admin/adapters/placement").json()["data"]
    assert [(e["backend"], e["adapters"]) for e in after] == [("e1", []), ("e2", [])]
    require_service(have_chromium, "chromium (apt-get install chromium; scripts/bootstrap.sh installs it as root)")
