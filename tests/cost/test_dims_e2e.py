"""End to end (`python -m gateway serve` in front of a simulated fleet process, the openai SDK): GPU-seconds per
adapter and per rollout arm.

One sim engine loads LoRA adapters at run time; tenant acme registers `acme-lora` (placed on it). The weighted
alias `support` splits between arms `v1` and `v2` and copies every answered request to the shadow `v3` (charged
to tenant `shadow-ops`). Requests go to the adapter, to the alias (distinct users, so both arms are chosen) and
to the base model. Pins: `gateway report --group-by adapter` and `--group-by arm` show the adapter's and each
arm's requests with non-zero GPU-seconds (the shadow copies in a row of their own, `support:v3 (shadow)`),
equal to the apportioned GPU-seconds of those requests' audit records; the other requests are in the empty
row, so each group-by's rows add up to the report's total; /metrics counts the same GPU-seconds per adapter and
per arm."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections import Counter

import httpx
import openai
import pytest
import yaml

from backends.sim.fleet import FleetProcess
from tests.support.procs import audit_record, free_port, start_gateway

pytestmark = pytest.mark.e2e
ADMIN = "dims-e2e-admin-0123456789"
MSG = [{"role": "user", "content": "tell me something about GPUs " * 8}]
N_ALIAS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dims")
    fleet = FleetProcess(["--engines", "1", "--profile", "tiny", "--base-port", "0", "--enable-lora",
                          "--max-loras", "2", "--lora-load-ms", "20"], tmp / "fleet.json")
    (e,) = fleet.start()["engines"]
    port = free_port()
    (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "defaults": {"allow": True}, "rules": []}))
    cfg = {"server": {"host": "127.0.0.1", "port": port, "workers": 1},
           "backends": [{"name": "e1", "url": e["url"], "kind": "sim", "models": ["base", "v1", "v2", "v3"],
                         "model_map": {m: "sim-model" for m in ("base", "v1", "v2", "v3")},
                         "health": {"enabled": False},
                         "lora": {"dynamic": True, "max_loras": 2, "refresh_s": 3600.0}}],
           "aliases": [{"name": "support", "targets": [
               {"model": "v1", "weight": 50}, {"model": "v2", "weight": 50},
               {"model": "v3", "shadow": {"sample": 1.0, "budget_scope": "shadow-ops"}}]}],
           "admin": {"key": ADMIN},
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "id.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                       "ledger_flush_s": 0.05},
           "cost": {"default": {"gpu_hour": 3.6}},
           "data_dir": str(tmp / "var")}
    path = tmp / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw, _ = start_gateway(path)
    try:
        yield {"base": f"http://127.0.0.1:{port}", "tmp": tmp, "config": path}
    finally:
        gw.stop()
        fleet.stop()


def admin(base: str, method: str, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.request(method, base + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)


def report(stack, group: str | None) -> list[dict]:
    argv = [sys.executable, "-m", "gateway", "report", "--config", str(stack["config"]), "--format", "json"]
    out = subprocess.run(argv + (["--group-by", group] if group else []), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["groups"]


def ledger_rows(stack) -> int:
    try:
        with sqlite3.connect(stack["tmp"] / "budgets.db") as con:
            return con.execute("select count(*) from budget_ledger").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[tuple(tuple(p.split("=", 1)) for p in labels.split(","))] = float(value)
    return {tuple((k, v.strip('"')) for k, v in key): v for key, v in out.items()}


def test_report_and_metrics_give_gpu_seconds_per_adapter_and_per_arm(stack):
    base = stack["base"]
    assert admin(base, "POST", "/admin/tenants", {"id": "acme"}).status_code == 201
    assert admin(base, "PUT", "/admin/tenants/acme/adapter_sources", {"prefixes": ["/w/acme/"]}).status_code == 200
    r = admin(base, "POST", "/admin/adapters", {"name": "acme-lora", "base_model": "base", "source": "/w/acme/l1",
                                                "owner": {"tenant": "acme"}})
    assert r.status_code == 201, r.text
    key = admin(base, "POST", "/admin/keys", {"tenant": "acme"}).json()["key"]
    c = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

    def ask(model: str, **kw) -> tuple[str, dict]:
        raw = c.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=16, **kw)
        assert raw.parse().choices[0].message.content
        return raw.headers.get("x-gateway-rollout-arm", ""), audit_record(base, raw.headers["x-request-id"], ADMIN)

    adapter_recs = [ask("acme-lora")[1] for _ in range(3)]
    assert all(rec["evidence"]["adapter"]["name"] == "acme-lora" for rec in adapter_recs)
    alias = [ask("support", user=f"user-{i}") for i in range(N_ALIAS)]
    arms = Counter(arm for arm, _ in alias)
    assert set(arms) == {"v1", "v2"}  # 8 users hashed over two 50% arms: both chosen (fixed by the hash)
    plain = [ask("base")[1] for _ in range(2)]
    # every request and every shadow copy in the ledger
    want_rows = len(adapter_recs) + 2 * N_ALIAS + len(plain)
    deadline = time.monotonic() + 30
    while ledger_rows(stack) < want_rows and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ledger_rows(stack) == want_rows

    (total,) = report(stack, None)
    for dim in ("adapter", "arm"):
        groups = report(stack, dim)
        assert sum(g["requests"] for g in groups) == total["requests"] == want_rows
        # the JSON rounds each figure to 9 decimals
        assert sum(g["gpu_seconds"] for g in groups) == pytest.approx(total["gpu_seconds"], abs=1e-8)
        assert sum(g["engine_cost"] for g in groups) == pytest.approx(total["engine_cost"], abs=1e-8)
        assert sum(g["total_tokens"] for g in groups) == total["total_tokens"]
        rows = {g[dim]: g for g in groups}
        if dim == "adapter":
            assert set(rows) == {"acme-lora", None}
            a = rows["acme-lora"]
            assert a["requests"] == 3 and a["gpu_seconds"] > 0
            assert a["gpu_seconds"] == pytest.approx(sum(r["unit_cost"]["gpu_seconds"] for r in adapter_recs),
                                                     rel=1e-6)
            adapter_gpu = a["gpu_seconds"]
        else:
            assert set(rows) == {"support:v1", "support:v2", "support:v3 (shadow)", None}
            for arm, n in arms.items():
                g = rows[f"support:{arm}"]
                assert g["requests"] == n and g["gpu_seconds"] > 0 and g["total_tokens"] > 0
                assert g["gpu_seconds"] == pytest.approx(
                    sum(rec["unit_cost"]["gpu_seconds"] for a, rec in alias if a == arm), rel=1e-6)
            assert rows["support:v3 (shadow)"]["requests"] == N_ALIAS
            assert rows["support:v3 (shadow)"]["gpu_seconds"] > 0
            assert rows[None]["requests"] == len(adapter_recs) + len(plain)
            arm_gpu = {k: g["gpu_seconds"] for k, g in rows.items() if k is not None}

    text = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).text
    ad = series(text, "gateway_cost_adapter_gpu_seconds_total")
    assert ad == {(("adapter", "acme-lora"),): pytest.approx(adapter_gpu, rel=1e-6)}
    arm_series = series(text, "gateway_cost_arm_gpu_seconds_total")
    assert arm_series == {
        (("alias", "support"), ("arm", "v1"), ("shadow", "false")): pytest.approx(arm_gpu["support:v1"], rel=1e-6),
        (("alias", "support"), ("arm", "v2"), ("shadow", "false")): pytest.approx(arm_gpu["support:v2"], rel=1e-6),
        (("alias", "support"), ("arm", "v3"), ("shadow", "true")):
            pytest.approx(arm_gpu["support:v3 (shadow)"], rel=1e-6)}
