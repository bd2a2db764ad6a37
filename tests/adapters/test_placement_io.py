"""Placement's I/O against a simulated engine with runtime LoRA (no gateway process): concurrent requests for one
adapter load it once (one lock per engine); a request in flight keeps its adapter from being unloaded, so an engine
whose slots are all held refuses (503, retryable) until one finishes; a 404 for an adapter the engine lost is
re-read; DELETE unloads the copy once its request finishes. Loads and unloads are counted per engine."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from backends.sim.fleet import start_fleet
from backends.sim.lora import LoraConfig
from gateway.adapters.model import Adapter
from gateway.adapters.placement import Placement, adapter_backends
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import AdapterUse, RequestContext
from gateway.routing.plan import Candidate


def ctx_for(rid: str, name: str) -> RequestContext:
    ctx = RequestContext(request_id=rid, endpoint="chat", headers={}, body={})
    ctx.adapter = AdapterUse(name, "base")  # what the adapters stage sets
    ctx.evidence["adapter"] = {"name": name, "base_model": "base"}
    return ctx


async def resident(url: str) -> set[str]:
    async with httpx.AsyncClient() as c:
        return {m["id"] for m in (await c.get(url + "/models")).json()["data"] if m.get("parent")}


async def test_load_once_hold_while_in_flight_reload_after_loss_and_unload_on_delete():
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=1, load_s=0.05)) as fleet:
        url = fleet[0].url
        cfg = parse_config(f"""
backends:
  - {{name: e1, url: "{url}", kind: sim, models: [base], model_map: {{base: sim-model}},
     lora: {{dynamic: true, max_loras: 1}}}}
""")
        reg: dict[str, Any] = {n: Adapter(name=n, base_model="base", source=f"/w/{n}", tenant="t") for n in ("a", "b")}

        async def sources() -> dict[str, Any]:
            return reg

        registry = CollectorRegistry()
        pl = Placement(lambda: cfg, lambda b: {}, sources, registry=registry)
        await pl.start()
        try:
            def cand(ctx: RequestContext, name: str) -> Candidate:
                (b,) = adapter_backends(cfg, ctx, name)
                return Candidate(backend=b, model=name)

            ctxs = [ctx_for(f"r{i}", "a") for i in range(5)]
            await asyncio.gather(*(pl.prepare(c, cand(c, "a")) for c in ctxs))
            assert sorted(c.evidence["adapter"]["loaded"] for c in ctxs) == [False] * 4 + [True]
            assert await resident(url) == {"a"}
            assert pl.slots["e1"].inflight == {"a": 5} and pl.slots["e1"].load_s is not None

            # the only slot is held by requests in flight: "b" cannot be placed (the dispatcher tries the next)
            cb = ctx_for("rb", "b")
            with pytest.raises(GatewayError) as e:  # no engine can take it now: refused, retryable later
                pl.order(cb, [cand(cb, "b")])
            assert e.value.status == 503 and e.value.code == "adapter_slots_busy" and "retry-after" in {
                k.lower() for k in e.value.headers}
            with pytest.raises(GatewayError) as e:
                await pl.prepare(cb, cand(cb, "b"))
            assert e.value.status == 503 and e.value.extra["_retryable"] is True
            for c in ctxs:
                await pl.finish(c)
            await pl.prepare(cb, cand(cb, "b"))  # now "a" is idle: unloaded for "b"
            assert cb.evidence["adapter"]["loaded"] is True and await resident(url) == {"b"}

            # lost behind our back: the 404 path re-reads the engine and the next prepare loads again
            async with httpx.AsyncClient() as c:
                assert (await c.post(url + "/unload_lora_adapter", json={"lora_name": "b"})).status_code == 200
            await pl.not_loaded(cb, cand(cb, "b"))
            assert "b" not in pl.slots["e1"].resident and cb.evidence["adapter"]["reloaded"] is True
            await pl.prepare(cb, cand(cb, "b"))
            assert await resident(url) == {"b"}
            await pl.prepare(cb, cand(cb, "b"))  # a request holds one copy, however many attempts it makes
            assert pl.slots["e1"].inflight == {"b": 1}

            # DELETE while a request holds it: unloaded when that request finishes, not before
            del reg["b"]
            await pl.forget("b")
            assert await resident(url) == {"b"}
            await pl.finish(cb)
            assert await resident(url) == set()
            cz = ctx_for("rz", "b")
            with pytest.raises(GatewayError) as e:  # deleted: refused as an unknown model
                await pl.prepare(cz, cand(cz, "b"))
            assert e.value.status == 404 and e.value.code == "model_not_found"

            def count(op: str) -> float | None:
                return registry.get_sample_value("gateway_adapter_placements_total", {"backend": "e1", "op": op})
            assert count("load") == 3.0 and count("unload") == 2.0
        finally:
            await pl.close()


async def test_a_resident_adapter_never_waits_behind_another_adapters_load():
    """The engine's lock is not held across a load: while `b` loads (0.5 s), a request for the resident `a` is
    placed at once, and a second request for `b` waits for the one load (none twice); both `b` requests count
    the wait as set-up time (their TTFT's, not the engine's)."""
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=2, load_s=0.5)) as fleet:
        url = fleet[0].url
        cfg = parse_config(f"""
backends:
  - {{name: e1, url: "{url}", kind: sim, models: [base], model_map: {{base: sim-model}},
     lora: {{dynamic: true, max_loras: 2}}}}
""")
        reg: dict[str, Any] = {n: Adapter(name=n, base_model="base", source=f"/w/{n}", tenant="t") for n in "ab"}

        async def sources() -> dict[str, Any]:
            return reg

        pl = Placement(lambda: cfg, lambda b: {}, sources, registry=CollectorRegistry())
        await pl.start()
        try:
            def cand(ctx: RequestContext, name: str) -> Candidate:
                (b,) = adapter_backends(cfg, ctx, name)
                return Candidate(backend=b, model=name)

            ca = ctx_for("a0", "a")
            await pl.prepare(ca, cand(ca, "a"))  # a: resident from here
            await pl.finish(ca)
            b1, b2, a1 = ctx_for("b1", "b"), ctx_for("b2", "b"), ctx_for("a1", "a")
            t1 = asyncio.create_task(pl.prepare(b1, cand(b1, "b")))
            while "b" not in pl.slots["e1"].loading:
                await asyncio.sleep(0.001)
            t2 = asyncio.create_task(pl.prepare(b2, cand(b2, "b")))
            await pl.prepare(a1, cand(a1, "a"))  # not behind b's load
            assert "b" in pl.slots["e1"].loading and not t1.done() and not t2.done()
            assert a1.evidence["adapter"]["loaded"] is False
            await asyncio.gather(t1, t2)
            assert [b1.evidence["adapter"]["loaded"], b2.evidence["adapter"]["loaded"]] == [True, False]
            assert pl.slots["e1"].inflight == {"a": 1, "b": 2} and await resident(url) == {"a", "b"}
            assert b1.setup_s >= 0.4 and b2.setup_s > 0 and a1.setup_s < b1.setup_s
            for c in (a1, b1, b2):
                await pl.finish(c)
        finally:
            await pl.close()
