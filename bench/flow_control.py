"""Flow-control benchmark (issue 21): gateway processes in front of live simulator processes, over HTTP.

Fleet (bench/routing_live's): one `backends.sim` process, four vllm-default engines (L40S cost model, chunked
prefill budget 2048 tokens per step, max_model_len 16384) at speeds 1x, 1.5x, 2x and 0.75x (POST /sim/faults
slow_factor = 1/speed). Capacity comes from the sim's cost model, in prefill tokens/s: sum over engines of
speed x budget / (step overhead + budget x prefill cost) (~29.8k tokens/s), divided by the mean prompt size of
the workload. Three gateway configurations, one gateway process at a time on the same fleet, each running every
scenario below (prefix caches reset before every run, a few unmeasured seconds of light traffic first so the
gateway has learned the engines' chunk budget and prefill rates):
  flow control  predicted_ttft routing, admission on, `routing.flow_control` defaults (enabled);
  flow off      the same with `routing.flow_control.enabled: false`;
  least_loaded  `routing.strategy: least_loaded`, `admission: false` (flow_control at its defaults);
  (least_loaded flow off, only with --configs: the same with `flow_control.enabled: false`).

Scenarios; every prompt is unique random text (no prefix sharing), streaming, max_tokens 16, TTFT measured at
the client (first content chunk). Arrival times and prompts are drawn once from --seed and replayed as they are
on every configuration:
  long-mix    Poisson arrivals at --load (0.6) of the fleet's capacity for the mix; 5% carry a 12k-token prompt
              with `x-ttft-slo-ms: 6000`, the rest 200-600 tokens with `x-ttft-slo-ms: 1000`. Baseline
              `short-only`: the same short arrivals (same times, same prompts) without the long ones.
              Reported: short TTFT p90 mix / short-only, short goodput (requests meeting their target per second
              of the run) mix / short-only, share of the long requests served within 6 s (and their 429s).
  two tenants API keys of tenants a and b (equal shares: no policy sets one), short requests only (200-600
              tokens, `x-ttft-slo-ms: 1000`). Fair share = half the fleet's capacity for short prompts. A sends
              Poisson at 0.6x its share, B at 3x. Baseline `A solo`: the same A arrivals without B.
              Reported: A's TTFT p90 and goodput mixed / solo, A's 429s, B's served rate (200 answers per second)
              and goodput as a fraction of its share, B's 429s and their client-side latency p50.
Every row shows the issue's target where it has one. Client numbers are the measure; the audit file only adds
the refusal reasons of the 429s (`error`/`route.admission` of their records). `lag p99` is how late the client fired its arrivals (CPU
saturation of the load generator shows there first: the two-tenant run fires ~135 req/s, more than two shared
cores drive at once; --time-scale K runs the same load in slow motion: every engine K x slower, every rate / K,
every target x K). Each run's processes are stopped in finally blocks, the temporary directory removed (--keep).
Usage: python -m bench.flow_control [--seconds 30] [--load 0.6] [--seed 21] [--only longmix|tenants]
       [--configs "flow control,flow off,least_loaded"] [--dump DIR] [--time-scale 1] [--keep]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.routing import free_port, text
from bench.routing_live import (BUDGET, KEY, PROFILE, SPEEDS, body_of, capacity_rps, gateway_config, pct,
                                read_audit, send, start, stop)

KEY_A = "bench-flow-tenant-a-0123456789"
KEY_B = "bench-flow-tenant-b-0123456789"
CONFIGS: dict[str, dict] = {
    "flow control": {},
    "flow off": {"flow_control": {"enabled": False}},
    # the baseline: least-loaded routing with none of the gateway's own control (no admission, no flow control)
    "least_loaded": {"strategy": "least_loaded", "admission": False, "flow_control": {"enabled": False}},
}
DEFAULT_CONFIGS = ("flow control", "flow off", "least_loaded")
SHORT_TOKENS = (200, 600)
LONG_TOKENS = 12_000  # + template + max_tokens stays under vllm-default's max_model_len 16384
LONG_SHARE = 0.05
SHORT_SLO_MS, LONG_SLO_MS = 1000.0, 6000.0
MAX_TOKENS = 16
A_LOAD, B_LOAD = 0.6, 3.0  # x the tenant's fair share
TEMPLATE_TOKENS = 8  # the sim's ChatML around one user message (backends/sim/tokenizer.render_chat)
SCALE = [1.0]  # --time-scale: every engine K times slower, rates / K, targets x K (set once by main)


def cap_rps(prompt_tokens: int) -> float:
    """routing_live's capacity (req/s for unique prompts of this size) of the fleet slowed by --time-scale."""
    return capacity_rps(prompt_tokens) / SCALE[0]


