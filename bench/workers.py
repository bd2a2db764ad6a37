"""Requests per host: `gateway serve --workers 1` vs `--workers 2` at saturation, in one run, side by side.

The load generator (bench/loadgen.py, raw asyncio, in this process) and the fast upstream
(bench/fast_upstream.py) run on the same machine as the gateway, as the issue asks, so on a 2-core host they
take their share of the cores the workers would use: the table shows what each process used, so the ratio can
be read against what was left for the gateway. Both configurations use the same full pipeline (key auth,
policy, Redis budgets, routing, evidence): budgets.store memory cannot run with 2 workers. Rounds alternate
between the configurations so drift on a shared VM hits both alike.

`--loadgen wrk` drives the same requests with wrk (Debian's package, one thread, a Lua script for the body and
headers) instead: the load generator then takes ~a fifth of the CPU the asyncio one does, so more of the
2-core box is left to the workers. Both are reported as they were measured; the table names the one used.

`--store sqlite --budgeted` measures the embedded budget store the workers of one host share by default
(`budgets.store: auto` is SQLite for N > 1): every request is reserved and settled against a tenant day budget
too large to bind, so each one runs two SQLite transactions besides the rest of the pipeline. `--store` takes
a list (`memory,sqlite`: the in-process store at one worker as the reference; memory is skipped for N > 1,
where it is refused). Without `--budgeted` no budget rule exists and the store is never asked.

Run: .venv/bin/python bench/workers.py [--rounds 3] [--seconds 8] [--connections 64] [--workers 1,2] [--stream]
     [--loadgen asyncio|wrk] [--store redis|sqlite|memory|auto,...] [--budgeted]
e.g. .venv/bin/python bench/workers.py --store memory,sqlite --budgeted --workers 1,2,4 --no-peers-off-row
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.loadgen import build_request, drive  # noqa: E402
from bench.overhead import KEY, cpu_seconds  # noqa: E402
from tests.support.procs import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


BUDGET_POLICY = """version: 1
rules:
  - id: bench-day-budget   # reserved and settled by every request, never binding
    match: {tenant: bench}
    budgets: [{window: day, tokens: 1000000000000, requests: 1000000000}]
"""


def config(tmp: Path, port: int, up_port: int, workers: int, prefix: str, extra: str = "", store: str = "redis",
           budgeted: bool = False) -> Path:
    cfg = tmp / f"gw-{port}.yaml"
    files = ""
    if budgeted:
        (tmp / "budget-policy.yaml").write_text(BUDGET_POLICY)
        files = f", files: [{tmp}/budget-policy.yaml]"
    cfg.write_text(f"""
server: {{host: 127.0.0.1, port: {port}, workers: {workers}}}
backends:
  - {{name: up, url: "http://127.0.0.1:{up_port}/v1", models: [m], location: {{country: DE}}, retention: zero,
      health: {{enabled: false}}}}
keys: [{{key_env: BENCH_KEY, tenant: bench}}]
policy: {{audit_path: {tmp}/audit-{port}.jsonl{files}}}
identity: {{sqlite_path: {tmp}/id-{port}.db}}
budgets: {{store: {store}, key_prefix: {prefix}, sqlite_path: {tmp}/budgets-{port}.db, spool_path: {tmp}/spool-{port}.jsonl}}
observability: {{log_level: warning}}
{extra}
""")
    return cfg


def budget_requests(path: Path) -> int:
    """Requests the run's SQLite store counted (its day counter of tenant bench): every request reached it."""
    import sqlite3

    db = sqlite3.connect(path)
    try:
        rows = db.execute("SELECT v FROM budget_counters WHERE k LIKE '%:tenant:bench:day:%'").fetchall()
    finally:
        db.close()
    return sum(orjson.loads(v)[0] for (v,) in rows)


def tree_pids(pid: int) -> list[int]:
    """`pid` and its children (the supervisor's workers)."""
    out = [pid]
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            kids = open(f"/proc/{pid}/task/{t}/children").read().split()
            out += [int(k) for k in kids]
    except OSError:
        pass
    return out


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        try:
            total += cpu_seconds(p)
        except OSError:
            pass
    return total


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


