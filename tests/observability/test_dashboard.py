"""/admin/ui in headless Chromium (Debian's `chromium`), in front of the simulator fleet (separate processes):
the page loads, polls /admin/ui/data with the admin key as a Bearer header, and shows the live values."""
from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import json
import os
import shutil
import struct
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.conftest import require_service
from tests.support.procs import free_port, start_gateway

from .conftest import ADMIN_KEY, KEY, TIGHT_KEY, gateway_config

pytestmark = pytest.mark.e2e
CHROMIUM = "/usr/bin/chromium"


class DomTable(HTMLParser):
    """Text of every <td data-field> keyed by its row's data-engine / data-request-id / data-budget."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[tuple[str, str], str] = {}
        self.attrs: dict[str, dict[str, str]] = {}
        self.circles: list[dict[str, str]] = []
        self._row: str | None = None
        self._field: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.attrs[a["id"]] = a
        if tag == "body":
            self.attrs["body"] = a
        if tag == "tr":
            self._row = (a.get("data-engine") or a.get("data-request-id") or a.get("data-budget")
                         or (f"flow:{a['data-flow']}" if "data-flow" in a else None))
        elif tag == "td" and self._row and "data-field" in a:
            self._field, self._text = a["data-field"], []
        elif tag == "circle":
            self.circles.append(a)

    def handle_data(self, data):
        if self._field:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._field:
            self.cells[(self._row, self._field)] = "".join(self._text).strip()
            self._field = None
        elif tag == "tr":
            self._row = None


def chromium(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1280,900",
            "--virtual-time-budget=5000", *extra, url]
    return subprocess.run(args, capture_output=True, timeout=90)


def fmt(v, d: int) -> str:
    """JavaScript's Number.prototype.toFixed: the exact binary value, ties away from zero (8048.5 -> "8049",
    where Python's format rounds ties to even: "8048")."""
    if v is None:
        return "–"
    return str(Decimal(float(v)).quantize(Decimal(1).scaleb(-d), rounding=ROUND_HALF_UP))


def tiers(b: dict) -> str:
    return ", ".join(f"{k}: {b[k]}" for k in sorted(b)) if b else "–"


def stable_data(base: str) -> dict:
    """The dashboard data once two reads 0.5 s apart agree (KV events and scrapes have settled)."""
    h = {"authorization": f"Bearer {ADMIN_KEY}"}
    prev = None
    for _ in range(40):
        d = httpx.get(base + "/admin/ui/data", headers=h, timeout=5).json()
        d.pop("generated_at")
        if d == prev:
            return d
        prev = d
        time.sleep(0.5)
    raise AssertionError("dashboard data never settled")


