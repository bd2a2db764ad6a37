"""Kind `sglang`: KV-event bytes, /metrics text and /tokenize requests built to the formats in SGLang's own code.

The formats were read in SGLang 0.5.23 (pip wheel sglang-0.5.23-cp311, read for the schema; no code taken):
- sglang/srt/disaggregation/kv_events.py: `EventBatch(ts, events, attn_dp_rank)` is an array_like msgspec
  Struct; `KVCacheEvent` is `omit_defaults=True, tag=True` (tagged maps, tag key "type" = class name);
  `BlockStored(block_hashes: list[int], parent_block_hash: int | None, token_ids: list[int], block_size: int,
  lora_id: int | None, medium=None, cache_salt=None, session_id=None, lora_name=None)` (lora_id has no default:
  always on the wire), `BlockRemoved(block_hashes, medium=None)`, `AllBlocksCleared()`; frames (topic, seq as
  8 bytes big-endian, payload), replay answers (b"", topic, seq, payload) and ends (b"", b"", END_SEQ, b"").
- sglang/srt/mem_cache/events.py: one BlockStored per page, coalesced while each continues the last one's
  chain (same medium, salt, LoRA): one event with several pages; `block_size` the page's length; hashes signed
  int64 (`hash_str_to_int64`); a salted node's events carry `cache_salt` on every event of the chain; bigram
  (EAGLE) keys publish `(t[j], t[j+1])` pairs; one BlockRemoved per radix node (its pages' hashes);
  media StorageMedium GPU / CPU_PINNED / DISK / EXTERNAL.
- SGLang 0.5.10's (pip wheel sglang-0.5.10) events were array_like: ["BlockStored", hashes, parent, token_ids,
  block_size, lora_id, medium].
- sglang/srt/observability/metrics_collector.py: scheduler gauges labelled model_name, engine_type, tp_rank,
  pp_rank, moe_ep_rank (+ priority, + dp_rank); queue counts' total under priority="" and per-priority series
  besides; tokenizer counters labelled model_name, engine_type (+ priority, is_streaming, cache_source).
- sglang/srt/entrypoints/openai/protocol.py TokenizeRequest / serving_tokenize.py: messages without
  `add_generation_prompt` are rendered as for a chat completion; the answer is {tokens, count, max_model_len}.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from gateway.telemetry.index import KVIndex, RequestKeys
from gateway.telemetry.kv_events import BlockStored, decode_batch
from gateway.telemetry.scraper import parse_metrics
from gateway.telemetry.tokens import TokenSource


# ------------------------------------------------------------------ SGLang 0.5.23's wire schema (as read)
class SGLEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredS(SGLEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[Any]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemovedS(SGLEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksClearedS(SGLEvent, tag="AllBlocksCleared"):
    pass


class EventBatchS(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SGLArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStoredA10(SGLArrayEvent, tag="BlockStored"):  # SGLang 0.5.10
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class BlockRemovedA10(SGLArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


class EventBatchA10(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


ENC = msgspec.msgpack.Encoder()


def wire(*events: Any, rank: int | None = 0) -> bytes:
    return ENC.encode(EventBatchS(1.0, list(events), rank))


def pages(toks: list[int], page: int) -> list[list[int]]:
    return [toks[i:i + page] for i in range(0, len(toks) // page * page, page)]


def h(i: int) -> int:
    """A signed int64 hash, as SGLang's hash_str_to_int64 gives (half of them negative)."""
    return -(i * 0x9E3779B97F4A7C15 % (1 << 63)) if i % 2 else (i * 0x9E3779B97F4A7C15) % (1 << 63)


def stored(toks: list[int], page: int, first: int, parent: int | None, **kw: Any) -> BlockStoredS:
    """One coalesced BlockStored: every page of `toks` in one event (SGLang's enqueue coalescing)."""
    ps = pages(toks, page)
    return BlockStoredS([h(first + i) for i in range(len(ps))], parent, [t for p in ps for t in p], page, None,
                        kw.pop("medium", "GPU"), **kw)


PROMPT = list(range(100, 100 + 16 * 12 + 3))


def test_sglang_0_5_23_bytes_decode_with_its_own_fields():
    raw = wire(stored(PROMPT[:64], 16, 1, None, cache_salt="tenant-a", session_id="s1", lora_name="ad"),
               BlockRemovedS([h(3), h(4)], "GPU"), AllBlocksClearedS(), rank=3)
    # the bytes are what SGLang's encoder makes: an array batch of tagged maps, lora_id always present
    obj = msgspec.msgpack.decode(raw)
    assert isinstance(obj, list) and obj[2] == 3 and obj[1][0]["type"] == "BlockStored"
    assert "lora_id" in obj[1][0] and obj[1][0]["lora_id"] is None and obj[1][0]["cache_salt"] == "tenant-a"
    assert obj[1][1] == {"type": "BlockRemoved", "block_hashes": [h(3), h(4)], "medium": "GPU"}
    b = decode_batch(raw)
    st = b.events[0]
    assert isinstance(st, BlockStored) and st.cache_salt == "tenant-a" and st.lora_name == "ad"
    assert st.session_id == "s1" and st.block_size == 16 and len(st.block_hashes) == 4
    assert any(x < 0 for x in st.block_hashes)  # signed int64 hashes decode as they are
    assert b.data_parallel_rank == 3 and type(b.events[2]).__name__ == "AllBlocksCleared"


