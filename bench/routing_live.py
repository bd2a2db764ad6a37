"""Live routing benchmark (issue 17): the gateway with its routing defaults in front of live simulator processes.

Fleet: one `backends.sim` process, four h200-8b engines with a chunked-prefill budget of 2048 tokens per step
(`--max-num-batched-tokens 2048`, which the gateway is not told: it learns it from the KV events) and speeds 1x,
1.5x, 2x and 0.75x (POST /sim/faults slow_factor = 1/speed). Tokens come from the engines' /tokenize (the
gateway's default `telemetry.tokenizer: auto` without a local tokenizer). Two gateway processes: ours
(`predicted_ttft`, admission on, every routing default) and `least_loaded` without admission, run one after the
other on the same fleet (prefix caches reset before each run).

Phases, each measured from the client and from the audit records (evidence) of the gateway:
  ladder-R  the issue's shared-prefix ladder, no TTFT target: 24 groups of ~1.5k-token system prompts, 8 users
            each (a user's turn = that user's own 60-token context + a new 20-token question), group and user
            uniform at random, Poisson arrivals at R = 8, 16, 32 req/s, one step after the other without a cache
            reset (the whole ladder runs on one gateway, then on the other; caches reset before each);
  churn-R   (--churn) the earlier ladder: 2500-token system prompts of groups that keep appearing (a new group
            every 0.5 s), so requests arrive while their prefix is still prefilling (the pending cache's case);
  burst     --burst-cycles cycles of --burst-s seconds at 0.6x then --burst-s at 2x the fleet's prefill
            capacity for unique --burst-tokens prompts (capacity from the sim's cost model: sum over engines of
            speed x budget / (step overhead + budget x prefill cost)), x-ttft-slo-ms 600 (40%) or 2500 (60%).
            Goodput = requests whose TTFT met their target per second of the phase, for ours, least-loaded and
            an oracle (see `oracle`): the same arrivals replayed on a fluid model of the simulator's own cost
            model with each engine's true backlog; it sends each request to the engine with the earliest true
            TTFT and sheds it iff that misses the target.
Printed (one table per gateway, then the side-by-side p90): per engine the KV-index agreement on cached tokens
(sum min(pred, actual) / max(sum pred, sum actual)), MdARE of the TTFT prediction per phase (ladder steps are
the steady loads below capacity), the calibration of the admission bound (share of admitted requests whose TTFT
was under the upper bound used, vs the target quantile), route-stage time p50/p90 (stage_timings_us.route),
rejection latency p50/p90 (client, and evidence since_arrival_ms), the p90 TTFT ratio least-loaded / ours per
phase, and the burst goodput. --dump FILE writes one JSON line per request of ours (features, predicted,
upper, actual) for residual analysis.
Usage: python -m bench.routing_live [--step-s 5] [--burst-cycles 3] [--burst-s 2] [--burst-tokens 3000] [--churn]
       [--target-fit] [--num-gpu-blocks N]
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

from backends.sim.profiles import PROFILES
from bench.routing import free_port, text

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-live-key-0123456789"
ADMIN = "bench-live-admin-0123456789"
SPEEDS = [1.0, 1.5, 2.0, 0.75]
BUDGET = 2048
PROFILE = "vllm-default"  # vLLM 0.32's scheduler defaults (budget 2048) on the L40S cost model
LADDER = [8, 16, 32]
STRATEGIES = ("predicted_ttft", "least_loaded")
GROUPS, USERS, GROUP_TOKENS, USER_TOKENS, QUESTION_TOKENS = 24, 8, 1500, 60, 20  # the ladder
SYSTEM_TOKENS = 2500  # churn ladder: more than one 2048-token chunk, each new prefix takes two steps
SLO_MIX = ((600.0, 0.4), (2500.0, 0.6))  # burst targets and their shares


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def s_per_token(speed: float) -> float:
    """Seconds per prefill token of a saturated engine: the sim's step_time (profiles.py) with full 2048-token
    chunks, the step overhead spread over the chunk, times the slow factor 1/speed."""
    p = PROFILES[ARGS_PROFILE[0]]
    return (p.prefill_s_per_token + p.step_overhead_s / BUDGET) / speed


ARGS_PROFILE = [PROFILE]
ARGS_TARGET_FIT = [False]  # --target-fit: ours with routing.target_fit (best-fit placement by TTFT target)


def capacity_rps(prompt_tokens: int) -> float:
    return sum(1.0 / (prompt_tokens * s_per_token(sp)) for sp in SPEEDS)


def gateway_config(tmp: Path, manifest: dict, strategy: str, port: int) -> Path:
    d = tmp / f"gw-{strategy}"
    d.mkdir(parents=True, exist_ok=True)
    backends = [{"name": e["name"], "kind": "sim", "url": e["url"], "models": ["sim-model"],
                 "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"],
                 "location": {"country": "DE"}, "timeouts": {"first_token_s": 60, "total_s": 120}}
                for e in manifest["engines"]]
    # least-loaded as a plain router: no admission and no gateway queue (flow control's queue timeouts would
    # refuse requests for it: admission by another name), as in bench/flow_control.py
    routing = {} if strategy == "predicted_ttft" else {"strategy": strategy, "admission": False,
                                                       "flow_control": {"enabled": False}}
    if strategy == "predicted_ttft" and ARGS_TARGET_FIT[0]:
        routing["target_fit"] = True
    doc = {"server": {"host": "127.0.0.1", "port": port}, "backends": backends,
           "keys": [{"key": KEY, "tenant": "bench"}], "admin": {"key": ADMIN}, "routing": routing,
           "policy": {"audit_path": str(d / "audit.jsonl")}, "data_dir": str(d / "var"),
           "identity": {"sqlite_path": str(d / "gw.db")},
           "budgets": {"sqlite_path": str(d / "budgets.db"), "spool_path": str(d / "spool.jsonl")},
           "observability": {"log_level": "warning"}}
    cfg = d / "gateway.yaml"
    cfg.write_text(json.dumps(doc))  # JSON is YAML
    return cfg


async def send(client: httpx.AsyncClient, base: str, body: dict, headers: dict, rid: str, out: list[dict],
               at: float | None = None, slo: float | None = None, group: int | None = None) -> None:
    t0 = time.perf_counter()
    rec = {"rid": rid, "status": None, "ttft_ms": None, "reject_ms": None, "at": at, "slo": slo,
           "prompt_tokens": None, "group": group}
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
                    elif '"prompt_tokens"' in line and line.startswith("data: {"):
                        u = json.loads(line[6:]).get("usage") or {}
                        rec["prompt_tokens"] = u.get("prompt_tokens")
    except httpx.HTTPError:
        rec["status"] = -1
    out.append(rec)


def body_of(system: str | None, user: str) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": "sim-model", "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True},
            "messages": msgs}


async def ladder(base: str, steps: list[float], seconds: float, out: list[dict], seed: int) -> None:
    """The issue's ladder: GROUPS system prompts x USERS users, Poisson at each rate of `steps` in turn."""
    rng = random.Random(seed)
    systems = [f"You are assistant {g}. " + text(random.Random(1000 + g), GROUP_TOKENS) for g in range(GROUPS)]
    users = [[f"I am user {g}-{u}. " + text(random.Random(5000 + g * USERS + u), USER_TOKENS)
              for u in range(USERS)] for g in range(GROUPS)]
    tasks = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=500)) as client:
        i = 0
        for rate in steps:
            t_start = time.perf_counter()
            while time.perf_counter() - t_start < seconds:
                g, u = rng.randrange(GROUPS), rng.randrange(USERS)
                msg = users[g][u] + " Question: " + text(rng, QUESTION_TOKENS)
                tasks.append(asyncio.create_task(send(client, base, body_of(systems[g], msg), {},
                                                      f"ladder{rate:g}-{i}", out, group=g)))
                i += 1
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)


