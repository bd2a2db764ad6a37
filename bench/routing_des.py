"""Routing benchmark as a discrete-event simulation in virtual time: the real router against real sim schedulers.

Why: bench/routing.py runs 4 gateways, the sim fleet and the load generator as live processes on a 2-core box,
so its TTFTs measure CPU contention. Here nothing waits on a wall clock: N `backends.sim.scheduler.Scheduler`
instances (their KV block pool and profiles, heterogeneous: 2x h200-8b + 2x l40s-8b) advance step by step on
one virtual clock, and every routing decision is made by the gateway's own code, called directly:
`gateway.routing.registry.build_strategy` (filters, scorers, pickers), `gateway.routing.predictor.Predictor`
(the per-engine online learner, fed the observed TTFT on first token as `PredictiveRouteStage.finish` does)
and `gateway.routing.admission.decide`. The engine views are built as `PredictiveRouteStage._view` builds
them: own dispatched-but-not-first-token prompt tokens and own decodes, plus `num_running`/`num_waiting` as a
metrics scrape reports them (every `SCRAPE_S`, so they lag). Cached prefixes come from
`gateway.telemetry.index.KVIndex`, fed by each engine's KV events through the real wire path
(`backends.sim.kv_wire.encode_batch` -> `gateway.telemetry.kv_events.decode_batch` -> `KVIndex.apply`);
the approximate prefix tree (`ApproxPrefixIndex`, prefix_hash) is fed on finish like the stage does.

TTFT = virtual time of the step that produced the first token - arrival. Rejections are answered at arrival
(0 ms virtual); the table also shows the real wall-clock microseconds the whole routing + admission decision
took in Python. Deterministic for a seed. Usage: python -m bench.routing_des [--seconds 40] [--seed 1]
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterator

from backends.sim.kv_wire import encode_batch
from backends.sim.profiles import EngineProfile, get_profile
from backends.sim.scheduler import Scheduler, SimRequest, StepPlan
from gateway.config import BackendConfig
from gateway.routing.admission import decide
from gateway.routing.plan import Candidate
from gateway.routing.approx import ApproxPrefixIndex, text_blocks
from gateway.routing.plugin import EngineView, Scored
from gateway.routing.registry import build_strategy
from gateway.routing.predictor import Features, Predictor, PredictorParams
from gateway.routing.view import Scrape, engine_view
from gateway.telemetry.index import KVIndex, RequestKeys
from gateway.telemetry.kv_events import decode_batch

STRATEGIES = ("round_robin", "least_loaded", "prefix_hash", "predicted_ttft")
FLEET = ("h200-8b", "h200-8b", "l40s-8b", "l40s-8b")
SCRAPE_S = 0.25  # metrics scrape interval (the gateway's telemetry default order of magnitude)
SLO_MS = 1000.0
APPROX_BLOCK_CHARS = 256  # as the stage: 256 chars ~ 64 tokens of 4 chars


# ------------------------------------------------------------------------------------------------ workload
@dataclass
class Job:
    """One request as the load generator issues it."""

    rid: int
    arrival: float
    tokens: list[int]
    max_tokens: int
    slo_ms: float | None = None
    session: str | None = None
    conv: "Conversation | None" = None


@dataclass
class Conversation:
    """A multi-turn chat: each turn's prompt is the previous prompt + the reply + a new user message."""

    cid: int
    context: list[int]
    turns_left: int
    rng: random.Random


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(n)]


def poisson(rng: random.Random, rate: float, seconds: float) -> Iterator[float]:
    t = rng.expovariate(rate)
    while t < seconds:
        yield t
        t += rng.expovariate(rate)


@dataclass
class Workload:
    name: str
    jobs: list[Job]  # open-loop arrivals (multi-turn adds follow-up turns while running)
    seconds: float
    follow_up: Callable[[Job, SimRequest, float], Job | None] | None = None
    admission: bool = False
    kv_blocks: int | None = None  # h200 KV blocks override (l40s gets 26%); None: the profiles' real KV


