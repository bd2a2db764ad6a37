"""Pending cache (issue 17b) and refusal before tokenizing (issue 17c), against the simulator fleet with the real
telemetry service (KV events, /tokenize, metrics); the fleet tests run with the engines presenting as vLLM (kind
sim) and as SGLang (kind sglang, whose /tokenize answers no token strings: its prefixes give no tail bound)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import yaml

from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.proxy.health import Health
from gateway.routing.pending import PendingCache
from gateway.routing.stage import PredictiveRouteStage, candidates, early_refusal

PROMPT = " ".join(f"w{i}" for i in range(400))  # a few hundred tokens: many 16-token blocks


def _ctx(rid: str, content: str, slo: float | None = None) -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={"x-ttft-slo-ms": str(slo)} if slo else {},
                       body={"model": "sim-model", "stream": True, "messages": [{"role": "user", "content": content}]})
    c.model, c.model_chain, c.prompt_tokens_est = "sim-model", ("sim-model",), 10
    c.stream = True
    return c


def _token_calls(tel) -> int:
    t = tel.tokens
    return t.hits + t.misses + t.uncached


@pytest.fixture(params=["vllm", "sglang"])
async def rig(request):
    from backends.sim.fleet import start_fleet
    from gateway.telemetry.service import TelemetryService

    async with start_fleet(2, profiles=["tiny"], present_as=request.param) as fleet:
        engines = fleet.manifest()["engines"]
        cfg = parse_config(yaml.safe_dump({"backends": [
            {"name": e["name"], "kind": e["kind"], "url": e["url"], "models": ["sim-model"], "kv_events": e["kv_events"],
             "replay": e["replay"], "metrics": e["metrics"]} for e in engines],
            "telemetry": {"scrape_interval_s": 0.1},
            # these tests pin the modelled mechanics (refusal before tokenizing) from the first request: the
            # prior counts as the engines' model (gateway/routing/mode.py)
            "routing": {"model_validity": {"min_observations": 0}}}))
        tel = TelemetryService(cfg)
        await tel.start()
        try:
            for _ in range(50):  # block sizes come from the first scrape
                if all(tel.index.block_size(e["name"]) and (ld := tel.load(e["name"])) is not None and ld.healthy
                       for e in engines):
                    break
                await asyncio.sleep(0.05)
            yield PredictiveRouteStage(lambda: cfg, Health(cfg), telemetry=tel), tel, engines
        finally:
            await tel.close()


def _cached(ctx: RequestContext) -> dict[str, int]:
    return {c["backend"]: c["predicted_cached_tokens"] for c in ctx.evidence["candidates"]}


async def test_a_prefix_still_prefilling_on_an_engine_counts_as_cached_there_until_its_request_finishes(rig):
    st, tel, engines = rig
    a = _ctx("a", PROMPT)
    await st.run(a)  # dispatched (not sent anywhere: nothing is stored on the engine, the index is empty)
    eng = a.route.candidates[0].backend.name
    other = next(e["name"] for e in engines if e["name"] != eng)
    assert st.pending.blocks(eng) > 0 and st.snapshot()["engines"][eng]["facts"]["pending_blocks"] > 0
    b = _ctx("b", PROMPT + " and more")
    await st.run(b)
    bs = tel.index.block_size(eng)
    n_a = len((await tel.tokens_for(eng, None, a.body))[0])
    assert _cached(b)[eng] == (n_a // bs) * bs  # a's full blocks, pending on a's engine
    assert _cached(b)[other] == 0
    await st.finish(b)
    await st.finish(a)  # a finished: its blocks are stored by now or never will be
    assert st.pending.blocks(eng) == 0
    c = _ctx("c", PROMPT + " and more")
    await st.run(c)
    assert _cached(c)[eng] == 0  # the engine never stored them (a was not really sent): no longer counted
    await st.finish(c)


async def test_pending_entries_expire_when_the_engine_stores_the_blocks(rig):
    st, tel, engines = rig
    a = _ctx("a2", PROMPT)
    await st.run(a)
    eng = a.route.candidates[0].backend.name
    url = next(e["url"] for e in engines if e["name"] == eng)
    async with httpx.AsyncClient(timeout=10) as client:  # the engine really computes (and stores) that prompt
        r = await client.post(url + "/chat/completions", json={"model": "sim-model", "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200
    for _ in range(50):
        if tel.index.engine_blocks(eng).get("GPU", 0) > 0:
            break
        await asyncio.sleep(0.05)
    before = st.pending.blocks(eng)
    b = _ctx("b2", PROMPT + " again")
    await st.run(b)  # its lookup finds the stored blocks in the index: they are no longer pending
    assert st.pending.blocks(eng) < before
    await st.finish(b)
    await st.finish(a)


async def test_a_refusal_certain_on_a_lower_bound_makes_no_tokenize_call(rig):
    st, tel, engines = rig
    busy = [_ctx(f"busy{i}", PROMPT + f" {i}") for i in range(2 * len(engines) * 3)]
    for c in busy:  # admitted (no target), streaming, no first token yet: prefill work ahead on every engine
        await st.run(c)
    calls = _token_calls(tel)
    late = _ctx("late", "a short question", slo=5)
    with pytest.raises(GatewayError) as ei:
        await st.run(late)
    assert ei.value.status == 429 and ei.value.code == "ttft_slo_unattainable"
    assert "at least" in ei.value.message and ei.value.headers["x-ttft-slo-ms"] == "5"
    assert _token_calls(tel) == calls  # decided without tokenizing
    assert late.evidence["route"]["token_source"].startswith("none")
    assert all(c.get("lower_bound") for c in late.evidence["candidates"])
    assert st.stats["rejected_before_tokenize"] == 1
    for c in busy:
        await st.finish(c)


async def test_when_only_the_full_prediction_is_over_the_target_it_tokenizes_then_refuses(rig):
    st, tel, engines = rig
    calls = _token_calls(tel)
    # idle fleet: the lower bound (overhead + one token) meets 60 ms; the prompt's own prefill at the cold-start
    # prior (8k tok/s) does not
    c = _ctx("long", PROMPT * 2, slo=60)
    with pytest.raises(GatewayError) as ei:
        await st.run(c)
    assert ei.value.code == "ttft_slo_unattainable" and "at least" not in ei.value.message
    assert _token_calls(tel) == calls + 1
    assert st.stats["rejected_before_tokenize"] == 0 and st.stats["rejected"] == 1


def test_early_refusal_is_the_admission_decision_on_lower_bounds():
    assert early_refusal(100.0, [150.0, 120.0], [100.0, 90.0]).action == "reject"
    assert early_refusal(100.0, [150.0, 80.0], [100.0, 60.0]) is None  # one engine may still meet it
    assert early_refusal(100.0, [], []) is None


def test_pending_cache_unit():
    p = PendingCache()
    p.add("a", "e", [1, 2, 3, 4])
    p.add("b", "e", [3, 4, 5])
    assert p.extend("e", [1, 2, 3, 4, 5, 6], 0, 6) == 5
    assert p.extend("e", [1, 2, 3, 4, 5, 6], 0, 3) == 3  # capped (vLLM recomputes the last token)
    assert p.extend("x", [1, 2], 0, 2) == 0  # another engine has nothing pending
    p.remove("a")
    assert p.extend("e", [1, 2, 3, 4, 5], 0, 5) == 0  # a's first blocks left with it
    assert p.extend("e", [1, 2, 3, 4, 5], 2, 5) == 5  # index holds 1-2, then b's 3-5
    assert p.blocks("e") == 3
    assert p.extend("e", [1, 2, 3, 4, 5], 4, 5) == 5 and p.blocks("e") == 1  # stored 3, 4: no longer pending
    p.remove("b")
    assert p.blocks("e") == 0 and len(p) == 0


def test_the_last_chunk_of_a_multi_chunk_prompt_is_seen_only_once_the_steps_before_it_are_stored():
    """A request co-scheduled with an earlier one's last chunk finds only its full chunks cached."""
    from gateway.routing.stage import last_chunk_from

    assert last_chunk_from(1500, 0, 2048, 16, 0) is None  # one step: no earlier step to tell apart
    assert last_chunk_from(4096, 0, 2048, 16, 0) is None  # full chunks: the next request starts after them
    assert last_chunk_from(2558, 0, 2048, 16, 0) == 128  # blocks 128.. complete in the second step
    assert last_chunk_from(2558, 320, 2048, 16, 20) == (320 + 2048) // 16 - 20
    p = PendingCache()
    keys = list(range(100, 260))  # a's 160 blocks, none stored yet; blocks 128.. are its last chunk
    p.add("a", "e", keys, tail_from=128, tail_at=10.0, tail_trigger=(2558 - 2048) // 16)
    assert p.extend("e", keys, 0, 159, now=9.0) == 128  # a's last step has not started: only the first chunk
    assert p.extend("e", keys, 0, 159, now=10.5) == 159  # its predicted start passed (events may lag)
    assert p.extend("e", keys, 128, 159, now=9.0) == 159  # the first chunk's BlockStored arrived: it runs
    p.remove("a")
    assert p.extend("e", keys, 0, 159) == 0
    # a's first step was shorter (it shared the step with another request's last chunk): 20 blocks stored leave
    # more than a chunk; 100 leave less than one chunk, so its last step runs now
    p.add("a", "e", keys, tail_from=128, tail_at=10.0, tail_trigger=(2558 - 2048) // 16)
    assert p.extend("e", keys, 20, 159, now=9.0) == 128
    assert p.extend("e", keys, 100, 159, now=9.0) == 159


def _chat(rid: str, system: str, user: str, slo: float | None = None) -> RequestContext:
    c = _ctx(rid, user, slo)
    c.body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return c


async def test_a_refusal_whose_system_prompt_ids_are_cached_makes_no_tokenize_call(rig):
    st, tel, engines = rig
    # idle fleet, cold caches: one token meets 60 ms (no early refusal), the ~800-token system prompt does not
    first = _chat("p1", PROMPT * 2, "first question", slo=60)
    with pytest.raises(GatewayError):
        await st.run(first)
    assert st.stats["rejected_before_tokenize"] == 0
    await asyncio.gather(*list(st._learning))  # the prefix's ids are learned off the request's path
    assert tel.tokens.prefixes.learned == 1
    calls = _token_calls(tel)
    second = _chat("p2", PROMPT * 2, "another question", slo=60)
    with pytest.raises(GatewayError) as ei:
        await st.run(second)
    assert ei.value.code == "ttft_slo_unattainable" and "at least" in ei.value.message
    assert _token_calls(tel) == calls  # no /tokenize: refused on the cached prefix's bound
    assert st.stats["rejected_before_tokenize"] == 1 and st.stats["rejected_on_cached_prefix"] == 1
    assert "prefix" in second.evidence["route"]["token_source"]
    assert all(c["uncached_tokens_at_least"] > 400 for c in second.evidence["candidates"])
    root = st._config().backend(engines[0]["name"]).server_root
    assert tel.tokens.cached_prefix(root, second.body, None) is not None
    # another tenant's salt (cache isolation) never reads that entry
    assert tel.tokens.cached_prefix(root, second.body, "other-salt") is None


async def test_a_prefix_held_on_an_engine_gives_no_bound_there(rig):
    st, tel, engines = rig
    eng, url = engines[0]["name"], engines[0]["url"]
    body = {"model": "sim-model", "max_tokens": 1,
            "messages": [{"role": "system", "content": PROMPT * 2}, {"role": "user", "content": "x"}]}
    async with httpx.AsyncClient(timeout=10) as client:  # the engine computes and stores the system prompt
        assert (await client.post(url + "/chat/completions", json=body)).status_code == 200
    for _ in range(50):
        if tel.index.engine_blocks(eng).get("GPU", 0) > 0:
            break
        await asyncio.sleep(0.05)
    await st.run(_chat("w1", PROMPT * 2, "x"))  # admitted (no target): tokenized, prefix learned
    await asyncio.gather(*list(st._learning))
    c = _chat("w2", PROMPT * 2, "y")
    own = candidates(st._config(), c, st._health).candidates
    bounds = st._uncached_lower_bounds(c, own, None, st.clock())
    assert eng not in bounds  # its chain runs through the whole prefix: anything past it may be cached
    assert all(v > 400 for v in bounds.values()) and len(bounds) == len(engines) - 1


def _queued_work(st: PredictiveRouteStage, engines: list[dict], tokens: float = 50_000.0) -> None:
    """The anonymous flow already has `tokens` waiting in both lanes of its class, and the gateway has been
    handing out 20k tokens/s: its queue alone is 2.5 s ahead of any new request in either lane."""
    from gateway.routing.flow import Waiter

    now = st.clock()
    names = frozenset(e["name"] for e in engines)
    for lane, long in (("standard", False), ("standard/long", True)):
        st.flow.queue.push(Waiter("anonymous", lane, tokens, long, names, now, now + 60.0,
                                  uncached=dict.fromkeys(names, int(tokens))), 1.0)
    st.flow.rate.add(now, 10_000.0)  # over the rate's shortest span (0.5 s): 20k tokens/s


async def test_a_prompt_that_may_be_long_is_refused_on_its_flows_queue_before_tokenizing_when_the_client_set_the_target(rig):
    st, tel, engines = rig
    _queued_work(st, engines)
    calls = _token_calls(tel)
    c = _ctx("maybe-long", "a short question", slo=600)
    c.prompt_tokens_est = 5000  # twice that passes the long threshold: it may be long on every engine
    assert st._maybe_long(c, [x for x in candidates(st._config(), c, st._health).candidates])
    with pytest.raises(GatewayError) as ei:
        await st.run(c)
    assert ei.value.status == 429 and ei.value.code == "ttft_slo_unattainable" and "fair queue" in ei.value.message
    assert _token_calls(tel) == calls  # decided without tokenizing: its target holds in either lane
    assert st.stats["rejected_before_tokenize"] == 1
    assert c.evidence["route"]["queue"]["outcome"] == "refused"


async def test_a_prompt_that_may_be_long_under_a_policy_target_is_tokenized_before_it_is_refused(rig):
    from gateway.types import Decision

    st, tel, engines = rig
    _queued_work(st, engines)
    calls = _token_calls(tel)
    c = _ctx("maybe-long-policy", "a short question")
    c.prompt_tokens_est = 5000
    c.decision = Decision(allow=True, ttft_slo_ms=600.0)  # a long prompt would get the long target instead
    with pytest.raises(GatewayError) as ei:
        await st.run(c)
    assert ei.value.status == 429 and ei.value.code == "ttft_slo_unattainable"
    assert _token_calls(tel) == calls + 1  # only its tokens say which target applies
    assert st.stats["rejected_before_tokenize"] == 0