@dataclass(frozen=True)
class Arrival:
    at: float  # offset from the run's start, s
    rid: str  # kind-index: short-12, long-3, a-5, b-7
    tokens: int
    slo: float
    key: str


def kind(rid: str) -> str:
    return rid.split("-", 1)[0]


def poisson(rng: random.Random, rate: float, seconds: float) -> list[float]:
    out, t = [], 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append(t)
    return out


def short_mean() -> float:
    return (SHORT_TOKENS[0] + SHORT_TOKENS[1]) / 2 + TEMPLATE_TOKENS


def mix_mean() -> float:
    return LONG_SHARE * (LONG_TOKENS + TEMPLATE_TOKENS) + (1 - LONG_SHARE) * short_mean()


def longmix_schedule(seconds: float, load: float, seed: int) -> list[Arrival]:
    """Poisson at load x capacity for the mix's mean prompt; each arrival is long with probability LONG_SHARE.
    Filtering out the long ones gives the short-only run's arrivals (same times, same rids)."""
    rng = random.Random(seed)
    out: list[Arrival] = []
    ns = nl = 0
    for at in poisson(rng, load * cap_rps(int(mix_mean())), seconds):
        if rng.random() < LONG_SHARE:
            out.append(Arrival(at, f"long-{nl}", LONG_TOKENS, LONG_SLO_MS * SCALE[0], KEY))
            nl += 1
        else:
            out.append(Arrival(at, f"short-{ns}", rng.randint(*SHORT_TOKENS), SHORT_SLO_MS * SCALE[0], KEY))
            ns += 1
    return out


def fair_share_rps() -> float:
    return cap_rps(int(short_mean())) / 2


def tenants_schedule(seconds: float, seed: int) -> list[Arrival]:
    """Tenant A at A_LOAD x its share, tenant B at B_LOAD x; two independent streams, so dropping B's arrivals
    gives the A-solo run."""
    share = fair_share_rps()
    out: list[Arrival] = []
    for name, key, load, s in (("a", KEY_A, A_LOAD, seed + 1), ("b", KEY_B, B_LOAD, seed + 2)):
        rng = random.Random(s)
        out += [Arrival(at, f"{name}-{i}", rng.randint(*SHORT_TOKENS), SHORT_SLO_MS * SCALE[0], key)
                for i, at in enumerate(poisson(rng, load * share, seconds))]
    return sorted(out, key=lambda a: a.at)


def prompts_for(arrivals: list[Arrival], seed: int) -> dict[str, str]:
    """A unique random text per rid (its rid first, then random words of one token each in the sim's
    tokenizer), drawn once so every configuration gets the same bytes."""
    return {a.rid: f"[{a.rid}] " + text(random.Random(f"{seed}/{a.rid}"), a.tokens - 3) for a in arrivals}


def make_config(tmp: Path, manifest: dict, name: str, port: int) -> Path:
    """routing_live's gateway config with this configuration's routing section and the two tenants' keys."""
    base = "least_loaded" if CONFIGS[name].get("strategy") == "least_loaded" else "predicted_ttft"
    cfg = gateway_config(tmp / name.replace(" ", "_"), manifest, base, port)
    doc = json.loads(cfg.read_text())
    doc["routing"] = json.loads(json.dumps(CONFIGS[name]))
    fc = doc["routing"].setdefault("flow_control", {})
    if SCALE[0] != 1 and fc.get("enabled", True):  # slow motion: the gate's own times slow down with the engines
        fc.setdefault("engine_queue_ms", 100.0 * SCALE[0])
        fc.setdefault("tick_ms", 10.0 * SCALE[0])
    doc["keys"] = doc["keys"] + [{"key": KEY_A, "tenant": "a"}, {"key": KEY_B, "tenant": "b"}]
    cfg.write_text(json.dumps(doc))
    return cfg


async def fire(base: str, arrivals: list[Arrival], prompts: dict[str, str], out: list[dict]) -> None:
    """Open loop: each arrival at its time (a task per request), then wait for every answer."""
    lag: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=5000,
                                                                  max_keepalive_connections=500)) as client:
        tasks = []
        t0 = time.perf_counter()
        for a in arrivals:
            d = a.at - (time.perf_counter() - t0)
            if d > 0:
                await asyncio.sleep(d)
            lag[a.rid] = (time.perf_counter() - t0 - a.at) * 1000
            body = body_of(None, prompts[a.rid])
            body["max_tokens"] = MAX_TOKENS
            hdr = {"x-ttft-slo-ms": f"{a.slo:g}", "authorization": f"Bearer {a.key}"}
            tasks.append(asyncio.create_task(send(client, base, body, hdr, a.rid, out, at=a.at, slo=a.slo)))
        await asyncio.gather(*tasks)
    for r in out:
        r["lag_ms"] = lag.get(r["rid"])


