"""End to end, two gateway replicas on one PostgreSQL identity store and one simulated engine that loads LoRA
adapters at run time with a single slot (`--max-loras 1`): the replicas never fight over the slot. While replica A
streams from adapter `a`, replica B's request for adapter `b` is refused with a retryable 503 instead of unloading
`a` under A's stream (B reads A's hold from the shared `adapter_holds` table); A's stream completes; once it ended
B loads `b` (unloading the now idle `a`). A DELETE on B of an adapter A placed unloads it from the engine.
"""
from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import httpx
import openai
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.conftest import require_service
from tests.e2e.test_revocation_e2e import PG_DSN, _pg, _pg_reachable
from tests.support.lora_stack import dynamic_backends, engine_roots
from tests.support.procs import audit_record, free_port, start_gateway

pytestmark = pytest.mark.e2e

ADMIN = "replica-placement-admin-0123456789"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    require_service(_pg_reachable(), f"PostgreSQL at {PG_DSN}")
    tmp = tmp_path_factory.mktemp("adapter-replicas")
    schema = f"e2e_lora_{uuid.uuid4().hex[:12]}"
    fleet = FleetProcess(["--engines", "1", "--profile", "vllm-default", "--base-port", "0", "--enable-lora",
                          "--max-loras", "1", "--lora-load-ms", "50"], tmp / "fleet.json")
    man = fleet.start()
    procs = []
    try:
        for i in range(2):
            port = free_port()
            cfg = {"server": {"host": "127.0.0.1", "port": port, "workers": 1},
                   "backends": dynamic_backends(man, max_loras=1),
                   "admin": {"key": ADMIN},
                   "identity": {"store": "postgres", "postgres_dsn": PG_DSN, "postgres_schema": schema},
                   "policy": {"audit_path": str(tmp / f"audit-{i}.jsonl")},
                   "budgets": {"sqlite_path": str(tmp / f"budgets-{i}.db"),
                               "spool_path": str(tmp / f"spool-{i}.jsonl")},
                   "data_dir": str(tmp / f"var-{i}")}
            path = tmp / f"gw-{i}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            gw, _ = start_gateway(path)
            procs.append((gw, f"http://127.0.0.1:{port}"))
        yield {"a": procs[0][1], "b": procs[1][1], "engine": engine_roots(man)["e1"]}
    finally:
        for p, _ in procs:
            p.stop()
        fleet.stop()
        _pg(lambda c: c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


def resident(root: str) -> set[str]:
    return {c["id"] for c in httpx.get(root + "/v1/models", timeout=5).json()["data"] if c.get("parent")}


def test_two_replicas_never_unload_what_the_other_streams_from(replicas):
    a, b, engine = replicas["a"], replicas["b"], replicas["engine"]
    assert admin(a, "POST", "/admin/tenants", {"id": "alpha"}).status_code == 201
    assert admin(a, "PUT", "/admin/tenants/alpha/adapter_sources", {"prefixes": ["/w/"]}).status_code == 200
    for n in ("ad-a", "ad-b"):
        r = admin(a, "POST", "/admin/adapters", {"name": n, "base_model": "base", "source": f"/w/{n}",
                                                 "owner": {"tenant": "alpha"}})
        assert r.status_code == 201, r.text
    key = admin(a, "POST", "/admin/keys", {"tenant": "alpha"}).json()["key"]
    ca = openai.OpenAI(base_url=a + "/v1", api_key=key, max_retries=0, timeout=60)
    cb = openai.OpenAI(base_url=b + "/v1", api_key=key, max_retries=0, timeout=60)

    def stream() -> str:
        out = []
        for ch in ca.chat.completions.create(model="ad-a", messages=MSG, max_tokens=150, stream=True):
            if ch.choices and ch.choices[0].delta.content:
                out.append(ch.choices[0].delta.content)
        return "".join(out)

    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream)
        deadline = time.monotonic() + 20
        while resident(engine) != {"ad-a"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(engine) == {"ad-a"}
        with pytest.raises(openai.APIStatusError) as e:  # B may not unload A's adapter under its stream
            cb.chat.completions.create(model="ad-b", messages=MSG, max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "adapter_slots_busy"  # type: ignore[index]
        assert resident(engine) == {"ad-a"}
        assert not fut.done(), "the stream was still running when B was refused"
        assert fut.result(timeout=60), "A's stream completed"

    deadline = time.monotonic() + 10  # A publishes its release in the background: B sees it within moments
    while True:
        try:
            raw = cb.chat.completions.with_raw_response.create(model="ad-b", messages=MSG, max_tokens=1)
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, e
            time.sleep(0.1)
    ad = audit_record(b, raw.headers["x-request-id"], ADMIN)["evidence"]["adapter"]
    assert ad["loaded"] is True and ad["engine"] == "e1"
    assert resident(engine) == {"ad-b"}

    # B placed ad-b; a DELETE on A unloads it from the engine (A reads the engine afresh)
    assert admin(a, "DELETE", "/admin/adapters/ad-b").status_code == 200
    assert resident(engine) == set()
