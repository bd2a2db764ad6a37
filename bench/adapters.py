"""Adapter placement (issue 38): TTFT and loads per minute for three placements of LoRA adapters, and the
canary's detection time for a 5x error-rate regression, in one run.

Fleet: one `backends.sim` process, four engines (profile l40s-8b, `--enable-lora --max-loras 4`, a load takes
--lora-load-ms), one real gateway (one worker: placement state is per process) with every backend's KV events,
replay and metrics, routing defaults (predicted_ttft). Twenty adapters ad-01 .. ad-20 of the base model; traffic
is an open-loop Poisson stream (--rate req/s) of streaming chat requests whose adapter is Zipf(s=--zipf) over
the adapter's rank (ad-01 the hottest), each a unique ~--prompt-words-word prompt and --max-tokens output tokens.
The same seeded arrival trace runs against each variant, each on a fresh fleet and gateway:

  (a) static       no dynamic placement: every engine is started with all twenty names in `--lora-modules` (one
                   fleet process, as for (b) and (c)), and the config serves adapter k on engine k mod 4 only
                   (`models`, `lora_adapters`), so engine i runs adapters i, i+4, ... An engine holds any number
                   of adapters but one batch runs at most 4 distinct ones (vLLM's --max-loras): the 5th waits, and
                   one outside the weight cache (--max-cpu-loras, default 4) is read in the engine first.
  (b) load-on-miss registered adapters (POST /admin/adapters, a tenant's adapter_sources grant), engines declared
                   `lora: {dynamic: true, max_loras: 4, choice: ignore_load}`: routed as if every adapter were
                   resident everywhere, loaded on a miss (the LRU idle one unloaded past 4).
  (c) ours         the same with `choice: predicted`: predicted TTFT plus the learned load where not resident.

Warm-up: the first --warmup seconds of the trace are not measured (the engines become modelled: routing's
min_observations, 16 by default, is left as it is, and the adapters reach a steady placement); the table says
how many engines were modelled when measuring began. Measured over the next --seconds: client TTFT (request sent
to first content chunk) p50/p90 of the requests that succeeded, loads and unloads per minute (deltas of the
gateway's gateway_adapter_placements_total{op} over the window), errors (non-200 or a stream without [DONE]),
and from the audit records (evidence.adapter) the share of requests that had to load their adapter and the
mean number of engines each adapter was served on.

Then bench/rollouts.py's `errors x5` case (its own fleet and gateway: a 10% canary whose error rate goes from 2%
to 10%) gives the canary's detection time.

Usage: python bench/adapters.py [--seconds 35] [--warmup 8] [--rate 12] [--lora-load-ms 500] [--no-canary]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backends.sim.fleet import FleetProcess  # noqa: E402
from bench import rollouts  # noqa: E402
from tests.support.procs import free_port, start_gateway  # noqa: E402

ADMIN = "bench-adapters-admin-0123456789"
STATIC_KEY = "bench-adapters-key-0123456789"
TENANT = "bench"
BASE = "base"
ENGINES = 4
MAX_LORAS = 4
VARIANTS = {"a": "static", "b": "load-on-miss", "c": "ours"}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def names(n: int) -> list[str]:
    return [f"ad-{k + 1:02d}" for k in range(n)]


def trace(args: argparse.Namespace) -> list[tuple[float, str, str]]:
    """(offset s, adapter, prompt) for warm-up + measurement: Poisson arrivals, Zipf over adapter rank."""
    rng = random.Random(args.seed)
    ads = names(args.adapters)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(len(ads))]
    out: list[tuple[float, str, str]] = []
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.warmup + args.seconds:
            return out
        ad = rng.choices(ads, weights)[0]
        text = f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        out.append((t, ad, text))
        i += 1


def gateway_config(variant: str, manifest: dict[str, Any], tmp: Path, port: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    ads = names(args.adapters)
    backends = []
    for i, e in enumerate(manifest["engines"]):
        b: dict[str, Any] = {"name": f"e{i}", "url": e["url"], "kind": "sim", "models": [BASE],
                             "model_map": {BASE: "sim-model"}, "kv_events": e["kv_events"], "replay": e["replay"],
                             "metrics": e["metrics"], "timeouts": {"first_token_s": 60, "total_s": 120}}
        if variant == "a":
            mine = ads[i::ENGINES]
            b["models"] = [BASE, *mine]
            b["lora_adapters"] = mine
        else:
            b["lora"] = {"dynamic": True, "max_loras": MAX_LORAS,
                         "choice": "ignore_load" if variant == "b" else "predicted"}
        backends.append(b)
    return {"server": {"host": "127.0.0.1", "port": port, "workers": 1}, "backends": backends,
            "keys": [{"key": STATIC_KEY, "tenant": TENANT, "name": "k"}], "admin": {"key": ADMIN},
            "policy": {"audit_path": str(tmp / "audit.jsonl")}, "identity": {"sqlite_path": str(tmp / "id.db")},
            "data_dir": str(tmp / "var"), "observability": {"log_level": "warning"}}


def register(base: str, args: argparse.Namespace) -> str:
    """Tenant, adapter_sources grant, the twenty adapters, a key (as tests/e2e/test_adapter_placement_e2e.py)."""
    h = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=base, headers=h, timeout=10) as c:
        tenant = "bench-lora"
        c.post("/admin/tenants", json={"id": tenant}).raise_for_status()
        c.put(f"/admin/tenants/{tenant}/adapter_sources", json={"prefixes": [f"/w/{tenant}/"]}).raise_for_status()
        for n in names(args.adapters):
            c.post("/admin/adapters", json={"name": n, "base_model": BASE, "source": f"/w/{tenant}/{n}",
                                            "owner": {"tenant": tenant}}).raise_for_status()
        r = c.post("/admin/keys", json={"tenant": tenant})
        r.raise_for_status()
        return str(r.json()["key"])


def scrape(base: str) -> dict[str, float]:
    """Loads and unloads so far (all engines), and how many engines are modelled."""
    text = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).text
    out = {"load": 0.0, "unload": 0.0, "modelled": 0.0}
    for line in text.splitlines():
        if line.startswith("gateway_adapter_placements_total{"):
            labels, value = line[len("gateway_adapter_placements_total{"):].rsplit("} ", 1)
            op = dict(p.split("=", 1) for p in labels.split(","))["op"].strip('"')
            out[op] = out.get(op, 0.0) + float(value)
        elif line.startswith("gateway_upstream_mode{") and 'mode="modelled"' in line:
            out["modelled"] += float(line.rsplit(" ", 1)[1])
    return out


def modes(base: str) -> dict[str, str]:
    """Each engine's routing mode and why (GET /admin/routing)."""
    snap = httpx.get(base + "/admin/routing", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10).json()
    return {n: f"{m['mode']}: {m['reason']}" for n, m in snap.get("modes", {}).items()}