def stats(recs: list[dict], k: str, seconds: float) -> dict:
    """One kind's numbers in one run: TTFT of the 200 answers, goodput, 429s (and their latency), errors."""
    rs = [r for r in recs if kind(r["rid"]) == k]
    ok = [r["ttft_ms"] for r in rs if r["status"] == 200 and r["ttft_ms"] is not None]
    met = sum(1 for r in rs if r["status"] == 200 and r["ttft_ms"] is not None and r["ttft_ms"] <= r["slo"])
    rej = [r["reject_ms"] for r in rs if r["status"] == 429]
    return {"n": len(rs), "ok": len(ok), "met": met, "goodput": met / seconds, "served_rps": len(ok) / seconds,
            "p50": pct(ok, 0.5), "p90": pct(ok, 0.9), "r429": len(rej), "r429_p50": pct(rej, 0.5),
            "e5xx": sum(1 for r in rs if (r["status"] or 0) >= 500),
            "other": sum(1 for r in rs if r["status"] not in (200, 429) and (r["status"] or 0) < 500
                         or r["status"] == 200 and r["ttft_ms"] is None)}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_config(runs: dict[str, list[dict]], seconds: float, reasons: Counter) -> dict:
    """The table's numbers for one configuration from its runs' client records."""
    out: dict = {"reasons": dict(reasons)}
    lags = [r["lag_ms"] for recs in runs.values() for r in recs if r.get("lag_ms") is not None]
    out["lag_p99"] = pct(lags, 0.99)
    out["errors"] = {run: {"5xx": sum(1 for r in recs if (r["status"] or 0) >= 500),
                           "other": sum(1 for r in recs if r["status"] == -1 or r["status"] == 200
                                        and r["ttft_ms"] is None)} for run, recs in runs.items()}
    if "mix" in runs:
        s, b, lg = stats(runs["mix"], "short", seconds), stats(runs["short-only"], "short", seconds), \
            stats(runs["mix"], "long", seconds)
        out["longmix"] = {"short": s, "base": b, "long": lg, "p90_ratio": ratio(s["p90"], b["p90"]),
                          "goodput_ratio": ratio(s["goodput"], b["goodput"]),
                          "long_met_share": ratio(lg["met"], lg["n"])}
    if "mixed" in runs:
        a, solo, bb = stats(runs["mixed"], "a", seconds), stats(runs["solo"], "a", seconds), \
            stats(runs["mixed"], "b", seconds)
        share = fair_share_rps()
        out["tenants"] = {"a": a, "solo": solo, "b": bb, "p90_ratio": ratio(a["p90"], solo["p90"]),
                          "goodput_ratio": ratio(a["goodput"], solo["goodput"]),
                          "b_served_share": bb["served_rps"] / share, "b_goodput_share": bb["goodput"] / share}
    return out


