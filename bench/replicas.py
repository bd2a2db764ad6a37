"""Replicas benchmark (issue 24): 1, 2 and 4 gateway replicas behind a round-robin nginx, peer bus on vs off.

Fleet and load are the live routing benchmark's (bench/routing_live.py): one `backends.sim` process with four
vllm-default engines (chunk budget 2048, speeds 1x, 1.5x, 2x, 0.75x), the shared-prefix ladder (24 groups x 8
users, Poisson at each --ladder rate for --step-s seconds) and the overload bursts (--burst-cycles cycles of
--burst-s at 0.6x then 2x the fleet's prefill capacity, unique --burst-tokens prompts, x-ttft-slo-ms 600 (40%)
or 2500 (60%)). Each replica is a `gateway serve` with every routing default; "peers on" puts them on one Redis
channel (routing.peers, docs/scale_out.md#replicas), "off" is each on its own view (routing.peers.mode: off).
nginx (Debian's nginx-light: `apt-get install nginx-light`) balances round robin over keep-alive upstreams.
Caches are reset and replicas restarted before each configuration, so every one starts cold the same way.

Printed: one table, per configuration the ladder's p90 TTFT and the bursts' goodput (requests whose TTFT met
their target per second), and each relative to one replica. On a 2-core machine the N replicas, nginx, the
simulator and the load generator share the cores: CPU contention is part of what it measures.
Usage: python -m bench.replicas [--replicas 1,2,4] [--step-s 4] [--ladder 8,16] [--burst-cycles 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench import routing_live as live
from bench.routing import free_port

REDIS = "redis://127.0.0.1:6379/0"


def replica_config(tmp: Path, manifest: dict, port: int, i: int, peers: str | None) -> Path:
    d = tmp / f"gw-{port}"
    d.mkdir(parents=True, exist_ok=True)
    backends = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                 "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                 "location": {"country": "DE"}, "timeouts": {"first_token_s": 60, "total_s": 120}}
                for e in manifest["engines"]]
    routing = {"peers": {"mode": "redis", "redis_url": REDIS, "channel": peers} if peers else {"mode": "off"}}
    doc = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
           "keys": [{"key": live.KEY, "tenant": "bench"}], "admin": {"key": live.ADMIN}, "routing": routing,
           "policy": {"audit_path": str(d / "audit.jsonl")}, "data_dir": str(d / "var"),
           "identity": {"sqlite_path": str(d / "gw.db")},
           "budgets": {"sqlite_path": str(d / "budgets.db"), "spool_path": str(d / "spool.jsonl")},
           "observability": {"log_level": "warning"}}
    cfg = d / "gateway.yaml"
    cfg.write_text(json.dumps(doc))
    return cfg


def nginx_conf(tmp: Path, port: int, upstreams: list[int]) -> Path:
    d = tmp / f"nginx-{port}"
    d.mkdir(parents=True, exist_ok=True)
    servers = "".join(f"    server 127.0.0.1:{p};\n" for p in upstreams)
    conf = d / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_buffer_size 4m;  # bodies stay in memory: the worker (www-data under a root master) cannot
  client_max_body_size 16m;    # write the private temp directory
  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
  upstream gateways {{
{servers}    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 120s;
    }}
  }}
}}
""")
    return conf