async def one(c: httpx.AsyncClient, ad: str, text: str, max_tokens: int, rec: dict[str, Any]) -> None:
    body = {"model": ad, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}]}
    t0 = time.perf_counter()
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            rec["status"], rec["id"] = r.status_code, r.headers.get("x-request-id")
            if r.status_code != 200:
                try:
                    e = json.loads(await r.aread()).get("error") or {}
                    rec["code"] = e.get("code") or e.get("type")
                except ValueError:
                    pass
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                elif "ttft" not in rec and '"content"' in data:
                    ch = json.loads(data).get("choices") or [{}]
                    if (ch[0].get("delta") or {}).get("content"):
                        rec["ttft"] = time.perf_counter() - t0
                elif '"error"' in data:
                    rec["status"] = -2
            rec["ok"] = r.status_code == 200 and done and rec["status"] == 200
    except httpx.HTTPError as e:
        rec["status"], rec["ok"], rec["exc"] = -1, False, type(e).__name__


async def drive(base: str, key: str, tr: list[tuple[float, str, str]], args: argparse.Namespace,
                marks: dict[str, Any]) -> list[dict[str, Any]]:
    """Open loop: each request is sent at its offset whatever the ones before are doing. At the warm-up's end
    the gateway's counters are read (in a thread, so sending goes on)."""
    recs: list[dict[str, Any]] = []
    tasks = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=120,
                                 limits=limits) as c:
        start = time.perf_counter()
        for off, ad, text in tr:
            if "at_warmup" not in marks and off >= args.warmup:
                marks["at_warmup"] = asyncio.create_task(asyncio.to_thread(scrape, base))
                marks["t_warmup"] = time.perf_counter()
            delay = start + off - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = {"off": off, "ad": ad, "late": max(0.0, -delay)}
            recs.append(rec)
            tasks.append(asyncio.create_task(one(c, ad, text, args.max_tokens, rec)))
        marks["t_end"] = time.perf_counter()
        await asyncio.gather(*tasks)
    marks["at_warmup"] = await marks["at_warmup"]
    return recs