def f(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_table(res: dict[str, dict], args: argparse.Namespace) -> None:
    names = list(res)
    cap_mix, cap_short = cap_rps(int(mix_mean())), cap_rps(int(short_mean()))
    print(f"\n## flow control, live fleet: 4 x {PROFILE} engines, speeds {SPEEDS}, chunk budget {BUDGET}; "
          f"{args.seconds:g} s per run, seed {args.seed}"
          + (f"; --time-scale {SCALE[0]:g}: engines {SCALE[0]:g}x slower, rates / {SCALE[0]:g}, targets and "
             f"flow_control's engine_queue_ms and tick_ms x {SCALE[0]:g}"
             if SCALE[0] != 1 else ""))
    if not args.only or args.only == "longmix":
        print(f"long-mix: {args.load:g} x {cap_mix:.1f} req/s (capacity for a {mix_mean():.0f}-token mean prompt), "
              f"{LONG_SHARE:.0%} {LONG_TOKENS}-token prompts (target {LONG_SLO_MS * SCALE[0]:g} ms), the rest "
              f"{SHORT_TOKENS[0]}-{SHORT_TOKENS[1]} tokens (target {SHORT_SLO_MS * SCALE[0]:g} ms), max_tokens {MAX_TOKENS}")
    if not args.only or args.only == "tenants":
        print(f"two tenants: fair share {fair_share_rps():.1f} req/s each (half of {cap_short:.1f} req/s for "
              f"{short_mean():.0f}-token prompts); A at {A_LOAD:g}x, B at {B_LOAD:g}x its share, target "
              f"{SHORT_SLO_MS * SCALE[0]:g} ms")
    print("\n| metric | target | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))

    def row(label: str, target: str, get) -> None:
        vals = []
        for n in names:
            try:
                vals.append(get(res[n]))
            except KeyError:
                vals.append("-")
        print(f"| {label} | {target} | " + " | ".join(vals) + " |")

    if not args.only or args.only == "longmix":
        L = lambda r: r["longmix"]  # noqa: E731
        row("long-mix: short p90 mix / short-only", "<= 1.5x", lambda r: f(L(r)["p90_ratio"]) + "x")
        row("long-mix: short p90 ms mix / short-only", "", lambda r: f"{f(L(r)['short']['p90'], '{:.0f}')} / "
            f"{f(L(r)['base']['p90'], '{:.0f}')}")
        row("long-mix: short goodput mix / short-only", ">= 0.9x", lambda r: f(L(r)["goodput_ratio"]) + "x")
        row("long-mix: short goodput req/s mix / short-only", "", lambda r: f"{L(r)['short']['goodput']:.2f} / "
            f"{L(r)['base']['goodput']:.2f}")
        row("long-mix: long served within target", ">= 90%", lambda r: f"{f(L(r)['long_met_share'] and L(r)['long_met_share'] * 100, '{:.0f}')}% "
            f"({L(r)['long']['met']}/{L(r)['long']['n']})")
        row("long-mix: long 429 / long TTFT p50 ms", "", lambda r: f"{L(r)['long']['r429']} / "
            f"{f(L(r)['long']['p50'], '{:.0f}')}")
        row("long-mix: short 429 mix / short-only", "", lambda r: f"{L(r)['short']['r429']} / {L(r)['base']['r429']}")
        row("long-mix: short requests (mix)", "", lambda r: str(L(r)["short"]["n"]))
    if not args.only or args.only == "tenants":
        T = lambda r: r["tenants"]  # noqa: E731
        row("tenants: A p90 mixed / solo", "<= 1.5x", lambda r: f(T(r)["p90_ratio"]) + "x")
        row("tenants: A p90 ms mixed / solo", "", lambda r: f"{f(T(r)['a']['p90'], '{:.0f}')} / "
            f"{f(T(r)['solo']['p90'], '{:.0f}')}")
        row("tenants: A goodput mixed / solo", ">= 0.9x", lambda r: f(T(r)["goodput_ratio"]) + "x")
        row("tenants: A 429 mixed / solo", "", lambda r: f"{T(r)['a']['r429']} / {T(r)['solo']['r429']}")
        row("tenants: B served / fair share", "~1.0", lambda r: f(T(r)["b_served_share"]))
        row("tenants: B goodput / fair share", "", lambda r: f(T(r)["b_goodput_share"]))
        row("tenants: B 429 (of sent) / 429 p50 ms", "fast", lambda r: f"{T(r)['b']['r429']} ({T(r)['b']['n']}) / "
            f"{f(T(r)['b']['r429_p50'], '{:.1f}')}")
        row("tenants: B 429 p50 ms at the gateway (audit total_ms)", "", lambda r: f(r["b429_gw_p50"], "{:.1f}"))
        row("tenants: B TTFT p50 / p90 ms (served)", "", lambda r: f"{f(T(r)['b']['p50'], '{:.0f}')} / "
            f"{f(T(r)['b']['p90'], '{:.0f}')}")
    row("5xx / other errors (all runs)", "0", lambda r: f"{sum(e['5xx'] for e in r['errors'].values())} / "
        f"{sum(e['other'] for e in r['errors'].values())}")
    row("client lag p99 ms", "", lambda r: f(r["lag_p99"], "{:.0f}"))
    row("429 reasons (audit)", "", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())) or "-")


async def start_fleet(tmp: Path) -> tuple[object, dict]:
    mpath = tmp / "fleet.json"
    fleet = start([sys.executable, "-m", "backends.sim", "--engines", "4", "--profile", PROFILE, "--base-port", "0",
                   "--max-num-batched-tokens", str(BUDGET), "--manifest", str(mpath), "--locations", "DE"],
                  tmp / "fleet.log")
    try:
        for _ in range(600):
            if mpath.exists() or fleet.poll() is not None:
                break
            await asyncio.sleep(0.05)
        manifest = json.loads(mpath.read_text())
        async with httpx.AsyncClient() as c:
            for e, speed in zip(manifest["engines"], SPEEDS):
                (await c.post(e["url"].removesuffix("/v1") + "/sim/faults",
                              json={"slow_factor": SCALE[0] / speed})).raise_for_status()
    except BaseException:
        stop(fleet)
        raise
    return fleet, manifest


