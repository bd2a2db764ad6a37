"""Live routing benchmark (issue 17): the gateway with its routing defaults in front of live simulator processes.

Fleet: one `backends.sim` process, four h200-8b engines with a chunked-prefill budget of 2048 tokens per step
(`--max-num-batched-tokens 2048`, which the gateway is not told: it learns it from the KV events) and speeds 1x,
1.5x, 2x and 0.75x (POST /sim/faults slow_factor = 1/speed). Tokens come from the engines' /tokenize (the
gateway's default `telemetry.tokenizer: auto` without a local tokenizer). Two gateway processes: ours
(`predicted_ttft`, admission on, every routing default) and `least_loaded` without admission, run one after the
other on the same fleet (prefix caches reset before each run).

Phases (each run on one gateway, then on the other, before the next phase), each measured from the client and
from the audit records (evidence) of the gateway:
  ladder-R  shared-prefix traffic at R req/s (Poisson; R = 8, 16, 32): 2500-token system prompts of groups
            that keep appearing (a new group every 0.5 s, requests spread over the 4 newest), so requests keep
            arriving while their prefix is still being prefilled somewhere; no TTFT target;
  burst     bursts of unique 1500-token prompts (24 at 150 req/s) with x-ttft-slo-ms cycling 150, 400, 1000 ms.
Printed (one table per gateway, then the side-by-side p90): per engine the KV-index agreement on cached tokens
(sum min(pred, actual) / max(sum pred, sum actual)), MdARE of the TTFT prediction, the calibration of the
admission bound (share of admitted requests whose TTFT was under the upper bound used, vs the target quantile),
route-stage time p50/p90 (stage_timings_us.route), rejection latency p50/p90 (client, and evidence
since_arrival_ms), and the p90 TTFT ratio ours / least-loaded per phase.
Usage: python -m bench.routing_live [--step-s 5] [--bursts 6] [--burst-size 24] [--slo-ms 400]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.routing import free_port, text

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-live-key-0123456789"
ADMIN = "bench-live-admin-0123456789"
SPEEDS = [1.0, 1.5, 2.0, 0.75]
BUDGET = 2048
LADDER = [8, 16, 32]
STRATEGIES = ("predicted_ttft", "least_loaded")
SYSTEM_TOKENS = 2500  # more than one 2048-token chunk: each new prefix takes two steps to prefill


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def gateway_config(tmp: Path, manifest: dict, strategy: str, port: int) -> Path:
    d = tmp / f"gw-{strategy}"
    d.mkdir(parents=True, exist_ok=True)
    backends = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                 "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                 "location": {"country": "DE"}, "timeouts": {"first_token_s": 60, "total_s": 120}}
                for e in manifest["engines"]]
    routing = {} if strategy == "predicted_ttft" else {"strategy": strategy, "admission": False}
    doc = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
           "keys": [{"key": KEY, "tenant": "bench"}], "admin": {"key": ADMIN}, "routing": routing,
           "policy": {"audit_path": str(d / "audit.jsonl")}, "data_dir": str(d / "var"),
           "identity": {"sqlite_path": str(d / "gw.db")},
           "budgets": {"sqlite_path": str(d / "budgets.db"), "spool_path": str(d / "spool.jsonl")},
           "observability": {"log_level": "warning"}}
    cfg = d / "gateway.yaml"
    cfg.write_text(json.dumps(doc))  # JSON is YAML
    return cfg


async def send(client: httpx.AsyncClient, base: str, body: dict, headers: dict, rid: str, out: list[dict]) -> None:
    t0 = time.perf_counter()
    rec = {"rid": rid, "status": None, "ttft_ms": None, "reject_ms": None}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body,
                                 headers={"authorization": f"Bearer {KEY}", "x-request-id": rid, **headers}) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                if r.status_code == 429:
                    rec["reject_ms"] = (time.perf_counter() - t0) * 1000
            else:
                async for line in r.aiter_lines():
                    if rec["ttft_ms"] is None and line.startswith("data: {") and '"content"' in line:
                        rec["ttft_ms"] = (time.perf_counter() - t0) * 1000
    except httpx.HTTPError:
        rec["status"] = -1
    out.append(rec)


def body_of(system: str | None, user: str) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": "sim-model", "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
            "messages": msgs}


async def ladder(base: str, rate: float, seconds: float, phase: str, out: list[dict], seed: int) -> None:
    rng = random.Random(seed)
    systems: dict[int, str] = {}
    tasks = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=500)) as client:
        t_start = time.perf_counter()
        i = 0
        while (t := time.perf_counter() - t_start) < seconds:
            g = seed * 1000 + int(t * 2) + rng.randrange(4)
            if g not in systems:
                systems[g] = f"You are assistant {g}. " + text(random.Random(g), SYSTEM_TOKENS)
            tasks.append(asyncio.create_task(send(client, base, body_of(systems[g], text(rng, 40)), {},
                                                  f"{phase}-{i}", out)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def bursts(base: str, n: int, size: int, rate: float, gap_s: float, slos: list[float], out: list[dict],
                 seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=500)) as client:
        tasks = []
        for b in range(n):
            for k in range(size):
                tasks.append(asyncio.create_task(send(client, base, body_of(None, text(rng, 1500)),
                                                      {"x-ttft-slo-ms": f"{slos[k % len(slos)]:g}"},
                                                      f"burst-{b}-{k}", out)))
                await asyncio.sleep(1.0 / rate)
            await asyncio.sleep(gap_s)
        await asyncio.gather(*tasks)


def read_audit(path: Path) -> dict[str, dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[r.get("client_request_id") or r["request_id"]] = r
    return out


def summarize(client: list[dict], audit: dict[str, dict], phase_of) -> dict:
    """Per engine and per phase numbers from the client records joined with the audit records."""
    eng: dict[str, dict] = {}
    phases: dict[str, dict] = {}
    for c in client:
        ph = phase_of(c["rid"])
        p = phases.setdefault(ph, {"ttft": [], "reject_ms": [], "reject_ev_ms": [], "route_us": [], "n": 0,
                                   "rejected": 0, "errors": 0})
        p["n"] += 1
        a = audit.get(c["rid"])
        if a is not None and (a.get("stage_timings_us") or {}).get("route") is not None:
            p["route_us"].append(a["stage_timings_us"]["route"])
        if c["status"] == 429:
            p["rejected"] += 1
            p["reject_ms"].append(c["reject_ms"])
            if a is not None and (a.get("route") or {}).get("since_arrival_ms") is not None:
                p["reject_ev_ms"].append(a["route"]["since_arrival_ms"])
            continue
        if c["status"] != 200 or c["ttft_ms"] is None:
            p["errors"] += 1
            continue
        p["ttft"].append(c["ttft_ms"])
        if a is None or not a.get("backend"):
            continue
        e = eng.setdefault(a["backend"], {"pred": 0, "act": 0, "agreed": 0, "ape": [], "cal": []})
        ct = a.get("cached_tokens") or {}
        if ct.get("predicted") is not None and ct.get("actual") is not None:
            e["pred"] += ct["predicted"]
            e["act"] += ct["actual"]
            e["agreed"] += min(ct["predicted"], ct["actual"])
        tt = a.get("ttft_ms") or {}
        if tt.get("predicted") and tt.get("actual"):
            e["ape"].append(abs(tt["actual"] - tt["predicted"]) / tt["actual"])
            pick = [x for x in (a.get("candidates") or []) if x.get("backend") == a["backend"]]
            up = pick[0].get("predicted_ttft_upper_ms") if pick else None
            if up:
                e["cal"].append(tt["actual"] <= up)
    return {"engines": eng, "phases": phases}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-live-"))
    mpath = tmp / "fleet.json"
    fleet = start([sys.executable, "-m", "backends.sim", "--engines", "4", "--profile", "h200-8b", "--base-port", "0",
                   "--max-num-batched-tokens", str(BUDGET), "--manifest", str(mpath), "--locations", "DE",
                   "--topic", "kv"], tmp / "fleet.log")
    results: dict[str, dict] = {}
    snaps: dict[str, dict] = {}
    try:
        for _ in range(300):
            if mpath.exists():
                break
            time.sleep(0.05)
        manifest = json.loads(mpath.read_text())
        names = [e["name"] for e in manifest["engines"]]
        async with httpx.AsyncClient() as c:  # the /tokenize round trip on the idle fleet: the floor of a decision
            root = manifest["engines"][0]["url"].removesuffix("/v1")
            rng = random.Random(5)
            tok_ms = []
            for _ in range(30):
                b = {"model": "sim-model", "add_generation_prompt": True,
                     "messages": [{"role": "system", "content": text(rng, SYSTEM_TOKENS)},
                                  {"role": "user", "content": text(rng, 40)}]}
                t0 = time.perf_counter()
                (await c.post(root + "/tokenize", json=b)).raise_for_status()
                tok_ms.append((time.perf_counter() - t0) * 1000)
            snaps["tokenize_ms"] = {"p50": pct(tok_ms, 0.5), "p90": pct(tok_ms, 0.9)}
            for e, speed in zip(manifest["engines"], SPEEDS):
                r = await c.post(e["url"].removesuffix("/v1") + "/sim/faults", json={"slow_factor": 1.0 / speed})
                r.raise_for_status()
        gws: dict[str, tuple[subprocess.Popen, str, Path]] = {}
        try:
            for strategy in STRATEGIES:
                port = free_port()
                cfg = gateway_config(tmp, manifest, strategy, port)
                gws[strategy] = (start([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)],
                                       cfg.parent / "log"), f"http://127.0.0.1:{port}", cfg.parent)
            for _, base, _ in gws.values():
                for _ in range(300):
                    try:
                        if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.1)
            await asyncio.sleep(1.0)  # first metrics scrape (block sizes)
            outs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
            # phase by phase, the two gateways one after the other (interleaved: the machine's noise hits both)
            phases = [(f"ladder{r}", r) for r in LADDER] + [("burst", None)]
            for k, (ph, rate) in enumerate(phases):
                for strategy, (_, base, _) in gws.items():
                    async with httpx.AsyncClient() as c:
                        for e in manifest["engines"]:
                            await c.post(e["url"].removesuffix("/v1") + "/reset_prefix_cache")
                    if rate is not None:
                        await ladder(base, rate, args.step_s, ph, outs[strategy], seed=k + 1)
                    else:
                        await bursts(base, args.bursts, args.burst_size, args.burst_rate, args.burst_gap_s,
                                     args.slo_ms, outs[strategy], seed=99)
                    await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)  # audit records flushed
            for strategy, (_, base, d) in gws.items():
                h = {"authorization": f"Bearer {ADMIN}"}
                snaps[strategy] = httpx.get(base + "/admin/routing", headers=h, timeout=10).json()
                results[strategy] = summarize(outs[strategy], read_audit(d / "audit.jsonl"),
                                              lambda rid: rid.split("-")[0])
        finally:
            for gw, _, _ in gws.values():
                stop(gw)
    finally:
        stop(fleet)
    print_tables(names, results, snaps, args)


def f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_tables(names: list[str], results: dict, snaps: dict, args: argparse.Namespace) -> None:
    ours, ll = results["predicted_ttft"], results["least_loaded"]
    snap = snaps["predicted_ttft"]
    q = snap["engines"].get(names[0], {}).get("calibration_target")
    print(f"\n## predicted_ttft (defaults), 4 engines h200-8b, speeds {SPEEDS}, chunk budget {BUDGET} (not configured)")
    print("| engine | speed | agreement (cached tokens) | cached tokens (engine) | MdARE | calibration (target "
          f"{q}) | requests | chunk budget (source) | fit resets |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, sp in zip(names, SPEEDS):
        e = ours["engines"].get(n, {})
        den = max(e.get("pred", 0), e.get("act", 0))
        agree = e["agreed"] / den if den else None
        md = statistics.median(e["ape"]) if e.get("ape") else None
        cal = sum(e["cal"]) / len(e["cal"]) if e.get("cal") else None
        fa = (snap["engines"].get(n) or {}).get("facts") or {}
        g = (snap["engines"].get(n) or {}).get("guard") or {}
        print(f"| {n} | {sp}x | {f(agree and agree * 100, '{:.2f}%')} | {e.get('act', 0)} "
              f"| {f(md and md * 100, '{:.1f}%')} "
              f"| {f(cal and cal * 100, '{:.1f}%')} | {len(e.get('ape', []))} "
              f"| {fa.get('chunk_budget')} ({fa.get('chunk_budget_source')}) | {g.get('resets')} |")
    print("\n| phase | reqs | rejected | route stage p50 / p90 ms | rejection p50 / p90 ms (client) "
          "| rejection p50 ms (evidence, since arrival) | TTFT p90 ms ours | least-loaded | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ph, p in ours["phases"].items():
        lp = ll["phases"].get(ph, {})
        r50, r90 = pct(p["route_us"], 0.5), pct(p["route_us"], 0.9)
        o90, l90 = pct(p["ttft"], 0.9), pct(lp.get("ttft", []), 0.9)
        print(f"| {ph} | {p['n']} | {p['rejected']} | {f(r50 and r50 / 1000, '{:.2f}')} / "
              f"{f(r90 and r90 / 1000, '{:.2f}')} | {f(pct(p['reject_ms'], 0.5))} / {f(pct(p['reject_ms'], 0.9))} "
              f"| {f(pct(p['reject_ev_ms'], 0.5), '{:.2f}')} | {f(o90, '{:.0f}')} | {f(l90, '{:.0f}')} "
              f"| {f(o90 / l90 if o90 and l90 else None, '{:.2f}')} |")
    tk = snaps.get("tokenize_ms") or {}
    print(f"\n/tokenize of a {SYSTEM_TOKENS}-token chat on the idle fleet (client -> sim, before the phases): "
          f"p50 {f(tk.get('p50'), '{:.2f}')} ms, p90 {f(tk.get('p90'), '{:.2f}')} ms")
    print(f"admission counters: {snap.get('admission')}; errors ours "
          f"{sum(p['errors'] for p in ours['phases'].values())}, least-loaded "
          f"{sum(p['errors'] for p in ll['phases'].values())}; bursts: {args.bursts} x {args.burst_size} unique "
          f"1500-token prompts at {args.burst_rate:g} req/s, x-ttft-slo-ms cycling {args.slo_ms}, "
          f"{args.burst_gap_s} s apart; "
          f"ladder steps {args.step_s} s, {SYSTEM_TOKENS}-token system prompts")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-s", type=float, default=5.0, help="seconds per ladder step")
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--burst-size", type=int, default=24)
    ap.add_argument("--burst-rate", type=float, default=150.0, help="requests/s within a burst")
    ap.add_argument("--burst-gap-s", type=float, default=1.5)
    ap.add_argument("--slo-ms", type=lambda v: [float(x) for x in v.split(",")], default=[150.0, 400.0, 1000.0],
                    help="x-ttft-slo-ms values cycled over a burst's requests")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
