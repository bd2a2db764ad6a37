"""KV index: own keys, stores/removals, salts, LoRA, tiers, resets, lookup caps; wire decode both forms."""
import msgspec

from gateway.telemetry.index import KVIndex, RequestKeys, own_keys
from gateway.telemetry.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                         decode_batch, encode_batch)

BS = 16
TOKS = list(range(1, 1 + 10 * BS + 5))


def stored(hashes, parent, toks, medium="GPU", lora=None, extra=None):
    return BlockStored(hashes, parent, toks, BS, None, medium, lora, extra)


def batch(*evs):
    return KVEventBatch(0.0, list(evs), 0)


def test_decode_map_and_array_forms_roundtrip():
    b = batch(stored([1, 2**64 - 1], None, TOKS[:32], extra=[["s"], None]), BlockRemoved([5], "CPU"),
              AllBlocksCleared())
    for arr in (False, True):
        d = decode_batch(encode_batch(b, array_events=arr))
        assert d.events == b.events and d.ts == 0.0
    raw = msgspec.msgpack.encode({"ts": 1.5, "events": [{"type": "BlockRemoved", "block_hashes": [b"x" * 32],
                                                          "medium": "GPU"}, ["AllBlocksCleared"]]})
    d = decode_batch(raw)
    assert isinstance(d.events[0], BlockRemoved) and isinstance(d.events[1], AllBlocksCleared)


def test_chain_store_lookup_evict_and_cap():
    idx = KVIndex()
    idx.apply("a", batch(stored([11, 12, 13], None, TOKS[:48])))
    idx.apply("a", batch(stored([14, 15], 13, TOKS[48:80])))
    r = idx.lookup(["a", "b"], TOKS)
    assert r["a"].tokens == 80 and r["a"].by_tier == {"GPU": 80} and r["b"].tokens == 0
    # vLLM reuses at most len-1 tokens: an exact 80-token prompt can reuse only 64
    assert idx.lookup(["a"], TOKS[:80])["a"].tokens == 64
    idx.apply("a", batch(BlockRemoved([13], "GPU")))
    assert idx.lookup(["a"], TOKS)["a"].tokens == 32  # a hole ends the prefix
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.lookup(["a"], TOKS)["a"].tokens == 0
    assert idx.stats()["block_engine_entries"] == 0


def test_salt_and_lora_separate_caches():
    idx = KVIndex()
    idx.apply("a", batch(stored([1, 2], None, TOKS[:32], extra=[("tenant-x",), None])))
    idx.apply("b", batch(stored([1, 2], None, TOKS[:32], lora="sql", extra=[("sql",), ("sql",)])))
    idx.apply("c", batch(stored([1, 2], None, TOKS[:32], lora="sql", extra=[("sql", "tenant-x"), ("sql",)])))
    q = TOKS[:40]
    assert {k: v.tokens for k, v in idx.lookup("abc", q).items()} == {"a": 0, "b": 0, "c": 0}
    assert {k: v.tokens for k, v in idx.lookup("abc", q, salt="tenant-x").items()} == {"a": 32, "b": 0, "c": 0}
    assert {k: v.tokens for k, v in idx.lookup("abc", q, lora="sql").items()} == {"a": 0, "b": 32, "c": 0}
    assert idx.lookup("abc", q, salt="tenant-x", lora="sql")["c"].tokens == 32
    # multimodal extra keys make a block unreachable for text requests
    idx.apply("d", batch(stored([9], None, TOKS[:16], extra=[(("mmhash", 0),)])))
    assert idx.lookup(["d"], q)["d"].tokens == 0


def test_tiers_and_duplicate_copies():
    idx = KVIndex()
    idx.apply("a", batch(stored([1, 2], None, TOKS[:32])))
    idx.apply("a", batch(stored([3], 2, TOKS[32:48], medium="CPU")))
    idx.apply("a", batch(stored([1], None, TOKS[:16], medium="CPU")))  # block 1 offloaded, still on GPU
    r = idx.lookup(["a"], TOKS)["a"]
    assert r.tokens == 48 and r.by_tier == {"GPU": 32, "CPU": 16}
    idx.apply("a", batch(BlockRemoved([1], "GPU")))
    assert idx.lookup(["a"], TOKS)["a"].by_tier == {"CPU": 32, "GPU": 16}
    assert idx.engine_blocks("a") == {"GPU": 1, "CPU": 2, "DISK": 0, "SHARED": 0}
    # the off-loop path (snapshot on the loop, count in a thread) gives the same counts for every engine
    idx.apply("c", batch(stored([5, 6], None, TOKS[:32])))
    snap = idx.block_count_snapshot()
    counts = KVIndex.count_blocks(snap)
    assert counts == {n: idx.engine_blocks(n) for n in ("a", "c")} and counts["c"]["GPU"] == 2
    idx.apply("c", batch(BlockRemoved([6], "GPU")))  # after the snapshot: the next snapshot sees it
    assert KVIndex.count_blocks(idx.block_count_snapshot())["c"]["GPU"] == 1
    # two physical copies of one hash: the first removal keeps it
    idx.apply("b", batch(stored([7], None, TOKS[:16])))
    idx.apply("b", batch(stored([7], None, TOKS[:16])))
    idx.apply("b", batch(BlockRemoved([7], "GPU")))
    assert idx.lookup(["b"], TOKS)["b"].tokens == 16
    idx.apply("b", batch(BlockRemoved([7], "GPU")))
    assert idx.lookup(["b"], TOKS)["b"].tokens == 0


def test_orphan_parent_never_matches_and_keys_match_requests():
    idx = KVIndex()
    idx.apply("a", batch(stored([5], 999, TOKS[16:32])))  # parent unknown (missed)
    assert idx.lookup(["a"], TOKS)["a"].tokens == 0
    assert idx.stats()["engines"]["a"]["orphans"] == 1
    k = own_keys(TOKS, BS, salt="s")
    assert RequestKeys(TOKS, "s").keys(BS) == k and len(k) == len(TOKS) // BS


def test_many_blocks_growth_and_reset_keeps_others():
    idx = KVIndex(initial_capacity=1024)
    for e in range(3):
        for c in range(300):
            toks = [c * 1000 + e * 7 + i for i in range(4 * BS)] if e else [c * 1000 + i for i in range(4 * BS)]
            idx.apply(f"e{e}", batch(stored([e << 32 | c << 8 | j for j in range(4)], None, toks)))
    assert idx.stats()["block_engine_entries"] == 3600
    idx.reset("e1")
    toks = [5 * 1000 + i for i in range(4 * BS + 1)]
    assert idx.lookup(["e0", "e1", "e2"], toks)["e0"].tokens == 64
    assert idx.stats()["block_engine_entries"] == 2400
    for c in range(300):
        idx.apply("e0", batch(BlockRemoved([c << 8 | j for j in range(4)], "GPU")))
    assert idx.stats()["engines"]["e0"]["entries"] == 0
    assert idx.lookup(["e0"], toks)["e0"].tokens == 0
    toks2 = [7 * 1000 + 2 * 7 + i for i in range(4 * BS + 1)]
    assert idx.lookup(["e2"], toks2)["e2"].tokens == 64