async def wait_healthy(base: str, proc) -> None:
    async with httpx.AsyncClient() as c:
        for _ in range(300):
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}")
            try:
                if (await c.get(base + "/healthz", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("gateway not healthy after 30 s")


async def reset(manifest: dict) -> None:
    async with httpx.AsyncClient() as c:
        for e in manifest["engines"]:
            await c.post(e["url"].removesuffix("/v1") + "/reset_prefix_cache")


async def run(args: argparse.Namespace) -> dict[str, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-flow-control-"))
    mix = longmix_schedule(args.seconds, args.load, args.seed) if args.only != "tenants" else []
    ten = tenants_schedule(args.seconds, args.seed) if args.only != "longmix" else []
    warm = [Arrival(at, f"warm-{i}", 400, SHORT_SLO_MS * SCALE[0], KEY)
            for i, at in enumerate(poisson(random.Random(1), 8.0 / SCALE[0], 3.0))]
    warm.insert(len(warm) // 2, Arrival(1.5, "warm-long", LONG_TOKENS, LONG_SLO_MS * SCALE[0], KEY))
    prompts = prompts_for(mix + ten + warm, args.seed)
    plan: list[tuple[str, list[Arrival]]] = []
    if mix:
        plan += [("short-only", [a for a in mix if kind(a.rid) == "short"]), ("mix", mix)]
    if ten:
        plan += [("solo", [a for a in ten if kind(a.rid) == "a"]), ("mixed", ten)]
    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    fleet, manifest = await start_fleet(tmp)
    try:
        for name in args.configs:
            port = free_port()
            cfg = make_config(tmp, manifest, name, port)
            base = f"http://127.0.0.1:{port}"
            gw = start([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], cfg.parent / "log")
            runs: dict[str, list[dict]] = {}
            try:
                await wait_healthy(base, gw)
                await asyncio.sleep(1.0)  # first metrics scrape
                await reset(manifest)
                await fire(base, warm, prompts, [])  # unmeasured: the gateway learns budgets and rates
                for run_name, arrivals in plan:
                    await reset(manifest)
                    await asyncio.sleep(0.5)
                    out: list[dict] = []
                    t0 = time.perf_counter()
                    await fire(base, arrivals, prompts, out)
                    print(f"[{name}] {run_name}: {len(arrivals)} requests in {time.perf_counter() - t0:.1f} s "
                          f"(incl. drain), statuses {dict(Counter(r['status'] for r in out))}", file=sys.stderr)
                    runs[run_name] = out
                    if dump:
                        with open(dump / f"{name.replace(' ', '_')}-{run_name}.jsonl", "w") as fh:
                            for r in out:
                                fh.write(json.dumps({**r, "config": name, "run": run_name}) + "\n")
                    await asyncio.sleep(1.0)  # the engines drain before the next run
            finally:
                stop(gw)
            audit = read_audit(cfg.parent / "audit.jsonl")
            measured = {r["rid"] for recs in runs.values() for r in recs if r["status"] == 429}
            reasons = Counter(f"{a.get('error') or '?'}/{(a.get('route') or {}).get('admission') or '-'}"
                              for rid, a in audit.items() if rid in measured)
            results[name] = summarize_config(runs, args.seconds, reasons)
            results[name]["b429_gw_p50"] = pct([a["total_ms"] for rid, a in audit.items() if kind(rid) == "b"
                                                and a.get("status") == 429 and a.get("total_ms") is not None], 0.5)
    finally:
        stop(fleet)
        if args.keep:
            print(f"logs and audit files kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per run")
    ap.add_argument("--load", type=float, default=0.6, help="long-mix load, x the fleet's capacity for the mix")
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--only", choices=["longmix", "tenants"], default=None)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--dump", help="directory: one JSON line per request, a file per configuration and run")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="K: every engine K x slower, arrival rates / K, TTFT targets x K (the same load in slow "
                         "motion, for machines whose cores cannot drive the full request rate); default 1")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (gateway logs, audit files)")
    args = ap.parse_args()
    SCALE[0] = args.time_scale
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {list(CONFIGS)}")
    print_table(asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