def shared_prefix(seed: int, rate: float, seconds: float, groups: int = 16, kv_blocks: int | None = 2500
                  ) -> Workload:
    """llm-d style: `groups` long system prompts (2-4k tokens) shared by many users, short unique suffixes."""
    g = random.Random(seed * 7919 + 1)
    systems = [_toks(g, g.randrange(2048, 4096)) for _ in range(groups)]
    rng = random.Random(seed)
    jobs = []
    for i, t in enumerate(poisson(rng, rate, seconds)):
        s = systems[rng.randrange(groups)]
        jobs.append(Job(i, t, s + _toks(rng, rng.randrange(64, 256)), rng.randrange(32, 160)))
    return Workload("shared_prefix", jobs, seconds, kv_blocks=kv_blocks)


def multi_turn(seed: int, conv_rate: float, seconds: float, turns: int = 6) -> Workload:
    """Conversations start as a Poisson process; each next turn arrives 1-4 s after the previous reply ended."""
    g = random.Random(seed * 7919 + 2)
    systems = [_toks(g, 1024) for _ in range(4)]
    rng = random.Random(seed + 100)
    jobs = []
    for i, t in enumerate(poisson(rng, conv_rate, seconds)):
        crng = random.Random(seed * 100_003 + i)
        conv = Conversation(i, list(systems[i % 4]), turns, crng)
        conv.context += _toks(crng, crng.randrange(100, 400))
        jobs.append(Job(i, t, list(conv.context), crng.randrange(64, 256), session=f"c{i}", conv=conv))
    ids = itertools.count(len(jobs) + 1_000_000)

    def follow(job: Job, sreq: SimRequest, now: float) -> Job | None:
        c = job.conv
        assert c is not None
        c.turns_left -= 1
        if c.turns_left <= 0:
            return None
        c.context = list(sreq.tokens[:-1]) + _toks(c.rng, c.rng.randrange(50, 300))  # reply + new user turn
        return Job(next(ids), now + c.rng.uniform(1.0, 4.0), list(c.context), c.rng.randrange(64, 256),
                   session=job.session, conv=c)
    return Workload("multi_turn", jobs, seconds, follow)


def unique_prompts(seed: int, rate: float, seconds: float, slo_ms: float | None, name: str = "overload"
                   ) -> Workload:
    """Unique 1-3k-token prompts (no reuse) at `rate`, each with a TTFT target: the overload burst."""
    rng = random.Random(seed + 200)
    jobs = [Job(i, t, _toks(rng, rng.randrange(1024, 3072)), rng.randrange(32, 160), slo_ms=slo_ms)
            for i, t in enumerate(poisson(rng, rate, seconds))]
    return Workload(name, jobs, seconds, admission=slo_ms is not None)


# ------------------------------------------------------------------------------------------------ engines
@dataclass
class Engine:
    name: str
    profile: EngineProfile
    sched: Scheduler
    busy: bool = False
    seq: int = 0
    scraped: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # running, waiting, kv usage, when scraped


@dataclass
class Flight:
    """A dispatched request as the router sees it (the stage's Flight)."""

    job: Job
    engine: str
    uncached: int
    features: Features
    predicted_s: float
    upper_s: float
    cached_pred: int
    blocks: list[int] = field(default_factory=list)
    prefilling: bool = True


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    met: int = 0
    admitted: int = 0
    rejected: int = 0
    reject_wall_us: list[float] = field(default_factory=list)
    decide_wall_us: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    pred: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # engine -> (predicted, actual)
    window: float = 0.0
    routed: dict[str, int] = field(default_factory=dict)