WRK_LUA = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = {auth}
"""


def lua_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def run_wrk(script: Path, port: int, connections: int, seconds: float) -> tuple[int, int, float]:
    """wrk at saturation: (2xx responses, other responses and socket errors, wrk's own CPU seconds)."""
    p = subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
                          f"http://127.0.0.1:{port}/v1/chat/completions"], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"wrk failed ({p.returncode}):\n{out}")
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        bad += sum(int(x) for x in m.groups())
    return total - bad, bad, ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--peers-off-row", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the largest worker count with the peer bus off (what the bus costs)")
    ap.add_argument("--stream", action="store_true", help="streaming chat (16 SSE events) instead of JSON")
    ap.add_argument("--loadgen", choices=["asyncio", "wrk"], default="asyncio",
                    help="bench/loadgen.py in this process, or wrk (needs Debian's wrk package)")
    ap.add_argument("--store", default="redis",
                    help="budgets.store of the gateways, or a list (memory,sqlite: a row per store and count)")
    ap.add_argument("--budgeted", action="store_true",
                    help="a never-binding tenant day budget, so every request is reserved and settled in the store")
    a = ap.parse_args()
    if a.loadgen == "wrk" and not shutil.which("wrk"):
        sys.exit("--loadgen wrk: wrk is not installed (apt-get install wrk)")
    counts = [int(x) for x in a.workers.split(",")]
    stores = a.store.split(",")
    one_store = len(stores) == 1
    specs = [(f"{n}" if one_store else f"{n} ({st})", n, "", st) for st in stores for n in counts
             if not (st == "memory" and n > 1)]
    if a.peers_off_row and max(counts) > 1:
        specs.append((f"{max(counts)}, peer bus off", max(counts), "routing: {peers: {mode: \"off\"}}",
                      stores[-1]))
    tmp = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(ROOT / "bench/fast_upstream.py"), str(up_port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16,
                         **({"stream": True} if a.stream else {})})
    req = build_request("/v1/chat/completions", body, {"authorization": f"Bearer {KEY}"})
    script = tmp / "wrk.lua"
    script.write_text(WRK_LUA.format(body=lua_str(body.decode()), auth=lua_str(f"Bearer {KEY}")))
    rows: dict[str, list[tuple[float, float, float, float]]] = {label: [] for label, _, _, _ in specs}
    prefix = f"bench-workers-{uuid.uuid4().hex[:8]}"
    try:
        wait_http(f"http://127.0.0.1:{up_port}/health", proc=up)
        for _ in range(a.rounds):
            for label, n, extra, store in specs:
                port = free_port()
                p = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config",
                                      str(config(tmp, port, up_port, n, prefix, extra, store, a.budgeted))], cwd=ROOT,
                                     env={**os.environ, "BENCH_KEY": KEY}, stdout=subprocess.DEVNULL,
                                     stderr=open(tmp / f"{port}.log", "wb"))
                try:
                    wait_http(f"http://127.0.0.1:{port}/readyz", proc=p, timeout=60)
                    time.sleep(0.5)
                    asyncio.run(drive("127.0.0.1", port, req, 8, 1.5))  # warm every worker's pools
                    pids = tree_pids(p.pid)
                    g0, u0, s0 = cpu_of(pids), cpu_seconds(up.pid), self_cpu()
                    if a.loadgen == "wrk":
                        ok, err, lg = run_wrk(script, port, a.connections, a.seconds)
                    else:
                        ok, err, _ = asyncio.run(drive("127.0.0.1", port, req, a.connections, a.seconds))
                    g, u, s = cpu_of(pids) - g0, cpu_seconds(up.pid) - u0, self_cpu() - s0
                    if a.loadgen == "wrk":
                        s = lg
                    if err:
                        sys.exit(f"{n} workers: {err} failed requests (log: {tmp}/{port}.log)")
                    rows[label].append((ok / a.seconds, g / a.seconds, u / a.seconds, s / a.seconds))
                finally:
                    p.terminate()
                    p.wait(30)
                if a.budgeted and (store == "sqlite" or (store == "auto" and n > 1)):
                    counted = budget_requests(tmp / f"budgets-{port}-counters.db")
                    if counted < ok:  # the warm-up's requests count too
                        sys.exit(f"{label}: the SQLite store counted {counted} requests of {ok} served")
    finally:
        up.terminate()
        up.wait(5)
    base = statistics.median(r[0] for r in rows[specs[0][0]])
    budgets = (f"budgets.store {a.store}, every request reserved and settled" if a.budgeted
               else f"budgets.store {a.store}, no budget rule (the store is never asked)")
    print(f"{os.cpu_count()} CPUs; load generator, upstream and gateway on the same machine; {a.connections} "
          f"keep-alive connections, {a.seconds:g} s per round, {'streaming' if a.stream else 'non-streaming'} chat, "
          f"full pipeline ({budgets}), load generator: {a.loadgen}\n")
    print(f"| workers | req/s, each round | median req/s | vs {specs[0][0]} worker(s) | gateway cores used | "
          "load generator cores | upstream cores | gateway req/s per core used |")
    print("|---|---|---|---|---|---|---|---|")
    for n, rs in rows.items():
        m = statistics.median(r[0] for r in rs)
        g = statistics.median(r[1] for r in rs)
        print(f"| {n} | {', '.join(f'{r[0]:.0f}' for r in rs)} | {m:.0f} | {m / base:.2f} | {g:.2f} | "
              f"{statistics.median(r[3] for r in rs):.2f} | {statistics.median(r[2] for r in rs):.2f} | "
              f"{m / g if g else 0:.0f} |")


if __name__ == "__main__":
    main()