async def churn(base: str, rate: float, seconds: float, phase: str, out: list[dict], seed: int) -> None:
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


def burst_schedule(cycles: int, period_s: float, tokens: int, seed: int) -> list[tuple[float, float]]:
    """(arrival offset s, target ms) of the burst phase: Poisson at 0.6x capacity for period_s, then 2x, repeated;
    the same for every gateway (and the oracle)."""
    rng = random.Random(seed)
    cap = capacity_rps(tokens)
    out, t = [], 0.0
    for c in range(cycles):
        for mult in (0.6, 2.0):
            end = (2 * c + (mult == 2.0) + 1) * period_s
            while True:
                t += rng.expovariate(mult * cap)
                if t >= end:
                    t = end
                    break
                slo = SLO_MIX[0][0] if rng.random() < SLO_MIX[0][1] else SLO_MIX[1][0]
                out.append((t, slo))
    return out


async def bursts(base: str, sched: list[tuple[float, float]], tokens: int, out: list[dict], seed: int) -> None:
    rng = random.Random(seed)
    prompts = [text(rng, tokens) for _ in sched]
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as client:
        tasks = []
        t0 = time.perf_counter()
        for k, ((at, slo), p) in enumerate(zip(sched, prompts)):
            d = at - (time.perf_counter() - t0)
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.create_task(send(client, base, body_of(None, p), {"x-ttft-slo-ms": f"{slo:g}"},
                                                  f"burst-{k}", out, at=at, slo=slo)))
        await asyncio.gather(*tasks)


