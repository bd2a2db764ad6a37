"""CPU cost of a simulated vLLM fleet under a saturating workload (prints a table).

Starts `python -m backends.sim` as a child process, drives it with streaming chat requests from this
process (more clients than the engines have sequence slots, so requests queue the whole time), and reads
the child's CPU time from /proc before and after a measurement window.

    python bench/sim_cost.py --engines 4 --profile l40s-8b --max-num-seqs 32 --concurrency 48 --duration 20
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from backends.sim.fleet import FleetProcess  # noqa: E402


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def scrape(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


async def client(c: httpx.AsyncClient, url: str, stop: float, rng: random.Random, stats: dict[str, int],
                 prefixes: list[str], max_tokens: int) -> None:
    while time.monotonic() < stop:
        msgs = [{"role": "system", "content": rng.choice(prefixes)},
                {"role": "user", "content": " ".join(f"u{rng.randrange(10**6)}" for _ in range(50))}]
        body = {"messages": msgs, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        try:
            async with c.stream("POST", url + "/chat/completions", json=body) as r:
                async for _ in r.aiter_raw():
                    pass
            stats["done"] += 1
        except httpx.HTTPError:
            stats["errors"] += 1


async def drive(manifest: dict, args: argparse.Namespace, pid: int) -> list[tuple[str, str]]:
    engines = manifest["engines"]
    prefixes = [" ".join(f"sys{p}w{j}" for j in range(args.prompt_tokens)) for p in range(8)]
    stats = {"done": 0, "errors": 0}
    limits = httpx.Limits(max_connections=args.concurrency * len(engines) + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        warm_stop = time.monotonic() + args.warmup + args.duration
        tasks = [asyncio.create_task(client(c, e["url"], warm_stop, random.Random(i * 1000 + k), stats, prefixes,
                                            args.max_tokens))
                 for i, e in enumerate(engines) for k in range(args.concurrency)]
        await asyncio.sleep(args.warmup)
        before = {e["name"]: (await c.get(e["metrics"])).text for e in engines}
        cpu0, t0, done0 = cpu_seconds(pid), time.monotonic(), stats["done"]
        waiting_samples = []
        while time.monotonic() < t0 + args.duration:
            await asyncio.sleep(1.0)
            w = 0.0
            for e in engines:
                w += scrape((await c.get(e["metrics"])).text, "vllm:num_requests_waiting")
            waiting_samples.append(w)
        cpu1, t1, done1 = cpu_seconds(pid), time.monotonic(), stats["done"]
        after = {e["name"]: (await c.get(e["metrics"])).text for e in engines}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gen = sum(scrape(after[n], "vllm:generation_tokens_total") - scrape(before[n], "vllm:generation_tokens_total")
              for n in after)
    prompt = sum(scrape(after[n], "vllm:prompt_tokens_total") - scrape(before[n], "vllm:prompt_tokens_total")
                 for n in after)
    hits = sum(scrape(after[n], "vllm:prefix_cache_hits_total") - scrape(before[n], "vllm:prefix_cache_hits_total")
               for n in after)
    queries = sum(scrape(after[n], "vllm:prefix_cache_queries_total")
                  - scrape(before[n], "vllm:prefix_cache_queries_total") for n in after)
    wall = t1 - t0
    cpu = cpu1 - cpu0
    return [
        ("engines x profile", f"{len(engines)} x {args.profile} (max_num_seqs {args.max_num_seqs})"),
        ("clients per engine", str(args.concurrency)),
        ("window (s)", f"{wall:.1f}"),
        ("fleet CPU (s)", f"{cpu:.2f}"),
        ("fleet CPU (cores)", f"{cpu / wall:.3f}"),
        ("requests completed", str(done1 - done0)),
        ("generated tokens/s", f"{gen / wall:.0f}"),
        ("prompt tokens/s", f"{prompt / wall:.0f}"),
        ("prefix hit rate", f"{hits / queries:.2f}" if queries else "n/a"),
        ("mean waiting requests (fleet)", f"{sum(waiting_samples) / max(1, len(waiting_samples)):.1f}"),
        ("CPU ms per generated token", f"{1000 * cpu / gen:.3f}" if gen else "n/a"),
        ("client errors", str(stats["errors"])),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--profile", default="l40s-8b")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=48, help="clients per engine (> max-num-seqs saturates)")
    ap.add_argument("--prompt-tokens", type=int, default=800, help="shared system prefix length")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        fp = FleetProcess(["--engines", str(args.engines), "--profile", args.profile, "--base-port", "0",
                           "--max-num-seqs", str(args.max_num_seqs)], Path(d) / "fleet.json")
        manifest = fp.start()
        try:
            rows = asyncio.run(drive(manifest, args, fp.proc.pid))  # type: ignore[union-attr]
        finally:
            fp.stop()
    w = max(len(k) for k, _ in rows)
    print(f"{'metric':<{w}}  value")
    print(f"{'-' * w}  {'-' * 40}")
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
