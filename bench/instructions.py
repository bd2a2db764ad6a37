"""CPU instructions per request, counted by valgrind (callgrind): a per-request cost that does not move with
the host's load, for comparing gateway trees or settings side by side on a shared, noisy box.

bench/proxy_floor.py measures requests per CPU-second, which on this 2-core shared VM moves +-15% between
rounds (other sessions' tests, frequency, steal). Instructions are deterministic to ~1% run to run: each
server runs under callgrind (instrumentation off while it starts and warms up, on while bench/loadgen.py
drives it, off again), and the count is divided by the requests completed in that window. Callgrind makes the
server ~40x slower, so the load is small (hundreds of requests); work done per unit of time (background loops)
weighs a little more than at full speed, and the count is not time: cache misses are not in it. The cyclic
GC is switched off for the instrumented window (a SIGUSR1 handler this script installs through a
sitecustomize: gc.collect(), then gc.disable()): one full collection walks every tracked object (~80 M
instructions here) and whether one falls in a window of a few hundred requests is chance, which swung the
per-request figure by up to 60%. GC time is its own measurement (gc.callbacks; docs/benchmarks.md). Use this
to find what costs, and proxy_floor.py for the throughput itself.

Run: .venv/bin/python bench/instructions.py [--seconds 20] [--connections 32] [--tree 'DIR[:LABEL[:YAML]]']...
(YAML is appended to that run's config, e.g. 'cost: {enabled: false}'; with no --tree, this checkout as is)
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
from bench.overhead import KEY, gateway_config  # noqa: E402
from tests.support.procs import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SITE = """import gc, signal
def _quiet(sig, frame):
    gc.collect()
    gc.disable()
signal.signal(signal.SIGUSR1, _quiet)
"""


def count(tree: Path, extra: str, tmp: Path, up_port: int, seconds: float, conns: int, cpu: str) -> tuple[int, int]:
    """(instructions, requests) of one gateway of `tree` under load, while instrumented."""
    port = free_port()
    cfg = gateway_config(tmp, f"gw-{port}", port, up_port, None)
    if extra:
        cfg.write_text(cfg.read_text() + extra + "\n")
    out = tmp / f"cg-{port}.out"
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    p = subprocess.Popen(["taskset", "-c", cpu, "valgrind", "--tool=callgrind", "--instr-atstart=no",
                          f"--callgrind-out-file={out}", sys.executable, "-m", "gateway", "serve", "--config",
                          str(cfg)], cwd=tree,
                         env={**os.environ, "BENCH_KEY": KEY, "PYTHONPATH": f"{site}{os.pathsep}{tree}"},
                         stdout=subprocess.DEVNULL, stderr=open(tmp / f"{port}.log", "wb"))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16})
    req = build_request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", proc=p, timeout=600)
        asyncio.run(drive("127.0.0.1", port, req, conns, 8.0))  # warm code paths, pools and the learner
        os.kill(p.pid, signal.SIGUSR1)  # collect, then no cyclic GC while counting (see the module doc)
        time.sleep(1.0)
        subprocess.run(["callgrind_control", "-i", "on", str(p.pid)], check=True, stdout=subprocess.DEVNULL)
        ok, err, _ = asyncio.run(drive("127.0.0.1", port, req, conns, seconds))
        subprocess.run(["callgrind_control", "-i", "off", str(p.pid)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, stdout=subprocess.DEVNULL)
        if err:
            sys.exit(f"{tree}: {err} failed requests (log: {tmp}/{port}.log)")
    finally:
        p.terminate()
        p.wait(60)
    total = 0
    for f in tmp.glob(f"cg-{port}.out*"):
        m = re.search(rb"^totals: (\d+)", f.read_bytes(), re.M)
        total += int(m.group(1)) if m else 0
    return total, ok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--tree", action="append", default=[], metavar="DIR[:LABEL[:YAML]]")
    a = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("needs valgrind (callgrind): apt-get install valgrind")
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu = str(cpus[-1])
    os.sched_setaffinity(0, {cpus[0]})
    runs = []
    for spec in a.tree:
        d, _, rest = spec.partition(":")
        label, _, extra = rest.partition(":")
        runs.append((Path(d).resolve(), label or d, extra))
    runs = runs or [(ROOT, "this checkout", "")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-instr-"))
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(ROOT / "bench/fast_upstream.py"), str(up_port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health", proc=up)
        for tree, label, extra in runs:
            instr, n = count(tree, extra, tmp, up_port, a.seconds, a.connections, server_cpu)
            rows.append((label, extra or "defaults", instr / max(n, 1), n))
    finally:
        up.terminate()
        up.wait(5)
    base = rows[0][2]
    print(f"callgrind, non-streaming chat, {a.connections} keep-alive connections, {a.seconds:g} s instrumented "
          f"per server (pinned to CPU {server_cpu})\n")
    print(f"| tree | config added | instructions per request | vs {rows[0][0]} | requests counted |")
    print("|---|---|---|---|---|")
    for label, extra, per, n in rows:
        print(f"| {label} | {extra} | {per / 1e6:.3f} M | {per / base:.3f} | {n} |")


if __name__ == "__main__":
    main()