def fluid_ttft(backlog_until: float, at: float, tokens: float, speed: float) -> float:
    """TTFT (s) of a request of `tokens` uncached tokens arriving at `at` on an engine whose queued prefill ends at
    `backlog_until`, FCFS at the saturated per-token cost (the sim's chunked prefill is FCFS)."""
    return max(backlog_until, at) + tokens * s_per_token(speed) - at


def oracle(sched: list[tuple[float, float]], tokens: list[int], scale: float = 1.0) -> dict:
    """Shed by true TTFT: each arrival, in order, goes to the engine whose true backlog gives it the earliest
    first token; it is admitted iff that meets its target (an admitted request adds its prefill to the backlog,
    a shed one nothing). Greedy, no gateway or HTTP overhead: an upper bound on what shedding by prediction can
    reach on this load, not the optimum over all shedding policies (it never sheds a loose-target request to
    save a tight one). `scale` stretches the model's prefill times (the calibrated oracle: by the measured /
    model ratio of `replay_error`, so its 'true' TTFT is what the simulator delivers to a client)."""
    until = [0.0] * len(SPEEDS)
    met = shed = 0
    for (at, slo), n in zip(sched, tokens):
        best = min(range(len(SPEEDS)), key=lambda e: fluid_ttft(until[e], at, n * scale, SPEEDS[e]))
        t = fluid_ttft(until[best], at, n * scale, SPEEDS[best])
        if t * 1000 <= slo:
            until[best] = max(until[best], at) + n * scale * s_per_token(SPEEDS[best])
            met += 1
        else:
            shed += 1
    return {"met": met, "shed": shed}


def replay_error(client: list[dict], audit: dict[str, dict], names: list[str]) -> tuple[float, float] | None:
    """MdARE of the oracle's fluid model against the TTFT ours measured, replaying ours' own admitted requests on
    the engines it picked (how far the oracle's notion of 'true TTFT' is from the simulator's), and the median of
    measured / model (> 1: the model, hence the oracle, is optimistic)."""
    until = {n: 0.0 for n in names}
    errs, ratios = [], []
    for c in sorted((c for c in client if c["rid"].startswith("burst") and c["status"] == 200
                     and c["ttft_ms"] and c["prompt_tokens"]), key=lambda c: c["at"]):
        a = audit.get(c["rid"]) or {}
        e = a.get("backend")
        if e not in until:
            continue
        sp = SPEEDS[names.index(e)]
        t = fluid_ttft(until[e], c["at"], c["prompt_tokens"], sp)
        until[e] = max(until[e], c["at"]) + c["prompt_tokens"] * s_per_token(sp)
        errs.append(abs(c["ttft_ms"] - t * 1000) / c["ttft_ms"])
        ratios.append(c["ttft_ms"] / (t * 1000))
    return (statistics.median(errs), statistics.median(ratios)) if errs else None


def read_audit(path: Path) -> dict[str, dict]:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out[r.get("client_request_id") or r["request_id"]] = r
    return out


