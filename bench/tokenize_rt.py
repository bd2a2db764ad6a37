"""The /tokenize round trip the route stage waits on (issue 17: a refusal that no bound decides before
tokenizing waits for it): the gateway's engine client (gateway/telemetry/tokens.TokenizeClient, the native
HTTP/1.1 client) next to httpx (what it used before), against one live `backends.sim` engine, alternating.

Prints wall time per call (p50/p90) and the client's own CPU per call (process time of this process, which runs
only the client: the engine is a child process).
Usage: python bench/tokenize_rt.py [--words 1500,3000] [--calls 60] [--rounds 2]
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
from typing import Any, Awaitable, Callable

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.routing import text  # noqa: E402
from gateway.telemetry.tokens import TokenizeClient  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


async def measure(call: Callable[[dict[str, Any]], Awaitable[int]], bodies: list[dict[str, Any]]
                  ) -> tuple[list[float], float, int]:
    walls: list[float] = []
    c0 = time.process_time()
    n = 0
    for b in bodies:
        t0 = time.perf_counter()
        n = await call(b)
        walls.append(time.perf_counter() - t0)
    return walls, (time.process_time() - c0) / len(bodies), n


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    manifest = tmp / "fleet.json"
    fleet = subprocess.Popen([sys.executable, "-m", "backends.sim", "--engines", "1", "--profile", "vllm-default",
                              "--base-port", "0", "--manifest", str(manifest)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            if manifest.exists():
                break
            await asyncio.sleep(0.05)
        root = json.loads(manifest.read_text())["engines"][0]["url"].removesuffix("/v1")
        hx = httpx.AsyncClient()
        native = TokenizeClient(5.0)

        async def via_httpx(b: dict[str, Any]) -> int:
            r = await hx.post(root + "/tokenize", json=b, timeout=5.0)
            r.raise_for_status()
            return len(r.json()["tokens"])

        async def via_native(b: dict[str, Any]) -> int:
            js = await native.post(root, b)
            assert js is not None
            return len(js["tokens"])

        rows = []
        for words in [int(w) for w in args.words.split(",")]:
            rng = random.Random(words)
            bodies = [{"model": "sim-model", "add_generation_prompt": True,
                       "messages": [{"role": "user", "content": text(rng, words)}]} for _ in range(args.calls)]
            for b in bodies[:3]:  # warm both pools and the engine
                await via_httpx(b)
                await via_native(b)
            res: dict[str, tuple[list[float], list[float], int]] = {"httpx": ([], [], 0), "native": ([], [], 0)}
            for _ in range(args.rounds):
                for name, f in (("httpx", via_httpx), ("native", via_native)):
                    w, cpu, n = await measure(f, bodies)
                    res[name][0].extend(w)
                    res[name][1].append(cpu)
                    res[name] = (res[name][0], res[name][1], n)
            rows.append((words, res))
        await hx.aclose()
        await native.aclose()
    finally:
        fleet.terminate()
        fleet.wait()
    print("| prompt tokens | client | wall p50 ms | wall p90 ms | client CPU ms per call | native / httpx (p50, CPU) |")
    print("|---|---|---|---|---|---|")
    for words, res in rows:
        base = res["httpx"]
        for name, (w, cpus, n) in res.items():
            cpu = sum(cpus) / len(cpus)
            ratio = "" if name == "httpx" else \
                f"{pct(w, .5) / pct(base[0], .5):.2f} / {cpu / (sum(base[1]) / len(base[1])):.2f}"
            print(f"| {n} | {name} | {pct(w, .5) * 1000:.2f} | {pct(w, .9) * 1000:.2f} | {cpu * 1000:.3f} | {ratio} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", default="1500,3000", help="prompt lengths (the sim: about one token per word)")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(ap.parse_args()))
