"""Conservation on the simulator's own clock: the sim's scheduler (backends/sim/scheduler.py, no I/O, no real
time) runs a mixed workload step by step; the spans a gateway would see (arrival - 2 ms to finish + 2 ms of
HTTP) go through the same EngineClock the gateway uses (`apportion`), with prefill owed at a learned cost per
token that is off by a factor (a router still learning). Deterministic, so the 5% bound is checked without a
loaded host's scheduling noise (tests/cost/test_conservation.py runs the same against live processes).
Per request, the apportioned seconds are compared with the scheduler's own split of every step."""
from __future__ import annotations

import random

import pytest

from backends.sim.profiles import get_profile
from backends.sim.scheduler import Scheduler, SimRequest
from gateway.cost.apportion import Span, apportion


def run_workload(profile: str, n: int, rate: float, seed: int) -> tuple[Scheduler, list[SimRequest]]:
    prof = get_profile(profile)
    rng = random.Random(seed)
    sched = Scheduler(prof, lambda r: 7)
    shared = [[10_000 * (p + 1) + j for j in range(320)] for p in range(3)]
    reqs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = (rng.choice(shared) if rng.random() < 0.7 else [1_000_000 + i * 1000 + j for j in range(400)])
        prompt = prompt + [2_000_000 + i * 100 + j for j in range(40)]
        reqs.append(SimRequest(f"r{i}", len(prompt), list(prompt), max_tokens=rng.choice([8, 24, 48, 128]),
                               arrival=t))
    pending = list(reqs)
    now = 0.0
    while pending or sched.has_work():
        while pending and pending[0].arrival <= now:
            sched.add(pending.pop(0))
        plan = sched.schedule(now)
        if plan is None:
            now = pending[0].arrival
            continue
        now += plan.duration
        sched.commit(plan, now)
    return sched, reqs


@pytest.mark.parametrize("profile,rate,skew", [("l40s-8b", 6.0, 1.0), ("h200-8b", 12.0, 1.0),
                                               ("l40s-8b", 3.0, 0.5), ("h200-8b", 12.0, 2.0)])
def test_apportioned_seconds_sum_to_the_schedulers_busy_time(profile, rate, skew):
    sched, reqs = run_workload(profile, 200, rate, seed=11)
    b = get_profile(profile).prefill_s_per_token * skew  # the learned cost per token, off by `skew`
    http = 0.002
    spans = [Span(r.rid, r.arrival - http, r.finished_at + http, (r.prompt_len - r.num_cached_tokens) * b)
             for r in reqs]
    out = apportion(spans)
    busy = sched.stats.busy_s
    assert sum(r.true_s for r in reqs) == pytest.approx(busy, rel=1e-9)  # the truth splits every step
    assert out.total_s == pytest.approx(out.busy_s, rel=1e-9)  # every instant of busy time went to someone
    assert out.total_s == pytest.approx(busy, rel=0.05), (out.total_s, busy)
    errs = sorted(abs(out.charges[r.rid].seconds - r.true_s) / r.true_s for r in reqs)
    wall = sorted(abs((r.finished_at - r.arrival) - r.true_s) / r.true_s for r in reqs)
    # per request: the median request within 25% of its true share even with the cost per token 2x off,
    # and several times closer than the wall time it spent on the engine
    assert errs[100] < 0.25, errs[100]
    assert errs[100] < wall[100] / 3, (errs[100], wall[100])