def summarize(client: list[dict], audit: dict[str, dict], phase_of, dump=None) -> dict:
    """Per engine and per phase numbers from the client records joined with the audit records."""
    eng: dict[str, dict] = {}
    phases: dict[str, dict] = {}
    for c in client:
        ph = phase_of(c["rid"])
        p = phases.setdefault(ph, {"ttft": [], "reject_ms": [], "reject_ev_ms": [], "route_us": [], "n": 0,
                                   "rejected": 0, "errors": 0, "met": 0, "rejected_by_slo": {}, "compute_us": [],
                                   "tokenize_us": []})
        p["n"] += 1
        a = audit.get(c["rid"])
        if a is not None and (a.get("stage_timings_us") or {}).get("route") is not None:
            p["route_us"].append(a["stage_timings_us"]["route"])
        r = (a or {}).get("route") or {}
        if r.get("compute_us") is not None:  # the decision's own work, without waits (issue 34)
            p["compute_us"].append(r["compute_us"])
            p["tokenize_us"].append(r.get("tokenize_us") or 0.0)
        if c["status"] == 429:
            p["rejected"] += 1
            p["rejected_by_slo"][c["slo"]] = p["rejected_by_slo"].get(c["slo"], 0) + 1
            p["reject_ms"].append(c["reject_ms"])
            if a is not None and (a.get("route") or {}).get("since_arrival_ms") is not None:
                p["reject_ev_ms"].append(a["route"]["since_arrival_ms"])
            continue
        if c["status"] != 200 or c["ttft_ms"] is None:
            p["errors"] += 1
            continue
        p["ttft"].append(c["ttft_ms"])
        if c["slo"] is not None and c["ttft_ms"] <= c["slo"]:
            p["met"] += 1
        if a is None or not a.get("backend"):
            continue
        e = eng.setdefault(a["backend"], {"pred": 0, "act": 0, "agreed": 0, "abs": 0, "ape": {}, "cal": [],
                                          "cal_ph": {}})
        ct = a.get("cached_tokens") or {}
        if ct.get("predicted") is not None and ct.get("actual") is not None:
            e["pred"] += ct["predicted"]
            e["act"] += ct["actual"]
            e["agreed"] += min(ct["predicted"], ct["actual"])
            e["abs"] += abs(ct["predicted"] - ct["actual"])
        tt = a.get("ttft_ms") or {}
        if tt.get("predicted") and tt.get("actual"):
            e["ape"].setdefault(ph, []).append(abs(tt["actual"] - tt["predicted"]) / tt["actual"])
            pick = [x for x in (a.get("candidates") or []) if x.get("backend") == a["backend"]]
            up = pick[0].get("predicted_ttft_upper_ms") if pick else None
            if up:
                e["cal"].append(tt["actual"] <= up)
                e["cal_ph"].setdefault(ph, []).append(tt["actual"] <= up)
            if dump is not None:
                info = pick[0] if pick else {}
                dump.write(json.dumps({"phase": ph, "engine": a["backend"], "pred": tt["predicted"],
                                       "upper": up, "actual": tt["actual"], "ahead": info.get("ahead_tokens"),
                                       "running": info.get("running"), "waiting": info.get("waiting"),
                                       "inflight": info.get("inflight"), "cached": ct.get("predicted"),
                                       "cached_actual": ct.get("actual"), "prompt": c["prompt_tokens"],
                                       "slo": c["slo"]}) + "\n")
    return {"engines": eng, "phases": phases}


def first_of_group(client: list[dict]) -> set[str]:
    """The ladder requests that are the first of their group in the run (by send order): their system prompt is
    on no engine yet, so every router pays its prefill in full."""
    seen: set[int] = set()
    first: set[str] = set()
    for c in sorted((c for c in client if c.get("group") is not None), key=lambda c: int(c["rid"].rsplit("-", 1)[1])):
        if c["group"] not in seen:
            seen.add(c["group"])
            first.add(c["rid"])
    return first


