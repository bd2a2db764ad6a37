"""A real stack for resilience tests: simulated engines (child process), a local partner upstream and the
gateway process, with the gateway's config written from the fleet manifest."""
from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from backends.sim.fleet import FleetProcess, manifest_backends
from tests.support.procs import free_port, start_gateway, start_upstream

GW_KEY = "resilience-key-0123456789"
EEA_KEY = "resilience-eea-key-0123456789"
ADMIN_KEY = "resilience-admin-key-0123456789"


def start_fleet_proc(tmp: Path, n: int, locations: str, extra: list[str] | None = None) -> tuple[FleetProcess, dict]:
    fp = FleetProcess(["--engines", str(n), "--profile", "tiny", "--base-port", "0", "--locations", locations,
                       *(extra or [])], tmp / "manifest.json")
    return fp, fp.start()


def engine_root(manifest: dict, i: int) -> str:
    return manifest["engines"][i]["url"].rstrip("/").removesuffix("/v1")


def set_faults(manifest: dict, i: int, **faults: Any) -> dict:
    r = httpx.post(engine_root(manifest, i) + "/sim/faults", json=faults, timeout=5)
    r.raise_for_status()
    return r.json()


def wait_engines_up(manifest: dict, timeout: float = 15.0) -> None:
    """Every engine of the manifest answers /health again (after a crash with restart_after_s)."""
    deadline = time.monotonic() + timeout
    for i in range(len(manifest["engines"])):
        while True:
            try:
                if httpx.get(engine_root(manifest, i) + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {i} did not come back within {timeout} s")
            time.sleep(0.1)


def write_config(tmp: Path, backends: list[dict], **sections: Any) -> Path:
    port = free_port()
    cfg = {"server": {"host": "127.0.0.1", "port": port, "graceful_shutdown_s": 10},
           "backends": backends,
           "keys": [{"key": GW_KEY, "tenant": "acme", "name": "plain"},
                    {"key": EEA_KEY, "tenant": "eea-co", "name": "eea", "labels": {"residency": "eea"}}],
           "admin": {"key": ADMIN_KEY},
           "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
           "identity": {"sqlite_path": str(tmp / "gateway.db")},
           "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                       "ledger_flush_s": 0.05},
           "data_dir": str(tmp / "var")}
    for k, v in sections.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    if not (tmp / "policy.yaml").exists():
        (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
            {"id": "eea-stays-in-eea", "match": {"labels": {"residency": "eea"}},
             "require": {"jurisdiction": "EEA", "retention": "zero"}}]}))
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def sim_backends(manifest: dict, **overrides: Any) -> list[dict]:
    out = []
    for b in manifest_backends(manifest, kind="sim"):
        b.setdefault("location", {"country": "DE"})
        b["retention"] = "zero"
        b["capabilities"] = ["chat", "completions"]
        b["context_window"] = 4096
        b.update(overrides)
        out.append(b)
    return out


def audit(tmp: Path) -> dict[str, dict]:
    p = tmp / "audit.jsonl"
    out = {}
    if p.exists():
        # complete lines only: the recorder may be mid-write of the last one (a half line is not JSON yet)
        for line in p.read_text().split("\n")[:-1]:
            if line.strip():
                rec = json.loads(line)
                out[rec["request_id"]] = rec
                if rec.get("client_request_id"):  # tests send their own x-request-id and look records up by it
                    out[rec["client_request_id"]] = rec
    return out


def wait_audit(tmp: Path, ids: set[str], timeout: float = 5.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        recs = audit(tmp)
        if ids <= set(recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


def ledger_rows(tmp: Path) -> list[tuple]:
    p = tmp / "budgets.db"
    if not p.exists():
        return []
    db = sqlite3.connect(p)
    try:
        # keyed by the client's x-request-id when it sent one (tests do), else the gateway's own id
        return db.execute("select coalesce(client_request_id, request_id), total_tokens, backend, status "
                          "from budget_ledger").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        db.close()


__all__ = ["start_gateway", "start_upstream", "free_port"]
