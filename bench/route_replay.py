"""The route stage alone, replayed on virtual time: instructions per request and decision equivalence between trees.

A fixed, seeded stream of requests goes through `PredictiveRouteStage.run` / `finish` of each tree (no server, no
upstream), on a virtual clock: time.perf_counter / monotonic / time and the event loop's clock are replaced, so two
trees see the same instants and a replay is deterministic. Three scenarios:

- `bench`: one openai backend and the real TelemetryService, the non-streamed JSON path (no TTFT, usage without
  cached tokens): what bench/instructions.py drives through the whole gateway;
- `plain`: three own openai backends and a partner, flow control on (short/long lanes, fair queue, SLOs, spill);
- `tel`: two `sim` engines with a fake telemetry service (token ids, prefix lookups, scrapes, stale views) and
  an openai one.

Every request's outcome is written as one JSON line (the candidates in order or the error with its status, code,
message and headers, the evidence record, the body overrides, the extra headers), then the stage's counters, flow
control's and /admin/routing's snapshots. A tree's replay is compared line by line with the first tree's: SAME, or
the first line that differs. With --instructions each replay also runs under valgrind (callgrind), instrumented
from request --warm to the end of the stream only, with the cyclic GC off: the count per request is stable to
about +-0.3k, and covers the stage and the replay's own loop (the same in every tree).

Run: .venv/bin/python bench/route_replay.py --tree /tmp/base:before --tree .:after [--instructions]
     [--scenarios bench,plain,tel] [--requests 3000] [--warm 300]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

SCENARIOS = ("bench", "plain", "tel")


# ---------------------------------------------------------------------------------------------- the replay (child)
def crc(s: Any) -> int:
    return zlib.crc32(str(s).encode())


class FakeIndex:
    def block_size(self, name: str) -> int:
        return 16

    def chunk_budget(self, name: str) -> int | None:
        return 2048 if name == "s1" else None


class FakeTel:
    """A telemetry service whose answers are functions of the request and the virtual time."""

    def __init__(self, vt: list[float]) -> None:
        self.vt = vt
        self.index = FakeIndex()
        self.began: dict[str, int] = {}

    async def tokens_for(self, name: str, x: Any, body: dict, retain: bool = True) -> tuple[list[int], str]:
        text = json.dumps(body.get("messages"))
        return [crc(text[i:i + 4]) & 0xffff for i in range(0, len(text), 4)], ("engine" if len(text) % 3 else "cache")

    def lookup(self, names: list[str], rk: Any, salt: Any = None, lora: Any = None) -> dict[str, NS]:
        out = {}
        for n in names:
            t = min((crc(n + str(rk.token_ids[:8])) % 6) * 16, len(rk.token_ids))
            out[n] = NS(tokens=t, blocks=t // 16)
        return out

    def load(self, name: str) -> NS:
        k = crc(name + str(int(self.vt[0] * 4))) % 7
        return NS(scraped_at=time.time() - 0.1 * k, healthy=k != 3, running=k, waiting=k % 3, kv_usage=0.1 * k,
                  num_gpu_blocks=1000)

    def is_stale(self, name: str) -> bool:
        return crc(name + str(int(self.vt[0]))) % 5 == 0

    def kv_view(self, name: str) -> dict:
        return {"reason": "gap"}

    def begin(self, n: str, u: int) -> None:
        self.began[n] = self.began.get(n, 0) + u

    def end(self, n: str, u: int) -> None:
        self.began[n] = self.began.get(n, 0) - u

    def observe_cached(self, *a: Any) -> None:
        pass


def _backend(name: str, kind: str, op: str = "self", country: str = "DE") -> dict:
    return {"name": name, "kind": kind, "url": f"http://127.0.0.1:9/{name}/v1", "models": ["m"],
            "location": {"country": country}, "retention": "zero", "operator": op}


def scenario_config(scen: str) -> dict:
    if scen == "bench":
        return {"backends": [_backend("up", "openai")], "routing": {}}
    if scen == "plain":
        return {"backends": [_backend("a", "openai"), _backend("b", "openai"), _backend("c", "openai"),
                             _backend("p", "openai", "partner", "SE")],
                "routing": {"flow_control": {"engine_queue_ms": 150, "long_prompt_tokens": 6000}}}
    return {"backends": [_backend("s1", "sim"), _backend("s2", "sim"), _backend("o", "openai")],
            "routing": {"affinity_rel": 0.2, "prefill_token_budgets": {"s2": 4096}}}


def replay(n: int, out_path: str, scen: str, warm: int) -> None:
    """Replay `n` requests of `scen` through this interpreter's gateway (PYTHONPATH), writing `out_path` (with
    `warm`: nothing written, callgrind counts from request `warm` on)."""
    vt = [1000.0]
    time.perf_counter = lambda: vt[0]
    time.monotonic = lambda: vt[0]
    time.time = lambda: 1.7e9 + vt[0]
    import yaml

    from gateway.api.endpoints import endpoint
    from gateway.config import parse_config
    from gateway.errors import GatewayError
    from gateway.pipeline import RequestContext, RequestHeaders
    from gateway.proxy.health import Health
    from gateway.routing.stage import PredictiveRouteStage
    from gateway.types import Decision, Principal, Usage

    rnd = random.Random(7)
    prefixes = ["You are a helpful assistant. " * k for k in (1, 12, 40, 90)]
    bench = scen == "bench"

    def make_ctx(i: int) -> Any:
        r = rnd.random
        pre = prefixes[rnd.randrange(4)] if not bench else ""
        content = "hello there" if bench else pre + " question %d " % rnd.randrange(50) + "x" * rnd.randrange(0, 600)
        msgs = [{"role": "user", "content": content}]
        if not bench and r() < 0.3:
            msgs = [{"role": "system", "content": pre}] + msgs
        hdr = {}
        if not bench and r() < 0.4:
            hdr["x-session-id"] = "s%d" % rnd.randrange(20)
        if not bench and r() < 0.1:
            hdr["x-ttft-slo-ms"] = str(rnd.choice([200, 800, 3000]))
        c = RequestContext(request_id=f"r{i}", endpoint="chat", headers=RequestHeaders(hdr),
                           body={"model": "m", "messages": msgs})
        c.ep = endpoint("chat")
        est = 8 if bench else int(rnd.choice([50, 200, 800, 3000, 9000, 20000]) * (0.5 + r()))
        c.model, c.model_chain, c.prompt_tokens_est = "m", ("m",), est
        t = "bench" if bench else "t%d" % rnd.randrange(4)
        c.principal = Principal(id="k" + t, kind="api_key", tenant=t)
        prio = "standard" if bench else rnd.choice(["standard", "standard", "realtime", "batch"])
        c.decision = Decision(allow=True, ttft_slo_ms=None if bench else rnd.choice([None, 500.0, 1500.0]),
                              priority=prio, spill_to_partner=r() < 0.3 if not bench else False,
                              share=rnd.choice([1.0, 2.0]) if not bench else 1.0)
        return c

    def callgrind(mode: str) -> None:
        subprocess.run(["callgrind_control", "-i", mode, str(os.getpid())], stdout=subprocess.DEVNULL)

    async def main() -> None:
        cfg = parse_config(yaml.safe_dump(scenario_config(scen)))
        tel: Any = FakeTel(vt) if scen == "tel" else None
        if bench:  # as gateway.wiring: a getter of the (real) telemetry service
            from gateway.telemetry.service import TelemetryService
            svc = TelemetryService(cfg)
            tel = lambda: svc  # noqa: E731
        st = PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel, clock=lambda: vt[0])
        loop = asyncio.get_running_loop()
        loop.time = lambda: vt[0]  # type: ignore[method-assign]
        out = open(out_path if not warm else os.devnull, "w")
        tasks: dict[int, tuple[Any, asyncio.Task]] = {}
        dt, hold = (0.004, 10) if bench else (0.03, 25)

        async def one(c: Any) -> dict:
            try:
                await st.run(c)
                return {"ok": [x.backend.name for x in c.route.candidates]}
            except GatewayError as e:
                return {"err": [e.status, e.code, e.message, e.headers]}

        for i in range(n):
            if warm and i == warm:
                callgrind("on")
            vt[0] += dt
            c = make_ctx(i)
            tasks[i] = (c, loop.create_task(one(c)))
            for _ in range(3):
                await asyncio.sleep(0)
            for j in [j for j, (cc, t) in tasks.items() if t.done() and j <= i - hold]:  # finish what is due
                cc, t = tasks.pop(j)
                res = t.result()
                if "ok" in res:
                    cc.backend, cc.backend_model, cc.status = res["ok"][0], "m", 200
                    cc.ttft_s = 0.02 + (crc(cc.request_id) % 100) / 400.0
                    cc.usage = Usage(prompt_tokens=cc.prompt_tokens_est, completion_tokens=20,
                                     cached_tokens=(crc(j) % 4) * 16)
                    cc.stream, cc.total_s = j % 2 == 0, cc.ttft_s + 0.3
                    if bench:  # the JSON path: no TTFT, usage without cached tokens
                        cc.stream, cc.ttft_s, cc.total_s = False, None, 0.01
                        cc.usage = Usage(prompt_tokens=9, completion_tokens=16)
                    await st.finish(cc)
                if not warm:
                    out.write(json.dumps({"i": j, "res": res, "ev": cc.evidence, "bo": cc.body_overrides,
                                          "xh": cc.extra_headers}, default=str, sort_keys=True) + "\n")
        if warm:
            callgrind("off")
        for _ in range(200):
            vt[0] += 0.05
            await asyncio.sleep(0)
        for j, (cc, t) in sorted(tasks.items()):
            out.write(json.dumps({"i": j, "done": t.done(), "res": t.result() if t.done() else None},
                                 default=str) + "\n")
            if not t.done():
                t.cancel()
        out.write(json.dumps({"stats": st.stats, "flow": st.flow.snapshot(), "snap": st.snapshot()}, default=str,
                             sort_keys=True) + "\n")
        out.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- the driver
def run_tree(tree: Path, scen: str, n: int, out: Path, warm: int, instructions: bool, tmp: Path) -> int | None:
    """Replay one scenario in `tree`; the instructions counted over requests warm..n (with `instructions`)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    child = [sys.executable, __file__, "--child", str(n), str(out), scen]
    subprocess.run(child, env=env, check=True, cwd=tree)  # the decisions
    if not instructions:
        return None
    cg = tmp / f"cg-{scen}-{tree.name}.out"
    p = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={cg}", *child,
                        "--warm", str(warm)], env=env, cwd=tree, capture_output=True, text=True)  # the count
    m = re.search(r"Collected : (\d+)", p.stderr)
    if p.returncode or not m:
        sys.exit(f"{tree} {scen}: callgrind failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return int(m.group(1))


def first_difference(a: Path, b: Path) -> str | None:
    with open(a) as fa, open(b) as fb:
        for k, (x, y) in enumerate(zip(fa, fb)):
            if x != y:
                return f"line {k + 1}"
    return None if a.stat().st_size == b.stat().st_size else "length"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="DIR[:LABEL]; the first is the reference")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--warm", type=int, default=300, help="requests before callgrind counts")
    ap.add_argument("--instructions", action="store_true", help="also count instructions per request (callgrind)")
    ap.add_argument("--child", nargs=3, metavar=("N", "OUT", "SCENARIO"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        counted = "--warm" in sys.argv
        if counted:
            import gc
            gc.disable()  # a full collection inside a counted window is chance, not the stage's cost
        replay(int(a.child[0]), a.child[1], a.child[2], a.warm if counted else 0)
        return
    trees = [(Path(t.split(":")[0]).resolve(), t.split(":")[1] if ":" in t else Path(t).name) for t in a.tree or ["."]]
    tmp = Path(tempfile.mkdtemp(prefix="route-replay-"))
    cols = "| scenario | tree | instructions per request | vs first | decisions vs first |"
    print(cols + "\n|---|---|---|---|---|")
    for scen in a.scenarios.split(","):
        ref_out, ref_n = None, None
        for k, (tree, label) in enumerate(trees):
            out = tmp / f"{scen}-{k}.jsonl"
            total = run_tree(tree, scen, a.requests, out, a.warm, a.instructions, tmp)
            per = total / max(1, a.requests - a.warm) if total is not None else 0.0
            same = "-" if ref_out is None else ("SAME" if (d := first_difference(ref_out, out)) is None else
                                                f"DIFF ({d}: {ref_out} vs {out})")
            ipr = f"{per / 1000:.1f}k" if total is not None else "-"
            vs = f"{per / ref_n:.3f}" if total is not None and ref_n else ("1.000" if total is not None else "-")
            print(f"| {scen} | {label} | {ipr} | {vs} | {same} |", flush=True)
            if ref_out is None:
                ref_out, ref_n = out, (per if total is not None else None)
    print(f"\n(replays in {tmp})")


if __name__ == "__main__":
    main()
