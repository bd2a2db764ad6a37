"""The cache stage's rules, driven directly: partitions are authorization, zero retention leaves nothing,
paraphrases hit while number / entity / negation swaps miss, whole conversations are compared, TTL and
invalidation, residency of the store."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cache.helpers import answer_of, make_ctx, make_stage, serve, user

pytestmark = pytest.mark.asyncio


async def test_exact_repeat_hits_with_original_usage_and_evidence(stores):
    stage, store, _ = make_stage(stores=stores)
    first = make_ctx(user("What is the capital of France?"), mode="exact")
    assert await serve(stage, first, "Paris") == "miss"
    again = make_ctx(user("What is the capital of France?"), mode="exact")
    assert await serve(stage, again, "WRONG") == "hit"
    assert answer_of(again) == "Paris"
    assert again.usage.prompt_tokens == 10 and again.usage.completion_tokens == 5
    ev = again.evidence["cache"]
    assert ev["created_by"] == first.request_id and ev["entry"] and ev["cached"] is True
    assert ev["guards_passed"] == ["exact_key"] and ev["similarity"] == 1.0


async def test_exact_key_covers_sampling_params_tools_and_format(stores):
    stage, _, _ = make_stage(stores=stores)
    await serve(stage, make_ctx(user("q"), mode="exact", temperature=0.0), "a")
    for extra in ({"temperature": 0.5}, {"max_tokens": 3}, {"response_format": {"type": "json_object"}},
                  {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"seed": 1}):
        c = make_ctx(user("q"), mode="exact", **extra)
        await stage.run(c)
        assert c.answer is None, extra
    c = make_ctx(user("q"), mode="exact", temperature=0.0, stream=True)  # delivery fields are not the key
    await stage.run(c)
    assert c.answer is not None


async def test_temperature_above_the_bound_never_caches(stores):
    stage, store, _ = make_stage(stores=stores, max_temperature=0.5)
    c = make_ctx(user("q"), mode="exact", temperature=0.9)
    assert await serve(stage, c, "a") == "bypass"
    assert c.evidence["cache"]["reason"] == "temperature" and (await store.count()) == 0
    assert await serve(stage, make_ctx(user("q"), mode="exact"), "a") == "bypass"  # absent = 1.0


requests = st.fixed_dictionaries({
    "text": st.sampled_from(["What is the refund policy?", "Summarise the contract", "hello", "Explain Berlin"])
    | st.text(min_size=1, max_size=40),
    "model": st.sampled_from(["m", "n"]),
    "team": st.sampled_from([None, "x", "y"]),
    "mode": st.sampled_from(["exact", "semantic"]),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=requests, b=requests)
async def test_tenant_b_never_receives_tenant_a_entry(stores, a, b):
    stage, _, _ = make_stage(stores=stores)
    secret = "TENANT-A-SECRET"
    await serve(stage, make_ctx(user(a["text"]), tenant="a", model=a["model"], team=a["team"], mode=a["mode"]), secret)
    cb = make_ctx(user(b["text"]), tenant="b", model=b["model"], team=b["team"], mode=b["mode"])
    await stage.run(cb)
    assert cb.answer is None
    # the control: the same request from tenant A itself does hit
    ca = make_ctx(user(a["text"]), tenant="a", model=a["model"], team=a["team"], mode=a["mode"])
    await stage.run(ca)
    assert answer_of(ca) == secret


async def test_team_scope_keeps_teams_apart(stores):
    stage, _, _ = make_stage(stores=stores)
    await serve(stage, make_ctx(user("q"), team="x", scope="team", mode="exact"), "x-answer")
    other = make_ctx(user("q"), team="y", scope="team", mode="exact")
    await stage.run(other)
    assert other.answer is None


async def test_residency_and_retention_partition_entries(stores):
    stage, _, _ = make_stage("DE", stores=stores)
    await serve(stage, make_ctx(user("q"), mode="exact"), "anywhere")
    eea = make_ctx(user("q"), mode="exact", countries=frozenset({"DE", "FR"}))
    await stage.run(eea)
    assert eea.answer is None  # an entry created without residency is not served to an EEA-bound request


@pytest.mark.parametrize("why", ["zero", "unknown"])
async def test_zero_or_unknown_retention_leaves_nothing_in_the_store(stores, why):
    stage, store, _ = make_stage(stores=stores)
    canary = "ZR-CANARY-77e1"
    c = make_ctx(user(f"my secret {canary}"), retention="zero" if why == "zero" else None)
    if why == "unknown":
        c.decision = None
    await stage.run(c)
    if c.cache is not None:
        c.cache.capture.json({"choices": [{"message": {"content": canary}}]})
    c.status = 200
    await stage.finish(c)
    assert (await store.count()) == 0 and canary.encode() not in await stores.raw_bytes()
    # and a zero-retention request is never served from an entry a retaining request left
    await serve(stage, make_ctx(user("shared q")), "kept")
    z = make_ctx(user("shared q"), retention="zero")
    await stage.run(z)
    assert z.answer is None and (why == "unknown" or z.extra_headers["x-gateway-cache"] == "bypass")
    raw = await stores.raw_bytes()  # now the SQLite file exists and Redis holds keys: still no canary
    assert b"kept" in raw and canary.encode() not in raw


async def test_retention_tightened_after_lookup_is_not_stored(stores):
    import dataclasses

    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("late zdr CANARY-2"))
    await stage.run(c)
    c.decision = dataclasses.replace(c.decision, retention="zero")
    c.cache.capture.json({"choices": [{"message": {"content": "x"}}]})
    c.status = 200
    await stage.finish(c)
    assert (await store.count()) == 0


async def test_store_location_must_satisfy_residency(stores):
    stage, store, _ = make_stage("US", stores=stores)
    c = make_ctx(user("q"), countries=frozenset({"DE", "FR"}))
    assert await serve(stage, c, "a") == "bypass"
    assert c.evidence["cache"]["reason"] == "residency" and (await store.count()) == 0
    stage, store, _ = make_stage(None, stores=stores)
    assert await serve(stage, make_ctx(user("q"), countries=frozenset({"DE"})), "a") == "bypass"
    stage, store, _ = make_stage("DE", stores=stores)
    assert await serve(stage, make_ctx(user("q"), countries=frozenset({"DE"})), "a") == "miss" and (await store.count()) == 1


BASE = "Can you tell me how to reset the password for my account on the Orion portal?"


async def test_paraphrase_hits_semantic_with_similarity_header(stores):
    stage, _, _ = make_stage(stores=stores)
    await serve(stage, make_ctx(user(BASE)), "reset via settings")
    p = make_ctx(user("please, how do I reset the password for my account on the Orion portal"))
    assert await serve(stage, p, "x") == "hit"
    assert answer_of(p) == "reset via settings"
    assert float(p.extra_headers["x-gateway-cache-similarity"]) >= 0.9
    ev = p.evidence["cache"]
    assert ev["tier"] == "semantic" and {"numbers", "entities", "negations", "roles"} <= set(ev["guards_passed"])


@pytest.mark.parametrize("near_miss", [
    "Can you tell me how to reset the password for my account on the Atlas portal?",  # entity
    "Can you tell me how to not reset the password for my account on the Orion portal?",  # negation
    "Can you tell me how to reset the password for my 2 accounts on the Orion portal?",  # number
])
async def test_near_miss_intents_miss(stores, near_miss):
    stage, _, _ = make_stage(stores=stores)
    await serve(stage, make_ctx(user(BASE)), "reset via settings")
    c = make_ctx(user(near_miss))
    await stage.run(c)
    assert c.answer is None


async def test_number_swap_misses_by_guard_even_under_a_loose_threshold(stores):
    stage, _, _ = make_stage(stores=stores)
    await serve(stage, make_ctx(user("What is the status of order 1234?"), similarity=0.3), "shipped")
    c = make_ctx(user("What is the status of order 1243?"), similarity=0.3)
    await stage.run(c)
    assert c.answer is None
    assert c.evidence.get("cache_guard_rejected", {}).get("guard") == "numbers"


async def test_multi_turn_conversations_sharing_only_the_last_message_miss(stores):
    stage, _, _ = make_stage(stores=stores)
    conv_a = [{"role": "user", "content": "I want to cancel my Orion subscription"},
              {"role": "assistant", "content": "Sure, which plan?"},
              {"role": "user", "content": "Yes, go ahead with that."}]
    conv_b = [{"role": "user", "content": "Please upgrade my Orion storage"},
              {"role": "assistant", "content": "To the 2 TB plan?"},
              {"role": "user", "content": "Yes, go ahead with that."}]
    await serve(stage, make_ctx(conv_a), "cancelled")
    for conv in (conv_b, [conv_a[-1]]):
        c = make_ctx(conv)
        await stage.run(c)
        assert c.answer is None
    c = make_ctx(conv_a)
    await stage.run(c)
    assert answer_of(c) == "cancelled"


async def test_system_prompt_and_tools_must_be_identical(stores):
    stage, _, _ = make_stage(stores=stores)
    sys_a = [{"role": "system", "content": "You are terse."}, *user(BASE)]
    await serve(stage, make_ctx(sys_a), "a")
    c = make_ctx([{"role": "system", "content": "You are verbose."}, *user(BASE)])
    await stage.run(c)
    assert c.answer is None
    c = make_ctx(sys_a, tools=[{"type": "function", "function": {"name": "f"}}])
    await stage.run(c)
    assert c.answer is None


async def test_ttl_expiry(stores):
    stage, store, clock = make_stage(stores=stores)
    await serve(stage, make_ctx(user("q"), mode="exact", ttl_s=30), "a")
    clock.t += 29
    c = make_ctx(user("q"), mode="exact")
    await stage.run(c)
    assert c.answer is not None
    clock.t += 2
    c = make_ctx(user("q"), mode="exact")
    await stage.run(c)
    assert c.answer is None and (await store.count()) == 0


async def test_invalidation_by_tenant_model_prefix(stores):
    stage, store, _ = make_stage(stores=stores)
    for t in ("a", "b"):
        for m in ("m", "n"):
            await serve(stage, make_ctx(user("q"), tenant=t, model=m, mode="exact"), f"{t}{m}")
    assert (await store.count()) == 4
    assert await store.invalidate(tenant="a", model="m") == 1
    assert await store.invalidate(tenant="a", model="m") == 0
    key = (await store.all_entries())[0].key
    n = await store.invalidate(prefix=key[:33])  # one partition (tenant, model, ...): its one entry
    assert n == 1 and key not in {e.key for e in await store.all_entries()}
    assert await store.invalidate(model="n") + await store.invalidate() == 2
    assert (await store.count()) == 0


async def test_streamed_responses_are_captured_and_replayed_in_chunk_shape(stores):
    from gateway.cache.replay import Capture, sse_events

    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("stream me"), mode="exact", stream=True)
    await stage.run(c)
    cap = c.cache.capture
    assert isinstance(cap, Capture)
    chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
              {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
              {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]}]
    raw = b"".join(b"data: " + orjson.dumps(x) + b"\n\n" for x in chunks) + b"data: [DONE]\n\n"
    cap.chunk(raw[:17])
    cap.chunk(raw[17:])
    from gateway.types import Usage

    c.usage, c.status = Usage(7, 2), 200
    await stage.finish(c)
    assert (await store.count()) == 1
    hit = make_ctx(user("stream me"), mode="exact", stream=True)
    await stage.run(hit)
    assert hit.answer.obj["choices"][0]["message"]["content"] == "Hello"
    sse = sse_events(hit.answer.obj, "chat", True)
    events = [orjson.loads(x[6:]) for x in sse.split(b"\n\n") if x.startswith(b"data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == "Hello"
    assert events[-1]["usage"]["completion_tokens"] == 2 and sse.endswith(b"data: [DONE]\n\n")


async def test_error_or_cut_responses_are_not_stored(stores):
    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("q"), mode="exact")
    await stage.run(c)
    c.cache.capture.json({"choices": [{"message": {"content": "x"}}]})
    c.status, c.cut_by_budget = 200, True
    await stage.finish(c)
    c = make_ctx(user("q"), mode="exact")
    await stage.run(c)
    c.status = 502
    await stage.finish(c)
    assert (await store.count()) == 0


async def test_provider_preferences_bypass(stores):
    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("q"), provider={"zdr": True})
    assert await serve(stage, c, "a") == "bypass" and (await store.count()) == 0


async def test_off_unless_a_rule_turns_it_on(stores):
    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("q"), mode="off")
    assert await serve(stage, c, "a") == "" and (await store.count()) == 0
    c = make_ctx(user("q"))
    c.decision = type(c.decision)()
    assert await serve(stage, c, "a") == "" and (await store.count()) == 0


async def test_batch_lane_lines_bypass(stores):
    stage, store, _ = make_stage(stores=stores)
    c = make_ctx(user("q"), mode="exact")
    c.batch = {"batch_id": "b", "line": 1, "custom_id": "x"}
    assert await serve(stage, c, "a") == "bypass" and (await store.count()) == 0 and c.answer is None


async def test_lru_bound_evicts_the_least_recently_used(stores):
    stage, store, _ = make_stage(stores=stores, max_entries=3)
    for i in range(3):
        await serve(stage, make_ctx(user(f"question {i}"), mode="exact"), f"a{i}")
    assert await serve(stage, make_ctx(user("question 0"), mode="exact"), "x") == "hit"  # 0 is now the most recent
    for i in (3, 4):
        await serve(stage, make_ctx(user(f"question {i}"), mode="exact"), f"a{i}")
    assert await store.count() == 3
    for i, want in ((0, "hit"), (3, "hit"), (4, "hit"), (1, "miss")):
        c = make_ctx(user(f"question {i}"), mode="exact")
        await stage.run(c)
        assert c.extra_headers["x-gateway-cache"] == want, i


@pytest.mark.parametrize("stores", ["sqlite", "redis"], indirect=True)  # memory bounds entries (cache.max_entries)
async def test_partition_candidate_list_is_bounded(stores):
    stage, store, _ = make_stage(stores=stores, max_partition_entries=2)
    texts = ["how do I reset the password on the Orion portal", "how do I export the invoices of the Orion portal",
             "how do I delete the account on the Orion portal"]
    for t in texts:
        await serve(stage, make_ctx(user(t)), t.upper())
    c = make_ctx(user("please, " + texts[0]))  # its candidate was the least recently used: gone
    await stage.run(c)
    assert c.answer is None
    c = make_ctx(user(texts[0]))  # the entry itself still answers exact lookups
    await stage.run(c)
    assert answer_of(c) == texts[0].upper()
    c = make_ctx(user("please, " + texts[2]))
    await stage.run(c)
    assert answer_of(c) == texts[2].upper()
