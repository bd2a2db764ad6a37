"""Hot reload: SIGHUP and POST /admin/reload swap the config snapshot without failing in-flight requests;
a broken new config is refused and the old one keeps serving."""
from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e
GW_KEY, ADMIN_KEY = "reload-key-0123456789", "reload-admin-0123456789"

CFG = """
server: {{host: 127.0.0.1, port: {gw}}}
backends:
  - name: local
    url: http://127.0.0.1:{up}/v1
    models: [mock-model{extra}]
    location: {{country: DE}}
keys:
  - {{key_env: GATEWAY_KEY, tenant: demo}}
admin: {{key_env: GATEWAY_ADMIN_KEY}}
"""


@pytest.fixture()
def stack(tmp_path):
    up, up_port = start_upstream(tmp_path)
    gw_port = free_port()
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(CFG.format(gw=gw_port, up=up_port, extra=""))
    gw, _ = start_gateway(cfg, env={"GATEWAY_KEY": GW_KEY, "GATEWAY_ADMIN_KEY": ADMIN_KEY})
    yield {"gw": gw, "base": f"http://127.0.0.1:{gw_port}", "cfg": cfg, "up_port": up_port, "gw_port": gw_port}
    gw.stop()
    up.stop()


async def _load(base: str, stop: asyncio.Event, results: list[int]) -> None:
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {GW_KEY}"}, timeout=10) as c:
        while not stop.is_set():
            stream = len(results) % 2 == 0
            body = {"model": "mock-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                    "stream": stream, "x_test_fault": "slow_chunks:0.02"}
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                text = (await r.aread()).decode()
                ok = r.status_code == 200 and (not stream or text.rstrip().endswith("[DONE]")) and "error" not in text
                results.append(200 if ok else r.status_code or 599)


async def test_reload_under_load_fails_no_request(stack):
    stop = asyncio.Event()
    results: list[int] = []
    workers = [asyncio.create_task(_load(stack["base"], stop, results)) for _ in range(8)]
    async with httpx.AsyncClient(base_url=stack["base"], timeout=10) as admin:
        for i in range(6):
            extra = ", extra-model" if i % 2 == 0 else ""
            stack["cfg"].write_text(CFG.format(gw=stack["gw_port"], up=stack["up_port"], extra=extra))
            if i % 3 == 2:
                stack["gw"].signal(signal.SIGHUP)
            else:
                r = await admin.post("/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
                assert r.status_code == 200, r.text
            await asyncio.sleep(0.3)
        stop.set()
        await asyncio.gather(*workers)
    assert len(results) > 20
    assert set(results) == {200}, results


async def test_broken_config_is_refused_and_old_keeps_serving(stack):
    async with httpx.AsyncClient(base_url=stack["base"], timeout=10) as c:
        stack["cfg"].write_text(CFG.format(gw=stack["gw_port"], up=stack["up_port"], extra="").replace(
            "url: http", "url: nope"))
        r = await c.post("/admin/reload", headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_config"
        assert "backends[0].url" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", headers={"authorization": f"Bearer {GW_KEY}"},
                         json={"model": "mock-model", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        # reload needs the admin credential, not a data-plane key
        r = await c.post("/admin/reload", headers={"authorization": f"Bearer {GW_KEY}"})
        assert r.status_code in (401, 403)
        r = await c.post("/admin/reload")
        assert r.status_code == 401


async def test_reload_adds_model(stack):
    stack["cfg"].write_text(CFG.format(gw=stack["gw_port"], up=stack["up_port"], extra=", new-model"))
    async with httpx.AsyncClient(base_url=stack["base"], timeout=10) as c:
        h = {"authorization": f"Bearer {GW_KEY}"}
        body = {"model": "new-model", "messages": [{"role": "user", "content": "x"}]}
        assert (await c.post("/v1/chat/completions", headers=h, json=body)).status_code == 404
        stack["gw"].signal(signal.SIGHUP)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if (await c.post("/v1/chat/completions", headers=h, json=body)).status_code == 200:
                break
        else:
            pytest.fail("SIGHUP reload did not take effect")