def audit(path: Path, ids: set[str]) -> dict[str, Any]:
    """From the measured requests' audit records: share that loaded, engines per adapter (and for the hottest),
    share routed with the serving engine modelled, the median |relative TTFT prediction error| of requests that
    loaded their adapter and of those that found it resident."""
    loaded, n, modelled = 0, 0, 0
    where: dict[str, set[str]] = {}
    err: dict[bool, list[float]] = {True: [], False: []}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("request_id") not in ids:
            continue
        ev = r.get("evidence") or {}
        ad = ev.get("adapter")
        if not isinstance(ad, dict):
            continue
        n += 1
        loaded += 1 if ad.get("loaded") else 0
        modelled += 1 if (r.get("route") or {}).get("mode") == "modelled" else 0
        if ev.get("ttft_prediction_error") is not None:
            err[bool(ad.get("loaded"))].append(abs(ev["ttft_prediction_error"]))
        if ad.get("engine"):
            where.setdefault(ad["name"], set()).add(ad["engine"])
    return {"audited": n, "loaded_share": loaded / n if n else None,
            "engines_per_adapter": sum(len(v) for v in where.values()) / len(where) if where else None,
            "hot_engines": len(where.get(names(1)[0], ())), "modelled_share": modelled / n if n else None,
            "err_loaded": pct(err[True], 0.5), "err_resident": pct(err[False], 0.5)}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def variant(v: str, tr: list[tuple[float, str, str]], args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fa = ["--engines", str(ENGINES), "--profile", args.profile, "--base-port", "0", "--enable-lora",
              "--max-loras", str(MAX_LORAS), "--lora-load-ms", str(args.lora_load_ms)]
        if v == "a":
            fa += ["--lora-modules", *names(args.adapters)]
        fleet = FleetProcess(fa, tmp / "fleet.json")
        man = fleet.start()
        port = free_port()
        (tmp / "gw.yaml").write_text(yaml.safe_dump(gateway_config(v, man, tmp, port, args)))
        gw, _ = start_gateway(tmp / "gw.yaml")
        base = f"http://127.0.0.1:{port}"
        try:
            key = STATIC_KEY if v == "a" else register(base, args)
            time.sleep(1.0)  # a first metrics scrape of every engine
            marks: dict[str, Any] = {}
            recs = asyncio.run(drive(base, key, tr, args, marks))
            end = scrape(base)
            end_modes = modes(base)
            time.sleep(1.5)  # the audit recorder writes behind the responses
            meas = [r for r in recs if r["off"] >= args.warmup]
            au = audit(tmp / "audit.jsonl", {r["id"] for r in meas if r.get("id")})
        finally:
            gw.stop()
            fleet.stop()
    w0 = marks["at_warmup"]
    window_s = marks["t_end"] - marks["t_warmup"]
    ttfts = [r["ttft"] * 1000 for r in meas if r.get("ok") and "ttft" in r]
    errs: dict[str, int] = {}
    for r in meas:
        if not r.get("ok"):
            k = str(r.get("exc") or r.get("status")) + (f" {r['code']}" if r.get("code") else "")
            errs[k] = errs.get(k, 0) + 1
    return {"variant": v, "requests": len(meas), "p50": pct(ttfts, 0.5), "p90": pct(ttfts, 0.9),
            "p99": pct(ttfts, 0.99), "loads_min": (end["load"] - w0["load"]) * 60 / window_s,
            "unloads_min": (end["unload"] - w0["unload"]) * 60 / window_s, "errors": sum(errs.values()),
            "error_kinds": errs, "modelled": int(w0["modelled"]), "modes": end_modes, "late_p99_ms": pct([r["late"] * 1000 for r in meas],
                                                                                        0.99), **au}


def canary(args: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(concurrency=8, warmup=5.0, timeout=60.0, window=30.0, min_requests=20)
    return asyncio.run(rollouts.scenario("errors x5", rollouts.REGRESSIONS["errors x5"], ns))


def commit() -> str:
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "gateway", "backends"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return h.strip() + (" (+ uncommitted changes under gateway/ or backends/)" if dirty else "")
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=35.0, help="measured seconds per variant")
    ap.add_argument("--warmup", type=float, default=8.0, help="seconds of the trace before measuring")
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    ap.add_argument("--adapters", type=int, default=20)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--lora-load-ms", type=float, default=500.0)
    ap.add_argument("--profile", default="l40s-8b")
    ap.add_argument("--prompt-words", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=38)
    ap.add_argument("--variants", default="abc", help="which of a, b, c to run")
    ap.add_argument("--no-canary", action="store_true")
    args = ap.parse_args()
    tr = trace(args)
    t0 = time.time()
    rows = [variant(v, tr, args) for v in args.variants]
    can = None if args.no_canary else canary(args)

    def f(x: float | None, nd: int = 0) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    print(f"commit {commit()}; {ENGINES} engines {args.profile}, max_loras {MAX_LORAS}, load {args.lora_load_ms:g} ms; "
          f"{args.adapters} adapters Zipf(s={args.zipf:g}); {args.rate:g} req/s Poisson, {args.prompt_words}-word "
          f"prompts, {args.max_tokens} tokens out; warm-up {args.warmup:g} s, measured {args.seconds:g} s; "
          f"run took {time.time() - t0:.0f} s")
    ref = {r["variant"]: r for r in rows}.get("c")
    print(f"{'placement':<16} {'reqs':>5} {'TTFT p50 ms':>11} {'p90 ms':>7} {'p99 ms':>7} {'p50 x':>6} {'p90 x':>6} "
          f"{'loads/min':>9} {'unloads/min':>11} {'loaded %':>8} {'engines/ad':>10} {'errors':>6} {'modelled':>8}")
    for r in rows:
        rp50 = r["p50"] / ref["p50"] if ref and ref["p50"] and r["p50"] else None
        rp90 = r["p90"] / ref["p90"] if ref and ref["p90"] and r["p90"] else None
        ls = r["loaded_share"]
        print(f"({r['variant']}) {VARIANTS[r['variant']]:<12} {r['requests']:>5} {f(r['p50']):>11} {f(r['p90']):>7} "
              f"{f(r['p99']):>7} {f(rp50, 2):>6} {f(rp90, 2):>6} {r['loads_min']:>9.1f} {r['unloads_min']:>11.1f} "
              f"{f(None if ls is None else ls * 100, 1):>8} {f(r['engines_per_adapter'], 2):>10} "
              f"{r['errors']:>6} {r['modelled']:>6}/{ENGINES}")
    for r in rows:
        if r["audited"]:
            print(f"  ({r['variant']}) audit: {r['audited']} records, routed modelled {f(r['modelled_share'] * 100)}%, "
                  f"ad-01 on {r['hot_engines']} engine(s), median |TTFT prediction error| loaded "
                  f"{f(r['err_loaded'], 2)} / resident {f(r['err_resident'], 2)}")
        if r["error_kinds"] or (r["late_p99_ms"] or 0) > 50:
            print(f"  ({r['variant']}) errors {r['error_kinds']}, client send lateness p99 {f(r['late_p99_ms'])} ms")
        off = {n: m for n, m in r["modes"].items() if not m.startswith("modelled")}
        if off:
            print(f"  ({r['variant']}) not modelled at the end: {off}")
    print("p50 x / p90 x: the variant's TTFT over ours (c). loaded %: requests that loaded their adapter (audit "
          "evidence.adapter.loaded); engines/ad: engines an adapter was served on (mean over adapters).")
    if can is not None:
        print(f"canary (bench/rollouts.py, errors x5: 10% canary 2% -> 10% errors, concurrency 8, window 30 s, "
              f"min_requests 20): detected {f(can['detected_s'], 2)} s, weight 0 seen {f(can['weight0_s'], 2)} s, "
              f"bad-arm requests {can['bad_arm_requests']}, client failures {can['client_failures']}, "
              f"reason: {can['reason']}")


if __name__ == "__main__":
    main()
