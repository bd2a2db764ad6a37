"""The simulator's LoRA surface as vLLM 0.32 has it: runtime load/unload, 404 for an adapter not loaded, /v1/models,
the --max-loras limit on adapters per batch and vllm:lora_requests_info; a restart loses what was loaded."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.fleet import start_fleet
from backends.sim.lora import LoraConfig
from backends.sim.scheduler import FINISHED
from tests.backends.sim.test_scheduler import new_sched, req

MSG = [{"role": "user", "content": "hello"}]


async def chat(c: httpx.AsyncClient, url: str, model: str, max_tokens: int = 2) -> httpx.Response:
    return await c.post(url + "/chat/completions", json={"model": model, "messages": MSG, "max_tokens": max_tokens})


def lora_info(text: str) -> dict[str, str]:
    for fam in text_string_to_metric_families(text):
        if fam.name == "vllm:lora_requests_info":
            return dict(fam.samples[0].labels)
    raise AssertionError("no vllm:lora_requests_info")


async def test_load_serve_unload_with_vllms_answers():
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=2, load_s=0.2)) as fleet:
        url, root = fleet[0].url, fleet[0].root
        async with httpx.AsyncClient(timeout=10) as c:
            r = await chat(c, url, "ad1")
            assert r.status_code == 404 and r.json()["error"]["message"] == "The model `ad1` does not exist. Valid aliases: sim-model."
            load = asyncio.create_task(c.post(url + "/load_lora_adapter",
                                              json={"lora_name": "ad1", "lora_path": "/w/acme/ad1"}))
            await asyncio.sleep(0.05)
            assert (await chat(c, url, "ad1")).status_code == 404  # not served while its load takes its time
            r = await load
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad1' added successfully."
            assert (await chat(c, url, "ad1")).json()["model"] == "ad1"
            models = (await c.get(url + "/models")).json()["data"]
            assert [(m["id"], m["root"], m["parent"]) for m in models] == [
                ("sim-model", "sim-model", None), ("ad1", "/w/acme/ad1", "sim-model")]
            r = await c.post(url + "/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/w/acme/ad1"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidUserInput"
            assert "has already been loaded" in r.json()["error"]["message"]
            for bad in ({"lora_name": "ad2"}, {"lora_path": "/x"}, {"lora_name": "sim-model", "lora_path": "/x"}):
                assert (await c.post(url + "/load_lora_adapter", json=bad)).status_code == 400
            r = await c.post(url + "/unload_lora_adapter", json={"lora_name": "ad1"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'ad1' removed successfully."
            assert (await chat(c, url, "ad1")).status_code == 404
            r = await c.post(url + "/unload_lora_adapter", json={"lora_name": "ad1"})
            assert r.status_code == 404 and r.json()["error"] == {
                "message": "The lora adapter 'ad1' cannot be found.", "type": "NotFoundError", "param": None,
                "code": 404}
            assert lora_info((await c.get(root + "/metrics")).text) == {
                "max_lora": "2", "waiting_lora_adapters": "", "running_lora_adapters": ""}


async def test_a_restart_loses_the_adapters_loaded_at_run_time():
    async with start_fleet(1, profiles=["tiny"], lora_modules=["static1"],
                           lora=LoraConfig(max_loras=2, load_s=0.0)) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            await c.post(url + "/load_lora_adapter", json={"lora_name": "ad1", "lora_path": "/w/ad1"})
            assert (await chat(c, url, "ad1")).status_code == 200
            await fleet[0].restart()
            assert (await chat(c, url, "ad1")).status_code == 404
            assert (await chat(c, url, "static1")).status_code == 200
            assert [m["id"] for m in (await c.get(url + "/models")).json()["data"]] == ["sim-model", "static1"]


async def test_without_runtime_updating_there_is_no_load_route_and_no_lora_metric():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(fleet[0].url + "/load_lora_adapter", json={"lora_name": "a", "lora_path": "/w/a"})
            assert r.status_code == 404
            assert "vllm:lora_requests_info" not in (await c.get(fleet[0].root + "/metrics")).text


async def test_metrics_show_the_adapter_that_waits_for_a_slot():
    async with start_fleet(1, profiles=["tiny"], lora=LoraConfig(max_loras=1, load_s=0.0)) as fleet:
        url, root = fleet[0].url, fleet[0].root
        async with httpx.AsyncClient(timeout=30) as c:
            for name in ("a", "b"):
                await c.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": f"/w/{name}"})
            long_a = asyncio.create_task(chat(c, url, "a", max_tokens=200))
            await asyncio.sleep(0.05)
            short_b = asyncio.create_task(chat(c, url, "b"))
            seen = None
            for _ in range(200):
                info = lora_info((await c.get(root + "/metrics")).text)
                if info["waiting_lora_adapters"]:
                    seen = info
                    break
                await asyncio.sleep(0.01)
            assert seen == {"max_lora": "1", "waiting_lora_adapters": "b", "running_lora_adapters": "a"}
            assert (await long_a).status_code == 200 and (await short_b).status_code == 200


def test_scheduler_runs_at_most_max_loras_adapters_per_batch_and_skips_past_a_blocked_one():
    s = new_sched()
    s.max_loras = 1
    a, b, base = req(range(4), max_tokens=3, lora="a"), req(range(4, 8), lora="b"), req(range(8, 12))
    for r in (a, b, base):
        s.add(r)
    plan = s.schedule(0.0)
    assert plan is not None
    assert [e[0] for e in plan.entries] == [a, base]  # b waits for a slot; the base-model request behind it runs
    assert s.lora_adapters() == (["a"], ["b"])
    t = 0.0
    while a.status != FINISHED:
        plan = s.schedule(t)
        assert plan is not None and b not in [e[0] for e in plan.entries]
        t += plan.duration
        s.commit(plan, t)
    plan = s.schedule(t)
    assert plan is not None and b in [e[0] for e in plan.entries]  # a left the batch: b gets the slot


def test_a_step_running_an_adapter_outside_the_weight_cache_reads_it_first():
    """vLLM keeps --max-cpu-loras adapters' weights in memory (LRU; default --max-loras): a step that runs an
    adapter outside them takes the load time longer, once; an adapter the load API put there costs nothing more.
    So static placement of more adapters than the cache pays loads inside the engine."""
    s = new_sched()
    s.max_loras, s.lora_cache_size, s.lora_load_s = 1, 1, 0.5
    s.lora_warm("a")  # loaded through the API: in memory

    prompts = iter(range(100, 10_000, 10))

    def step_for(lora: str) -> float:
        first = next(prompts)
        s.add(req(list(range(first, first + 5)), lora=lora))  # no prefix shared with an earlier request
        plan = s.schedule(0.0)
        assert plan is not None
        s.commit(plan, plan.duration)
        while s.has_work():  # finish it (max_tokens 1)
            p = s.schedule(0.0)
            assert p is not None
            s.commit(p, p.duration)
        return plan.duration

    warm = step_for("a")
    cold = step_for("b")  # not in memory: read first, and "a" leaves the cache (size 1)
    assert cold - warm == pytest.approx(0.5)
    assert step_for("b") == pytest.approx(warm)
    assert step_for("a") == pytest.approx(cold)  # read again
    assert list(s.lora_cache) == ["a"]