def any_router_p90_floor(client: list[dict], phase_of, others: tuple[list[dict], ...] = (), q: float = 0.9
                         ) -> dict[str, tuple[int, int, float | None]]:
    """Per ladder phase: (requests, first of their group, a floor under any router's p90 TTFT or None). When the
    first-of-group requests are more than 1 - q of a phase, the phase's q-quantile is one of them or slower for
    every router, so no router's p90 is below the fastest cold prefill: the fastest first-of-group TTFT measured
    on any of the gateways run (`client` and `others`, the same arrivals)."""
    first = first_of_group(client)
    out: dict[str, tuple[int, int, float | None]] = {}
    for ph in {phase_of(c["rid"]) for c in client if c.get("group") is not None}:
        recs = [c for c in client if phase_of(c["rid"]) == ph]
        cold = [c for c in recs if c["rid"] in first]
        ttfts = [c["ttft_ms"] for run in (client, *others) for c in run
                 if c["rid"] in first and phase_of(c["rid"]) == ph and c.get("ttft_ms") is not None]
        floor = min(ttfts) if ttfts and len(cold) > (1 - q) * len(recs) else None
        out[ph] = (len(recs), len(cold), floor)
    return out


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
    fleet = start([sys.executable, "-m", "backends.sim", "--engines", "4", "--profile", args.profile,
                   "--base-port", "0",
                   "--max-num-batched-tokens", str(BUDGET), "--manifest", str(mpath), "--locations", "DE"]
                  + (["--num-gpu-blocks", str(args.num_gpu_blocks)] if args.num_gpu_blocks else []),
                  tmp / "fleet.log")
    results: dict[str, dict] = {}
    snaps: dict[str, dict] = {}
    sched = burst_schedule(args.burst_cycles, args.burst_s, args.burst_tokens, seed=99)
    outs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
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
                     "messages": [{"role": "system", "content": text(rng, GROUP_TOKENS)},
                                  {"role": "user", "content": text(rng, USER_TOKENS + QUESTION_TOKENS)}]}
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

            async def reset() -> None:
                async with httpx.AsyncClient() as c:
                    for e in manifest["engines"]:
                        await c.post(e["url"].removesuffix("/v1") + "/reset_prefix_cache")

            # phase by phase, the two gateways one after the other (the machine's noise hits both)
            phases: list[tuple[str, object]] = [("ladder", None)]
            if args.churn:
                phases += [(f"churn{r}", r) for r in LADDER]
            phases += [("burst", None)]
            for k, (ph, rate) in enumerate(phases):
                for strategy, (_, base, _) in gws.items():
                    await reset()
                    if ph == "ladder":
                        await ladder(base, [float(r) for r in LADDER], args.step_s, outs[strategy], seed=7)
                    elif ph == "burst":
                        await bursts(base, sched, args.burst_tokens, outs[strategy], seed=99)
                    else:
                        await churn(base, rate, args.step_s, ph, outs[strategy], seed=k + 1)  # type: ignore[arg-type]
                    await asyncio.sleep(1.0)  # the engines drain before the next run
            await asyncio.sleep(1.0)  # audit records flushed
            dump = open(args.dump, "w") if args.dump else None
            for strategy, (_, base, d) in gws.items():
                h = {"authorization": f"Bearer {ADMIN}"}
                snaps[strategy] = httpx.get(base + "/admin/routing", headers=h, timeout=10).json()
                audit = read_audit(d / "audit.jsonl")
                results[strategy] = summarize(outs[strategy], audit, lambda rid: rid.split("-")[0],
                                              dump if strategy == "predicted_ttft" else None)
                if strategy == "predicted_ttft":
                    snaps["p90_floor"] = any_router_p90_floor(outs[strategy], lambda rid: rid.split("-")[0],
                                                              (outs["least_loaded"],))
                    snaps["oracle_model_mdare"] = replay_error(outs[strategy], audit, names)
            if dump is not None:
                dump.close()
        finally:
            for gw, _, _ in gws.values():
                stop(gw)
    finally:
        stop(fleet)
    # the oracle's prompt sizes: what the engine counted for the same request (least-loaded admits all)
    ptoks = {c["rid"]: c["prompt_tokens"] for s in STRATEGIES for c in outs[s] if c["prompt_tokens"]}
    fallback = statistics.median(ptoks.values()) if ptoks else args.burst_tokens
    btoks = [int(ptoks.get(f"burst-{k}", fallback)) for k in range(len(sched))]
    snaps["oracle"] = oracle(sched, btoks)
    om = snaps.get("oracle_model_mdare")
    if om:  # the same oracle with the model's times stretched to what the simulator measurably delivers
        snaps["oracle_calibrated"] = {**oracle(sched, btoks, om[1]), "scale": om[1]}
    print_tables(names, results, snaps, args, sched)


