"""The simulator presenting as SGLang (`present_as="sglang"`, `--present-as sglang`): what a client and the
gateway read from it is SGLang 0.5.23's (schema in tests/telemetry/test_sglang_formats.py, which cites where in
SGLang's code each format was read)."""
from __future__ import annotations

import asyncio

import httpx
import msgspec
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.fleet import build_fleet, manifest_backends, start_fleet
from backends.sim.kv_wire import BlockRemoved, BlockStored, encode_batch, int64
from gateway.telemetry.scraper import parse_metrics
from tests.telemetry.test_sglang_formats import AllBlocksClearedS, BlockRemovedS, BlockStoredS

# SGLang's own schema, strict: a field SGLang does not have fails the decode
_STRICT = msgspec.msgpack.Decoder(
    msgspec.defstruct("Batch", [("ts", float), ("events", list[BlockStoredS | BlockRemovedS | AllBlocksClearedS]),
                                ("attn_dp_rank", int | None)], array_like=True, forbid_unknown_fields=True))


def test_the_sim_encodes_sglangs_event_wire():
    evs = [BlockStored([2**64 - 5, 7], None, list(range(32)), 16, 3, "GPU", "lora-a", [("lora-a", "salt"), None],
                       0, "full_attention"),
           BlockStored([11], 7, list(range(32, 48)), 16, 3, "GPU", "lora-a", [None], 0, "full_attention"),
           BlockRemoved([2**64 - 5], "GPU", 0), BlockRemoved([7], "GPU", 0), BlockRemoved([9], "CPU_PINNED", 0)]
    salts: dict[int, str] = {}
    raw = encode_batch(1.0, evs, 2, wire="sglang", salts=salts)
    b = _STRICT.decode(raw)
    st = b.events[0]
    assert b.attn_dp_rank == 2 and st.block_hashes == [-5, 7] and st.cache_salt == "salt"
    assert b.events[1].cache_salt == "salt" and b.events[1].parent_block_hash == 7  # the chain's salt, every event
    assert st.lora_id is None and st.lora_name == "lora-a"  # SGLang always sends lora_id None
    assert b.events[2].block_hashes == [-5, 7] and b.events[3].block_hashes == [9]  # coalesced per medium
    assert salts == {11: "salt"}  # removed blocks leave the publisher's chain table
    obj = msgspec.msgpack.decode(raw)
    assert "lora_id" in obj[1][0] and "extra_keys" not in obj[1][0] and "group_idx" not in obj[1][1]
    # vLLM's wire never carries the salt as a field (it is in extra_keys)
    assert "cache_salt" not in msgspec.msgpack.decode(encode_batch(1.0, evs[:1], 0, batch_form="array"))[1][0]
    arr = msgspec.msgpack.decode(encode_batch(1.0, evs[:2], 0, event_form="array", wire="sglang"))
    assert arr[1][0] == ["BlockStored", [-5, 7], None, list(range(32)), 16, None, "GPU"]  # SGLang 0.5.10
    assert int64(2**63) == -(2**63) and int64(5) == 5


async def test_an_sglang_engine_answers_as_sglang_does():
    async with start_fleet(1, profiles=["tiny"], present_as="sglang", lora_modules=["sql"],
                           priority_policy=True) as fleet:
        m = fleet.manifest()["engines"][0]
        assert m["present_as"] == "sglang" and m["kind"] == "sglang"
        assert manifest_backends(fleet.manifest(), None)[0]["kind"] == "sglang"
        root = m["url"].removesuffix("/v1")
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(m["kv_events"])
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=10) as c:
            chat = {"model": "sim-model", "max_tokens": 2, "cache_salt": "t1", "priority": 5,
                    "messages": [{"role": "user", "content": "hello " * 60}]}
            r = await c.post(m["url"] + "/chat/completions", json=chat)
            assert r.status_code == 200
            u = r.json()["usage"]
            assert set(u) == {"prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
                              "reasoning_tokens"} and u["prompt_tokens_details"] == {"cached_tokens": 0}
            frames = await asyncio.wait_for(sub.recv_multipart(), 5)
            b = _STRICT.decode(frames[2])
            assert frames[0] == b"" and b.events[0].cache_salt == "t1"
            # the adapter as <base>:<adapter>; another name is the base model; an unknown adapter a 400
            assert (await c.post(m["url"] + "/chat/completions",
                                 json={**chat, "model": "sim-model:sql"})).status_code == 200
            assert (await c.post(m["url"] + "/chat/completions", json={**chat, "model": "whatever"})).status_code == 200
            r = await c.post(m["url"] + "/chat/completions", json={**chat, "model": "sim-model:nope"})
            assert r.status_code == 400 and r.json() == {
                "object": "error", "message": "LoRA adapter 'nope' was not found.", "type": "BadRequestError",
                "param": "model", "code": 400}
            # /tokenize and /v1/tokenize: chat rendered as for a completion; {tokens, count, max_model_len}
            tk = {"model": "sim-model", "messages": chat["messages"]}
            a = (await c.post(root + "/tokenize", json=tk)).json()
            assert set(a) == {"tokens", "count", "max_model_len"} and a["count"] == u["prompt_tokens"]
            assert (await c.post(m["url"] + "/tokenize", json=tk)).json() == a
            no_gen = (await c.post(root + "/tokenize", json={**tk, "add_generation_prompt": False})).json()
            assert no_gen["count"] < a["count"]
            assert (await c.post(root + "/tokenize", json={"model": "sim-model"})).json()["object"] == "error"
            # metrics in SGLang's names, read by the gateway's sglang form
            text = (await c.get(m["metrics"])).text
            names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
            assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                    "sglang:gen_throughput", "sglang:page_size", "sglang:num_pages", "sglang:prompt_tokens_total",
                    "sglang:cached_tokens_total", "sglang:num_retracted_requests_total"} <= names
            assert not any(n.startswith("vllm:") for n in names)
            load = parse_metrics(text, form="sglang")
            assert load.prompt_tokens >= 2 * u["prompt_tokens"] and load.block_size == 16
            # SGLang's /flush_cache
            assert (await c.post(root + "/flush_cache")).status_code == 200
        sub.close(0)


def test_the_cli_and_fleet_take_the_presentation():
    from backends.sim.cli import _fleet_from_args, add_arguments
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    fleet = _fleet_from_args(p.parse_args(["--engines", "1", "--present-as", "sglang", "--base-port", "0"]))
    assert fleet.servers[0].engine.present_as == "sglang"
    assert build_fleet(1).servers[0].engine.present_as == "vllm"
