"""Metrics parsing on real vLLM /metrics text; token sources (approx fallback, engine /tokenize via the sim)."""
from pathlib import Path

from gateway.telemetry.scraper import parse_metrics
from gateway.telemetry.tokens import TokenSource, approx_tokens

DATA = Path(__file__).resolve().parents[1] / "data"


def test_parse_real_vllm_metrics():
    load = parse_metrics((DATA / "vllm_metrics.txt").read_text(), now=1.0)
    assert load.healthy and load.block_size == 32 and load.num_gpu_blocks == 80
    assert load.prefix_queries >= load.prefix_hits > 0
    assert 0.0 <= load.kv_usage <= 1.0 and load.running == 0


async def test_approx_source_shares_prefix_blocks_and_caches():
    ts = TokenSource("approx")
    a, src = await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "a"}]})
    b, _ = await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "b"}]})
    assert src == "approx" and a[:90] == b[:90] and a != b
    await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "a"}]})
    assert ts.hits == 1 and ts.misses == 2
    assert approx_tokens("abcd") == approx_tokens("abcd")


async def test_unreachable_engine_falls_back_to_approx():
    ts = TokenSource("auto", timeout_s=0.2)
    toks, src = await ts.tokens("http://127.0.0.1:9", {"model": "m", "prompt": "hello world"})
    assert src == "approx" and toks
    await ts.close()


def _chat(*contents, **extra):
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"model": "m", **extra, "messages": [{"role": r, "content": c} for r, c in zip(roles, contents)]}


def test_prefix_keys_cover_every_earlier_message_and_what_changes_the_template():
    from gateway.telemetry.tokens import prefix_keys

    a = prefix_keys(_chat("sys", "q1", "a1", "q2"), None)
    b = prefix_keys(_chat("sys", "q1", "a1", "other"), None)
    assert len(a) == 3 and a == b  # the last message (the new tail) is never part of a key
    assert prefix_keys(_chat("sys", "q9", "a1", "q2"), None)[:1] == a[:1]
    assert prefix_keys(_chat("sys", "q9", "a1", "q2"), None)[1] != a[1]
    assert prefix_keys(_chat("sys", "q"), "tenant-a") != prefix_keys(_chat("sys", "q"), "tenant-b")
    assert prefix_keys(_chat("sys", "q"), None, "http://e1") != prefix_keys(_chat("sys", "q"), None, "http://e2")
    assert prefix_keys(_chat("sys", "q", tools=[{"type": "function"}]), None) != prefix_keys(_chat("sys", "q"), None)
    assert prefix_keys(_chat("only"), None) == [] and prefix_keys({"prompt": "x"}, None) == []


def test_prefix_cache_stores_only_true_prefixes_and_returns_the_longest():
    from gateway.telemetry.tokens import PrefixTokenCache, prefix_keys

    c = PrefixTokenCache(size=2)
    keys = prefix_keys(_chat("sys", "q1", "a1", "q2"), None)
    assert not c.put(keys[0], [1, 2, 9], [1, 2, 3, 4]) and c.mismatched == 1
    assert c.put(keys[0], [1, 2], [1, 2, 3, 4]) and c.put(keys[2], [1, 2, 3], [1, 2, 3, 4])
    assert c.longest(keys) == (3, (1, 2, 3))
    assert c.longest(keys[:2]) == (1, (1, 2))
    c.put(keys[1], [1, 2, 3], [1, 2, 3])  # LRU: size 2 drops the oldest
    assert len(c._ids) == 2 and c.tokens_held == 5 and keys[2] not in c  # keys[0] was read last
    t = PrefixTokenCache(max_tokens=5)  # bounded by tokens held too
    t.put(keys[0], [1, 2, 3], [1, 2, 3])
    t.put(keys[1], [1, 2, 3], [1, 2, 3])
    assert keys[0] not in t and keys[1] in t and t.tokens_held == 3
    assert not t.put(keys[2], list(range(6)), list(range(6)))  # longer than the whole budget: not stored
    c.observe_token_strs("e", ["ab", " héllo", None])
    c.observe_token_strs("e", ["a"])
    assert c.max_token_bytes["e"] == 7


def test_tail_lower_bound_is_bytes_over_twice_the_longest_token_seen():
    from gateway.telemetry.tokens import content_bytes, tail_token_lower_bound

    assert tail_token_lower_bound(100, None) == 0 and tail_token_lower_bound(0, 5) == 0
    assert tail_token_lower_bound(100, 5) == 10 and tail_token_lower_bound(101, 5) == 11
    assert content_bytes([{"content": "héllo"}, {"content": [{"type": "text", "text": "ab"}]}, {"content": None}]) == 8


async def test_learn_prefix_against_the_sim_engine_and_bound_the_tail():
    from backends.sim.fleet import start_fleet
    from gateway.telemetry.tokens import prefix_keys

    async with start_fleet(1, profiles=["tiny"]) as fleet:
        root = fleet.manifest()["engines"][0]["url"].removesuffix("/v1")
        ts = TokenSource("engine")
        body = _chat("You are a careful assistant. " * 20, "What is a prefix cache?", model="sim-model")
        full, src = await ts.tokens(root, body)
        assert src == "engine"
        assert await ts.learn_prefix(root, body, full, None)
        ids, tail = ts.cached_prefix(root, _chat("You are a careful assistant. " * 20, "x" * 90, model="sim-model"),
                                     None)
        assert is_prefix_of(ids, full) and 0 < tail <= 90
        assert not await ts.learn_prefix(root, body, full, None)  # once per prefix
        assert prefix_keys(body, None, root)[-1] in ts.prefixes._ids
        await ts.close()


def is_prefix_of(a, b):
    return list(b[:len(a)]) == list(a)