def f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_tables(names: list[str], results: dict, snaps: dict, args: argparse.Namespace, sched: list) -> None:
    ours, ll = results["predicted_ttft"], results["least_loaded"]
    snap = snaps["predicted_ttft"]
    q = snap["engines"].get(names[0], {}).get("calibration_target")
    phs = list(ours["phases"])
    print(f"\n## predicted_ttft ({'routing.target_fit: true' if ARGS_TARGET_FIT[0] else 'defaults'}), 4 engines {args.profile}, speeds {SPEEDS}, chunk budget {BUDGET} "
          "(not configured)")
    print("| engine | speed | agreement (cached tokens) | 1 - sum abs err / sum actual | cached tokens (engine) "
          "| MdARE " + " / ".join(phs)
          + f" | calibration (target {q}) | requests | chunk budget (source) | fit resets | mode |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, sp in zip(names, SPEEDS):
        e = ours["engines"].get(n, {})
        den = max(e.get("pred", 0), e.get("act", 0))
        agree = e["agreed"] / den if den else None
        mds = []
        for ph in phs:
            xs = (e.get("ape") or {}).get(ph)
            mds.append(f(statistics.median(xs) * 100, "{:.1f}%") + f" ({len(xs)})" if xs else "-")
        cal = sum(e["cal"]) / len(e["cal"]) if e.get("cal") else None
        fa = (snap["engines"].get(n) or {}).get("facts") or {}
        g = (snap["engines"].get(n) or {}).get("guard") or {}
        err_agree = 1 - e["abs"] / e["act"] if e.get("act") else None
        mode = ((snap.get("modes") or {}).get(n) or {}).get("mode")
        print(f"| {n} | {sp}x | {f(agree and agree * 100, '{:.2f}%')} | {f(err_agree and err_agree * 100, '{:.2f}%')} "
              f"| {e.get('act', 0)} "
              f"| {' / '.join(mds)} | {f(cal and cal * 100, '{:.1f}%')} ({len(e.get('cal', []))}) "
              f"| {sum(len(v) for v in (e.get('ape') or {}).values())} "
              f"| {fa.get('chunk_budget')} ({fa.get('chunk_budget_source')}) | {g.get('resets')} | {mode} |")
    print("\n| phase | reqs | rejected | route stage p50 / p90 ms | decision compute p50 / tokenize wait p50 ms "
          "| rejection p50 / p90 / p99 ms (client) "
          "| rejection p50 ms (evidence, since arrival) | TTFT p50 ms ours / least-loaded | TTFT p90 ms ours "
          "| least-loaded | least-loaded / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ph, p in ours["phases"].items():
        lp = ll["phases"].get(ph, {})
        r50, r90 = pct(p["route_us"], 0.5), pct(p["route_us"], 0.9)
        o90, l90 = pct(p["ttft"], 0.9), pct(lp.get("ttft", []), 0.9)
        c50, t50 = pct(p["compute_us"], 0.5), pct(p["tokenize_us"], 0.5)
        print(f"| {ph} | {p['n']} | {p['rejected']} | {f(r50 and r50 / 1000, '{:.2f}')} / "
              f"{f(r90 and r90 / 1000, '{:.2f}')} | {f(c50 and c50 / 1000, '{:.2f}')} / {f(t50 / 1000 if t50 is not None else None, '{:.2f}')} "
              f"| {f(pct(p['reject_ms'], 0.5))} / {f(pct(p['reject_ms'], 0.9))} / {f(pct(p['reject_ms'], 0.99))} "
              f"| {f(pct(p['reject_ev_ms'], 0.5), '{:.2f}')} "
              f"| {f(pct(p['ttft'], 0.5), '{:.0f}')} / {f(pct(lp.get('ttft', []), 0.5), '{:.0f}')} "
              f"| {f(o90, '{:.0f}')} | {f(l90, '{:.0f}')} "
              f"| {f(l90 / o90 if o90 and l90 else None, '{:.2f}')} |")
    floors = snaps.get("p90_floor") or {}
    if floors:
        print("\nladder: requests that are the first of their group in the run (their prefix is on no engine: every "
              "router prefills it); when they are over 10% of a step, no router's p90 is below the fastest of them")
        print("| phase | requests | first of their group | floor under any router's p90 ms | least-loaded p90 / floor "
              "(the most any router's ratio can be) |")
        print("|---|---|---|---|---|")
        for ph in phs:
            if ph not in floors:
                continue
            n, k, fl = floors[ph]
            l90 = pct(ll["phases"].get(ph, {}).get("ttft", []), 0.9)
            print(f"| {ph} | {n} | {k} ({100 * k / max(1, n):.0f}%) | {f(fl, '{:.0f}')} "
                  f"| {f(l90 / fl if fl and l90 else None, '{:.2f}')} |")
    dur = sched[-1][0] if sched else 1.0
    bo, bl, orc = ours["phases"].get("burst", {}), ll["phases"].get("burst", {}), snaps["oracle"]
    cap = capacity_rps(args.burst_tokens)
    print(f"\nburst: {len(sched)} requests in {dur:.1f} s ({args.burst_cycles} x ({args.burst_s:g} s at 0.6x + "
          f"{args.burst_s:g} s at 2x) of capacity {cap:.1f} req/s for {args.burst_tokens}-token prompts; targets "
          f"{SLO_MIX})")
    print("| gateway | met target | goodput req/s | shed | shed by target (ms) | errors |")
    print("|---|---|---|---|---|---|")
    for name, p in (("ours", bo), ("least-loaded", bl)):
        print(f"| {name} | {p.get('met')} | {f(p.get('met', 0) / dur, '{:.2f}')} | {p.get('rejected')} "
              f"| {p.get('rejected_by_slo')} | {p.get('errors')} |")
    print(f"| oracle (fluid model, true backlog) | {orc['met']} | {orc['met'] / dur:.2f} | {orc['shed']} | - | - |")
    oc = snaps.get("oracle_calibrated")
    if oc:
        print(f"| oracle, model x {oc['scale']:.2f} (measured / model below) | {oc['met']} | {oc['met'] / dur:.2f} "
              f"| {oc['shed']} | - | - |")
    om = snaps.get("oracle_model_mdare")
    print(f"oracle model vs ours' measured TTFT on ours' own dispatches: MdARE "
          f"{f(om and om[0] * 100, '{:.1f}%')}, median measured / model {f(om and om[1], '{:.2f}')}")
    print("calibration per phase (all engines): " + ", ".join(
        f"{ph} {f(100 * sum(x) / len(x), '{:.0f}%')} ({len(x)})" for ph in phs
        for x in [[v for e in ours["engines"].values() for v in e["cal_ph"].get(ph, [])]] if x))
    tk = snaps.get("tokenize_ms") or {}
    print(f"\n/tokenize of a {GROUP_TOKENS}-token chat on the idle fleet (client -> sim, before the phases): "
          f"p50 {f(tk.get('p50'), '{:.2f}')} ms, p90 {f(tk.get('p90'), '{:.2f}')} ms")
    print(f"admission counters: {snap.get('admission')}; errors ours "
          f"{sum(p['errors'] for p in ours['phases'].values())}, least-loaded "
          f"{sum(p['errors'] for p in ll['phases'].values())}; ladder steps {args.step_s} s at {LADDER} req/s, "
          f"{GROUPS} groups x {USERS} users, {GROUP_TOKENS}-token system prompts")
    fl = snap.get("flow") or {}
    print(f"flow control counters: {fl.get('stats')}; healthy peaks (room.py) {snap.get('room')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-s", type=float, default=5.0, help="seconds per ladder step")
    ap.add_argument("--churn", action="store_true", help="also run the churning-prefix ladder (pending cache)")
    ap.add_argument("--burst-cycles", type=int, default=3)
    ap.add_argument("--burst-s", type=float, default=2.0, help="seconds at 0.6x, then at 2x, per cycle")
    ap.add_argument("--burst-tokens", type=int, default=3000, help="unique prompt size in the bursts")
    ap.add_argument("--dump", help="write ours' per-request features and errors as JSON lines here")
    ap.add_argument("--profile", default=PROFILE, choices=sorted(PROFILES), help="the sim's engine profile")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="KV capacity per engine in 16-token blocks (default: the profile's; vllm-default 13000)")
    ap.add_argument("--target-fit", action="store_true", help="ours with routing.target_fit: true")
    args = ap.parse_args()
    ARGS_PROFILE[0] = args.profile
    ARGS_TARGET_FIT[0] = args.target_fit
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
