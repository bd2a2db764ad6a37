"""1,000 concurrent streaming requests through one gateway process in front of the simulated fleet.

Every request must either complete (200, SSE ending in [DONE]) or be refused cleanly (an OpenAI-shaped 4xx/503
with Retry-After); anything else (5xx, a stream cut without [DONE], a transport error, a hang) is an error.
Prints completed / refused / errors, latency percentiles and the gateway's RSS before, peak and after.
Run: .venv/bin/python bench/concurrency.py [--concurrency 1000] [--engines 4] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hardening.stack import GW_KEY, proc_stats, start_stack, wait_ready  # noqa: E402


def raise_nofile(n: int = 65536) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(n, hard)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # children (gateway, fleet) inherit it
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int, timeout_s: float) -> tuple[str, float]:
    body = {"model": "sim-model", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"request {i}: tell me a story about the sea"}]}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=orjson.dumps(body), headers={
                    "authorization": f"Bearer {GW_KEY}", "content-type": "application/json"}) as r:
                data = await r.read()
                if r.status == 200:
                    ok = data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
                    return ("completed" if ok else "error:stream_cut"), time.perf_counter() - t0
                if r.status < 500 or r.status == 503:
                    err = orjson.loads(data).get("error", {})
                    if err.get("message") and (r.status not in (429, 503) or r.headers.get("retry-after")):
                        return "refused", time.perf_counter() - t0
                return f"error:{r.status}", time.perf_counter() - t0
    except TimeoutError:
        return "error:hang", time.perf_counter() - t0
    except (aiohttp.ClientError, OSError, ValueError) as e:
        return f"error:{type(e).__name__}", time.perf_counter() - t0


async def sample_rss(pid: int, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        out.append(proc_stats(pid)["rss_mib"])
        await asyncio.sleep(0.2)


async def run(base: str, pid: int, n: int, max_tokens: int, timeout_s: float) -> tuple[Counter, list[float], float, list[float]]:
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    rss: list[float] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=conn) as s:
        sampler = asyncio.create_task(sample_rss(pid, stop, rss))
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(s, base + "/v1/chat/completions", i, max_tokens, timeout_s) for i in range(n)))
        wall = time.perf_counter() - t0
        stop.set()
        await sampler
    kinds = Counter(k for k, _ in res)
    lat = sorted(t for k, t in res if k == "completed")
    return kinds, lat, wall, rss


def pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--profile", default="h200-8b")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args()
    nofile = raise_nofile()
    st = start_stack(Path(tempfile.mkdtemp(prefix="bench-conc-")), engines=a.engines, profile=a.profile,
                     locations=",".join(["DE", "SE", "FI", "NL"][: a.engines]))
    try:
        wait_ready(st.base)
        pid = st.gw.p.pid
        before = proc_stats(pid)
        kinds, lat, wall, rss = asyncio.run(run(st.base, pid, a.concurrency, a.max_tokens, a.timeout))
        time.sleep(1.0)
        after = proc_stats(pid)
        tracebacks = st.gw.log_path.read_text(errors="replace").count("Traceback")
    finally:
        st.stop()
    errors = sum(v for k, v in kinds.items() if k.startswith("error"))
    print(f"| concurrent streams | engines ({a.profile}) | completed | refused | errors | p50 ms | p99 ms | wall s | "
          f"RSS before MiB | RSS peak MiB | RSS after MiB | fds before/after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {a.concurrency} | {a.engines} | {kinds['completed']} | {kinds['refused']} | {errors} | {pct(lat, .5):.0f} | "
          f"{pct(lat, .99):.0f} | {wall:.1f} | {before['rss_mib']:.0f} | {max(rss + [after['peak_rss_mib']]):.0f} | "
          f"{after['rss_mib']:.0f} | {before['fds']}/{after['fds']} |")
    print(f"\nnofile limit {nofile}; outcome kinds {dict(kinds)}; gateway tracebacks {tracebacks}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
