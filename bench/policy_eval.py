"""Benchmark: compiled policy evaluation (CompiledPolicy.decide) with N rules. Prints a table.

    python bench/policy_eval.py [--rules 1000] [--iters 200000]

"no-memo" evaluates without the memo of combined decisions (every request pays matching + combining).
Rules mimic a real fleet: per-tenant, per-team and per-key rules (indexed buckets), label rules, model rules
and a handful of unindexed glob/header/time rules that every request tests.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import yaml

from gateway.policy.compiler import compile_text
from gateway.policy.model import RequestAttrs
from gateway.types import Principal


def make_policy(n: int, seed: int = 1) -> str:
    rnd = random.Random(seed)
    rules = []
    wild = [
        {"id": "w-secret", "match": {"headers": {"x-data-classification": "secret"}}, "deny": True},
        {"id": "w-conf", "match": {"headers": {"x-data-classification": ["confidential", "restricted"]}},
         "require": {"jurisdiction": "EEA", "retention": "zero"}},
        {"id": "w-huge", "match": {"max_tokens": {"gt": 32768}}, "deny": True},
        {"id": "w-night", "match": {"time": {"hours": "22:00-06:00", "tz": "Europe/Berlin"}}, "set": {"priority": "batch"}},
        {"id": "w-frontier", "match": {"model": ["kimi-k3*", "glm-5*"], "scopes": "intern"}, "deny": True},
    ]
    rules.extend(wild)
    i = 0
    while len(rules) < n:
        t = f"tenant{i % 200}"
        kind = i % 5
        if kind == 0:
            rules.append({"id": f"r{i}", "match": {"tenant": t}, "budgets": [{"window": "month", "limit": "1000 EUR"}]})
        elif kind == 1:
            rules.append({"id": f"r{i}", "match": {"tenant": t, "team": f"team{i % 7}"}, "set": {"priority": "realtime"}})
        elif kind == 2:
            rules.append({"id": f"r{i}", "match": {"key": f"key{i}"}, "set": {"max_tokens": 1000 + i}})
        elif kind == 3:
            rules.append({"id": f"r{i}", "match": {"labels.residency": rnd.choice(["eea", "de", "fr"]), "tenant": t},
                          "require": {"jurisdiction": "EEA"}})
        else:
            rules.append({"id": f"r{i}", "match": {"model": f"model-{i % 50}", "team": f"team{i % 7}", "tenant": t},
                          "set": {"ttft_slo_ms": 500 + i}})
        i += 1
    rules.append({"id": "opper", "match": {"partner": "opper"}, "require": {"jurisdiction": "EEA", "retention": "zero"}})
    return yaml.safe_dump({"rules": rules[:n]})


def bench(n: int, iters: int) -> dict[str, float]:
    pol = compile_text(make_policy(n))
    rnd = random.Random(7)
    reqs = []
    for j in range(256):
        p = Principal(id="k", kind="api_key", tenant=f"tenant{rnd.randrange(200)}", team=f"team{rnd.randrange(7)}",
                      key_id=f"key{rnd.randrange(n)}", labels={"residency": rnd.choice(["eea", "de", "us"])},
                      scopes=("intern",) if j % 9 == 0 else ())
        r = RequestAttrs(model=f"model-{rnd.randrange(60)}", headers={"x-data-classification": rnd.choice(["public", "confidential"])},
                         max_tokens=rnd.choice([None, 512, 4096]), now=1.7e9 + j * 3600)
        reqs.append((p, r))
    decide = pol.decide
    for p, r in reqs:  # warm up
        decide(p, r)
    samples = []
    per = max(1, iters // 20)
    for _ in range(20):
        t0 = time.perf_counter()
        for k in range(per):
            p, r = reqs[k & 255]
            decide(p, r)
        samples.append((time.perf_counter() - t0) / per * 1e6)
    cold = []
    combine, matched_fn = pol._combine, pol.matched
    for _ in range(10):
        t0 = time.perf_counter()
        for k in range(per // 2):
            p, r = reqs[k & 255]
            combine(matched_fn(p, r), r.model)
        cold.append((time.perf_counter() - t0) / (per // 2) * 1e6)
    matched = statistics.mean(len(pol.matched(p, r)) for p, r in reqs)
    cands = statistics.mean(len(pol.candidates(p, r)) for p, r in reqs)
    return {"rules": n, "median_us": statistics.median(samples), "p95_us": sorted(samples)[int(0.95 * len(samples)) - 1],
            "cands": cands, "matched": matched, "cold_us": statistics.median(cold)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rules", type=int, nargs="*", default=[10, 100, 1000])
    ap.add_argument("--iters", type=int, default=100000)
    a = ap.parse_args()
    print(f"{'rules':>6} | {'median µs/decide':>16} | {'p95 µs (of 20 batches)':>22} | {'no-memo µs':>10} | {'rules tested':>12} | {'rules matched':>13}")
    print("-" * 96)
    for n in a.rules:
        r = bench(n, a.iters)
        print(f"{r['rules']:>6} | {r['median_us']:>16.2f} | {r['p95_us']:>22.2f} | {r['cold_us']:>10.2f} | {r['cands']:>12.1f} | {r['matched']:>13.1f}")


if __name__ == "__main__":
    main()
