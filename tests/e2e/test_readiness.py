"""/readyz under server.readiness, with real processes: two models, one whose only backend is dead.

process (default) and any_model stay ready (one dead partner must not take every pod out of the Service);
all_models is 503. Per-model health is in the body under every mode."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    up, port = start_upstream(tmp_path_factory.mktemp("ready-up"))
    yield port
    up.stop()


def _config(tmp, up_port: int, mode: str | None) -> tuple:
    port, dead = free_port(), free_port()
    server = f"{{host: 127.0.0.1, port: {port}" + (f", readiness: {mode}}}" if mode else "}")
    cfg = tmp / "gateway.yaml"
    cfg.write_text(f"""
server: {server}
backends:
  - name: live
    kind: openai
    url: http://127.0.0.1:{up_port}/v1
    models: [live-model]
    location: {{country: DE}}
    health: {{interval_s: 0.2}}
  - name: dead
    kind: openai
    url: http://127.0.0.1:{dead}/v1
    models: [dead-model]
    location: {{country: FR}}
    health: {{interval_s: 0.2, failures_to_open: 1, open_s: 60}}
""")
    return cfg, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("mode,status", [(None, 200), ("process", 200), ("any_model", 200), ("all_models", 503)])
def test_a_dead_model_fails_readiness_only_under_all_models(upstream, tmp_path, mode, status):
    cfg, base = _config(tmp_path, upstream, mode)
    gw, _ = start_gateway(cfg)
    try:
        deadline = time.monotonic() + 15
        while True:  # until the active probe has opened the dead backend's circuit
            r = httpx.get(base + "/readyz", timeout=2)
            if r.json()["models_without_healthy_backend"] == ["dead-model"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        body = r.json()
        assert body["models_without_healthy_backend"] == ["dead-model"], body
        assert body["models"] == {"dead-model": {"healthy_backends": [], "backends": 1},
                                  "live-model": {"healthy_backends": ["live"], "backends": 1}}
        assert body["readiness"] == (mode or "process")
        assert r.status_code == status, body
        if status == 503:
            assert body["reasons"] == ["model_without_healthy_backend"] and r.headers["retry-after"]
        else:
            assert body["status"] == "ready" and body["reasons"] == []
    finally:
        gw.stop()


def test_any_model_fails_when_no_model_has_a_healthy_backend(tmp_path):
    cfg, base = _config(tmp_path, free_port(), "any_model")  # the "live" upstream is not running either
    gw, _ = start_gateway(cfg)
    try:
        deadline = time.monotonic() + 15
        while (r := httpx.get(base + "/readyz", timeout=2)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["reasons"] == ["no_model_has_a_healthy_backend"], r.json()
    finally:
        gw.stop()


@pytest.mark.parametrize("mode,status", [("closed", 503), ("open", 200)])
def test_a_failing_budget_store_fails_readiness_only_when_it_fails_closed(upstream, tmp_path, mode, status):
    """Redis down: under on_store_error closed every budgeted request is a 503, so the pod is not ready; under
    open it serves from local limits and stays ready (the store's state is in the body)."""
    port = free_port()
    (tmp_path / "budget.yaml").write_text("""
rules:
  - id: demo-budget
    match: {tenant: demo}
    budgets: [{window: minute, requests: 100}]
""")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
backends:
  - name: live
    kind: openai
    url: http://127.0.0.1:{upstream}/v1
    models: [live-model]
    location: {{country: DE}}
keys:
  - key_env: GATEWAY_KEY
    tenant: demo
policy: {{files: [budget.yaml]}}
budgets: {{store: redis, redis_url: "redis://127.0.0.1:{free_port()}/0", on_store_error: {mode}, redis_retry_s: 60}}
""")
    gw, _ = start_gateway(cfg, env={"GATEWAY_KEY": "gw-ready-key-0123456789"})
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(base + "/readyz", timeout=2).status_code == 200  # no store error seen yet
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": "Bearer gw-ready-key-0123456789"},
                       json={"model": "live-model", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == (503 if mode == "closed" else 200), r.text
        ready = httpx.get(base + "/readyz", timeout=2)
        assert ready.status_code == status, ready.json()
        assert ready.json()["stores"]["budgets"] == f"unavailable (on_store_error: {mode})"
        assert ready.json()["reasons"] == (["budget_store_unavailable"] if mode == "closed" else [])
    finally:
        gw.stop()