def test_dashboard_in_headless_chromium(tmp_path: Path) -> None:
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
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(cfg))
        gw, _ = start_gateway(tmp_path / "gateway.yaml")
        base = f"http://127.0.0.1:{port}"

        # protected: the data needs the admin credential; the page shell carries no data
        assert httpx.get(base + "/admin/ui/data").status_code == 401
        assert httpx.get(base + "/admin/ui/data", headers={"authorization": f"Bearer {KEY}"}).status_code == 403
        shell = httpx.get(base + "/admin/ui")
        assert shell.status_code == 200 and shell.headers["content-type"].startswith("text/html")

        rids = []
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=20) as c:
            for i in range(6):
                r = c.post("/v1/chat/completions", json={
                    "model": "sim-model", "max_tokens": 5, "stream": True,
                    "messages": [{"role": "user", "content": f"dashboard question {i % 3} " * 20}]})
                assert r.status_code == 200
                rids.append(r.headers["x-request-id"])
            r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {TIGHT_KEY}"},
                       json={"model": "sim-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            r = c.post("/v1/chat/completions", headers={"authorization": f"Bearer {TIGHT_KEY}"},
                       json={"model": "sim-model", "max_tokens": 900, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 429
        assert shell.text.count("req_") == 0 and not any(rid in shell.text for rid in rids)

        data = stable_data(base)
        url = f"{base}/admin/ui#key={ADMIN_KEY}"
        dom = chromium(url, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr.decode(errors="replace")[-3000:]
        html = dom.stdout.decode()
        after = stable_data(base)
        assert after == data, "live values moved while the page was loading"
        page = DomTable()
        page.feed(html)

        assert int(page.attrs["body"].get("data-polls", "0")) >= 1, html[:2000]
        assert ADMIN_KEY not in html  # the key left the address bar and is not rendered
        for e in data["engines"]:
            n = e["name"]
            assert page.cells[(n, "circuit")] == e["circuit"] == "closed"
            assert page.cells[(n, "mode")].startswith(e["mode"]) and e["mode_reason"], e  # issue 34
            assert page.cells[(n, "running")] == fmt(e["running"], 0)
            assert page.cells[(n, "waiting")] == fmt(e["waiting"], 0)
            assert page.cells[(n, "cached_blocks")] == tiers(e["cached_blocks"])
            assert page.cells[(n, "prefill_tokens_per_s")] == fmt(e["prefill_tokens_per_s"], 0)
            assert page.cells[(n, "predicted_ttft_ms")] == fmt(e["predicted_ttft_ms"], 1)
            assert page.cells[(n, "mdare")] == fmt(e["mdare"], 3)  # prediction quality per engine (issue 17d)
            assert page.cells[(n, "calibration")] == fmt(e["calibration"], 3) + " / " + fmt(e["calibration_target"], 2)
            assert e["chunk_budget_source"] in ("configured", "learned", "assumed")
            assert page.cells[(n, "chunk_budget")].startswith(fmt(e["chunk_budget"], 0))
        assert sum(sum(e["cached_blocks"].values()) for e in data["engines"]) > 0  # real KV events arrived
        assert any(e["predicted_ttft_ms"] for e in data["engines"])
        by_rid = {d["request_id"]: d for d in data["decisions"]}
        for rid in rids:
            d = by_rid[rid]
            assert d["actual_ttft_ms"] and d["predicted_ttft_ms"]
            assert page.cells[(rid, "predicted_ttft_ms")] == fmt(d["predicted_ttft_ms"], 1)
            assert page.cells[(rid, "actual_ttft_ms")] == fmt(d["actual_ttft_ms"], 1)
            assert page.cells[(rid, "backend")] == d["backend"]
        [tight] = [b for b in data["budgets"] if b["scope"] == "team" and b["window"] == "minute"]
        assert tight["tenant"] == "smallco" and tight["refused"] and tight["limit"]["tokens"] == 60
        assert page.cells[(f"team:{tight['id']}:minute", "limit")] == "tokens 60"
        # flow control: the tenants' served tokens as the gate counted them (docs/flow_control.md)
        flows = data["flow"]["flows"]
        assert data["flow"]["enabled"] and {"acme", "smallco"} <= set(flows), flows
        for name, f in flows.items():
            assert page.cells[(f"flow:{name}", "served_prompt_tokens")] == fmt(f["served_prompt_tokens"], 0)
            assert page.cells[(f"flow:{name}", "served_completion_tokens")] == fmt(f["served_completion_tokens"], 0)
        assert flows["acme"]["served_prompt_tokens"] > 0 and flows["acme"]["served_completion_tokens"] > 0
        chart = page.attrs["ttft-chart"]
        assert int(chart["data-points"]) == len(data["ttft_series"]) >= len(rids)
        actual = {c["data-request-id"]: float(c["data-value"]) for c in page.circles if c.get("class") == "actual"}
        assert {p["request_id"]: p["actual_ms"] for p in data["ttft_series"]} == actual

        shot = tmp_path / "dashboard.png"
        res = chromium(url, tmp_path, f"--screenshot={shot}")
        assert res.returncode == 0 and shot.exists(), res.stderr.decode(errors="replace")[-3000:]
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", png[16:24]) == (1280, 900)
        assert len(png) > 20_000  # a rendered page with tables and a chart, not a blank canvas
        out = os.environ.get("DASHBOARD_SCREENSHOT")
        if out:
            shutil.copy(shot, out)
            Path(out).with_suffix(".json").write_text(json.dumps(data, indent=1))
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()
