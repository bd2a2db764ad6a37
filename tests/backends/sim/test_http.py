"""The simulator over real sockets: vLLM's HTTP surface, KV events + replay, faults, fleet and CLI."""
from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest
import zmq
import zmq.asyncio

from backends.sim.fleet import FleetProcess, start_fleet
from backends.sim.kv_wire import BlockStored, decode_batch, parse_seq
from backends.sim.profiles import EngineProfile, get_profile

MSGS = [{"role": "system", "content": "You are a terse assistant. " * 20},
        {"role": "user", "content": "Name three prime numbers and explain why they are prime."}]


async def _chat(c: httpx.AsyncClient, url: str, **kw) -> dict:
    body = {"model": "sim-model", "messages": MSGS, "max_tokens": 4, **kw}
    r = await c.post(url + "/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_chat_completions_tokenize_and_cached_tokens():
    async with start_fleet(1, profiles=["tiny"], lora_modules=["ad1"]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            tok = (await c.post(fleet[0].root + "/tokenize", json={"messages": MSGS})).json()
            first = await _chat(c, url)
            assert first["object"] == "chat.completion" and first["choices"][0]["finish_reason"] == "length"
            u = first["usage"]
            assert u["prompt_tokens"] == tok["count"] and u["completion_tokens"] == 4
            assert u["prompt_tokens_details"]["cached_tokens"] == 0
            bs = get_profile("tiny").block_size
            full = (tok["count"] - 1) // bs * bs
            assert u["prompt_tokens_details"]["created_cache_tokens"] == tok["count"] // bs * bs
            again = await _chat(c, url)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full
            salted = await _chat(c, url, cache_salt="tenant-a")
            assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            lora = await _chat(c, url, model="ad1")
            assert lora["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and lora["model"] == "ad1"
            # the same text through /v1/completions with the rendered template hits the chat's cache
            text = (await c.post(fleet[0].root + "/detokenize", json={"tokens": tok["tokens"]})).json()["prompt"]
            r = await c.post(url + "/completions", json={"prompt": text, "max_tokens": 2})
            assert r.json()["usage"]["prompt_tokens"] == tok["count"]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full
            r = await c.post(url + "/completions", json={"prompt": tok["tokens"], "max_tokens": 2})
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == full
            # errors in vLLM's shape
            r = await c.post(url + "/chat/completions", json={"model": "nope", "messages": MSGS})
            assert r.status_code == 404 and r.json()["error"]["code"] == 404
            r = await c.post(url + "/chat/completions", json={"messages": MSGS, "max_tokens": 5000})
            assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
            r = await c.post(url + "/chat/completions", json={"messages": MSGS, "priority": 3})
            assert r.status_code == 400
            r = await c.post(url + "/chat/completions", json={"messages": MSGS, "cache_salt": "a/b"})
            assert r.status_code == 400
            models = (await c.get(url + "/models")).json()
            assert [m["id"] for m in models["data"]] == ["sim-model", "ad1"]
            assert (await c.get(fleet[0].root + "/health")).status_code == 200
            emb = (await c.post(url + "/embeddings", json={"input": ["a b c", "d"]})).json()
            assert len(emb["data"]) == 2 and emb["usage"]["prompt_tokens"] == 4


async def test_stream_first_chunk_include_usage_and_vllm_chunk_shape():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            body = {"messages": MSGS, "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
            async with c.stream("POST", url + "/chat/completions", json=body) as r:
                assert r.headers["content-type"].startswith("text/event-stream")
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 30
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks[:-1])
            assert len(text.split()) == 30
            assert 2 < len(chunks) < 30  # tokens after the first arrive in coarse chunks
            # completions stream without usage
            async with c.stream("POST", url + "/completions",
                                json={"prompt": "hello world", "max_tokens": 3, "stream": True}) as r:
                events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all("usage" not in json.loads(e) for e in events[:-1])


async def test_single_request_ttft_matches_cost_model_over_http():
    prof = EngineProfile(name="slowish", step_overhead_s=0.03, prefill_s_per_token=0.0002, decode_s_per_seq=0.001,
                         attn_s_per_ctx_token=0.0, max_num_batched_tokens=4096, max_num_seqs=8,
                         num_gpu_blocks=512, max_model_len=4096)
    async with start_fleet(1, profiles=[prof]) as fleet:
        url = fleet[0].url
        async with httpx.AsyncClient(timeout=10) as c:
            results = []
            for i in range(3):
                prompt = " ".join(f"w{i}x{j}" for j in range(400))
                n = (await c.post(fleet[0].root + "/tokenize", json={"prompt": prompt})).json()["count"]
                t0 = time.perf_counter()
                async with c.stream("POST", url + "/completions",
                                    json={"prompt": prompt, "max_tokens": 3, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            results.append((time.perf_counter() - t0, prof.step_time(n, 0, 0)))
                            break
            measured = statistics.median(m for m, _ in results)
            model = results[0][1]
            assert model == pytest.approx(0.03 + 400 * 0.0002, rel=0.01)
            assert model * 0.98 <= measured <= model + 0.05, (measured, model)


async def test_kv_events_gap_replay_faults_and_restart():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        srv = fleet[0]
        root = srv.root
        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        m = fleet.manifest()["engines"][0]
        sub.connect(m["kv_events"])
        await asyncio.sleep(0.2)
        try:
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(root + "/sim/faults", json={"event_loss": 1.0})
                assert r.json()["event_loss"] == 1.0
                await c.post(srv.url + "/completions", json={"prompt": "alpha " * 40, "max_tokens": 1})
                await c.post(root + "/sim/faults", json={"event_loss": 0.0})
                await c.post(srv.url + "/completions", json={"prompt": "beta " * 40, "max_tokens": 1})
                topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
                assert parse_seq(seq) == 1  # seq 0 was lost: a gap the subscriber must repair
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(m["replay"])
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                got = []
                while True:
                    f = await asyncio.wait_for(dealer.recv_multipart(), 5)
                    if parse_seq(f[2]) == -1:
                        break
                    got.append((parse_seq(f[2]), decode_batch(f[3])))
                dealer.close(0)
                assert [s for s, _ in got] == [0, 1]
                assert isinstance(got[0][1].events[0], BlockStored)
                # event delay: the batch is published late (a slow event path), in order, nothing lost
                r = await c.post(root + "/sim/faults", json={"event_delay_ms": 400})
                assert r.json()["event_delay_ms"] == 400
                t0 = time.monotonic()
                await c.post(srv.url + "/completions", json={"prompt": "gamma " * 40, "max_tokens": 1})
                answered = time.monotonic() - t0
                topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
                arrived = time.monotonic() - t0
                assert parse_seq(seq) == 2 and arrived >= 0.38 and arrived - answered > 0.2, (answered, arrived)
                await c.post(root + "/sim/faults", json={"event_delay_ms": 0})
                # HTTP 500s on demand
                await c.post(root + "/sim/faults", json={"error_rate": 1.0})
                r = await c.post(srv.url + "/completions", json={"prompt": "x", "max_tokens": 1})
                assert r.status_code == 500 and r.json()["error"]["code"] == 500
                await c.post(root + "/sim/faults", json={"error_rate": 0.0})
                # hang: requests wait until it clears
                await c.post(root + "/sim/faults", json={"hang": True})
                pending = asyncio.ensure_future(c.post(srv.url + "/completions", json={"prompt": "y", "max_tokens": 1}))
                await asyncio.sleep(0.3)
                assert not pending.done()
                await c.post(root + "/sim/faults", json={"hang": False})
                assert (await asyncio.wait_for(pending, 5)).status_code == 200
                # metrics use vLLM's names and labels
                text = (await c.get(root + "/metrics")).text
                for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                             "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{",
                             "vllm:prompt_tokens_total{", "vllm:generation_tokens_total{",
                             "vllm:num_preemptions_total{", "vllm:time_to_first_token_seconds_bucket{",
                             "vllm:cache_config_info{"):
                    assert name in text, name
                assert 'model_name="sim-model"' in text and 'engine="0"' in text
                # crash: the port goes dark; restart: empty cache, seq from 0
                await c.post(root + "/sim/faults", json={"crash": True, "restart_after_s": 0.3})
                await asyncio.sleep(0.15)
                with pytest.raises(httpx.TransportError):
                    await c.get(root + "/health")
            for _ in range(100):
                await asyncio.sleep(0.05)
                if not srv.crashed:
                    break
            async with httpx.AsyncClient(timeout=10) as c:
                assert (await c.get(root + "/health")).status_code == 200
                await asyncio.sleep(0.4)  # the SUB socket reconnects to the rebound PUB on its own
                r = await c.post(srv.url + "/completions", json={"prompt": "beta " * 40, "max_tokens": 1})
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                # A SUB may miss batches while it reconnects to the restarted PUB (as with a real engine);
                # the first one it does see carries a restarted, small seq.
                seq = None
                for i in range(10):
                    await c.post(srv.url + "/completions", json={"prompt": f"delta{i} " * 40, "max_tokens": 1})
                    try:
                        seq = parse_seq((await asyncio.wait_for(sub.recv_multipart(), 0.3))[1])
                        break
                    except asyncio.TimeoutError:
                        continue
                assert seq is not None and seq <= i + 1
                n_batches = srv.engine.publisher.next_seq
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(m["replay"])
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                seqs = []
                while True:
                    f = await asyncio.wait_for(dealer.recv_multipart(), 5)
                    if parse_seq(f[2]) == -1:
                        break
                    seqs.append(parse_seq(f[2]))
                dealer.close(0)
                assert seqs == list(range(n_batches))  # replay has everything since the restart
                assert (await c.get(root + "/sim/state")).json()["generation"] == 1
        finally:
            sub.close(0)


async def test_reset_prefix_cache_is_published_with_next_batch():
    async with start_fleet(1, profiles=["tiny"]) as fleet:
        srv = fleet[0]
        async with httpx.AsyncClient(timeout=10) as c:
            body = {"prompt": "gamma " * 40, "max_tokens": 1}
            await c.post(srv.url + "/completions", json=body)
            assert (await c.post(srv.root + "/reset_prefix_cache")).status_code == 200
            r = await c.post(srv.url + "/completions", json=body)
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert srv.engine.publisher.next_seq == 2


async def test_queueing_makes_ttft_grow_at_capacity():
    prof = get_profile("tiny").with_overrides(max_num_seqs=2, step_overhead_s=0.01)
    async with start_fleet(1, profiles=[prof]) as fleet:
        srv = fleet[0]
        async with httpx.AsyncClient(timeout=20) as c:
            async def one(i: int) -> float:
                t0 = time.perf_counter()
                ttft = -1.0
                async with c.stream("POST", srv.url + "/completions",
                                    json={"prompt": f"q{i} " * 20, "max_tokens": 10, "stream": True}) as r:
                    async for line in r.aiter_lines():  # read to the end: leaving early aborts the request
                        if line.startswith("data: ") and ttft < 0:
                            ttft = time.perf_counter() - t0
                return ttft
            ttfts = sorted(await asyncio.gather(*(one(i) for i in range(6))))
        # 2 slots, 10 decode steps of >= 10 ms each: the last pair waits for two earlier generations
        assert ttfts[-1] > ttfts[0] + 0.15, ttfts
        assert srv.engine.sched.stats.queue_count == 6


def test_cli_subprocess_fleet_writes_manifest(tmp_path):
    mf = tmp_path / "fleet.json"
    with FleetProcess(["--engines", "2", "--profile", "tiny,l40s-8b", "--base-port", "0",
                       "--locations", "DE:eu-central,US"], mf) as manifest:
        engines = manifest["engines"]
        assert [e["name"] for e in engines] == ["sim-0", "sim-1"]
        assert [e["profile"] for e in engines] == ["tiny", "l40s-8b"]
        assert engines[0]["location"] == {"country": "DE", "region": "eu-central"}
        for e in engines:
            assert set(e) >= {"name", "url", "kv_events", "replay", "metrics", "location", "profile"}
            assert e["url"].endswith("/v1") and e["kv_events"].startswith("tcp://")
            r = httpx.post(e["url"] + "/completions", json={"prompt": "hi there", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_cli_crash_and_restart_flags(tmp_path):
    """--crash-after-s / --restart-after-s: the engine goes away (connection refused), comes back with an
    empty cache, and its KV-event stream starts again from seq 0 (what a real engine restart looks like)."""
    from gateway.telemetry.index import KVIndex
    from gateway.telemetry.subscriber import KVEventSubscriber

    mf = tmp_path / "fleet.json"
    with FleetProcess(["--engines", "1", "--profile", "tiny", "--base-port", "0", "--crash-after-s", "1.0",
                       "--restart-after-s", "1.0"], mf) as manifest:
        e = manifest["engines"][0]
        health = e["url"].removesuffix("/v1") + "/health"
        body = {"prompt": "a long enough prompt to fill a few blocks " * 8, "max_tokens": 1}
        for _ in range(3):  # three batches before the crash: seq 0..2
            r = httpx.post(e["url"] + "/completions", json={**body, "prompt": body["prompt"] + str(_)}, timeout=10)
        assert r.status_code == 200
        r = httpx.post(e["url"] + "/completions", json=body, timeout=10)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # warm before the crash

        def is_up() -> bool:
            try:
                return httpx.get(health, timeout=0.5).status_code == 200
            except httpx.TransportError:
                return False

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and is_up():
            time.sleep(0.05)
        assert not is_up(), "the engine never went down"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not is_up():
            time.sleep(0.05)
        assert is_up(), "the engine never came back"
        r = httpx.post(e["url"] + "/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sub = KVEventSubscriber("e", e["kv_events"], e["replay"], "kv", KVIndex(), replay_timeout_s=2.0)
        got = asyncio.run(sub.replay(0))
        assert got and got[0][0] == 0 and len(got) <= 2, [s for s, _ in got or []]  # the new engine's batches only


async def test_manifest_feeds_a_gateway_config():
    import yaml

    from backends.sim.fleet import manifest_backends
    from gateway.config import parse_config

    async with start_fleet(2, profiles=["tiny", "l40s-8b"], locations=["DE:eu-central", "US"]) as fleet:
        m = fleet.manifest()
        cfg = parse_config(yaml.safe_dump({"backends": manifest_backends(m)}))
        assert [b.url for b in cfg.backends] == [e["url"] for e in m["engines"]]
        assert [b.kv_events for b in cfg.backends] == [e["kv_events"] for e in m["engines"]]
        assert cfg.backends[0].kind == "vllm" and cfg.backends[0].location.country == "DE"
        assert cfg.backends[1].server_root + "/metrics" == m["engines"][1]["metrics"]
