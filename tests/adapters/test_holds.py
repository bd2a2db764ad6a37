"""gateway/adapters/holds.py on both stores (SQLite file, a Postgres schema): one process's hold on an adapter is
seen by another before it unloads; a lease that is not renewed lapses (a crashed replica does not pin an adapter
forever); a release and a clean close give the hold back; the latest use of any process is what an LRU choice
sees. And Placement with two processes on one engine (max_loras 1, the simulated vLLM engine): the second never
unloads the adapter the first has a request in flight on, nor one the engine reports running, and the engine's
own --max-loras (vllm:lora_requests_info) is used when the config leaves max_loras unset."""
from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from backends.sim.fleet import start_fleet
from backends.sim.lora import LoraConfig
from gateway.adapters.holds import LEASE_S, SCHEMA, SharedHolds
from gateway.adapters.model import Adapter
from gateway.adapters.placement import Placement, adapter_backends
from gateway.adapters.service import AdapterService
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.routing.plan import Candidate
from tests.adapters.test_placement_io import ctx_for, resident


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


async def test_a_hold_is_seen_by_the_other_process_until_released_or_lapsed(adapters: AdapterService):
    clock = Clock()
    store = adapters.identity.store
    a, b = SharedHolds(store, "a", clock), SharedHolds(store, "b", clock)
    await store.ensure_tables(SCHEMA)
    assert a.note("e1", "x", 1) is True  # crossed zero: publish
    await a.flush("e1", "x")
    assert a.note("e1", "x", 2) is False  # still held: nothing to write
    assert (await b.others("e1"))["x"].inflight == 1
    assert await a.others("e1") == {}  # its own rows are not "others"
    assert await b.others("e2") == {}

    clock.t += LEASE_S + 1  # not renewed: the hold lapses, its use time stays
    h = (await b.others("e1"))["x"]
    assert h.inflight == 0 and h.used_at == 1_000_000.0
    await a.renew()  # renewed: counts again
    assert (await b.others("e1"))["x"].inflight == 1

    assert a.note("e1", "x", 0) is True
    await a.flush("e1", "x")
    h = (await b.others("e1"))["x"]
    assert h.inflight == 0 and h.used_at == clock.t

    a.note("e1", "y", 1)
    await a.flush("e1", "y")
    await a.close()  # a clean stop gives every hold back
    assert await b.others("e1") == {}


async def test_placement_never_unloads_what_another_process_or_the_engine_is_using(adapters: AdapterService):
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=1, load_s=0.0)) as fleet:
        url = fleet[0].url
        cfg = parse_config(f"""
backends:
  - {{name: e1, url: "{url}", kind: sim, models: [base], model_map: {{base: sim-model}},
     lora: {{dynamic: true}}}}
""")
        reg: dict[str, Any] = {n: Adapter(name=n, base_model="base", source=f"/w/{n}", tenant="t") for n in "xy"}

        async def sources() -> dict[str, Any]:
            return reg

        places = []
        for holder in ("p1", "p2"):
            pl = Placement(lambda: cfg, lambda b: {}, sources, registry=CollectorRegistry())
            pl.shared = lambda h=holder: SharedHolds(adapters.identity.store, h)
            await pl.start()
            places.append(pl)
        p1, p2 = places

        def cand(ctx: Any, name: str) -> Candidate:
            (b,) = adapter_backends(cfg, ctx, name)
            return Candidate(backend=b, model=name)

        try:
            c1 = ctx_for("r1", "x")
            await p1.prepare(c1, cand(c1, "x"))  # p1: x loaded, a request in flight on it
            assert await resident(url) == {"x"}
            c2 = ctx_for("r2", "y")
            with pytest.raises(GatewayError) as e:  # p2 must not unload x to make room for y
                await p2.prepare(c2, cand(c2, "y"))
            assert e.value.status == 503 and e.value.code == "adapter_slots_busy"
            assert await resident(url) == {"x"}

            await p1.finish(c1)
            await p1.close()  # its hold published as released (background write flushed at close)
            await p2.prepare(c2, cand(c2, "y"))  # now x is idle everywhere: unloaded for y
            assert await resident(url) == {"y"}
            await p2.finish(c2)

            # y runs on the engine, sent by a gateway we share no store with: its report guards it
            body = {"model": "y", "prompt": "hi", "max_tokens": 400, "stream": True, "ignore_eos": True}
            async with httpx.AsyncClient(timeout=30) as hc:
                async with hc.stream("POST", url + "/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _ in r.aiter_lines():  # the first chunk: it is running
                        break
                    c3 = ctx_for("r3", "x")
                    with pytest.raises(GatewayError) as e:
                        await p2.prepare(c3, cand(c3, "x"))
                    assert e.value.code == "adapter_slots_busy"
                    assert await resident(url) == {"y"}
            await p2.prepare(c3, cand(c3, "x"))  # its stream closed: y is idle, unloaded for x
            assert await resident(url) == {"x"}
            await p2.finish(c3)
        finally:
            for pl in places:
                await pl.close()


async def test_an_engine_without_max_loras_in_the_config_is_given_its_own(adapters: AdapterService):
    """`lora: {dynamic: true}` without max_loras: the engine's --max-loras as vllm:lora_requests_info exports it."""
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=3, load_s=0.0)) as fleet:
        url = fleet[0].url
        cfg = parse_config(f"""
backends:
  - {{name: e1, url: "{url}", kind: sim, models: [base], model_map: {{base: sim-model}}, lora: {{dynamic: true}}}}
""")
        reg: dict[str, Any] = {n: Adapter(name=n, base_model="base", source=f"/w/{n}", tenant="t") for n in "abcd"}

        async def sources() -> dict[str, Any]:
            return reg

        pl = Placement(lambda: cfg, lambda b: {}, sources, registry=CollectorRegistry())
        await pl.start()
        try:
            async with httpx.AsyncClient() as hc:  # a step, so the engine exports its LoRA report
                await hc.post(url + "/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 1})
            ctxs = []
            for n in "abc":
                c = ctx_for(f"r{n}", n)
                (b,) = adapter_backends(cfg, c, n)
                await pl.prepare(c, Candidate(backend=b, model=n))
                ctxs.append(c)
            assert pl.slots["e1"].max_loras == 3 and await resident(url) == {"a", "b", "c"}
            for c in ctxs:
                await pl.finish(c)
        finally:
            await pl.close()