def wait_ok(url: str, timeout: float = 60.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


async def one(tmp: Path, manifest: dict, n: int, peers: bool, args: argparse.Namespace,
              sched: list[tuple[float, float]]) -> dict:
    """Start n replicas (+ nginx), run ladder then bursts through nginx, stop them; client-side results."""
    channel = f"bench-peers:{uuid.uuid4().hex[:8]}" if peers else None
    ports = [free_port() for _ in range(n)]
    procs = [live.start([sys.executable, "-m", "gateway", "serve", "--config",
                         str(replica_config(tmp, manifest, p, i, channel))], tmp / f"gw-{p}.log")
             for i, p in enumerate(ports)]
    lb_port = free_port()
    lb = live.start(["nginx", "-c", str(nginx_conf(tmp, lb_port, ports))], tmp / f"nginx-{lb_port}.log")
    base = f"http://127.0.0.1:{lb_port}"
    out: list[dict] = []
    try:
        for p in ports:
            wait_ok(f"http://127.0.0.1:{p}/healthz")
        wait_ok(base + "/healthz")
        await asyncio.sleep(1.0)  # first metrics scrape; with peers, the first heartbeats
        async with httpx.AsyncClient() as c:
            for e in manifest["engines"]:
                await c.post(e["url"].removesuffix("/v1") + "/reset_prefix_cache")
        await live.ladder(base, args.ladder, args.step_s, out, seed=7)
        await asyncio.sleep(1.0)
        await live.bursts(base, sched, args.burst_tokens, out, seed=99)
        heard = None
        if peers:
            h = {"authorization": f"Bearer {live.ADMIN}"}
            snap = httpx.get(f"http://127.0.0.1:{ports[0]}/admin/routing", headers=h, timeout=10).json()
            heard = {"peers": len(snap["peers"]["peers"]), "events_in": snap["peers"]["events_in"],
                     "events_out": snap["peers"]["events_out"]}
    finally:
        live.stop(lb)
        for p in procs:
            live.stop(p)
    lad = [r["ttft_ms"] for r in out if r["rid"].startswith("ladder") and r["ttft_ms"] is not None]
    lad_fail = sum(1 for r in out if r["rid"].startswith("ladder") and r["status"] != 200)
    bur = [r for r in out if r["rid"].startswith("burst")]
    met = sum(1 for r in bur if r["status"] == 200 and r["ttft_ms"] is not None and r["ttft_ms"] <= r["slo"])
    dur = 2 * args.burst_cycles * args.burst_s
    return {"n": n, "peers": peers, "ladder_p90_ms": live.pct(lad, 0.9), "ladder_p50_ms": live.pct(lad, 0.5),
            "ladder_n": len(lad), "ladder_failed": lad_fail, "burst_n": len(bur), "burst_met": met,
            "goodput_rps": met / dur, "refused": sum(1 for r in bur if r["status"] == 429), "bus": heard}


async def run(args: argparse.Namespace) -> list[dict]:
    if shutil.which("nginx") is None:
        raise SystemExit("nginx not found: apt-get install -y nginx-light")
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    mpath = tmp / "fleet.json"
    fleet = live.start([sys.executable, "-m", "backends.sim", "--engines", "4", "--profile", live.PROFILE,
                        "--base-port", "0", "--max-num-batched-tokens", str(live.BUDGET), "--manifest", str(mpath),
                        "--locations", "DE"], tmp / "fleet.log")
    results = []
    try:
        for _ in range(300):
            if mpath.exists():
                break
            time.sleep(0.05)
        manifest = json.loads(mpath.read_text())
        async with httpx.AsyncClient() as c:
            for e, speed in zip(manifest["engines"], live.SPEEDS):
                (await c.post(e["url"].removesuffix("/v1") + "/sim/faults", json={"slow_factor": 1.0 / speed}))\
                    .raise_for_status()
        sched = live.burst_schedule(args.burst_cycles, args.burst_s, args.burst_tokens, seed=99)
        for n in args.replicas:
            for peers in ((False,) if n == 1 else (False, True)):
                r = await one(tmp, manifest, n, peers, args, sched)
                print(json.dumps(r), file=sys.stderr, flush=True)
                results.append(r)
                await asyncio.sleep(2.0)  # the engines drain
    finally:
        live.stop(fleet)
    return results


def table(results: list[dict], args: argparse.Namespace) -> str:
    base = next(r for r in results if r["n"] == 1)
    lines = [f"\n## Replicas behind round-robin nginx: ladder {args.ladder} req/s x {args.step_s:g} s, "
             f"bursts {args.burst_cycles} x ({args.burst_s:g} s at 0.6x + {args.burst_s:g} s at 2x capacity, "
             f"{args.burst_tokens}-token prompts)\n",
             "| replicas | peer bus | ladder p50 TTFT ms | ladder p90 TTFT ms | p90 vs 1 | burst goodput req/s | "
             "goodput vs 1 | burst met/sent | refused |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        p90 = r["ladder_p90_ms"]
        rel = f"{p90 / base['ladder_p90_ms']:.2f}x" if p90 and base["ladder_p90_ms"] else "-"
        grel = f"{r['goodput_rps'] / base['goodput_rps']:.2f}x" if base["goodput_rps"] else "-"
        lines.append(f"| {r['n']} | {'on' if r['peers'] else 'off'} | {live.f(r['ladder_p50_ms'], '{:.0f}')} | "
                     f"{live.f(p90, '{:.0f}')} | {rel} | {r['goodput_rps']:.1f} | {grel} | "
                     f"{r['burst_met']}/{r['burst_n']} | {r['refused']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="1,2,4", help="comma-separated replica counts")
    ap.add_argument("--ladder", default="8,16", help="ladder rates, req/s")
    ap.add_argument("--step-s", type=float, default=4.0, help="seconds per ladder step")
    ap.add_argument("--burst-cycles", type=int, default=2)
    ap.add_argument("--burst-s", type=float, default=2.0)
    ap.add_argument("--burst-tokens", type=int, default=3000)
    args = ap.parse_args()
    args.replicas = [int(x) for x in args.replicas.split(",")]
    args.ladder = [float(x) for x in args.ladder.split(",")]
    print(table(asyncio.run(run(args)), args))


if __name__ == "__main__":
    main()
