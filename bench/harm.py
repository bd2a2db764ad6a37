"""First, do no harm (issue 34): the default config against pass-through and against no gateway at all, side by
side in one run, for three upstreams:

  fast     an OpenAI-compatible upstream that answers at once (bench/fast_upstream.py)
  partner  the same with 200 ms to the first token and 10 events 10 ms apart (a partner API's shape)
  sim      one simulated vLLM engine (backends/sim, profile vllm-default) with KV events and metrics

at 1, 8, 32, 64, 128 and 256 keep-alive connections, streaming and not. "default" is the gateway with the
README's minimal config; "pass-through" is the same gateway with admission and flow control off and the
least_loaded strategy; "direct" is the load generator talking to the upstream itself. Each gateway runs through
the whole sweep (the sim engine's model is learned as it goes, as it would be in production). The table gives
requests per second, the latency the gateway adds at p50 and p99 over direct (send to last byte, as the client
measures it), non-200 answers (refusals), and default / pass-through.

Usage: python bench/harm.py [--seconds 3] [--connections 1,8,32,64,128,256] [--upstreams fast,partner,sim]
       [--baseline DIR]  (also the default config of another checkout, e.g. a git worktree of an older commit)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import build_request, drive  # noqa: E402
from tests.support.procs import free_port, wait_http  # noqa: E402

KEY = "bench-harm-key-0123456789"
MODES = ("default", "pass-through")


def gateway_yaml(tmp: Path, name: str, port: int, backend: dict, routing: dict | None) -> Path:
    cfg = {"server": {"host": "127.0.0.1", "port": port}, "backends": [backend],
           "keys": [{"key_env": "BENCH_KEY", "tenant": "bench"}],
           "policy": {"audit_path": str(tmp / f"audit-{name}.jsonl")},
           "identity": {"sqlite_path": str(tmp / f"id-{name}.db")},
           "budgets": {"sqlite_path": str(tmp / f"budgets-{name}.db")},
           "observability": {"log_level": "warning"}}
    if routing:
        cfg["routing"] = routing
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(cfg))
    return path


PASS_THROUGH = {"admission": False, "strategy": "least_loaded", "flow_control": {"enabled": False}}


def start(cmd: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, "BENCH_KEY": KEY, "PYTHONPATH": str(cwd)},
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")


def cell(port: int, req: bytes, conns: int, seconds: float) -> dict:
    ok, err, lat = asyncio.run(drive("127.0.0.1", port, req, conns, seconds))
    return {"rps": (ok + err) / seconds, "ok": ok, "refused": err, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99)}


def upstreams(names: list[str], tmp: Path) -> list[tuple[str, dict, subprocess.Popen, int, str]]:
    """(name, backend config, process, port, model) per upstream, started."""
    out = []
    for name in names:
        port = free_port()
        if name in ("fast", "partner"):
            args = [sys.executable, str(ROOT / "bench/fast_upstream.py"), str(port)]
            if name == "partner":
                args += ["200", "10"]
            p = start(args, tmp / f"{name}.log")
            wait_http(f"http://127.0.0.1:{port}/health", proc=p)
            backend = {"name": name, "kind": "openai", "url": f"http://127.0.0.1:{port}/v1", "models": ["m"],
                       "location": {"country": "DE"}, "retention": "zero", "health": {"enabled": False}}
            out.append((name, backend, p, port, "m"))
        elif name == "sim":
            man = tmp / "fleet.json"
            p = start([sys.executable, "-m", "gateway", "sim", "--engines", "1", "--profile", "vllm-default",
                       "--base-port", str(port), "--manifest", str(man)], tmp / "sim.log")
            for _ in range(200):
                if man.exists() and man.stat().st_size:
                    break
                asyncio.run(asyncio.sleep(0.05))
            e = json.loads(man.read_text())["engines"][0]
            eport = int(e["url"].rsplit(":", 1)[1].split("/")[0])
            wait_http(e["url"].rsplit("/v1", 1)[0] + "/health", proc=p)
            backend = {"name": "sim", "kind": "sim", "url": e["url"], "models": ["sim-model"],
                       "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                       "location": {"country": "DE"}}
            out.append((name, backend, p, eport, "sim-model"))
        else:
            sys.exit(f"unknown upstream {name!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--connections", default="1,8,32,64,128,256")
    ap.add_argument("--upstreams", default="fast,partner,sim")
    ap.add_argument("--baseline", default=None, metavar="DIR", help="also the default config of this checkout")
    a = ap.parse_args()
    conns = [int(x) for x in a.connections.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-harm-"))
    ups = upstreams(a.upstreams.split(","), tmp)
    modes = list(MODES) + (["baseline"] if a.baseline else [])
    rows = []
    try:
        for name, backend, _, uport, model in ups:
            gws: dict[str, tuple[subprocess.Popen, int]] = {}
            try:
                for mode in modes:
                    port = free_port()
                    tree = Path(a.baseline).resolve() if mode == "baseline" else ROOT
                    cfg = gateway_yaml(tmp, f"{name}-{mode}", port, backend,
                                       PASS_THROUGH if mode == "pass-through" else None)
                    gws[mode] = (start([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
                                       tmp / f"gw-{name}-{mode}.log", tree), port)
                    wait_http(f"http://127.0.0.1:{port}/healthz", proc=gws[mode][0])
                for stream in (False, True):
                    body = {"model": model, "max_tokens": 10,
                            "messages": [{"role": "user", "content": "a short question about the weather"}]}
                    if stream:
                        body["stream"] = True
                    raw = orjson.dumps(body)
                    greq = build_request("/v1/chat/completions", raw, {"authorization": f"Bearer {KEY}"})
                    dreq = build_request("/v1/chat/completions", raw)
                    for c in conns:
                        r = {"upstream": name, "stream": stream, "conns": c,
                             "direct": cell(uport, dreq, c, a.seconds)}
                        for mode in modes:
                            r[mode] = cell(gws[mode][1], greq, c, a.seconds)
                        rows.append(r)
                        print(json.dumps(r), file=sys.stderr, flush=True)
            finally:
                for p, _ in gws.values():
                    p.terminate()
                    p.wait(15)
    finally:
        for _, _, p, _, _ in ups:
            p.terminate()
            p.wait(15)
    head = ["upstream", "stream", "conns", "direct req/s"] + [f"{m} req/s" for m in modes] + \
        ["default / pass-through"] + [f"{m} added p50 / p99 ms" for m in modes] + [f"{m} non-200" for m in modes]
    print(f"{a.seconds:g} s per cell; log and configs in {tmp}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    ratios = []
    for r in rows:
        d = r["direct"]
        ratio = r["default"]["rps"] / max(1e-9, r["pass-through"]["rps"])
        ratios.append(ratio)
        vals = [r["upstream"], "yes" if r["stream"] else "no", str(r["conns"]), f"{d['rps']:.0f}"]
        vals += [f"{r[m]['rps']:.0f}" for m in modes] + [f"{ratio:.2f}"]
        vals += [f"{r[m]['p50'] - d['p50']:.1f} / {r[m]['p99'] - d['p99']:.1f}" for m in modes]
        vals += [str(r[m]["refused"]) for m in modes]
        print("| " + " | ".join(vals) + " |")
    print(f"\ndefault / pass-through req/s: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
