"""Does a batch upload hold up the gateway? /healthz latency while concurrent maximal uploads run (issue 35 #3).

Starts the gateway (as `gateway serve`, like the other benches), generates one batch input file of `--mb` MiB
(request lines of ~2 KiB; 100 MiB is 50,000 lines, just under `batch.max_file_bytes` and `batch.max_lines`),
and posts it `--uploads` times at once (one static key per upload, so the per-tenant bound does not refuse
any) while a separate process asks /healthz every 10 ms on its own connection. Prints per gateway: /healthz
p50/p99/max before and during the uploads, the uploads' statuses and wall time, and the gateway's peak RSS.
`--compare-rev REV` also runs the gateway of git revision REV (a temporary worktree) for a before/after table.

Run: .venv/bin/python bench/uploads.py [--mb 100] [--uploads 4] [--compare-rev e94bc4c]
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.procs import Proc, free_port, wait_http  # noqa: E402

KEYS = [f"bench-upload-key-{i}-0123456789" for i in range(16)]
LINE_BYTES = 2097  # one request line (50,000 of them: 100 MiB + change, under max_file_bytes with the newlines)


def make_file(path: Path, mib: float) -> int:
    """`mib` MiB of chat request lines, each ~LINE_BYTES long; returns the line count."""
    n = min(50000, max(1, int(mib * 1048576 // (LINE_BYTES + 1))))
    with open(path, "wb") as f:
        for i in range(n):
            body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": ""}]}
            pad = LINE_BYTES - len(orjson.dumps({"custom_id": f"r{i:06d}", "method": "POST",
                                                 "url": "/v1/chat/completions", "body": body}))
            body["messages"][0]["content"] = "x" * max(0, pad)
            f.write(orjson.dumps({"custom_id": f"r{i:06d}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + b"\n")
    return n


def gateway_config(tmp: Path, port: int, uploads: int) -> Path:
    cfg = tmp / f"gw-{port}.yaml"
    keys = ", ".join(f"{{key: {k}, tenant: t{i}}}" for i, k in enumerate(KEYS[:uploads]))
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
backends:
  - {{name: up, url: "http://127.0.0.1:9/v1", models: [m], location: {{country: DE}}, retention: zero,
      health: {{enabled: false}}}}
keys: [{keys}]
policy: {{audit_path: {tmp}/audit-{port}.jsonl}}
identity: {{sqlite_path: {tmp}/id-{port}.db}}
budgets: {{sqlite_path: {tmp}/budgets-{port}.db}}
observability: {{log_level: warning}}
""")
    return cfg


def probe(url: str, stop: Any, out: Any) -> None:
    """In its own process: GET /healthz every 10 ms on one keep-alive connection; (t, seconds) per request."""
    lat: list[tuple[float, float]] = []
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get(url)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.status_code
            lat.append((time.time(), dt))
            time.sleep(max(0.0, 0.01 - dt))
    out.put(lat)


async def upload_all(base: str, path: Path, n: int) -> list[tuple[int, float]]:
    async def one(key: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as c:
            with open(path, "rb") as f:
                r = await c.post(base + "/v1/files", headers={"authorization": f"Bearer {key}"},
                                 data={"purpose": "batch"}, files={"file": ("in.jsonl", f, "application/jsonl")})
        return r.status_code, time.perf_counter() - t0
    return await asyncio.gather(*(one(k) for k in KEYS[:n]))


def peak_rss_mib(pid: int) -> float:
    for ln in open(f"/proc/{pid}/status"):
        if ln.startswith("VmHWM:"):
            return int(ln.split()[1]) / 1024
    return float("nan")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")


def run_one(label: str, root: Path, tmp: Path, path: Path, uploads: int) -> dict[str, Any]:
    port = free_port()
    cfg = gateway_config(tmp, port, uploads)
    env = {"PYTHONPATH": str(root)}
    gw = Proc([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], tmp / f"gateway-{port}.log",
              env=env, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/healthz", timeout=60, proc=gw.p)
        ctx = mp.get_context("spawn")
        stop, q = ctx.Event(), ctx.Queue()
        pr = ctx.Process(target=probe, args=(base + "/healthz", stop, q))
        pr.start()
        time.sleep(1.0)  # idle samples first
        t_start = time.time()
        results = asyncio.run(upload_all(base, path, uploads))
        t_end = time.time()
        time.sleep(0.3)
        stop.set()
        lat = q.get(timeout=120)
        pr.join(30)
        idle = [d for t, d in lat if t < t_start]
        during = [d for t, d in lat if t_start <= t <= t_end]
        return {"label": label, "idle_p50": pct(idle, .5), "idle_p99": pct(idle, .99), "p50": pct(during, .5),
                "p99": pct(during, .99), "max": max(during) * 1000 if during else float("nan"), "n": len(during),
                "over50": sum(d > 0.05 for d in during),
                "slow": [(round(t - t_start, 2), round(d * 1000)) for t, d in lat if d > 0.03],
                "statuses": ",".join(str(s) for s, _ in results), "wall": t_end - t_start,
                "rss": peak_rss_mib(gw.p.pid)}
    finally:
        gw.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0, help="MiB per upload (100: the issue's maximal upload)")
    ap.add_argument("--uploads", type=int, default=4)
    ap.add_argument("--compare-rev", default=None, help="also run the gateway of this git revision (before)")
    ap.add_argument("--verbose", action="store_true", help="list the probes over 30 ms")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-uploads-"))
    path = tmp / "in.jsonl"
    lines = make_file(path, a.mb)
    size = path.stat().st_size
    rows = []
    worktree = None
    try:
        if a.compare_rev:
            worktree = tmp / "before"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), a.compare_rev],
                           check=True, capture_output=True)
            rows.append(run_one(f"before ({a.compare_rev})", worktree, tmp, path, a.uploads))
        rows.append(run_one("this tree", ROOT, tmp, path, a.uploads))
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{a.uploads} concurrent uploads of {size / 1048576:.1f} MiB ({lines} lines) each; /healthz every 10 ms "
          f"from another process; {os.cpu_count()} CPUs")
    hdr = ("gateway", "idle p50 ms", "idle p99 ms", "during p50 ms", "during p99 ms", "during max ms", "probes",
           "probes > 50 ms",
           "upload statuses", "uploads wall s", "gateway peak RSS MiB")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in rows:
        print(f"| {r['label']} | {r['idle_p50']:.2f} | {r['idle_p99']:.2f} | {r['p50']:.2f} | {r['p99']:.2f} | "
              f"{r['max']:.1f} | {r['n']} | {r['over50']} | {r['statuses']} | {r['wall']:.1f} | {r['rss']:.0f} |")
    if a.verbose:
        for r in rows:
            print(r["label"], "probes over 30 ms (s after the uploads started, ms):", r["slow"])


if __name__ == "__main__":
    main()
