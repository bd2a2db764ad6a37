"""The dashboard's unit-economics section in headless Chromium, in front of a gateway process and a sim fleet
process: the engines' utilisation and apportioned seconds, cost and charge per 1M tokens per engine and model,
margin, savings and waste render with the data /admin/ui/data serves, and the bar chart has one bar pair per
engine x model."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.conftest import require_service
from tests.observability.conftest import ADMIN_KEY, KEY, gateway_config
from tests.observability.test_dashboard import CHROMIUM, DomTable, chromium, fmt
from tests.support.procs import free_port, start_gateway

pytestmark = pytest.mark.e2e


def settled(base: str) -> dict:
    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    prev = None
    for _ in range(40):
        d = httpx.get(base + "/admin/ui/data", headers=h, timeout=5).json()["cost"]
        if d == prev:
            return d
        prev = d
        time.sleep(0.3)
    raise AssertionError("cost data never settled")


def test_unit_economics_render_in_headless_chromium(tmp_path: Path) -> None:
    have = os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)
    require_service(have, "chromium (apt-get install chromium; scripts/bootstrap.sh installs it as root)")
    fleet = FleetProcess(["--engines", "2", "--profile", "tiny", "--base-port", "0"], tmp_path / "fleet.json")
    manifest = fleet.start()
    gw = None
    try:
        port = free_port()
        cfg = gateway_config(tmp_path, manifest["engines"])
        cfg["server"]["port"] = port
        cfg["observability"] = {"json_logs": True, "log_level": "warning"}
        cfg["budgets"]["prices"] = {"sim-model": {"input": 2.0, "output": 8.0}}
        cfg["cost"] = {"default": {"gpu_hour": 4.0}}
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gw, _ = start_gateway(tmp_path / "gateway.yaml")
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=20) as c:
            for i in range(8):
                r = c.post("/v1/chat/completions", json={
                    "model": "sim-model", "max_tokens": 6, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"cost question {i % 2} " * 30}]})
                assert r.status_code == 200
        data = settled(base)
        dom = chromium(f"{base}/admin/ui#key={ADMIN_KEY}", tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-3000:]
        assert settled(base) == data, "cost values moved while the page was loading"
        page = DomTable()
        page.feed(dom.stdout.decode())
        assert data["by_model"] and data["engines"]
        assert sum(m["requests"] for m in data["by_model"]) == 8
        for name, e in data["engines"].items():
            assert e["charged_s"] > 0 and e["charged_s"] == pytest.approx(e["busy_s"], rel=1e-3)
            assert page.cells[(f"cost:{name}", "charged_s")] == fmt(e["charged_s"], 3)
            assert page.cells[(f"cost:{name}", "busy_s")] == fmt(e["busy_s"], 3)
            util = page.cells[(f"cost:{name}", "utilisation")]  # busy / time since the meter started
            assert util.endswith("%") and 0 < float(util.rstrip("%")) <= 100
        for m in data["by_model"]:
            row = f"cost:{m['backend']}:{m['model']}"
            assert m["cost_per_1m_tokens"] > 0 and m["charged_per_1m_tokens"] > 0
            assert page.cells[(row, "cost_per_1m_tokens")] == fmt(m["cost_per_1m_tokens"], 4)
            assert page.cells[(row, "charged_per_1m_tokens")] == fmt(m["charged_per_1m_tokens"], 4)
            assert page.cells[(row, "margin")] == fmt(m["margin"], 6)
            assert page.cells[(row, "gpu_seconds")] == fmt(m["gpu_seconds"], 3)
            assert page.cells[(row, "categories")] == f"served: {m['requests']}"
        chart = page.attrs["cost-chart-svg"]
        assert int(chart["data-bars"]) == len(data["by_model"])
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
