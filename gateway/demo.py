"""`gateway demo`: the gateway on its embedded defaults in front of a simulated, heterogeneous vLLM fleet.

Starts the simulator (4 engines: H200- and L40S-class, in DE, SE, FI and US), writes a gateway config from the
fleet's manifest (SQLite state, in-process policy engine with the packaged copy of policies/tenants.yaml, or
`--policy FILE`), starts the gateway and prints the URL, demo keys and a curl line. Ctrl-C stops everything.
Everything it reads is package data and everything it writes is under `--dir`, so an installed wheel runs it
from any directory.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Callable
from importlib import resources
from pathlib import Path

import httpx
import yaml

# package data; policies/tenants.yaml is the same file (tests/packaging/test_package_data.py keeps them equal)
EXAMPLE_POLICY = resources.files("gateway.policy") / "example_policy.yaml"
LOCATIONS = ["DE", "SE", "FI", "US"]
PROFILES = ["h200-8b", "l40s-8b"]


def demo_config(manifest: dict, port: int, policy_file: Path) -> dict:
    backends = []
    for e in manifest["engines"]:
        loc = e.get("location") or {"country": "DE"}
        backends.append({
            "name": e["name"], "kind": "vllm", "url": e["url"], "kv_events": e["kv_events"], "replay": e["replay"],
            "metrics": e.get("metrics"), "models": ["sim-model"], "location": {"country": loc.get("country", "DE")},
            "retention": "zero", "capabilities": ["chat", "completions", "embeddings", "rerank", "score"],
        })
    return {
        "server": {"host": "127.0.0.1", "port": port},
        "backends": backends,
        "aliases": [{"name": "default", "targets": ["sim-model"]}],
        "keys": [
            {"name": "demo", "key_env": "GATEWAY_DEMO_KEY", "tenant": "demo", "team": "search"},
            {"name": "demo-eea", "key_env": "GATEWAY_DEMO_EEA_KEY", "tenant": "acme-eu",
             "labels": {"residency": "eea"}},
        ],
        "admin": {"key_env": "GATEWAY_ADMIN_KEY"},
        "policy": {"files": [str(policy_file)], "audit_path": "audit.jsonl"},
        "identity": {"sqlite_path": "gateway.db"},
        "budgets": {"sqlite_path": "budgets.db"},
        "observability": {"json_logs": False, "log_level": "warning"},
    }


def run_demo(args: argparse.Namespace) -> int:
    work = Path(args.dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    manifest_path = work / "fleet.json"
    if manifest_path.exists():
        manifest_path.unlink()
    n = args.engines
    locs = ",".join(LOCATIONS[i % len(LOCATIONS)] for i in range(n))
    profiles = ",".join(PROFILES[i % len(PROFILES)] for i in range(n))
    env = dict(os.environ)
    env.setdefault("GATEWAY_DEMO_KEY", "gw-demo-" + secrets.token_urlsafe(12))
    env.setdefault("GATEWAY_DEMO_EEA_KEY", "gw-demo-eea-" + secrets.token_urlsafe(12))
    env.setdefault("GATEWAY_ADMIN_KEY", "gw-admin-" + secrets.token_urlsafe(12))
    # handlers first: a Ctrl-C or SIGTERM while the fleet or the gateway is starting must still stop both (with
    # the default handlers a SIGTERM then killed this process and orphaned its children, which run in their own
    # sessions)
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sim = subprocess.Popen([sys.executable, "-m", "backends.sim", "--engines", str(n), "--profile", profiles,
                            "--locations", locs, "--base-port", str(args.sim_base_port), "--manifest",
                            str(manifest_path)], cwd=work, start_new_session=True)
    gw = None
    try:
        started = _wait_started(lambda: manifest_path.exists(), sim, stop, "the simulated fleet", 0.1)
        if started is not None:
            return started
        import json

        manifest = json.loads(manifest_path.read_text())
        cfg_path = work / "gateway.yaml"
        if args.policy:
            policy_file = Path(args.policy).resolve()
        else:  # a real file next to the config, so the gateway (and its reload) reads it like any policy
            policy_file = work / "policy.yaml"
            policy_file.write_text(EXAMPLE_POLICY.read_text(encoding="utf-8"), encoding="utf-8")
        cfg_path.write_text(yaml.safe_dump(demo_config(manifest, args.port, policy_file), sort_keys=False))
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path)], cwd=work,
                              env=env, start_new_session=True)
        base = f"http://127.0.0.1:{args.port}"
        started = _wait_started(lambda: _ready(base), gw, stop, "the gateway", 0.2)
        if started is not None:
            return started
        _banner(base, cfg_path, n, profiles, locs, env)
        while not stop["now"] and gw.poll() is None and sim.poll() is None:
            time.sleep(0.2)
        return 0
    finally:
        for p in (gw, sim):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (gw, sim):
            if p is not None:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _wait_started(up: Callable[[], bool], proc: "subprocess.Popen[bytes]", stop: dict[str, bool], what: str,
                  poll_s: float) -> int | None:
    """Wait up to 30 s until `up()`; None when it is, else the exit code: 0 when stopped (Ctrl-C, SIGTERM),
    1 when the process died or did not come up in time."""
    deadline = time.monotonic() + 30
    while not up():
        if stop["now"]:
            return 0
        if proc.poll() is not None or time.monotonic() > deadline:
            print(f"error: {what} did not start", file=sys.stderr)
            return 1
        time.sleep(poll_s)
    return None


def _banner(base: str, cfg_path: Path, n: int, profiles: str, locs: str, env: dict[str, str]) -> None:
    key = env["GATEWAY_DEMO_KEY"]
    print(f"""
Gateway ready at {base}/v1   (config: {cfg_path})
  fleet:      {n} simulated vLLM engines ({profiles}) in {locs}
  demo key:   {key}          (tenant demo, team search)
  EEA key:    {env['GATEWAY_DEMO_EEA_KEY']}   (tenant acme-eu, residency=eea: never leaves the EEA)
  admin key:  {env['GATEWAY_ADMIN_KEY']}

  curl {base}/v1/chat/completions -H 'authorization: Bearer {key}' -H 'content-type: application/json' \\
       -d '{{"model": "sim-model", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  Evidence for a request: curl {base}/admin/decisions/<x-request-id> -H 'authorization: Bearer {env['GATEWAY_ADMIN_KEY']}'
  Fleet view:             curl {base}/admin/fleet -H 'authorization: Bearer {env['GATEWAY_ADMIN_KEY']}'
Ctrl-C stops everything.
""", flush=True)
