"""What the gateway adds: direct-to-upstream vs through the gateway, side by side in one run.

Prints added latency p50/p99 at concurrency 1, 16 and 64, requests/s, and gateway CPU-seconds per 1,000
requests (and so requests/s per gateway core), streaming and not, against a fast local upstream.
Each upstream transport (aiohttp, the default, and httpx) gets its own gateway process so they are compared
in the same run. Run: .venv/bin/python bench/overhead.py [--requests 2000] [--transports aiohttp,httpx]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.procs import Proc, free_port, start_gateway, wait_http  # noqa: E402

KEY = "bench-key-0123456789abcdef"
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / CLK


async def run(url: str, n: int, conc: int, stream: bool) -> tuple[list[float], float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    lat: list[float] = []
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(limits=limits, timeout=30, headers={"authorization": f"Bearer {KEY}"}) as c:
        q = iter(range(n))

        async def worker():
            for _ in q:
                t0 = time.perf_counter()
                if stream:
                    async with c.stream("POST", url, json=body) as r:
                        async for _ in r.aiter_raw():
                            pass
                else:
                    r = await c.post(url, json=body)
                    r.read()
                assert r.status_code == 200, r.status_code
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return lat, time.perf_counter() - t0


def gateway_config(tmp: Path, name: str, port: int, up_port: int, client: str | None) -> Path:
    """The benchmarks' gateway: one fast upstream, a static key (BENCH_KEY), the full default pipeline
    (policy + evidence, SQLite identity and budgets, metrics); client None keeps the default upstream client."""
    cfg = tmp / f"{name}.yaml"
    uc = f", upstream_client: {client}" if client else ""
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}{uc}}}
backends:
  - {{name: up, url: "http://127.0.0.1:{up_port}/v1", models: [m], location: {{country: DE}}, retention: zero,
      health: {{enabled: false}}}}
keys: [{{key_env: BENCH_KEY, tenant: bench}}]
policy: {{audit_path: {tmp}/audit-{name}.jsonl}}
identity: {{sqlite_path: {tmp}/id-{name}.db}}
budgets: {{sqlite_path: {tmp}/budgets-{name}.db}}
observability: {{log_level: warning}}
""")
    return cfg


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--transports", default="native,aiohttp,httpx")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    up_port = free_port()
    up = Proc([sys.executable, "bench/fast_upstream.py", str(up_port)], tmp / "up.log")
    wait_http(f"http://127.0.0.1:{up_port}/health", proc=up.p)
    rows = []
    direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    try:
        for transport in a.transports.split(","):
            gw_port = free_port()
            cfg = gateway_config(tmp, f"gw-{transport}", gw_port, up_port, transport)
            gw, _ = start_gateway(cfg, env={"BENCH_KEY": KEY})
            try:
                via = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
                asyncio.run(run(via, 200, 8, False))  # warm up pools
                for stream in (False, True):
                    for conc in (1, 16, 64):
                        n = a.requests if conc > 1 else max(300, a.requests // 4)
                        d_lat, d_wall = asyncio.run(run(direct, n, conc, stream))
                        c0 = cpu_seconds(gw.p.pid)
                        g_lat, g_wall = asyncio.run(run(via, n, conc, stream))
                        cpu = cpu_seconds(gw.p.pid) - c0
                        rows.append((transport, ("stream" if stream else "json"), conc, n, pct(d_lat, .5),
                                     pct(g_lat, .5), pct(g_lat, .5) - pct(d_lat, .5), pct(g_lat, .99) - pct(d_lat, .99),
                                     n / d_wall, n / g_wall, cpu / n * 1000, n / cpu if cpu else float("inf")))
            finally:
                gw.stop()
    finally:
        up.stop()
    hdr = ("transport", "mode", "conc", "reqs", "direct p50 ms", "gw p50 ms", "added p50 ms", "added p99 ms", "direct rps",
           "gw rps", "gw CPU s/1k req", "req/s per gw core")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.2f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]:.2f} | "
              f"{r[8]:.0f} | {r[9]:.0f} | {r[10]:.3f} | {r[11]:.0f} |")


if __name__ == "__main__":
    main()