def test_index_predicts_sglang_reuse_salt_on_every_event_coalesced_chains_and_node_removal():
    idx = KVIndex()
    salt = "tenant-a"
    # a salted chain in two inserts (two radix nodes): each event carries the salt, the second links its parent
    idx.apply("e", decode_batch(wire(stored(PROMPT[:64], 16, 1, None, cache_salt=salt))))
    idx.apply("e", decode_batch(wire(stored(PROMPT[64:128], 16, 5, h(4), cache_salt=salt))))
    assert idx.lookup(["e"], RequestKeys(PROMPT, salt))["e"].tokens == 128
    assert idx.lookup(["e"], RequestKeys(PROMPT, "tenant-b"))["e"].tokens == 0  # another salt: no reuse
    assert idx.lookup(["e"], RequestKeys(PROMPT))["e"].tokens == 0  # unsalted requests neither
    # an unsalted chain of the same tokens is another cache
    idx.apply("e", decode_batch(wire(stored(PROMPT[:32], 16, 50, None))))
    assert idx.lookup(["e"], RequestKeys(PROMPT))["e"].tokens == 32
    # eviction of the second radix node: one BlockRemoved with its pages' hashes
    idx.apply("e", decode_batch(wire(BlockRemovedS([h(5), h(6), h(7), h(8)], "GPU"))))
    assert idx.lookup(["e"], RequestKeys(PROMPT, salt))["e"].tokens == 64
    idx.apply("e", decode_batch(wire(AllBlocksClearedS())))
    assert idx.lookup(["e"], RequestKeys(PROMPT, salt))["e"].tokens == 0


def test_page_size_one_reuses_token_exactly_and_caps_at_prompt_minus_one():
    """SGLang's default page size is 1: every token a block; like vLLM it reuses at most len - 1 tokens
    (schedule_batch `_compute_max_prefix_len`: input_len - 1)."""
    idx = KVIndex()
    idx.apply("e", decode_batch(wire(stored(PROMPT[:37], 1, 1, None))))
    assert idx.block_size("e") == 1
    assert idx.lookup(["e"], RequestKeys(PROMPT))["e"].tokens == 37
    assert idx.lookup(["e"], RequestKeys(PROMPT[:37]))["e"].tokens == 36


def test_hicache_media_are_tiers_and_lora_name_keys_the_adapter():
    idx = KVIndex()
    idx.apply("e", decode_batch(wire(stored(PROMPT[:32], 16, 1, None),
                                     stored(PROMPT[32:64], 16, 3, h(2), medium="CPU_PINNED"),
                                     stored(PROMPT[64:96], 16, 5, h(4), medium="EXTERNAL"))))
    got = idx.lookup(["e"], RequestKeys(PROMPT))["e"]
    assert got.tokens == 96 and got.by_tier == {"GPU": 32, "CPU": 32, "SHARED": 32}
    idx.apply("l", decode_batch(wire(stored(PROMPT[:48], 16, 70, None, lora_name="sql-adapter"))))
    assert idx.lookup(["l"], RequestKeys(PROMPT, None, "sql-adapter"))["l"].tokens == 48
    assert idx.lookup(["l"], RequestKeys(PROMPT))["l"].tokens == 0


def test_bigram_pages_of_eagle_radix_keys_are_read_as_their_tokens():
    toks = PROMPT[:33]
    pairs = [(toks[j], toks[j + 1]) for j in range(32)]
    ev = BlockStoredS([h(1), h(2)], None, pairs, 16, None, "GPU")
    b = decode_batch(wire(ev, BlockRemovedS([h(9)], "GPU")))
    assert b.events[0].token_ids == toks[:32]
    idx = KVIndex()
    idx.apply("e", b)
    assert idx.lookup(["e"], RequestKeys(PROMPT))["e"].tokens == 32


def test_sglang_0_5_10_array_events_decode():
    raw = ENC.encode(EventBatchA10(2.0, [BlockStoredA10([h(1), h(2)], None, PROMPT[:32], 16, None, "GPU"),
                                         BlockRemovedA10([h(2)], "GPU")], 0))
    obj = msgspec.msgpack.decode(raw)
    assert obj[1][0][0] == "BlockStored" and len(obj[1][0]) == 7
    idx = KVIndex()
    idx.apply("e", decode_batch(raw))
    assert idx.lookup(["e"], RequestKeys(PROMPT))["e"].tokens == 16


# ------------------------------------------------------------------ /metrics
SCHED = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]


