"""Routing benchmark: round-robin vs least-loaded vs approximate prefix-hash vs predicted-TTFT (ours).

One simulated heterogeneous fleet (backends/sim, one subprocess: 2x h200-8b + 2x l40s-8b with a small KV cache
so prefixes cannot all live everywhere), one gateway process per strategy, three workloads:
  shared_prefix  groups of users sharing long system prompts (llm-d style), Poisson arrivals above the
                 fleet's no-cache capacity;
  multi_turn     closed-loop conversations whose context grows each turn (x-session-id set);
  overload       unique long prompts at 2x the fleet's capacity with a TTFT target (x-ttft-slo-ms).
Prints one table. Usage: python -m bench.routing [--seconds 8] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key-0123456789"
ADMIN = "bench-admin-0123456789"
PROFILES = ["h200-8b", "h200-8b", "l40s-8b", "l40s-8b"]
# The sim's cost model (backends/sim/profiles.py): seconds per prefill token and per step.
PREFILL_S = {"h200-8b": 1 / 16000, "l40s-8b": 1 / 6000}
STEP_S = {"h200-8b": 0.007, "l40s-8b": 0.020}
NUM_GPU_BLOCKS = 900  # 14.4k tokens of KV per engine: about four 3k-token system prompts
STRATEGIES = ["round_robin", "least_loaded", "prefix_hash", "predicted_ttft"]
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randrange(1000)) for _ in range(n))


def capacity_rps(prompt_tokens: int) -> float:
    """Requests/s the fleet can prefill with no cache hits (sum over engines of 1 / service time)."""
    return sum(1.0 / (prompt_tokens * PREFILL_S[p] + STEP_S[p]) for p in PROFILES)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    met: int = 0
    rejected: int = 0
    reject_ms: list[float] = field(default_factory=list)
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pred: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # engine -> (pred, actual)


async def one(client: httpx.AsyncClient, base: str, body: dict, headers: dict, res: Result | None,
              slo_ms: float | None, measure: bool = True) -> str:
    t0 = time.perf_counter()
    h = {"authorization": f"Bearer {KEY}", **headers}
    reply = ""
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=h) as r:
            if r.status_code == 429:
                await r.aread()
                if res is not None and measure:
                    res.rejected += 1
                    res.reject_ms.append((time.perf_counter() - t0) * 1000)
                return ""
            if r.status_code != 200:
                await r.aread()
                if res is not None and measure:
                    res.errors += 1
                return ""
            ttft = None
            usage = None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                ch = obj.get("choices") or []
                if ch and ttft is None and (ch[0].get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                if ch:
                    reply += (ch[0].get("delta") or {}).get("content") or ""
                if obj.get("usage"):
                    usage = obj["usage"]
            if res is None or not measure or ttft is None:
                return reply
            res.ok += 1
            res.ttft.append(ttft)
            if slo_ms is None or ttft * 1000 <= slo_ms:
                res.met += 1
            if usage:
                res.prompt_tokens += usage.get("prompt_tokens", 0)
                res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            pm = r.headers.get("x-predicted-ttft-ms")
            eng = r.headers.get("x-gateway-backend")
            if pm and eng:
                res.pred.setdefault(eng, []).append((float(pm), ttft * 1000))
    except (httpx.HTTPError, json.JSONDecodeError):
        if res is not None and measure:
            res.errors += 1
    return reply


async def open_loop(base: str, make, rate: float, seconds: float, res: Result | None, slo_ms: float | None,
                    seed: int) -> None:
    rng = random.Random(seed)
    tasks = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as client:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            body, hdrs = make(rng)
            tasks.append(asyncio.create_task(one(client, base, body, hdrs, res, slo_ms)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


def shared_prefix_maker(groups: int, sys_tokens: int, seed: int = 7):
    g = random.Random(seed)
    prompts = [f"You are assistant {i}. " + text(g, sys_tokens) for i in range(groups)]
    weights = [1.0 / (i + 1) ** 0.3 for i in range(groups)]

    def make(rng: random.Random) -> tuple[dict, dict]:
        i = rng.choices(range(groups), weights)[0]
        return ({"model": "sim-model", "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
                 "messages": [{"role": "system", "content": prompts[i]},
                              {"role": "user", "content": text(rng, 40)}]}, {})
    return make


def overload_maker(tokens: int, slo_ms: float):
    def make(rng: random.Random) -> tuple[dict, dict]:
        return ({"model": "sim-model", "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
                 "messages": [{"role": "user", "content": text(rng, tokens)}]}, {"x-ttft-slo-ms": str(slo_ms)})
    return make


async def multi_turn(base: str, convs: int, turns: int, res: Result | None, seed: int) -> None:
    g = random.Random(seed)
    sys_prompt = "You are a patient tutor. " + text(g, 1000)

    async def conv(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 100 + i)
        msgs = [{"role": "system", "content": sys_prompt}]
        await asyncio.sleep(rng.uniform(0, 1.0))
        for _ in range(turns):
            msgs.append({"role": "user", "content": text(rng, 150)})
            body = {"model": "sim-model", "stream": True, "max_tokens": 16, "messages": list(msgs),
                    "stream_options": {"include_usage": True}}
            reply = await one(client, base, body, {"x-session-id": f"s{seed}-{i}"}, res, None)
            msgs.append({"role": "assistant", "content": reply or "ok"})
            await asyncio.sleep(rng.uniform(0.1, 0.4))

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as client:
        await asyncio.gather(*(conv(i, client) for i in range(convs)))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def gateway_config(tmp: Path, manifest: dict, strategy: str, port: int) -> Path:
    cfg = tmp / f"gw-{strategy}" / "gateway.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    backends = []
    for e in manifest["engines"]:
        backends.append({"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                         "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                         "location": {"country": "DE"}, "timeouts": {"first_token_s": 60, "total_s": 120},
                         "health": {"enabled": False}})
    doc = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
           "keys": [{"key": KEY, "tenant": "bench"}], "admin": {"key": ADMIN},
           "routing": {"strategy": strategy, "admission": strategy == "predicted_ttft"},
           "telemetry": {"scrape_interval_s": 0.25},
           "observability": {"log_level": "warning"}}
    cfg.write_text(json.dumps(doc))  # JSON is YAML
    return cfg


async def reset_fleet(manifest: dict) -> None:
    async with httpx.AsyncClient() as c:
        for e in manifest["engines"]:
            await c.post(e["url"].removesuffix("/v1") + "/reset_prefix_cache")
    await asyncio.sleep(0.3)


async def run_all(seconds: float, workloads: list[str]) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    mpath = tmp / "fleet.json"
    fleet = subprocess.Popen([sys.executable, "-m", "backends.sim", "--engines", "4", "--profile", ",".join(PROFILES),
                              "--base-port", "0", "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--manifest", str(mpath),
                              "--locations", "DE"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    gws: dict[str, tuple[subprocess.Popen, str]] = {}
    rows: list[dict] = []
    try:
        for _ in range(200):
            if mpath.exists():
                break
            time.sleep(0.05)
        manifest = json.loads(mpath.read_text())
        for s in STRATEGIES:
            port = free_port()
            cfg = gateway_config(tmp, manifest, s, port)
            p = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=open(cfg.parent / "log", "wb"),
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            gws[s] = (p, f"http://127.0.0.1:{port}")
        for s, (p, base) in gws.items():
            for _ in range(300):
                try:
                    if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        sp_tokens, ov_tokens, slo = 3000, 3000, 1000.0
        for w in workloads:
            for s in STRATEGIES:
                base = gws[s][1]
                await reset_fleet(manifest)
                res = Result()
                t0 = time.perf_counter()
                if w == "shared_prefix":
                    rate = 1.6 * capacity_rps(sp_tokens)
                    mk = shared_prefix_maker(12, sp_tokens)
                    await open_loop(base, mk, 8, 2.5, None, None, 1)  # warm-up (not measured)
                    t0 = time.perf_counter()
                    await open_loop(base, mk, rate, seconds, res, None, 2)
                    dur = seconds
                elif w == "multi_turn":
                    await multi_turn(base, 16, 6, res, 3)
                    dur = time.perf_counter() - t0
                else:
                    cap = capacity_rps(ov_tokens)
                    await open_loop(base, overload_maker(ov_tokens, slo), 0.5 * cap, 1.5, None, slo, 4)  # warm-up
                    t0 = time.perf_counter()
                    await open_loop(base, overload_maker(ov_tokens, slo), 2 * cap, seconds, res, slo, 5)
                    dur = seconds
                admitted = res.ok
                mape = {}
                for eng, pairs in sorted(res.pred.items()):
                    mape[eng] = statistics.mean(abs(p - a) / a for p, a in pairs) if pairs else None
                rows.append({
                    "workload": w, "strategy": s, "requests": res.ok + res.rejected + res.errors,
                    "p50": pct(res.ttft, 0.5) * 1000, "p90": pct(res.ttft, 0.9) * 1000,
                    "p99": pct(res.ttft, 0.99) * 1000,
                    "goodput": res.met / dur, "met_of_admitted": res.met / admitted if admitted else float("nan"),
                    "rejected": res.rejected, "reject_p99_ms": pct(res.reject_ms, 0.99) if res.reject_ms else None,
                    "errors": res.errors,
                    "cached_ratio": res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0.0,
                    "mape": mape, "capacity": capacity_rps(ov_tokens) if w == "overload" else None,
                })
                print_row(rows[-1], file=sys.stderr)
    finally:
        for p, _ in gws.values():
            p.send_signal(signal.SIGTERM)
        for p, _ in gws.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        fleet.send_signal(signal.SIGTERM)
        try:
            fleet.wait(10)
        except subprocess.TimeoutExpired:
            fleet.kill()
    return rows


HEADER = ("| workload | strategy | reqs | TTFT p50 ms | p90 ms | p99 ms | goodput req/s | met/admitted | rejected "
          "| reject p99 ms | cached ratio | MAPE per engine |")


def fmt_row(r: dict) -> str:
    mape = " ".join(f"{k.split('-')[-1]}:{v * 100:.0f}%" for k, v in r["mape"].items() if v is not None) or "-"
    if r["strategy"] != "predicted_ttft":
        mape = "-"
    rj = f"{r['reject_p99_ms']:.1f}" if r["reject_p99_ms"] is not None else "-"
    return (f"| {r['workload']} | {r['strategy']} | {r['requests']} | {r['p50']:.0f} | {r['p90']:.0f} | {r['p99']:.0f} "
            f"| {r['goodput']:.1f} | {r['met_of_admitted'] * 100:.1f}% | {r['rejected']} | {rj} "
            f"| {r['cached_ratio']:.2f} | {mape} |")


def print_row(r: dict, file=sys.stdout) -> None:
    print(fmt_row(r), file=file, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workloads", default="shared_prefix,multi_turn,overload")
    args = ap.parse_args()
    t0 = time.time()
    rows = asyncio.run(run_all(args.seconds, args.workloads.split(",")))
    print(f"fleet: {', '.join(PROFILES)} (sim, {NUM_GPU_BLOCKS} KV blocks of 16 tokens each); "
          f"overload capacity {capacity_rps(3000):.1f} req/s (3000-token prompts, TTFT target 1000 ms)")
    print(HEADER)
    print("|" + "---|" * 12)
    for r in rows:
        print_row(r)
    print(f"wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