class Router:
    """The gateway's routing decision for one strategy, on the real plugins, learner and admission."""

    def __init__(self, strategy: str, engines: list[Engine], admission: bool) -> None:
        self.strategy = build_strategy(strategy)
        self.name = strategy
        self.admission = admission and strategy == "predicted_ttft"
        self.now = 0.0  # virtual time of the event being handled: the learner's clock (its refit interval)
        self.predictor = Predictor(PredictorParams(), clock=lambda: self.now)
        self.approx = ApproxPrefixIndex()
        self.kv = KVIndex()
        self.engines = engines
        self.backends = {e.name: BackendConfig(name=e.name, url="http://sim", kind="sim", models=["m"],
                                               context_window=e.profile.max_model_len) for e in engines}
        self.flights: dict[str, dict[int, Flight]] = {e.name: {} for e in engines}
        self.avg_uncached: dict[str, float] = {}
        self.affinity: dict[str, str] = {}

    def view(self, e: Engine, now: float) -> EngineView:
        """The stage's view (`gateway.routing.view.engine_view`, the same function): own in-flight work drained
        at the learned rate, maxed with the (lagging) scraped engine metrics."""
        running, waiting, usage, at = e.scraped
        return engine_view(((f.job.arrival, f.uncached, f.prefilling) for f in self.flights[e.name].values()),
                           now, self.predictor.drain(e.name, e.profile.max_num_batched_tokens),
                           Scrape(running, waiting, usage, now - at), self.avg_uncached.get(e.name, 512.0))

    def route(self, job: Job) -> tuple[Flight | None, float]:
        """(flight or None when refused, wall-clock µs of the decision)."""
        t0 = time.perf_counter()
        self.now = job.arrival
        n = len(job.tokens)
        rk = RequestKeys(job.tokens)
        found = self.kv.lookup([e.name for e in self.engines], rk)
        blocks = text_blocks(array("I", job.tokens).tobytes().decode("latin-1"), APPROX_BLOCK_CHARS)
        aff = self.affinity.get(job.session) if job.session else None
        items: list[Scored] = []
        feats: dict[str, Features] = {}
        for e in self.engines:
            v = self.view(e, job.arrival)
            v.prompt_tokens = n
            v.cached_tokens = max(0, min(found[e.name].tokens, n - 1))
            v.approx_match = self.approx.match(e.name, blocks) / len(blocks) if blocks else 0.0
            v.affinity = aff == e.name
            f = Features(ahead_tokens=v.ahead_tokens, uncached_tokens=n - v.cached_tokens, running=v.running)
            feats[e.name] = f
            mean, upper = self.predictor.predict(e.name, f)
            c = Candidate(self.backends[e.name], "m", round(mean * 1000, 3), round(upper * 1000, 3),
                          v.cached_tokens)
            items.append(Scored(c, v))
        kept, _ = self.strategy.run(items, n)
        order = [s.cand for s in kept]
        target = job.slo_ms
        if self.admission and target is not None:
            adm = decide(target, [c.predicted_ttft_upper_ms for c in order],  # type: ignore[misc]
                         [c.predicted_ttft_ms for c in order], priority="standard", can_spill=False)
            if adm.action == "reject":
                return None, (time.perf_counter() - t0) * 1e6
            order.sort(key=lambda c: (c.predicted_ttft_upper_ms or 0) > target)
        pick = order[0]
        name = pick.backend.name
        f = feats[name]
        fl = Flight(job, name, int(f.uncached_tokens), f, (pick.predicted_ttft_ms or 0) / 1000,
                    (pick.predicted_ttft_upper_ms or 0) / 1000, pick.cached_tokens or 0, blocks)
        self.flights[name][job.rid] = fl
        if job.session:
            self.affinity[job.session] = name
        return fl, (time.perf_counter() - t0) * 1e6

    def first_token(self, fl: Flight, ttft: float) -> None:
        """What finish() feeds the learner (the stage learns on finish with the features it predicted from)."""
        fl.prefilling = False
        self.now = fl.job.arrival + ttft
        self.predictor.observe(fl.engine, fl.features, ttft)

    def finished(self, fl: Flight, actual_cached: int, step_s: float | None) -> None:
        """What finish() does: drop the flight, feed the approximate tree, the mean uncached prompt and the
        request's mean inter-token time (the engine's step, as a stream shows it)."""
        self.flights[fl.engine].pop(fl.job.rid, None)
        if step_s is not None:
            self.predictor.observe_step(fl.engine, step_s)
        self.approx.insert(fl.engine, fl.blocks)
        unc = len(fl.job.tokens) - actual_cached
        a = self.avg_uncached.get(fl.engine)
        self.avg_uncached[fl.engine] = unc if a is None else 0.9 * a + 0.1 * unc

    def apply_kv(self, e: Engine, payload: bytes) -> None:
        self.kv.apply(e.name, decode_batch(payload))  # type: ignore[arg-type]


