"""Gateway CPU per streamed request and per SSE event, next to the JSON path and a bare streaming relay.

One table (issue 24): for a JSON chat request and for 20-, 200- and 1000-event streams (bench/fast_upstream.py
sends `max_tokens` content events, then a usage-only event and `[DONE]`), the CPU each server spends per
request, counted two ways:
- instructions per request under valgrind's callgrind (the primary measure: deterministic to ~1% on a shared,
  noisy box; the method and its caveats are bench/instructions.py's: instrumentation on only while
  bench/loadgen.py drives the server, cyclic GC off while counting);
- CPU microseconds per request from /proc (utime + stime of the server process, pinned to one core, while
  bench/loadgen.py drives it from the other core; kernel time included; noisy, the second measure).
Each server's background cost (timers, flushes: its rate with no load, measured first) is subtracted from each
window for the time it ran. The per-event slope is (cost of the longest stream - cost of the shortest) / the
difference in events, per stream mode.

Three servers: the gateway (full default pipeline: key auth, policy, budgets, routing, evidence; the config of
bench/overhead.py), a bare streaming relay on the same stack (uvicorn + uvloop + httptools, a raw ASGI
callable that posts the body upstream through one pooled aiohttp session and relays each upstream read as one
body message: no parsing, no accounting), the floor for the same bytes through an ASGI server, and (`--servers
...,splice`) a TCP splice in uvloop protocols (no HTTP at all: each read written to the other side), the floor
of any user-space relay in Python on this kernel.

Two stream modes: all events in one upstream write (the gateway reads them in a few large reads and can
coalesce them into a few downstream writes) and paced (`--paced`: one upstream write and HTTP chunk per
event, `--gap-ms` apart, as an engine sends them; each event is its own read, parse and downstream write).
Paced streams run for n x gap of wall time each; under callgrind the server is ~40x slower, so the defaults
(8 connections, 20 ms apart: ~400 events/s) keep it well below saturation, where events would coalesce again.

Run: .venv/bin/python bench/streaming.py [--events 20,200,1000] [--paced 20,200] [--gap-ms 20] [--seconds 10]
     [--connections 4] [--paced-connections 8]
     [--no-callgrind] [--no-cpu] [--servers gateway,bare,splice] [--tree DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen import build_request, drive  # noqa: E402
from bench.instructions import SITE  # noqa: E402  # the GC switch-off for the instrumented window
from bench.overhead import KEY, cpu_seconds, gateway_config  # noqa: E402
from tests.support.procs import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bare_app(upstream: str):
    """A raw ASGI streaming relay: POST body -> upstream -> status, content-type, then each upstream read."""
    state: dict = {}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    import aiohttp

                    state["c"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await state["c"].close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] in ("/healthz", "/readyz"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        async with state["c"].post(upstream, data=body, headers={"content-type": "application/json"}) as r:
            ctype = r.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                out = await r.read()
                await send({"type": "http.response.start", "status": r.status, "headers": [
                    (b"content-type", ctype.encode()), (b"content-length", str(len(out)).encode())]})
                await send({"type": "http.response.body", "body": out})
                return
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type", ctype.encode())]})
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


def serve_bare(port: int, upstream: str) -> None:
    import uvicorn

    uvicorn.run(bare_app(upstream), host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                log_level="warning", access_log=False, lifespan="on")


def serve_splice(port: int, up_port: int) -> None:
    """The floor of any user-space relay on this kernel and loop: a TCP splice in uvloop protocols. Each client
    connection gets its own upstream connection and every read is written to the other side as it came, with no
    HTTP parsing at all (the bytes are the upstream's HTTP). Per paced event it pays what every relay must: the
    loop's wake-up, one recv and one send (which on loopback also runs the receiver's TCP)."""
    import uvloop

    class Up(asyncio.Protocol):
        def __init__(self, down: asyncio.Transport) -> None:
            self.down = down

        def data_received(self, data: bytes) -> None:
            self.down.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.down.close()

    class Down(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t = transport
            self.up: asyncio.Transport | None = None
            self.pending: list[bytes] = []
            asyncio.get_running_loop().create_task(self._connect())

        async def _connect(self) -> None:
            up, _ = await asyncio.get_running_loop().create_connection(lambda: Up(self.t), "127.0.0.1", up_port)
            self.up = up
            for d in self.pending:
                up.write(d)
            self.pending.clear()

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.pending.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.close()

    async def run() -> None:
        srv = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        async with srv:
            await srv.serve_forever()

    uvloop.run(run())


Workload = tuple[int | None, float]  # (content events, None: JSON; ms between events, 0: all in one write)


IDLE: Workload = (-1, 0.0)  # the server's own background cost per second, with no load


def request(w: Workload) -> bytes:
    """A chat request: JSON when n is None, else a stream of n content events (paced when gap > 0)."""
    n, gap = w
    body: dict = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": n or 16}
    if n is not None:
        body["stream"] = True
    if gap:
        body["x_bench_gap_ms"] = gap
    return build_request("/v1/chat/completions", orjson.dumps(body), {"authorization": f"Bearer {KEY}"})


def server_cmd(kind: str, tree: Path, tmp: Path, port: int, up_port: int) -> tuple[list[str], str]:
    if kind == "bare":
        return ([sys.executable, str(ROOT / "bench/streaming.py"), "--serve-bare", str(port),
                 f"http://127.0.0.1:{up_port}/v1/chat/completions"], f"http://127.0.0.1:{port}/healthz")
    if kind == "splice":
        return ([sys.executable, str(ROOT / "bench/streaming.py"), "--serve-splice", str(port), str(up_port)],
                f"http://127.0.0.1:{port}/health")
    cfg = gateway_config(tmp, f"gw-{port}", port, up_port, None)
    return [sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], f"http://127.0.0.1:{port}/readyz"


def run_server(kind: str, tree: Path, tmp: Path, up_port: int, workloads: list[Workload], seconds: float,
               conns: int, paced_conns: int, cpu: str, callgrind: bool) -> dict[Workload, tuple[float, int]]:
    """{workload: (instructions or CPU-seconds per request, requests counted)} for one server process."""
    port = free_port()
    cmd, ready = server_cmd(kind, tree, tmp, port, up_port)
    out = tmp / f"cg-{port}.out"
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    pre = ["taskset", "-c", cpu]
    if callgrind:
        pre += ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = {**os.environ, "BENCH_KEY": KEY, "PYTHONPATH": f"{site}{os.pathsep}{tree}{os.pathsep}{ROOT}"}
    p = subprocess.Popen(pre + cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                         stderr=open(tmp / f"{port}.log", "wb"))
    res: dict[Workload, tuple[float, int]] = {}

    def measured(req: bytes | None, c: int) -> tuple[float, float, int, int]:
        """(instructions or CPU-seconds, wall seconds, ok, errors) of one window: a load, or idle (req None)."""
        if callgrind:
            os.kill(p.pid, signal.SIGUSR1)  # collect, then no cyclic GC while counting
            time.sleep(0.5)
            before = set(tmp.glob(f"cg-{port}.out*"))
            subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            subprocess.run(["callgrind_control", "-i", "on", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        else:
            c0 = cpu_seconds(p.pid)
        t0 = time.perf_counter()
        if req is None:
            time.sleep(seconds)
            ok = err = 0
        else:
            ok, err, _ = asyncio.run(drive("127.0.0.1", port, req, c, seconds))
        wall = time.perf_counter() - t0
        if not callgrind:
            return cpu_seconds(p.pid) - c0, wall, ok, err
        subprocess.run(["callgrind_control", "-i", "off", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        total = 0
        for f in set(tmp.glob(f"cg-{port}.out*")) - before:
            m = re.search(rb"^totals: (\d+)", f.read_bytes(), re.M)
            total += int(m.group(1)) if m else 0
        return float(total), wall, ok, err

    try:
        wait_http(ready, proc=p, timeout=600)
        asyncio.run(drive("127.0.0.1", port, request((16, 0.0)), conns, 0.5 if not callgrind else 3.0))
        idle_cost, idle_wall, _, _ = measured(None, 0)
        idle_rate = idle_cost / idle_wall  # background loops (audit linger, scrapes, timers), per second
        res[IDLE] = (idle_rate, 0)
        for w in workloads:
            req = request(w)
            c = paced_conns if w[1] else conns
            asyncio.run(drive("127.0.0.1", port, req, c, 0.5 if not callgrind else max(2.0, seconds / 3)))  # warm
            cost, wall, ok, err = measured(req, c)
            if err:
                sys.exit(f"{kind}: {err} failed requests on workload {w} (log: {tmp}/{port}.log)")
            res[w] = (max(cost - idle_rate * wall, 0.0) / max(ok, 1), ok)
    finally:
        p.terminate()
        p.wait(60)
    return res


def label(w: Workload) -> str:
    n, gap = w
    if n is None:
        return "JSON"
    return f"stream, {n} events" + (f", one upstream write each, {gap:g} ms apart" if gap else ", one upstream write")


def table(workloads: list[Workload], servers: list[str], instr: dict, cpu: dict) -> str:
    """The one table: per server, instructions (M) and CPU µs per request, the gateway's ratios to JSON and to
    the bare relay, then the per-event slope of each stream mode."""
    main = instr if instr else cpu
    json_w = (None, 0.0)
    cols = []
    for s in servers:
        if instr:
            cols.append((f"{s} instructions", lambda w, s=s: f"{instr[s][w][0] / 1e6:.3f} M"))
        if cpu:
            cols.append((f"{s} CPU µs", lambda w, s=s: f"{cpu[s][w][0] * 1e6:.0f}"))
    if "gateway" in servers and json_w in workloads:
        cols.append(("gateway vs its JSON", lambda w: f"{main['gateway'][w][0] / main['gateway'][json_w][0]:.2f}x"))
    for floor in ("bare", "splice"):
        if "gateway" in servers and floor in servers:
            cols.append((f"gateway vs {floor}",
                         lambda w, f=floor: f"{main['gateway'][w][0] / max(main[f][w][0], 1e-12):.2f}x"))
    lines = ["| request | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for w in workloads:
        lines.append(f"| {label(w)} | " + " | ".join(c[1](w) for c in cols) + " |")
    cells = []
    for s in servers:
        if instr:
            cells.append(f"{instr[s][IDLE][0] / 1e6:.1f} M")
        if cpu:
            cells.append(f"{cpu[s][IDLE][0] * 1e6:.0f}")
    lines.append("| idle, per second (subtracted above) | " + " | ".join(cells) + " |" * (len(cols) - len(cells) + 1))
    for gap in sorted({g for n, g in workloads if n is not None}):
        streams = sorted(w for w in workloads if w[0] is not None and w[1] == gap)
        if len(streams) < 2:
            continue
        lo, hi = streams[0], streams[-1]
        d = hi[0] - lo[0]  # type: ignore[operator]
        cells = []
        for s in servers:
            if instr:
                cells.append(f"{(instr[s][hi][0] - instr[s][lo][0]) / d / 1e3:.1f} k")
            if cpu:
                cells.append(f"{(cpu[s][hi][0] - cpu[s][lo][0]) / d * 1e6:.1f}")
        if "gateway" in servers and json_w in workloads:
            cells.append("")
        for floor in ("bare", "splice"):
            if "gateway" in servers and floor in servers:
                gw = main["gateway"][hi][0] - main["gateway"][lo][0]
                cells.append(f"{gw / max(main[floor][hi][0] - main[floor][lo][0], 1e-12):.2f}x")
        mode = f"{gap:g} ms apart" if gap else "one write"
        lines.append(f"| per event ({lo[0]} -> {hi[0]}, {mode}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", default="20,200,1000", help="stream lengths, all events in one upstream write")
    ap.add_argument("--paced", default="20,200", help="stream lengths, one upstream write per event")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="ms between the events of a paced stream")
    ap.add_argument("--paced-connections", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per workload and server")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--servers", default="gateway,bare")
    ap.add_argument("--no-callgrind", action="store_true", help="skip the instruction counts")
    ap.add_argument("--no-cpu", action="store_true", help="skip the /proc CPU-seconds runs")
    ap.add_argument("--tree", default=str(ROOT), help="the gateway checkout to measure (default: this one)")
    ap.add_argument("--serve-bare", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    ap.add_argument("--serve-splice", nargs=2, type=int, metavar=("PORT", "UPSTREAM_PORT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_bare:
        serve_bare(int(a.serve_bare[0]), a.serve_bare[1])
        return
    if a.serve_splice:
        serve_splice(*a.serve_splice)
        return
    callgrind = not a.no_callgrind
    if callgrind and (shutil.which("valgrind") is None or shutil.which("callgrind_control") is None):
        sys.exit("needs valgrind (callgrind): apt-get install valgrind, or --no-callgrind")
    workloads: list[Workload] = [(None, 0.0)] + [(int(x), 0.0) for x in a.events.split(",") if x]
    workloads += [(int(x), a.gap_ms) for x in a.paced.split(",") if x]
    servers = [s for s in a.servers.split(",") if s]
    tree = Path(a.tree).resolve()
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = str(cpus[-1])
    os.sched_setaffinity(0, {cpus[0]})  # this process (load generator) and the upstream stay off the server's core
    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(ROOT / "bench/fast_upstream.py"), str(up_port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    instr: dict = {}
    cpu: dict = {}
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health", proc=up)
        for s in servers:
            if callgrind:
                instr[s] = run_server(s, tree, tmp, up_port, workloads, a.seconds, a.connections,
                                     a.paced_connections, server_cpu, True)
            if not a.no_cpu:
                cpu[s] = run_server(s, tree, tmp, up_port, workloads, a.seconds, a.connections,
                                     a.paced_connections, server_cpu, False)
    finally:
        up.terminate()
        up.wait(5)
    what = []
    if instr:
        what.append(f"callgrind instructions ({a.seconds:g} s instrumented per workload, GC off while counting)")
    if cpu:
        what.append(f"/proc CPU µs ({a.seconds:g} s at saturation per workload)")
    print(f"gateway {tree}; servers pinned to CPU {server_cpu}, bench/loadgen.py with {a.connections} keep-alive "
          f"connections on CPU {cpus[0]}; " + " and ".join(what) + "\n")
    print(table(workloads, servers, instr, cpu))
    counted = {s: {label(w): n for w, (_, n) in (instr.get(s) or cpu.get(s) or {}).items()
                   if w != IDLE} for s in servers}
    print(f"\nrequests counted: {counted}")


if __name__ == "__main__":
    main()
