"""Batch lane benchmark (issue 22): does a large batch run in the fleet's spare capacity without costing realtime?

Fleet: one `backends.sim` process, two h200-8b engines slowed by --slow-factor (so a 2-core box can drive them to
saturation) with `--scheduling-policy priority` (the gateway sends batch lines at vLLM priority 10, realtime at
0). One gateway process with its defaults plus `routing.default_ttft_slo_ms` (admission on).
Phases, each `--seconds` long, with the same request shape for realtime and batch lines (a unique ~`--prompt`
word prompt, `--max-tokens` completion tokens):
  capacity  closed loop, `--clients` concurrent realtime streams: completed requests/s = C (admission trims it);
  saturated closed loop, `--cap-clients` streams with a 600 s TTFT target (nothing refused): the fleet's capacity;
  alone     realtime open loop (Poisson) at `--load` x C: TTFT p50/p90, goodput (200 and TTFT <= SLO, per s);
  with      the same realtime load while a `--lines`-line batch runs (submitted with the official openai SDK):
            the same figures, plus batch lines completed per second in the window.
Printed: one row per phase, then the realtime p90 ratio (with / alone), the goodput ratio (with / alone: the
share of sent realtime requests answered 200 within the SLO; per second too), the batch throughput as a share
of the spare capacity (saturated capacity - realtime rate, and of C - realtime rate), and from the audit
records the realtime TTFT split by whether a batch line started on the same engine near it.
Usage: python -m bench.batch_lane [--seconds 30] [--lines 2000] [--load 0.5] [--slow-factor 4] [--headroom 0.25]
       [--prefill-duty 1.0] [--clear-engines 1] [--max-prefilling 1] [--seed 1]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.sim.fleet import FleetProcess  # noqa: E402
from bench.routing import free_port, text  # noqa: E402
from tests.support.procs import start_gateway  # noqa: E402

KEY = "bench-batch-key-0123456789"
ADMIN = "bench-batch-admin-0123456789"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def body(rng: random.Random, words: int, max_tokens: int, stream: bool) -> dict:
    b = {"model": "sim-model", "max_tokens": max_tokens, "messages": [{"role": "user", "content": text(rng, words)}]}
    if stream:
        b["stream"] = True
    return b


async def one(client: httpx.AsyncClient, base: str, b: dict, out: list, slo_hdr: str | None = None) -> None:
    t0 = time.perf_counter()
    ttft = None
    hdrs = {"authorization": f"Bearer {KEY}"}
    if slo_hdr:
        hdrs["x-ttft-slo-ms"] = slo_hdr  # the capacity phase: no admission refusal trims what the fleet does
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=b, headers=hdrs) as r:
            status = r.status_code
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"content"' in line:
                    ttft = time.perf_counter() - t0
    except httpx.HTTPError:
        status = 599
    out.append((status, ttft, time.perf_counter() - t0))


async def closed_loop(base: str, clients: int, seconds: float, args, rng: random.Random,
                      slo_hdr: str | None = None) -> list:
    out: list = []
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients + 8)) as c:
        async def worker() -> None:
            while time.perf_counter() < stop:
                await one(c, base, body(rng, args.prompt, args.max_tokens, True), out, slo_hdr)
        await asyncio.gather(*(worker() for _ in range(clients)))
    return out


async def open_loop(base: str, rate: float, seconds: float, args, rng: random.Random) -> list:
    out: list = []
    tasks = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=512)) as c:
        t_end = time.perf_counter() + seconds
        nxt = time.perf_counter()
        while nxt < t_end:
            await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
            tasks.append(asyncio.create_task(one(c, base, body(rng, args.prompt, args.max_tokens, True), out)))
            nxt += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return out


def summary(name: str, res: list, seconds: float, slo_ms: float) -> dict:
    ok = [t for s, t, _ in res if s == 200 and t is not None]
    good = [t for t in ok if t * 1000 <= slo_ms]
    return {"phase": name, "sent": len(res), "ok": len(ok), "refused": sum(1 for s, _, _ in res if s == 429),
            "p50_ms": (pct(ok, 0.5) or 0) * 1000, "p90_ms": (pct(ok, 0.9) or 0) * 1000,
            "goodput_rps": len(good) / seconds, "rps": len(ok) / seconds,
            "good_share": len(good) / max(1, len(res))}


def _epoch(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts).timestamp()


def attribute(audit: Path, t0: float, t1: float, near_s: float) -> dict:
    """From the audit records: every realtime request answered in [t0, t1) (wall clock), grouped by whether a
    batch line was started on its engine within `near_s` before its arrival up to its first token (a batch
    prefill in the step it arrived during, or co-scheduled in its own step), and how many batch lines were
    decoding there when it arrived (started earlier, not yet answered)."""
    rt: list[tuple[float, str, float]] = []
    bl: dict[str, list[tuple[float, float]]] = {}
    for raw in audit.read_text().splitlines():
        try:
            r = json.loads(raw)
        except ValueError:
            continue
        if r.get("status") != 200 or not r.get("backend"):
            continue
        a = _epoch(r["ts"])
        if r.get("batch"):
            start = a + ((r.get("route") or {}).get("since_arrival_ms") or 0) / 1000
            bl.setdefault(r["backend"], []).append((start, a + (r.get("total_ms") or 0) / 1000))
        elif r.get("stream") and (r.get("ttft_ms") or {}).get("actual") is not None and t0 <= a < t1:
            rt.append((a, r["backend"], r["ttft_ms"]["actual"]))
    groups: dict[str, list[tuple[float, int]]] = {"no batch start near": [], "batch start near": []}
    for a, e, ttft in rt:
        ft = a + ttft / 1000
        lines = bl.get(e, [])
        near = sum(1 for s, _ in lines if a - near_s <= s < ft)
        dec = sum(1 for s, end in lines if s < a - near_s and end > a)
        groups["batch start near" if near else "no batch start near"].append((ttft, dec))
    out = {}
    for g, xs in groups.items():
        t = [x for x, _ in xs]
        out[g] = {"n": len(xs), "p50_ms": pct(t, 0.5), "p90_ms": pct(t, 0.9),
                  "mean_decoding_batch_lines": (sum(d for _, d in xs) / len(xs)) if xs else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=300, help="words per prompt (about 2 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slow-factor", type=float, default=4.0)
    ap.add_argument("--slo-ms", type=float, default=1500.0)
    ap.add_argument("--headroom", type=float, default=0.25, help="batch.headroom (lines start below headroom x SLO)")
    ap.add_argument("--prefill-duty", type=float, default=None, help="batch.prefill_duty (default: the config's)")
    ap.add_argument("--clear-engines", type=int, default=None, help="batch.clear_engines")
    ap.add_argument("--max-prefilling", type=int, default=None, help="batch.max_prefilling_per_engine")
    ap.add_argument("--cap-clients", type=int, default=64,
                    help="closed-loop clients of the capacity phase (sent with a 600 s TTFT target: nothing refused)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    fleet = FleetProcess(["--engines", "2", "--profile", "h200-8b", "--base-port", "0", "--scheduling-policy",
                          "priority", "--slow-factor", str(args.slow_factor)], tmp / "fleet.json")
    man = fleet.start()
    gw = None
    try:
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port},
               "backends": [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                             "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                             "priority_scheduling": True, "location": {"country": "DE"}} for e in man["engines"]],
               "keys": [{"key": KEY, "tenant": "bench"}], "admin": {"key": ADMIN},
               "identity": {"sqlite_path": str(tmp / "gateway.db")},
               "policy": {"audit_path": str(tmp / "audit.jsonl")},
               "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl")},
               "routing": {"default_ttft_slo_ms": args.slo_ms}, "telemetry": {"scrape_interval_s": 0.2},
               "batch": {"headroom": args.headroom,
                         **({"prefill_duty": args.prefill_duty} if args.prefill_duty is not None else {}),
                         **({"max_prefilling_per_engine": args.max_prefilling} if args.max_prefilling else {}),
                         **({"clear_engines": args.clear_engines} if args.clear_engines is not None else {})},
               "observability": {"log_level": "warning"}}
        path = tmp / "gateway.yaml"
        path.write_text(json.dumps(cfg))
        gw, _ = start_gateway(path)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(closed_loop(base, 4, 3.0, args, rng))  # warm the predictor
        cap = summary("capacity (SLO-trimmed)", asyncio.run(closed_loop(base, args.clients, args.seconds, args, rng)),
                      args.seconds, args.slo_ms)
        capacity = cap["rps"]
        time.sleep(2.0)
        sat = summary("capacity (saturated)", asyncio.run(closed_loop(base, args.cap_clients, args.seconds, args, rng,
                                                                      "600000")), args.seconds, args.slo_ms)
        fleet_cap = max(sat["rps"], capacity)
        rate = args.load * capacity
        time.sleep(2.0)
        ta0 = time.time()
        alone = summary("alone", asyncio.run(open_loop(base, rate, args.seconds, args, rng)), args.seconds, args.slo_ms)
        ta1 = time.time()
        time.sleep(2.0)
        from openai import OpenAI

        sdk = OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        data = "".join(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": body(rng, args.prompt, args.max_tokens, False)}) + "\n"
                       for i in range(args.lines)).encode()
        f = sdk.files.create(file=("bench.jsonl", io.BytesIO(data)), purpose="batch")
        b = sdk.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while sdk.batches.retrieve(b.id).status == "validating":
            time.sleep(0.1)
        time.sleep(2.0)  # the lane ramps up to the spare capacity
        c0, t0 = sdk.batches.retrieve(b.id).request_counts.completed, time.perf_counter()
        tw0 = time.time()
        with_ = summary("with batch", asyncio.run(open_loop(base, rate, args.seconds, args, rng)), args.seconds,
                        args.slo_ms)
        c1, t1 = sdk.batches.retrieve(b.id).request_counts.completed, time.perf_counter()
        tw1 = time.time()
        lane = httpx.get(base + "/admin/batch", headers={"authorization": f"Bearer {ADMIN}"}).json()
        sdk.batches.cancel(b.id)
        batch_rps = (c1 - c0) / (t1 - t0)
        spare = max(1e-9, capacity - with_["rps"])
        honest = max(1e-9, fleet_cap - with_["rps"])
        print(f"\nfleet: 2x h200-8b, slow-factor {args.slow_factor}, priority scheduling; SLO {args.slo_ms:.0f} ms, "
              f"batch.headroom {args.headroom}, prefill_duty {args.prefill_duty or 'default'}, "
              f"max_prefilling_per_engine {args.max_prefilling or 'default'}, "
              f"clear_engines {'default' if args.clear_engines is None else args.clear_engines}; "
              f"prompt ~{args.prompt} words, max_tokens {args.max_tokens}; realtime at {args.load:.0%} of capacity "
              f"= {rate:.2f} req/s; {args.seconds:.0f} s per phase; batch {args.lines} lines\n")
        print("| phase | sent | ok | 429 | TTFT p50 ms | TTFT p90 ms | goodput req/s | within SLO | realtime req/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in (cap, sat, alone, with_):
            print(f"| {r['phase']} | {r['sent']} | {r['ok']} | {r['refused']} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} "
                  f"| {r['goodput_rps']:.2f} | {r['good_share']:.1%} | {r['rps']:.2f} |")
        print(f"\nrealtime p90 ratio (with / alone): {with_['p90_ms'] / max(alone['p90_ms'], 1e-9):.2f}")
        print(f"realtime goodput ratio (with / alone, share of sent requests answered within the SLO): "
              f"{with_['good_share'] / max(alone['good_share'], 1e-9):.2f} (per second: "
              f"{with_['goodput_rps'] / max(alone['goodput_rps'], 1e-9):.2f}, Poisson arrivals differ per phase)")
        print(f"batch throughput: {batch_rps:.2f} lines/s = {batch_rps / honest:.0%} of the spare capacity "
              f"({honest:.2f} req/s = saturated fleet capacity {fleet_cap:.2f} - realtime {with_['rps']:.2f}); "
              f"{batch_rps / spare:.0%} of the SLO-trimmed closed-loop figure's spare ({spare:.2f} req/s)")
        time.sleep(1.0)  # the audit writer flushes
        for ph, (w0, w1) in (("alone", (ta0, ta1)), ("with batch", (tw0, tw1))):
            print(f"attribution ({ph}, audit records, batch start within 150 ms before arrival .. first token): "
                  f"{json.dumps(attribute(tmp / 'audit.jsonl', w0, w1, 0.15))}")
        print(f"batch lane at the end: {json.dumps(lane)}")
    finally:
        if gw is not None:
            gw.stop()
        fleet.stop()


if __name__ == "__main__":
    main()