def make_fleet(kv_blocks: int | None) -> list[Engine]:
    out = []
    for i, p in enumerate(FLEET):
        prof = get_profile(p)
        if kv_blocks is not None:
            prof = prof.with_overrides(num_gpu_blocks=min(prof.num_gpu_blocks, kv_blocks if "h200" in p
                                                          else int(kv_blocks * 13 / 50)))
        out.append(Engine(f"{i}-{p}", prof, Scheduler(prof, lambda r: 7 + r.num_output % 97)))
    return out


# ------------------------------------------------------------------------------------------------ the loop
class Probe:
    """Hooks for diagnostics (bench/ttft_floor.py) to read the engines' true state; no-ops by default."""

    def routed(self, e: Engine, fl: Flight, now: float) -> None:
        """`fl` was routed to `e` at `now`, before the engine saw it."""

    def planned(self, e: Engine, plan: StepPlan) -> None:
        """`e` started the step `plan`."""

    def stepped(self, e: Engine, plan: StepPlan, now: float) -> None:
        """`e` is about to commit `plan`, ending at `now`."""

    def first_token(self, e: Engine, fl: Flight, now: float) -> None:
        """`fl` got its first token from `e` at `now`."""


def simulate(wl: Workload, strategy: str, warmup: float, probe: Probe | None = None) -> Outcome:
    """Run one workload through one strategy; stats count arrivals in [warmup, seconds)."""
    probe = probe or Probe()
    engines = make_fleet(wl.kv_blocks)
    by_name = {e.name: e for e in engines}
    router = Router(strategy, engines, wl.admission)
    out = Outcome(window=wl.seconds - warmup)
    ev: list[tuple[float, int, str, object]] = []
    cnt = itertools.count()
    for j in wl.jobs:
        heapq.heappush(ev, (j.arrival, next(cnt), "arrive", j))
    heapq.heappush(ev, (0.0, next(cnt), "scrape", None))
    live: dict[int, tuple[Flight, SimRequest]] = {}
    horizon = wl.seconds + 60.0

    def kick(e: Engine, now: float) -> None:
        if e.busy or not e.sched.has_work():
            return
        plan = e.sched.schedule(now)
        if plan is None:
            return
        e.busy = True
        probe.planned(e, plan)
        heapq.heappush(ev, (now + plan.duration, next(cnt), "step", (e, plan)))

    while ev:
        now, _, kind, obj = heapq.heappop(ev)
        if now > horizon:
            break
        if kind == "arrive":
            job: Job = obj  # type: ignore[assignment]
            fl, us = router.route(job)
            measured = warmup <= job.arrival < wl.seconds
            if measured:
                out.decide_wall_us.append(us)
            if fl is None:
                if measured:
                    out.rejected += 1
                    out.reject_wall_us.append(us)
                continue
            if measured:
                out.admitted += 1
                out.routed[fl.engine] = out.routed.get(fl.engine, 0) + 1
            e = by_name[fl.engine]
            probe.routed(e, fl, now)
            sreq = SimRequest(str(job.rid), len(job.tokens), list(job.tokens), job.max_tokens, arrival=now)
            live[job.rid] = (fl, sreq)
            e.sched.add(sreq)
            kick(e, now)
        elif kind == "step":
            e, plan = obj  # type: ignore[misc]
            probe.stepped(e, plan, now)
            res = e.sched.commit(plan, now)
            e.busy = False
            if res.events:
                router.apply_kv(e, encode_batch(now, res.events, 0))
            for r in res.first_tokens:
                fl, _ = live[int(r.rid)]
                ttft = now - fl.job.arrival
                if warmup <= fl.job.arrival < wl.seconds:
                    out.ttft.append(ttft)
                    if ttft * 1000 <= (fl.job.slo_ms or SLO_MS):
                        out.met += 1
                    out.prompt_tokens += r.prompt_len
                    out.cached_tokens += max(0, r.num_cached_tokens)
                    out.pred.setdefault(e.name, []).append((fl.predicted_s, ttft))
                router.first_token(fl, ttft)
                probe.first_token(e, fl, now)
            for r in res.finished:
                fl, sreq = live.pop(int(r.rid))
                step = ((r.finished_at - r.first_token_at) / (r.num_output - 1)
                        if r.num_output > 1 and r.first_token_at is not None else None)
                router.finished(fl, max(0, r.num_cached_tokens), step)
                if wl.follow_up is not None:
                    nxt = wl.follow_up(fl.job, sreq, now)
                    if nxt is not None and nxt.arrival < wl.seconds:
                        heapq.heappush(ev, (nxt.arrival, next(cnt), "arrive", nxt))
            kick(e, now)
        elif kind == "scrape":
            for e in engines:
                e.scraped = (float(len(e.sched.running)), float(len(e.sched.waiting)), e.sched.pool.usage(), now)
            if now < wl.seconds + 30:
                heapq.heappush(ev, (now + SCRAPE_S, next(cnt), "scrape", None))
    return out


