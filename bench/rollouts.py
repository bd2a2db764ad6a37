"""Canary rollback (issue 38): how fast a regressing arm of a weighted alias is rolled back to weight 0.

A real gateway (one worker) in front of a simulated fleet of two engines (profile vllm-default): engine v1 serves
`support-v1` (weight 90, stable), engine v2 `support-v2` (the canary, weight 10); both fail 2% of requests from
the start. Streaming chat requests from distinct end users (`user` field) run at a fixed concurrency; after a
warm-up the canary regresses, through the simulator's /sim/faults:

  errors x5   engine v2's error rate goes from 2% to 10%
  TTFT x5     engine v2 runs every step 5x slower (slow_factor 5)

The table gives, per regression: detection time (regression start to the rollback's timestamp in the live
state), time to weight 0 as an admin sees it (GET /admin/aliases, polled every 50 ms), the requests the bad arm
was chosen for after the regression started and before weight 0, how many of those the canary failed (the
client got the fallback arm's answer), and requests the clients saw fail.

Usage: python bench/rollouts.py [--concurrency 8] [--warmup 5] [--timeout 60] [--window 30] [--min-requests 20]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.sim.fleet import FleetProcess  # noqa: E402
from tests.support.procs import free_port, start_gateway  # noqa: E402

KEY, ADMIN = "bench-rollouts-key-0123456789", "bench-rollouts-admin-0123456789"
BASE_ERR = 0.02
REGRESSIONS = {"errors x5": {"error_rate": BASE_ERR * 5}, "TTFT x5": {"slow_factor": 5.0}}


def gateway_config(port: int, e1: dict[str, Any], e2: dict[str, Any], tmp: Path, args: argparse.Namespace) -> dict:
    def backend(name: str, e: dict[str, Any], model: str) -> dict[str, Any]:
        return {"name": name, "url": e["url"], "kind": "sim", "models": [model], "model_map": {model: "sim-model"},
                "health": {"enabled": False, "failures_to_open": 1000}}

    return {"server": {"host": "127.0.0.1", "port": port},
            "backends": [backend("v1-engine", e1, "support-v1"), backend("v2-engine", e2, "support-v2")],
            "aliases": [{"name": "support", "targets": [{"model": "support-v2", "weight": 10},
                                                        {"model": "support-v1", "weight": 90}],
                         "rollback": {"window_s": args.window, "min_requests": args.min_requests}}],
            "keys": [{"key": KEY, "tenant": "bench", "name": "k"}], "admin": {"key": ADMIN},
            "policy": {"audit_path": str(tmp / "audit.jsonl")}, "identity": {"sqlite_path": str(tmp / "id.db")}}


async def one(c: httpx.AsyncClient, user: str, log: list[tuple[float, str, bool]]) -> None:
    body = {"model": "support", "stream": True, "max_tokens": 8, "user": user,
            "messages": [{"role": "user", "content": f"hello from {user}"}]}
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode(errors="replace")
            ok = r.status_code == 200 and text.rstrip().endswith("[DONE]") and '"error"' not in text
            log.append((time.time(), r.headers.get("x-gateway-rollout-arm", "?"), ok))
    except httpx.HTTPError:
        log.append((time.time(), "?", False))


async def drive(base: str, stop: asyncio.Event, log: list[tuple[float, str, bool]], conc: int) -> None:
    n = 0

    async def worker(w: int) -> None:
        nonlocal n
        async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=30) as c:
            while not stop.is_set():
                n += 1
                await one(c, f"user-{n}", log)

    await asyncio.gather(*(worker(w) for w in range(conc)))


async def scenario(name: str, fault: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fleet = FleetProcess(["--engines", "2", "--profile", "vllm-default", "--base-port", "0",
                              "--error-rate", str(BASE_ERR)], tmp / "fleet.json")
        e1, e2 = fleet.start()["engines"]
        port = free_port()
        (tmp / "gw.yaml").write_text(yaml.safe_dump(gateway_config(port, e1, e2, tmp, args)))
        gw, _ = start_gateway(tmp / "gw.yaml")
        base = f"http://127.0.0.1:{port}"
        try:
            stop, log = asyncio.Event(), []
            load = asyncio.create_task(drive(base, stop, log, args.concurrency))
            await asyncio.sleep(args.warmup)
            async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {ADMIN}"}) as adm:
                t0 = time.time()
                await adm.post(e2["url"].removesuffix("/v1") + "/sim/faults", json=fault)
                seen = None
                while time.time() - t0 < args.timeout:
                    v = (await adm.get("/admin/aliases/support")).json()
                    if v["arms"][0]["weight"] == 0.0:
                        seen = time.time()
                        break
                    await asyncio.sleep(0.05)
            stop.set()
            await load
        finally:
            gw.stop()
            fleet.stop()
    end = seen or time.time()
    bad = [e for e in log if t0 <= e[0] <= end and e[1] == "support-v2"]
    return {"regression": name, "detected_s": (v["updated_at"] - t0) if seen else None,
            "weight0_s": (seen - t0) if seen else None, "bad_arm_requests": len(bad),
            "client_failures": sum(1 for e in log if t0 <= e[0] <= end and not e[2]),
            "after_rps": len([e for e in log if t0 <= e[0] <= end]) / max(1e-9, end - t0),
            "reason": v["arms"][0]["rolled_back"] if seen else "not rolled back"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--min-requests", type=int, default=20)
    args = ap.parse_args()
    rows = [asyncio.run(scenario(n, f, args)) for n, f in REGRESSIONS.items()]
    print(f"canary 10% / stable 90%, both {BASE_ERR:.0%} errors at start, concurrency {args.concurrency}, "
          f"window {args.window:g} s, min_requests {args.min_requests}")
    print(f"{'regression':<11} {'detected s':>10} {'weight 0 s':>10} {'bad-arm reqs':>12} {'client fails':>12} "
          f"{'req/s':>6}  reason")
    for r in rows:
        def f(x: float | None) -> str:
            return f"{x:.2f}" if x is not None else "-"
        print(f"{r['regression']:<11} {f(r['detected_s']):>10} {f(r['weight0_s']):>10} {r['bad_arm_requests']:>12} "
              f"{r['client_failures']:>12} {r['after_rps']:>6.0f}  {r['reason']}")


if __name__ == "__main__":
    main()
