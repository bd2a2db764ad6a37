"""DNS discovery with real processes and the real resolver: a backend `discovery: {dns: localhost}` becomes the
backend `eng-127-0-0-1` at start, which serves a chat completion (gateway/discovery.py)."""
from __future__ import annotations

import httpx
import pytest

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e


def test_a_discovered_replica_serves(tmp_path):
    up, up_port = start_upstream(tmp_path)
    port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}, readiness: all_models}}
backends:
  - name: eng
    kind: openai
    url: http://engines.invalid:1/v1
    models: [mock-model]
    location: {{country: DE}}
    discovery: {{dns: localhost, port: {up_port}, refresh_s: 0.5}}
keys:
  - key_env: GATEWAY_KEY
    tenant: demo
""")
    gw, _ = start_gateway(cfg, env={"GATEWAY_KEY": "gw-disc-key-0123456789"}, ready_path="/readyz")
    base = f"http://127.0.0.1:{port}"
    try:
        ready = httpx.get(base + "/readyz", timeout=2).json()
        assert ready["models"] == {"mock-model": {"healthy_backends": ["eng-127-0-0-1"], "backends": 1}}, ready
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": "Bearer gw-disc-key-0123456789"},
                       json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 200, r.text
    finally:
        gw.stop()
        up.stop()
