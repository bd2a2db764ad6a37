"""The end-to-end checks against real vLLM engines behind the gateway, shared by tests/vllm and bench/gpu_check.

Each check takes a running `VllmStack`, raises AssertionError (with the numbers) when the gateway's view of the
engines disagrees with what the engines did, and returns the numbers it measured (one row of the GPU table).
Prompts are built from a fixed word list and sized with the engine's own /tokenize, so they work with the
generated tiny model and with a real model alike.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx
import openai

from gateway.telemetry.index import KVIndex
from gateway.telemetry.scraper import parse_metrics
from gateway.telemetry.subscriber import KVEventSubscriber
from tests.vllm.stack import API_KEY, Engine, VllmStack

WORDS = ("cache block token engine gateway request prefix policy budget route model prompt stream event replay "
         "metric latency tenant key alpha beta gamma delta omega sigma").split()


def text(seed: int | str, n_words: int) -> str:
    """Deterministic filler text (about 1.3 tokens per word with the tiny tokenizer)."""
    rng = random.Random(str(seed))
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(n_words))


def tokenize(engine: Engine, model: str, prompt: str) -> list[int]:
    r = httpx.post(engine.root + "/tokenize", json={"model": model, "prompt": prompt}, timeout=30)
    r.raise_for_status()
    return list(r.json()["tokens"])


def sized_text(engine: Engine, model: str, seed: int | str, n_tokens: int) -> str:
    """Filler text of about n_tokens tokens (a few under, never over), measured with the engine's tokenizer."""
    words = max(4, n_tokens // 2)
    for _ in range(6):
        t = text(seed, words)
        n = len(tokenize(engine, model, t))
        if 0.9 * n_tokens <= n <= n_tokens:
            return t
        words = max(4, int(words * n_tokens / max(n, 1) * 0.97))
    return t


def client(stack: VllmStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def engine_complete(engine: Engine, model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    """One completion sent straight to the engine (bypassing the gateway); returns the JSON response."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(engine.url + "/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def cached_of(resp: dict[str, Any]) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def evidence(stack: VllmStack, rid: str, timeout: float = 10.0) -> dict[str, Any]:
    """The gateway's audit record for a request (written after the response; poll until it is there)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = stack.admin_get(f"/admin/decisions/{rid}")
            if rec.get("backend") is not None:
                return rec
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 404:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"no evidence for {rid} after {timeout} s")
        time.sleep(0.05)


def settle(stack: VllmStack, quiet_s: float = 0.3, timeout: float = 10.0) -> None:
    """Wait until the gateway has applied every KV-event batch the engines published (no news for quiet_s)."""
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        snap = stack.admin_get("/admin/fleet")["engines"]["engines"]
        cur = tuple((n, (e["kv_events"] or {}).get("last_seq"), (e["kv_events"] or {}).get("queued"))
                    for n, e in sorted(snap.items()))
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet_s and all(q == 0 for _, _, q in cur):
            return
        time.sleep(0.05)


def chat(stack: VllmStack, messages: list[dict[str, str]], *, stream: bool = False, max_tokens: int = 2,
         **extra: Any) -> dict[str, Any]:
    """One chat completion through the gateway with the OpenAI SDK: request id, text, usage, client TTFT."""
    c = client(stack)
    t0 = time.perf_counter()
    if not stream:
        raw = c.chat.completions.with_raw_response.create(model=stack.model, messages=messages,
                                                           max_tokens=max_tokens, temperature=0, **extra)
        resp = raw.parse()
        return {"rid": raw.headers["x-request-id"], "text": resp.choices[0].message.content,
                "usage": resp.usage, "ttft_s": time.perf_counter() - t0, "finish": resp.choices[0].finish_reason}
    raw = c.chat.completions.with_raw_response.create(model=stack.model, messages=messages, max_tokens=max_tokens,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}, **extra)
    ttft = None
    parts: list[str] = []
    usage = None
    chunks = 0
    for ch in raw.parse():
        chunks += 1
        if ch.choices:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage is not None:
            usage = ch.usage
    return {"rid": raw.headers["x-request-id"], "text": "".join(parts), "usage": usage, "ttft_s": ttft,
            "chunks": chunks}


# ------------------------------------------------------------------------------------------------ checks


def check_openai_sdk(stack: VllmStack) -> dict[str, Any]:
    """Chat and completions, streamed and not, through the gateway to real engines, with usage details."""
    names = {e.name for e in stack.engines}
    msgs = [{"role": "user", "content": "Say something about " + text("sdk", 20)}]
    r1 = chat(stack, msgs, max_tokens=4)
    assert isinstance(r1["text"], str) and r1["usage"].completion_tokens >= 1, r1
    assert r1["usage"].prompt_tokens > 10
    assert r1["usage"].prompt_tokens_details is not None, "engine must run with --enable-prompt-tokens-details"
    r2 = chat(stack, msgs, stream=True, max_tokens=4)
    assert r2["chunks"] >= 2 and r2["usage"] is not None, r2
    assert r2["usage"].prompt_tokens == r1["usage"].prompt_tokens
    assert r2["usage"].prompt_tokens_details is not None
    c = client(stack)
    comp = c.completions.with_raw_response.create(model=stack.model, prompt=text("comp", 30), max_tokens=3,
                                                  temperature=0)
    cr = comp.parse()
    assert cr.choices and cr.usage.prompt_tokens > 10
    sparts = [ch for ch in c.completions.create(model=stack.model, prompt=text("comp", 30), max_tokens=3,
                                               temperature=0, stream=True, stream_options={"include_usage": True})]
    assert any(ch.choices for ch in sparts) and sparts[-1].usage is not None
    recs = [evidence(stack, rid) for rid in (r1["rid"], r2["rid"], comp.headers["x-request-id"])]
    for rec in recs:
        assert rec["backend"] in names and rec["status"] == 200, rec
        assert rec["usage"]["prompt_tokens"] > 10
    return {"requests": 4, "stream_chunks": r2["chunks"], "ttft_ms": round((r2["ttft_s"] or 0) * 1000, 1)}


def check_kv_events_indexed(stack: VllmStack) -> dict[str, Any]:
    """The gateway decoded the engines' KV events and indexed the blocks (per engine, right block size)."""
    settle(stack)
    fleet = stack.admin_get("/admin/fleet")["engines"]
    served = 0
    for name, e in fleet["engines"].items():
        kv = e["kv_events"]
        assert kv is not None and kv["decode_errors"] == 0 and not e["stale"], (name, e)
        if kv["batches"]:
            served += 1
            assert kv["block_events"] > 0, (name, kv)
            assert sum(e["cached_blocks"].values()) > 0, (name, e)
            if stack.block_size:
                assert e["block_size"] == stack.block_size, (name, e["block_size"])
    assert served >= 1, fleet
    idx = fleet["index"]
    return {"engines_with_events": served, "indexed_blocks": sum(sum(e["cached_blocks"].values())
                                                                 for e in fleet["engines"].values()),
            "index": {k: v for k, v in idx.items() if isinstance(v, (int, float))}}


def check_metrics(stack: VllmStack) -> dict[str, Any]:
    """Each engine's /metrics parses (load, prefix-cache counters, cache config) and the gateway scrapes it."""
    out = {}
    for e in stack.engines:
        load = parse_metrics(httpx.get(e.root + "/metrics", timeout=10).text)
        assert load.healthy, load
        if stack.block_size:
            assert load.block_size == stack.block_size, load
        if stack.num_blocks:
            assert load.num_gpu_blocks == stack.num_blocks, load
        assert 0.0 <= load.kv_usage <= 1.0
        out[e.name] = {"prompt_tokens": load.prompt_tokens, "prefix_hits": load.prefix_hits}
    deadline = time.monotonic() + 5
    while True:
        fleet = stack.admin_get("/admin/fleet")["engines"]["engines"]
        if all(v["load"] and v["load"]["healthy"] for v in fleet.values()):
            break
        assert time.monotonic() < deadline, fleet
        time.sleep(0.2)
    assert sum(v["prompt_tokens"] for v in out.values()) > 0, out
    return out


def check_agreement(stack: VllmStack, n: int = 16) -> dict[str, Any]:
    """Shared-prefix workload through the gateway: the index's predicted cached tokens (evidence) must agree
    with the engine's usage.prompt_tokens_details.cached_tokens."""
    e0 = stack.engines[0]
    systems = [sized_text(e0, stack.model, f"sys{j}", 300) for j in range(3)]
    rng = random.Random(7)
    pairs = []
    for i in range(n):
        settle(stack)
        msgs = [{"role": "system", "content": systems[i % 3]},
                {"role": "user", "content": f"question {rng.randrange(5)}: " + text(f"q{i % 5}", rng.randrange(3, 40))}]
        r = chat(stack, msgs, stream=bool(i % 2))
        rec = evidence(stack, r["rid"])
        pairs.append((rec["cached_tokens"]["predicted"], rec["cached_tokens"]["actual"], rec["backend"]))
    bad = [p for p in pairs if p[0] != p[1]]
    pred = sum(p[0] or 0 for p in pairs)
    actual = sum(p[1] or 0 for p in pairs)
    agreed = sum(min(p[0] or 0, p[1] or 0) for p in pairs)
    agreement = agreed / max(pred, actual, 1)
    assert actual > 0, f"no cache hits at all: {pairs}"
    assert all(p[1] is not None for p in pairs), pairs
    assert agreement >= 0.99, f"token agreement {agreement:.3f}; differing (predicted, actual, engine): {bad}"
    return {"requests": n, "exact": n - len(bad), "predicted_tokens": pred, "actual_tokens": actual,
            "token_agreement": round(agreement, 4)}


_LOCAL_TOKENIZE = """
import json, sys
from gateway.telemetry.local_tokenizer import LocalTokenizer
tok = LocalTokenizer(sys.argv[1])
print(json.dumps([tok.encode_body(b) for b in json.loads(sys.stdin.read())]))
"""


def check_local_tokenizer(stack: VllmStack, model_dir: str) -> dict[str, Any]:
    """`telemetry.tokenizer: <model dir>` tokenizes chat and completion requests exactly as the engine does
    (its /tokenize): the KV-index keys built from them are the engine's. Runs LocalTokenizer under .venv-vllm,
    which has the optional `tokenizers` and `jinja2` packages."""
    import json
    import os
    import subprocess

    from tests.vllm.stack import ROOT, VENV_PY

    bodies = [
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo wörld 42"}]},
        {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                      {"role": "user", "content": "three, with  double  spaces\nand a newline"}]},
        {"prompt": "a plain completion prompt ü"},
    ]
    r = subprocess.run([str(VENV_PY), "-c", _LOCAL_TOKENIZE, model_dir], input=json.dumps(bodies), cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    local = json.loads(r.stdout)
    e = stack.engines[0]
    engine = []
    for b in bodies:
        resp = httpx.post(e.root + "/tokenize", json={"model": stack.model, **b}, timeout=30)
        resp.raise_for_status()
        engine.append(list(resp.json()["tokens"]))
    assert local == engine, {"local": local, "engine": engine}
    return {"bodies": len(bodies), "tokens": [len(t) for t in engine]}


def check_priority_forwarding(stack: VllmStack) -> dict[str, Any]:
    """Requests routed through the gateway to an engine started with --scheduling-policy priority carry the
    policy's priority (standard -> 5; `upstream_body` adds it only for `priority_scheduling` backends) and are
    served; so are those routed to the plain engine. Each request is pinned to its engine by `provider.only`.
    Direct calls record what each engine does with an explicit priority (vLLM 0.32 accepts it
    even without the priority scheduler, and then ignores it)."""
    prio = [e for e in stack.engines if e.priority]
    plain = [e for e in stack.engines if not e.priority]
    assert prio and plain, "the stack needs one engine of each kind"
    out: dict[str, Any] = {}
    for e in (prio[0], plain[0]):
        r = httpx.post(e.url + "/chat/completions", timeout=120, json={
            "model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "priority": 5})
        out[f"direct_priority_{e.name}"] = r.status_code
    assert out[f"direct_priority_{prio[0].name}"] == 200, out
    for e in (prio[0], plain[0]):
        # pinned to the engine by the request's own provider preference (`provider.only`, a hard filter), not
        # steered by a cached prompt: which engine the predictor prefers is check_routing_repeat's concern, and
        # under a loaded CI machine the load term sometimes outweighed a 600-token cache hit here
        msgs = [{"role": "user", "content": f"prio-{e.name}-{time.time_ns()} " + text(e.name, 30)}]
        got = chat(stack, msgs, extra_body={"provider": {"only": [e.name]}})  # raises on a non-200
        rec = evidence(stack, got["rid"])
        assert rec["backend"] == e.name, (e.name, rec["backend"])
        assert rec["decision"]["providers_only"] == [e.name], rec["decision"]
        out[f"gateway_{e.name}"] = rec["backend"]
    return out


def check_routing_repeat(stack: VllmStack, repeats: int = 5, n_tokens: int = 1500) -> dict[str, Any]:
    """A long prompt cached on one engine is routed there by the gateway, and its TTFT is below a cold one's.

    To be able to fail, the prompt is first cached *directly* on the engine the gateway does not pick for a
    cold prompt of the same size (its default choice): a router that ignored the KV index would keep sending
    the repeats to its default engine. With one engine, the prompt is warmed through the gateway."""
    settle(stack)
    probe = [{"role": "user", "content": sized_text(stack.engines[0], stack.model, f"cold-{time.time_ns()}",
                                                    n_tokens)}]
    cold = chat(stack, probe, stream=True)
    default = evidence(stack, cold["rid"])["backend"]
    long = sized_text(stack.engines[0], stack.model, f"long-{time.time_ns()}", n_tokens)
    msgs = [{"role": "user", "content": long}]
    others = [e for e in stack.engines if e.name != default]
    settle(stack)
    if others:
        home = others[0].name
        r = httpx.post(others[0].url + "/chat/completions", timeout=120,
                       json={"model": stack.model, "messages": msgs, "max_tokens": 1, "temperature": 0})
        r.raise_for_status()
    else:
        home = evidence(stack, chat(stack, msgs, stream=True)["rid"])["backend"]
    ttfts, recs = [], []
    for _ in range(repeats):
        settle(stack)
        r = chat(stack, msgs, stream=True)
        rec = evidence(stack, r["rid"])
        recs.append(rec)
        ttfts.append(r["ttft_s"])
    where = [r["backend"] for r in recs]
    assert all(w == home for w in where), f"cached on {home} (cold default {default}), repeats on {where}"
    prompt = recs[0]["usage"]["prompt_tokens"]
    assert all(r["cached_tokens"]["actual"] >= prompt - 2 * (stack.block_size or 16) for r in recs), \
        [r["cached_tokens"] for r in recs]
    assert all(r["cached_tokens"]["predicted"] == r["cached_tokens"]["actual"] for r in recs), \
        [r["cached_tokens"] for r in recs]
    cold_s, warm = cold["ttft_s"], statistics.median(ttfts)
    assert warm < cold_s, f"cached TTFT {warm * 1000:.0f} ms not below cold {cold_s * 1000:.0f} ms"
    last = recs[-1]
    return {"prompt_tokens": prompt, "engine": home, "cold_default": default, "cold_ttft_ms": round(cold_s * 1000, 1),
            "cached_ttft_ms": round(warm * 1000, 1), "candidates": last["candidates"]}


def check_ttft_learned(stack: VllmStack, routing_row: dict[str, Any] | None = None) -> dict[str, Any]:
    """The router learned TTFT per engine from real timings (samples, moved off the prior) and predicts the
    engine holding a long prompt faster than one that does not."""
    snap = stack.admin_get("/admin/routing")
    engines = snap["engines"]
    learned = {n: v for n, v in engines.items() if v["samples"]}
    assert learned, snap
    prior = {"overhead_ms": 30.0, "prefill_tokens_per_s": 8000.0}
    for n, v in learned.items():
        assert v["mape"] is not None
        assert (v["overhead_ms"], v["prefill_tokens_per_s"]) != (prior["overhead_ms"], prior["prefill_tokens_per_s"]), v
    out: dict[str, Any] = {n: {k: v[k] for k in ("samples", "overhead_ms", "prefill_tokens_per_s", "mape")}
                           for n, v in learned.items()}
    if routing_row and len(stack.engines) > 1:
        cands = {c["backend"]: c for c in routing_row["candidates"]}
        home = cands[routing_row["engine"]]
        others = [c for n, c in cands.items() if n != routing_row["engine"]]
        for o in others:
            assert home["predicted_ttft_ms"] < o["predicted_ttft_ms"], cands
        out["predicted_ms_home_vs_other"] = [home["predicted_ttft_ms"], [o["predicted_ttft_ms"] for o in others]]
    return out


async def _subscriber(stack: VllmStack, e: Engine, index: KVIndex, **kw: Any) -> KVEventSubscriber:
    # topic "": the engines keep vLLM's default (KVEventsConfig.topic = ""), the gateway's default takes it
    sub = KVEventSubscriber(e.name, e.kv, e.replay, "", index, replay_timeout_s=5.0, **kw)
    await sub.start()
    await asyncio.sleep(0.3)  # ZMQ slow joiner: let the SUB connect before the engine publishes
    return sub


async def _quiet(*subs: KVEventSubscriber, quiet_s: float = 0.4, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        cur = tuple((s.last_seq, s._queue.qsize()) for s in subs)
        if cur != last:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet_s and all(q == 0 for _, q in cur):
            return
        await asyncio.sleep(0.05)


async def _predict_vs_engine(stack: VllmStack, e: Engine, index: KVIndex, prompts: list[str],
                             salt: str | None = None) -> list[tuple[int, int]]:
    """For each prompt: the index's predicted cached tokens, then the engine's actual on sending it."""
    out = []
    for p in prompts:
        toks = await asyncio.to_thread(tokenize, e, stack.model, p)
        pred = index.lookup([e.name], toks, salt=salt)[e.name].tokens
        extra = {"cache_salt": salt} if salt else {}
        resp = await asyncio.to_thread(engine_complete, e, stack.model, p, **extra)
        out.append((int(pred), cached_of(resp)))
    return out


def _block_size(stack: VllmStack, e: Engine) -> int:
    if stack.block_size:
        return stack.block_size
    bs = parse_metrics(httpx.get(e.root + "/metrics", timeout=10).text).block_size
    assert bs, "engine /metrics has no vllm:cache_config_info block_size"
    return bs


async def check_replay_gap(stack: VllmStack) -> dict[str, Any]:
    """A subscriber that loses live batches repairs the gap from the engine's replay socket; a subscriber that
    joins late rebuilds the engine's history from seq 0; both views then predict the engine's cached tokens."""
    e = stack.engines[-1]
    bs = _block_size(stack, e)
    seen: list[int] = []

    def drop(seq: int) -> bool:  # lose the 2nd and 3rd live batches this subscriber receives
        seen.append(seq)
        return len(seen) in (2, 3)

    idx_a = KVIndex()
    idx_a.set_block_size(e.name, bs)
    a = await _subscriber(stack, e, idx_a, drop_filter=drop)
    try:
        prompts = [sized_text(e, stack.model, f"gap{i}-{time.time_ns()}", 200) for i in range(5)]
        for p in prompts:
            await asyncio.to_thread(engine_complete, e, stack.model, p)
            await asyncio.sleep(0.1)
        await _quiet(a)
        assert len(seen) >= 4, f"too few live batches to force a gap: {seen}"
        # it joined mid-stream (one initial replay from 0) and lost two live batches (one gap, replayed)
        c = a.counters
        assert c["gaps"] >= 1 and c["replays_ok"] >= c["gaps"] and c["replays_failed"] == 0, c
        assert not a.stale, a.snapshot()
        idx_b = KVIndex()
        idx_b.set_block_size(e.name, bs)
        b = await _subscriber(stack, e, idx_b)
        try:
            trigger = sized_text(e, stack.model, f"gap-trigger-{time.time_ns()}", 100)
            await asyncio.to_thread(engine_complete, e, stack.model, trigger)  # first live batch -> replay 0..
            await _quiet(a, b)
            assert b.last_seq == a.last_seq and b.counters["replays_ok"] >= 1 and not b.stale, b.snapshot()
            for p in prompts + [trigger]:
                toks = await asyncio.to_thread(tokenize, e, stack.model, p)
                assert idx_a.lookup([e.name], toks)[e.name].tokens == idx_b.lookup([e.name], toks)[e.name].tokens
            pairs = await _predict_vs_engine(stack, e, idx_a, prompts)
        finally:
            await b.close()
    finally:
        await a.close()
    assert all(p == q for p, q in pairs), pairs
    assert sum(q for _, q in pairs) > 0, pairs
    return {"gaps": a.counters["gaps"], "replayed_batches": a.counters["replayed_batches"],
            "late_join_replayed": b.counters["replayed_batches"], "agree": f"{len(pairs)}/{len(pairs)}"}


async def check_evictions(stack: VllmStack) -> dict[str, Any]:
    """Overfill one engine's small KV cache: BlockRemoved events arrive, the index drops those blocks, and its
    predictions for evicted and surviving prompts still match the engine."""
    e = stack.engines[0]
    bs = _block_size(stack, e)
    capacity = (stack.num_blocks or 0) * bs
    if not capacity:
        load = parse_metrics(httpx.get(e.root + "/metrics", timeout=10).text)
        capacity = (load.num_gpu_blocks or 0) * bs
    if capacity > 40_000:
        return {"skipped": f"KV cache holds {capacity} tokens; too big to overfill quickly"}
    idx = KVIndex()
    idx.set_block_size(e.name, bs)
    sub = await _subscriber(stack, e, idx)
    try:
        n_prompts = capacity // 600 + 3
        prompts = [sized_text(e, stack.model, f"evict{i}-{time.time_ns()}", 700) for i in range(n_prompts)]
        for p in prompts:
            await asyncio.to_thread(engine_complete, e, stack.model, p)
        await _quiet(sub)
        st = idx.stats()["engines"][e.name]
        assert st["removed"] > 0, st
        held = sum(idx.engine_blocks(e.name).values())
        assert held <= (stack.num_blocks or held), (held, stack.num_blocks)
        pairs = await _predict_vs_engine(stack, e, idx, [prompts[0], prompts[-1]])
        assert pairs[0][0] == pairs[0][1] and pairs[1][0] == pairs[1][1], pairs
        assert pairs[1][1] > 0, pairs
    finally:
        await sub.close()
    settle(stack)
    gw = stack.admin_get("/admin/fleet")["engines"]["engines"][e.name]["cached_blocks"]
    assert sum(gw.values()) <= (stack.num_blocks or sum(gw.values())), gw  # the gateway dropped them too
    return {"capacity_tokens": capacity, "removed_blocks": st["removed"], "held_blocks": held,
            "evicted_prompt": pairs[0], "recent_prompt": pairs[1], "gateway_blocks": gw}


async def check_cache_salt(stack: VllmStack) -> dict[str, Any]:
    """Only requests with the same cache_salt share cached blocks, and the index keeps salted blocks apart."""
    e = stack.engines[0]
    bs = _block_size(stack, e)
    idx = KVIndex()
    idx.set_block_size(e.name, bs)
    sub = await _subscriber(stack, e, idx)
    try:
        p = sized_text(e, stack.model, f"salt-{time.time_ns()}", 300)
        first = await _predict_vs_engine(stack, e, idx, [p], salt="alpha")
        await _quiet(sub)
        same = await _predict_vs_engine(stack, e, idx, [p], salt="alpha")
        await _quiet(sub)
        other = await _predict_vs_engine(stack, e, idx, [p], salt="beta")
        await _quiet(sub)
        none = await _predict_vs_engine(stack, e, idx, [p])
    finally:
        await sub.close()
    assert first == [(0, 0)], first
    assert same[0][1] >= bs and same[0][0] == same[0][1], same
    assert other == [(0, 0)], other
    assert none == [(0, 0)], none
    return {"same_salt": same[0], "other_salt": other[0], "no_salt": none[0]}


def check_cache_salt_gateway(stack: VllmStack) -> dict[str, Any]:
    """A client's own cache_salt passes through the gateway, and the gateway's prediction accounts for it."""
    p = text(f"gwsalt-{time.time_ns()}", 250)
    msgs = [{"role": "user", "content": p}]
    r1 = chat(stack, msgs, extra_body={"cache_salt": "client-salt-1"})
    e1 = evidence(stack, r1["rid"])
    settle(stack)
    r2 = chat(stack, msgs, extra_body={"cache_salt": "client-salt-1"})
    e2 = evidence(stack, r2["rid"])
    settle(stack)
    r3 = chat(stack, msgs, extra_body={"cache_salt": "client-salt-2"})
    e3 = evidence(stack, r3["rid"])
    got = [(x["backend"], x["cached_tokens"]["predicted"], x["cached_tokens"]["actual"]) for x in (e1, e2, e3)]
    assert e3["cached_tokens"]["actual"] == 0, got  # another salt never shares (whatever engine it went to)
    if e2["backend"] == e1["backend"]:
        assert e2["cached_tokens"]["actual"] > 0, got
    assert all(pr == ac for _, pr, ac in got), f"(engine, predicted, actual) with client cache_salt: {got}"
    return {"requests": got}


# ------------------------------------------------------------------------------------------------ issue 17


def check_default_topic_conformance(stack: VllmStack) -> dict[str, Any]:
    """Engines started with vLLM's documented kv-events config (no topic key: vLLM's own default, "") and
    default scheduler settings, a gateway config naming no topic: the engines report topic "", the gateway
    subscribes to "" and applies their batches, nothing is stale, and a repeated prompt is predicted exactly."""
    sources = {}
    for e in stack.engines:
        r = httpx.get(e.root + "/kv_event_sources", timeout=10)
        r.raise_for_status()
        cfgs = list(r.json().values())
        assert cfgs and all(c["topic"] == "" for c in cfgs), (e.name, r.json())  # vLLM's default, not ours
        sources[e.name] = cfgs[0]["topic"]
    prompt = [{"role": "user", "content": sized_text(stack.engines[0], stack.model, f"conf-{time.time_ns()}", 300)}]
    settle(stack)
    first = evidence(stack, chat(stack, prompt)["rid"])
    settle(stack)
    again = evidence(stack, chat(stack, prompt)["rid"])
    got = [(x["backend"], x["cached_tokens"]["predicted"], x["cached_tokens"]["actual"]) for x in (first, again)]
    assert again["backend"] == first["backend"], got  # the engine holding it
    assert again["cached_tokens"]["actual"] > 0 and again["cached_tokens"]["predicted"] == \
        again["cached_tokens"]["actual"], got
    fleet = stack.admin_get("/admin/fleet")["engines"]["engines"]
    out: dict[str, Any] = {"engine_topics": sources, "requests": got}
    for name, e in fleet.items():
        kv = e["kv_events"]
        assert kv["subscribed_topic"] == "" and kv["other_topic_frames"] == 0, (name, kv)
        assert not e["stale"] and e["stale_reason"] is None, (name, e["stale_reason"], e["stale_detail"])
        out[name] = {"batches": kv["batches"], "last_batch_age_s": kv["last_batch_age_s"]}
    assert fleet[first["backend"]]["kv_events"]["batches"] > 0, fleet
    return out


def check_wrong_topic_reported(stack: VllmStack, grace_s: float = 3.0) -> dict[str, Any]:
    """A second gateway configured with `telemetry.kv_topic: kv` in front of the same engines (which publish on
    vLLM's default "", the topic the original failure met): after one request, its view of the engine is stale
    with reason wrong_topic within the grace period, in /admin/fleet and /metrics; `gateway config check
    --probe` says the same before serving, and passes for the stack's own (topic-less) config."""
    import os
    import subprocess
    import sys

    import yaml

    from tests.support.procs import Proc, free_port, wait_http
    from tests.vllm.stack import ADMIN_KEY, ROOT, gateway_config

    work = stack.workdir / "wrong-topic"
    work.mkdir(exist_ok=True)
    port = free_port()
    cfg = gateway_config(stack, port)
    cfg["telemetry"] = {"kv_topic": "kv", "kv_silence_grace_s": grace_s, "scrape_interval_s": 0.5}
    cfg["data_dir"] = str(work)
    cfg["policy"]["audit_path"] = str(work / "audit.jsonl")
    cfg["budgets"]["sqlite_path"] = str(work / "budgets.db")
    path = work / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {"VLLM_E2E_KEY": API_KEY, "VLLM_E2E_ADMIN_KEY": ADMIN_KEY}
    for e in stack.engines:  # every engine has published at least one batch: its replay buffer answers the probe
        engine_complete(e, stack.model, sized_text(e, stack.model, f"probe-{e.name}-{time.time_ns()}", 100))
    probe = {}
    for name, cpath in (("default", stack.workdir / "gateway.yaml"), ("kv", path)):
        r = subprocess.run([sys.executable, "-m", "gateway", "config", "check", "--probe", "--probe-timeout", "5",
                            str(cpath)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, **env})
        probe[name] = (r.returncode, r.stdout.strip().splitlines()[1:])
    assert probe["default"][0] == 0 and all(": ok: " in line for line in probe["default"][1]), probe
    assert probe["kv"][0] == 1 and all("FAIL wrong_topic" in line for line in probe["kv"][1]), probe
    gw = Proc([sys.executable, "-m", "gateway", "serve", "--config", str(path)], work / "gateway.log", env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", timeout=60, proc=gw.p)
        time.sleep(0.5)  # ZMQ slow joiner: let the SUBs connect before the engines publish
        c = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        content = sized_text(stack.engines[0], stack.model, f"wrong-topic-{time.time_ns()}", 200)
        raw = c.chat.completions.with_raw_response.create(model=stack.model, max_tokens=1, temperature=0,
                                                           messages=[{"role": "user", "content": content}])
        sent = time.monotonic()
        rid = raw.headers["x-request-id"]
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        served = None
        deadline = sent + grace_s + 15  # bounded wait; the grace period plus scrape and re-judge intervals
        while time.monotonic() < deadline:
            rec = httpx.get(f"{base}/admin/decisions/{rid}", headers=admin, timeout=10)
            if served is None and rec.status_code == 200:
                served = rec.json().get("backend")
            fleet = httpx.get(base + "/admin/fleet", headers=admin, timeout=10).json()["engines"]["engines"]
            if served and fleet[served]["stale"]:
                break
            time.sleep(0.2)
        assert served, "no audit record for the request"
        e = fleet[served]
        assert e["stale"] and e["stale_reason"] == "wrong_topic", (e["stale_reason"], e["kv_events"])
        assert e["kv_events"]["batches"] == 0 and e["kv_events"]["other_topic_frames"] > 0
        assert e["kv_events"]["other_topics"].get("", 0) > 0, e["kv_events"]["other_topics"]
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert f'gateway_kv_stream_stale{{engine="{served}",reason="wrong_topic"}} 1.0' in metrics
        assert gw.log().count("KV view is stale (wrong_topic)") >= 1
        return {"engine": served, "other_topic_frames": e["kv_events"]["other_topic_frames"],
                "probe": {k: v[0] for k, v in probe.items()}, "grace_s": grace_s}
    finally:
        gw.stop()


def check_responses_api(stack: VllmStack) -> dict[str, Any]:
    """POST /v1/responses through the gateway to a real engine's own /v1/responses, with the openai SDK, streamed
    and not: text, usage (input/output tokens) and the audit record naming an engine."""
    names = {e.name for e in stack.engines}
    c = client(stack)
    prompt = "Say something about " + text("responses", 20)
    raw = c.responses.with_raw_response.create(model=stack.model, input=prompt, max_output_tokens=4, temperature=0)
    r = raw.parse()
    assert r.usage is not None and r.usage.input_tokens > 10 and r.usage.output_tokens >= 1, r
    assert isinstance(r.output_text, str)
    events: list[str] = []
    done = None
    with c.responses.stream(model=stack.model, input=prompt, max_output_tokens=4, temperature=0) as s:
        for ev in s:
            events.append(ev.type)
        done = s.get_final_response()
    assert "response.completed" in events and done.usage is not None, events
    assert done.usage.input_tokens == r.usage.input_tokens
    rec = evidence(stack, raw.headers["x-request-id"])
    assert rec["backend"] in names and rec["status"] == 200 and rec["usage"]["prompt_tokens"] == r.usage.input_tokens
    return {"input_tokens": r.usage.input_tokens, "stream_events": len(events)}


def check_messages_api(stack: VllmStack) -> dict[str, Any]:
    """POST /v1/messages (Anthropic Messages) through the gateway to a real engine's own /v1/messages, with the
    official anthropic SDK, streamed and not: text, usage and the audit record naming an engine."""
    import anthropic

    names = {e.name for e in stack.engines}
    a = anthropic.Anthropic(base_url=stack.base, api_key=API_KEY, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Say something about " + text("messages", 20)}]
    raw = a.messages.with_raw_response.create(model=stack.model, max_tokens=4, messages=msgs)
    m = raw.parse()
    assert m.type == "message" and m.usage.input_tokens > 10 and m.usage.output_tokens >= 1, m
    with a.messages.stream(model=stack.model, max_tokens=4, messages=msgs) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert isinstance(streamed, str) and final.usage.output_tokens >= 1, final
    rec = evidence(stack, raw.headers["x-request-id"])
    assert rec["backend"] in names and rec["status"] == 200, rec
    return {"input_tokens": m.usage.input_tokens, "output_tokens": m.usage.output_tokens}
