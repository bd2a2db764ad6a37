"""Requests per second on one gateway core, at saturation, next to the serving stack's own floor.

bench/overhead.py divides requests by the gateway's CPU seconds while an httpx client drives it; that client
costs more CPU per request than the gateway, so on a small box the gateway's event loop is mostly idle and
every request pays for its own wake-ups. Here the server under test is pinned to one core and driven by
bench/loadgen.py (raw asyncio protocols) from the other core until that core is full, so requests/s *is*
requests per core. Four servers, each against the same fast upstream (bench/fast_upstream.py), non-streaming:

- bare ASGI proxy + aiohttp / + httpx: uvicorn (uvloop, httptools) running a raw ASGI callable that reads the
  JSON body, posts it upstream through one pooled client and relays the answer; no gateway logic. The floor
  of the stack before any gateway work.
- gateway + native / + aiohttp / + httpx: the real gateway, full pipeline (key auth, policy, budgets, routing,
  evidence), with each upstream client (`server.upstream_client`).

Rounds alternate between the servers so drift on a shared VM hits all alike. Needs >= 2 CPUs.
`--baseline DIR[:CLIENT]` adds the gateway of another checkout (e.g. `git worktree add /tmp/base <commit>`) to
the same alternation, to compare two trees side by side; `--stream` drives streaming chat instead.
Run: .venv/bin/python bench/proxy_floor.py [--rounds 3] [--seconds 6] [--connections 32] [--stream]
     [--bare-clients aiohttp,httpx] [--gateway-clients native,aiohttp,httpx] [--baseline DIR[:CLIENT]]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen import build_request, drive  # noqa: E402
from bench.overhead import KEY, cpu_seconds, gateway_config  # noqa: E402
from tests.support.procs import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bare_app(upstream: str, client: str):
    """A raw ASGI proxy: POST body -> upstream -> the upstream's status, content-type and body."""
    state: dict = {}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    if client == "aiohttp":
                        import aiohttp

                        state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
                    else:
                        import httpx

                        state["c"] = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await state["c"].close() if client == "aiohttp" else await state["c"].aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        c = state["c"]
        hdrs = {"content-type": "application/json"}
        if client == "aiohttp":
            async with c.post(upstream, data=body, headers=hdrs) as r:
                out, status, ctype = await r.read(), r.status, r.headers.get("content-type", "")
        else:
            r = await c.post(upstream, content=body, headers=hdrs)
            out, status, ctype = r.content, r.status_code, r.headers.get("content-type", "")
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})
    return app


def serve_bare(port: int, upstream: str, client: str) -> None:
    import uvicorn

    uvicorn.run(bare_app(upstream, client), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="on")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--stream", action="store_true", help="streaming chat (SSE) instead of JSON")
    ap.add_argument("--bare-clients", default="aiohttp,httpx")
    ap.add_argument("--gateway-clients", default="native,aiohttp,httpx")
    ap.add_argument("--baseline", action="append", default=[], metavar="DIR[:CLIENT]",
                    help="also run the gateway of this checkout (its default upstream client unless given)")
    ap.add_argument("--serve-bare", nargs=3, metavar=("PORT", "UPSTREAM", "CLIENT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_bare:
        serve_bare(int(a.serve_bare[0]), a.serve_bare[1], a.serve_bare[2])
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs at least 2 CPUs: one for the server under test, one for the load generator")
    server_cpu, client_cpu = str(cpus[-1]), {cpus[0]}
    os.sched_setaffinity(0, client_cpu)  # this process (load generator) and the upstream stay off the server's core
    tmp = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(ROOT / "bench/fast_upstream.py"), str(up_port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16,
                         **({"stream": True} if a.stream else {})})
    req = build_request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
    servers = [(f"bare ASGI proxy + {c}", "bare", c, ROOT) for c in a.bare_clients.split(",") if c]
    servers += [(f"gateway (full pipeline) + {c}", "gw", c, ROOT) for c in a.gateway_clients.split(",") if c]
    for spec in a.baseline:
        tree, _, client = spec.partition(":")
        servers.append((f"gateway @ {tree}" + (f" + {client}" if client else ""), "gw", client or None,
                        Path(tree).resolve()))
    if not servers:
        sys.exit("nothing to run")
    res: dict[str, list[float]] = {s[0]: [] for s in servers}
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health", proc=up)
        for _ in range(a.rounds):
            for name, kind, client, tree in servers:
                port = free_port()
                if kind == "bare":
                    cmd = [sys.executable, __file__, "--serve-bare", str(port),
                           f"http://127.0.0.1:{up_port}/v1/chat/completions", client]
                    ready = f"http://127.0.0.1:{port}/healthz"
                else:
                    cfg = gateway_config(tmp, f"gw-{client}-{port}", port, up_port, client)
                    cmd = [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)]
                    ready = f"http://127.0.0.1:{port}/readyz"
                p = subprocess.Popen(["taskset", "-c", server_cpu, *cmd], cwd=tree,
                                     env={**os.environ, "BENCH_KEY": KEY, "PYTHONPATH": str(tree)},
                                     stdout=subprocess.DEVNULL, stderr=open(tmp / f"{port}.log", "wb"))
                try:
                    wait_http(ready, proc=p)
                    asyncio.run(drive("127.0.0.1", port, req, 8, 1.0))  # warm pools and code paths
                    c0 = cpu_seconds(p.pid)
                    ok, err, _ = asyncio.run(drive("127.0.0.1", port, req, a.connections, a.seconds))
                    cpu = cpu_seconds(p.pid) - c0
                    if err:
                        sys.exit(f"{name}: {err} failed requests (log: {tmp}/{port}.log)")
                    res[name].append(ok / cpu)
                finally:
                    p.terminate()
                    p.wait(15)
    finally:
        up.terminate()
        up.wait(5)
    base = statistics.median(res[servers[0][0]])
    print(f"server pinned to CPU {server_cpu}; load generator and upstream on CPU {cpus[0]}; "
          f"{a.connections} keep-alive connections, {a.seconds:g} s per round, "
          f"{'streaming' if a.stream else 'non-streaming'} chat\n")
    print(f"| server | req/s per core, each round | median | vs {servers[0][0]} |")
    print("|---|---|---|---|")
    for name, xs in res.items():
        m = statistics.median(xs)
        print(f"| {name} | {', '.join(f'{x:.0f}' for x in xs)} | {m:.0f} | {m / base:.2f} |")


if __name__ == "__main__":
    main()
