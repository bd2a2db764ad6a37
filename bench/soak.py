"""Soak: N minutes of mixed traffic through one gateway in front of the simulated fleet, checking for leaks.

Traffic (fixed mix, 24 client workers): streaming and non-streaming chats, refusals (bad key, bad body,
unknown model), clients that disconnect mid-stream, and engine faults (one engine cycles through
500-storms and hangs). Every 10 s it samples the gateway's RSS, open fds, sockets, asyncio tasks and
in-flight requests; at the end it prints the samples' least-squares RSS slope (MiB/min, first minute of
warm-up excluded) and the end-of-run fd / socket / task / in-flight counts after traffic stops.
Run: .venv/bin/python bench/soak.py [--minutes 10] [--workers 24] [--server '{"gc_threshold": null}']
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hardening.stack import GW_KEY, proc_stats, start_stack, wait_ready  # noqa: E402
from tests.resilience.stack import engine_root  # noqa: E402

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "soak test, say something"}], "max_tokens": 16}


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


async def worker(c: httpx.AsyncClient, base: str, stop: float, out: Counter, rnd: random.Random) -> None:
    auth = {"authorization": f"Bearer {GW_KEY}"}
    url = base + "/v1/chat/completions"
    while time.monotonic() < stop:
        kind = rnd.choices(["json", "stream", "disconnect", "bad_key", "bad_body", "unknown_model"],
                           weights=[30, 35, 10, 8, 9, 8])[0]
        try:
            if kind == "json":
                r = await c.post(url, json=CHAT, headers=auth)
                out[f"json:{r.status_code}"] += 1
            elif kind in ("stream", "disconnect"):
                async with c.stream("POST", url, json={**CHAT, "stream": True}, headers=auth) as r:
                    n = 0
                    async for _ in r.aiter_raw():
                        n += 1
                        if kind == "disconnect" and n >= 2:
                            break  # leaves the stream early: the connection is dropped
                out[f"{kind}:{r.status_code}"] += 1
            elif kind == "bad_key":
                r = await c.post(url, json=CHAT, headers={"authorization": "Bearer nope"})
                out[f"bad_key:{r.status_code}"] += 1
            elif kind == "bad_body":
                r = await c.post(url, content=b'{"model": 1', headers={**auth, "content-type": "application/json"})
                out[f"bad_body:{r.status_code}"] += 1
            else:
                r = await c.post(url, json={**CHAT, "model": "no-such-model"}, headers=auth)
                out[f"unknown_model:{r.status_code}"] += 1
        except httpx.HTTPError as e:
            out[f"{kind}:transport:{type(e).__name__}"] += 1


async def faults(manifest: dict, stop: float, out: Counter) -> None:
    """Engine 1 cycles: healthy 20 s, 500-storm 10 s, healthy 20 s, hung 10 s."""
    root = engine_root(manifest, 1) + "/sim/faults"
    async with httpx.AsyncClient(timeout=5) as c:
        cycle = [({"error_rate": 0.0, "hang": False}, 20), ({"error_rate": 0.5}, 10),
                 ({"error_rate": 0.0, "hang": False}, 20), ({"hang": True}, 10)]
        i = 0
        while time.monotonic() < stop:
            f, dur = cycle[i % len(cycle)]
            await c.post(root, json=f)
            out["fault_phases"] += 1
            await asyncio.sleep(min(dur, max(0.0, stop - time.monotonic())))
            i += 1
        await c.post(root, json={"error_rate": 0.0, "hang": False})


async def sampler(base: str, pid: int, stop: float, samples: list[dict]) -> None:
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() < stop:
            s = proc_stats(pid)
            try:
                m = (await c.get(base + "/metrics")).text
                s["tasks"] = metric(m, "gateway_event_loop_tasks")
                s["in_flight"] = metric(m, "gateway_in_flight_requests")
            except httpx.HTTPError:
                s["tasks"] = s["in_flight"] = float("nan")
            s["t_min"] = (time.monotonic() - t0) / 60
            samples.append(s)
            await asyncio.sleep(10)


async def run(st, minutes: float, workers: int) -> tuple[Counter, list[dict]]:
    stop = time.monotonic() + minutes * 60
    out: Counter = Counter()
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=workers * 2, max_keepalive_connections=workers)
    async with httpx.AsyncClient(timeout=30, limits=limits) as c:
        await asyncio.gather(*(worker(c, st.base, stop, out, random.Random(i)) for i in range(workers)),
                             faults(st.manifest, stop, out), sampler(st.base, st.gw.p.pid, stop, samples))
    return out, samples


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--workers", type=int, default=24)
    ap.add_argument("--server", default="{}", help="JSON merged into the gateway config's server section")
    a = ap.parse_args()
    st = start_stack(Path(tempfile.mkdtemp(prefix="bench-soak-")), engines=3, locations="DE,SE,FI",
                     fleet_args=["--max-num-seqs", "64"], server=orjson.loads(a.server),
                     identity={"auth_fail_limit_per_minute": 1_000_000})
    try:
        wait_ready(st.base)
        base_stats = proc_stats(st.gw.p.pid)
        out, samples = asyncio.run(run(st, a.minutes, a.workers))
        time.sleep(5)  # let keep-alive connections and in-flight work wind down
        end = proc_stats(st.gw.p.pid)
        m = httpx.get(st.base + "/metrics", timeout=10).text
        end["tasks"] = metric(m, "gateway_event_loop_tasks")
        end["in_flight"] = metric(m, "gateway_in_flight_requests")
        tracebacks = st.gw.log_path.read_text(errors="replace").count("Traceback")
    finally:
        st.stop()
    warm = [s for s in samples if s["t_min"] >= min(1.0, a.minutes / 4)]
    rss_slope = slope([s["t_min"] for s in warm], [s["rss_mib"] for s in warm])
    print("| t min | RSS MiB | fds | sockets | asyncio tasks | in flight |")
    print("|---|---|---|---|---|---|")
    for s in samples[:: max(1, len(samples) // 12)] + [dict(end, t_min=float("nan"))]:
        t = "end (idle)" if s["t_min"] != s["t_min"] else f"{s['t_min']:.1f}"
        print(f"| {t} | {s['rss_mib']:.1f} | {s['fds']} | {s['sockets']} | {s['tasks']:.0f} | {s['in_flight']:.0f} |")
    total = sum(v for k, v in out.items() if k != "fault_phases")
    # 502/503/504 on the main traffic kinds are the injected engine faults answered cleanly; a 500 (the
    # gateway's own failure) on any kind, a 5xx on the other kinds and a transport error never are
    bad = {k: v for k, v in out.items() if k.endswith(":500") or "transport" in k
           or (":5" in k and not k.startswith(("stream:", "json:")))}
    print(f"\nminutes {a.minutes:g}, workers {a.workers}, requests {total}, fault phases {out['fault_phases']}")
    print(f"RSS slope after warm-up: {rss_slope:+.3f} MiB/min; RSS start {base_stats['rss_mib']:.1f} -> end "
          f"{end['rss_mib']:.1f} MiB (peak {end['peak_rss_mib']:.1f}); fds {base_stats['fds']} -> {end['fds']}; "
          f"sockets {base_stats['sockets']} -> {end['sockets']}; tasks at end {end['tasks']:.0f}; "
          f"in flight at end {end['in_flight']:.0f}; gateway tracebacks {tracebacks}")
    print("outcomes:", orjson.dumps(dict(sorted(out.items()))).decode())
    problems = []
    if bad:
        problems.append(f"unexpected outcomes {bad}")
    if tracebacks:
        problems.append(f"{tracebacks} tracebacks in the gateway log")
    if end["in_flight"]:
        problems.append(f"{end['in_flight']:.0f} requests still in flight when idle")
    if problems:
        sys.exit("soak FAILED: " + "; ".join(problems))


if __name__ == "__main__":
    main()