# ------------------------------------------------------------------------------------------------ report
def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def mape(pairs: list[tuple[float, float]]) -> float:
    return statistics.fmean(abs(a - p) / a for p, a in pairs) if pairs else float("nan")


def capacity(seed: int, seconds: float, slo_ms: float) -> tuple[float, str]:
    """The fleet's capacity on the overload prompts: the highest Poisson rate at which, with the best of the
    routers (ours included) and no admission, at least 95% of requests meet the TTFT target (bisection)."""
    def ok(rate: float) -> tuple[bool, str]:
        for strat in ("predicted_ttft", "least_loaded", "round_robin"):  # ours without admission counts too
            o = simulate(unique_prompts(seed + 9, rate, seconds, None, "capacity"), strat, seconds * 0.25)
            if o.ttft and sum(1 for t in o.ttft if t * 1000 <= slo_ms) >= 0.95 * len(o.ttft):
                return True, strat
        return False, ""
    lo, hi, best = 2.0, 40.0, "least_loaded"
    for _ in range(7):
        mid = (lo + hi) / 2
        good, strat = ok(mid)
        if good:
            lo, best = mid, strat
        else:
            hi = mid
    return lo, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="virtual seconds of arrivals per run")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-blocks", type=int, default=2500,
                    help="shared_prefix only: h200 KV blocks (l40s gets 26%%), so the prompts do not fit on every engine")
    ap.add_argument("--shared-rate", type=float, default=None, help="shared-prefix req/s (default 0.9x the no-cache capacity)")
    ap.add_argument("--groups", type=int, default=16, help="shared-prefix groups (system prompts of 2-4k tokens)")
    ap.add_argument("--conv-rate", type=float, default=1.5, help="multi-turn: new conversations per second")
    args = ap.parse_args(argv)
    t_wall = time.perf_counter()
    secs = args.seconds
    warm = min(10.0, secs * 0.25)
    cap, cap_by = capacity(args.seed, max(20.0, secs / 2), SLO_MS)
    nocache = sum(1.0 / (3072 * get_profile(p).prefill_s_per_token + get_profile(p).step_overhead_s) for p in FLEET)
    shared_rate = args.shared_rate or round(0.9 * nocache, 2)
    makers: list[Callable[[], Workload]] = [  # fresh per strategy: multi-turn conversations carry state
        lambda: shared_prefix(args.seed, shared_rate, secs, args.groups, args.kv_blocks),
        lambda: multi_turn(args.seed, args.conv_rate, secs),
        lambda: unique_prompts(args.seed, 2.0 * cap, secs, SLO_MS),
    ]
    workloads = [m() for m in makers]
    rows = []
    mapes: dict[tuple[str, str], dict[str, float]] = {}
    for mk in makers:
        for s in STRATEGIES:
            wl = mk()
            o = simulate(wl, s, warm)
            rows.append((wl, s, o))
            mapes[(wl.name, s)] = {k: mape(v) for k, v in sorted(o.pred.items())}
    print(f"fleet: {', '.join(FLEET)}; shared_prefix KV blocks h200={args.kv_blocks} l40s="
          f"{int(args.kv_blocks * 13 / 50)} (x16 tokens; other workloads: the profiles' KV); scrape every {SCRAPE_S * 1000:.0f} ms; {secs:g} virtual s per run, first {warm:g} s warm-up")
    print(f"capacity on the overload prompts (>=95% within {SLO_MS:g} ms, best router = {cap_by}): "
          f"{cap:.2f} req/s; shared_prefix offered {shared_rate} req/s ({args.groups} groups, 0.9x the no-cache capacity "
          f"{nocache:.2f} req/s for 3k-token prompts); overload offered {2 * cap:.2f} req/s\n")
    print("| workload | strategy | reqs | TTFT p50 ms | p90 ms | p99 ms | goodput req/s | goodput / capacity | "
          "met / admitted | rejected | reject answered (virtual ms / wall µs p99) | decision wall µs p50 | "
          "cached ratio | MAPE per engine |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for wl, s, o in rows:
        good = o.met / o.window
        mp = mapes[(wl.name, s)]
        mtxt = " ".join(f"{k.split('-')[0]}:{v * 100:.0f}%" for k, v in mp.items()) if s == "predicted_ttft" else "-"
        rej = f"0 / {pct(o.reject_wall_us, 0.99):.0f}" if o.rejected else "-"
        print(f"| {wl.name} | {s} | {o.admitted + o.rejected} | {pct(o.ttft, .5) * 1000:.0f} | "
              f"{pct(o.ttft, .9) * 1000:.0f} | {pct(o.ttft, .99) * 1000:.0f} | {good:.2f} | {good / cap:.2f} | "
              f"{o.met / max(1, o.admitted) * 100:.1f}% | {o.rejected} | {rej} | "
              f"{pct(o.decide_wall_us, .5):.0f} | {o.cached_tokens / max(1, o.prompt_tokens):.2f} | {mtxt} |")
    print("\nprediction MAPE per engine (predicted_ttft's learner, out of sample, after warm-up):")
    for wl in workloads:
        mp = mapes[(wl.name, "predicted_ttft")]
        print(f"  {wl.name}: " + ", ".join(f"{k} {v * 100:.1f}%" for k, v in mp.items()))
    sp = {s: o for w, s, o in rows if w.name == "shared_prefix"}
    ov = {s: o for w, s, o in rows if w.name == "overload"}
    ratio = pct(sp["least_loaded"].ttft, .9) / max(1e-9, pct(sp["predicted_ttft"].ttft, .9))
    o = ov["predicted_ttft"]
    worst = max((v for d in (mapes[(w.name, "predicted_ttft")] for w in workloads) for v in d.values()
                 if not math.isnan(v)), default=float("nan"))
    print(f"\ntargets: shared-prefix p90 least_loaded/ours = {ratio:.1f}x (>= 10x); worst per-engine MAPE "
          f"{worst * 100:.1f}% (<= 10%); overload met/admitted {o.met / max(1, o.admitted) * 100:.1f}% (>= 95%), "
          f"goodput {o.met / o.window / cap * 100:.0f}% of capacity (>= 90%)")
    print(f"wall time {time.perf_counter() - t_wall:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