def sglang_metrics(running: dict[str, int], waiting: dict[str, int], dp_ranks: int = 1) -> str:
    """An SGLang /metrics page with priority scheduling on (priority label) and `dp_ranks` DP schedulers."""
    reg = CollectorRegistry()
    lab = SCHED + ["priority", "dp_rank"]
    g = {n: Gauge(n, n, lab, registry=reg) for n in ("sglang:num_running_reqs", "sglang:num_queue_reqs",
                                                       "sglang:token_usage", "sglang:cache_hit_rate",
                                                       "sglang:gen_throughput", "sglang:page_size",
                                                       "sglang:num_pages", "sglang:max_total_num_tokens")}
    retracted = Counter("sglang:num_retracted_requests", "", lab, registry=reg)
    tl = ["model_name", "engine_type", "priority"]
    prompt = Counter("sglang:prompt_tokens", "", tl + ["is_streaming"], registry=reg)
    cached = Counter("sglang:cached_tokens", "", tl + ["cache_source"], registry=reg)
    for dp in range(dp_ranks):
        base = ["m", "unified", str(dp), "0", "0"]
        for name, d in (("sglang:num_running_reqs", running), ("sglang:num_queue_reqs", waiting)):
            g[name].labels(*base, "", str(dp)).set(sum(d.values()))  # the total under priority=""
            for p, n in d.items():
                g[name].labels(*base, p, str(dp)).set(n)  # the breakdown
        g["sglang:token_usage"].labels(*base, "", str(dp)).set(0.2 + 0.2 * dp)
        g["sglang:cache_hit_rate"].labels(*base, "", str(dp)).set(0.5)
        g["sglang:gen_throughput"].labels(*base, "", str(dp)).set(123.0)
        g["sglang:page_size"].labels(*base, "", str(dp)).set(16)
        g["sglang:num_pages"].labels(*base, "", str(dp)).set(4096)
        g["sglang:max_total_num_tokens"].labels(*base, "", str(dp)).set(65536)
        retracted.labels(*base, "", str(dp)).inc(2)
    prompt.labels("m", "unified", "", "false").inc(1000)
    prompt.labels("m", "unified", "10", "true").inc(500)  # a request's own priority fills the label in
    cached.labels("m", "unified", "", "device").inc(300)
    cached.labels("m", "unified", "10", "host").inc(100)
    return generate_latest(reg).decode()


def test_sglang_metrics_text_into_the_engine_view():
    text = sglang_metrics({"0": 2, "10": 1}, {"10": 4}, dp_ranks=2)
    assert 'sglang:num_running_reqs{dp_rank="1",engine_type="unified"' in text
    load = parse_metrics(text, now=5.0, form="sglang")
    assert load.healthy and load.scraped_at == 5.0
    assert (load.running, load.waiting) == (6, 8)  # totals of both DP ranks; no breakdown counted twice
    assert load.kv_usage == pytest.approx(0.3)  # mean over DP ranks
    assert (load.block_size, load.num_gpu_blocks) == (16, 4096)
    assert load.prompt_tokens == 1500 and load.prompt_tokens_cached == 400 and load.preemptions == 4
    assert load.prefix_queries == 0 and load.prefix_hits == 0  # SGLang exports no such counters
    # the same text read as vLLM's finds nothing: the form is per kind
    assert parse_metrics(text, form="vllm").running == 0


def test_sglang_metrics_without_num_pages_take_capacity_from_tokens():
    reg = CollectorRegistry()
    for n, v in (("sglang:page_size", 32), ("sglang:max_total_num_tokens", 3200), ("sglang:num_running_reqs", 1)):
        Gauge(n, n, SCHED, registry=reg).labels("m", "unified", "0", "0", "0").set(v)
    load = parse_metrics(generate_latest(reg).decode(), form="sglang")
    assert (load.block_size, load.num_gpu_blocks, load.running) == (32, 100, 1)


# ------------------------------------------------------------------ /tokenize
class _Recorder:
    """A tiny HTTP engine that answers /tokenize as SGLang does and records the request bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.server: asyncio.AbstractServer | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            body = json.loads(await reader.readexactly(n))
            self.bodies.append(body)
            out = json.dumps({"tokens": [1, 2, 3], "count": 3, "max_model_len": 4096}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(out)).encode() + b"\r\n\r\n" + out)
            await writer.drain()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_tokenize_asks_sglang_to_render_as_for_a_chat_completion():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    rec = _Recorder()
    async with rec as root:
        ts = TokenSource("engine", timeout_s=2.0)
        toks, src = await ts.tokens(root, chat, form="sglang")
        assert (toks, src) == ([1, 2, 3], "engine")
        await ts.tokens(root + "/", chat, form="vllm")
        await ts.tokens(root, {"model": "m", "prompt": "hello"}, form="sglang")
        # the prefix learner: SGLang answers no token_strs (no tail bound), the ids are still learned
        full = [1, 2, 3, 4]
        body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
        assert await ts.learn_prefix(root, body, full, None, form="sglang")
        await ts.close()
    sgl, vllm, prompt, prefix = rec.bodies
    assert "add_generation_prompt" not in sgl and sgl["messages"] == chat["messages"]
    assert vllm["add_generation_prompt"] is True
    assert prompt == {"model": "m", "prompt": "hello"}
    assert prefix["add_generation_prompt"] is False and prefix["messages"] == body["messages"][:1]
    assert ts.prefixes.max_token_bytes.get(root) is None
