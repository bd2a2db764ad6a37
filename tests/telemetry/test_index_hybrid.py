"""Hybrid models (a full-attention and a sliding-window KV-cache group), copies removed one at a time, and
kv_cache_report_mode="full" re-announcements. Events go through the wire (encode_batch, vLLM 0.32 field order
of vllm/distributed/kv_events.py: map events tagged "type", array batch) and back before they are applied."""
from types import SimpleNamespace

import pytest
import yaml

from gateway.config import parse_config
from gateway.proxy.dialects.vllm import VLLMDialect
from gateway.telemetry.index import KVIndex
from gateway.telemetry.kv_events import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from gateway.telemetry.service import TelemetryService
from tests.support.procs import free_port

BS = 16
WINDOW = 128  # tokens: vLLM needs cdiv(127, 16) = 8 resident blocks before the hit point
PROMPT = list(range(1, 1 + 12 * BS + 10))  # 12 full blocks (192 tokens) + a partial block
FULL = [1000 + i for i in range(12)]  # engine hashes, group 0 (full attention)
SW = [2000 + i for i in range(12)]  # group 1 (sliding window); vLLM uses the same hashes, any works


def wire(*evs):
    return decode_batch(encode_batch(KVEventBatch(0.0, list(evs), 0)))


def store(hashes, parent, first, group, kind=None, window=None):
    return BlockStored(hashes, parent, PROMPT[first * BS:(first + len(hashes)) * BS], BS, None, "GPU", None, None,
                       group, kind, window)


def hybrid(idx, eng="h"):
    idx.apply(eng, wire(store(FULL, None, 0, 0, "full_attention"),
                        store(SW, None, 0, 1, "sliding_window", WINDOW)))


def test_hybrid_all_resident_predicts_the_full_prefix():
    idx = KVIndex()
    hybrid(idx)
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 192


def test_hybrid_sliding_group_losing_blocks_inside_its_window_predicts_vllms_hit():
    """Blocks 4-11 evicted from the sliding-window group only: no run of 8 resident blocks ends anywhere, so vLLM
    reuses the resident run from block 0: 4 blocks = 64 tokens (the full-attention group alone says 192)."""
    idx = KVIndex()
    hybrid(idx)
    idx.apply("h", wire(BlockRemoved(SW[4:], "GPU", 1)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 64
    assert idx.stats()["engines"]["h"]["kv_groups"]["1"] == {"kind": "sliding_window", "sliding_window": WINDOW,
                                                             "blocks": 4}


def test_hybrid_sliding_group_losing_blocks_outside_its_window_keeps_the_hit():
    """Blocks 0-3 lost in the sliding group: blocks 4-11 still cover the window before the hit point."""
    idx = KVIndex()
    hybrid(idx)
    idx.apply("h", wire(BlockRemoved(SW[:4], "GPU", 1)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 192
    # one block inside the last window gone: the hit moves down to the longest window that is whole
    idx.apply("h", wire(BlockRemoved([SW[9]], "GPU", 1)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 0  # blocks 4-8 (5 < 8) and 10-11: no window, block 0 gone


def test_hybrid_full_group_eviction_still_caps_the_hit():
    idx = KVIndex()
    hybrid(idx)
    idx.apply("h", wire(BlockRemoved([FULL[10]], "GPU", 0)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 160  # sliding group: blocks 2-9 resident, a whole window


def test_block_removed_drops_one_copy_per_group():
    idx = KVIndex()
    hybrid(idx)
    # a second physical copy of block 11 in both groups (vLLM does not dedup concurrent computations)
    idx.apply("h", wire(store([FULL[11]], FULL[10], 11, 0), store([SW[11]], SW[10], 11, 1, "sliding_window", WINDOW)))
    idx.apply("h", wire(BlockRemoved([FULL[11]], "GPU", 0), BlockRemoved([SW[11]], "GPU", 1)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 192  # the other copies are still resident
    idx.apply("h", wire(BlockRemoved([FULL[11]], "GPU", 0)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 176
    idx.apply("h", wire(BlockRemoved([SW[11]], "GPU", 1)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 176  # blocks 3-10 of the sliding group: still a window


def test_full_report_mode_reannouncements_do_not_add_copies():
    """With kv_cache_report_mode="full" vLLM re-announces a reused prefix (parent None, from block 0, every group,
    the sliding group's null positions included). One BlockRemoved must then remove the block."""
    idx = KVIndex()
    idx.set_report_full("h", True)
    hybrid(idx)
    idx.apply("h", wire(BlockRemoved(SW[:4], "GPU", 1)))  # outside the window: still 192
    for _ in range(2):  # two requests reuse the prompt
        idx.apply("h", wire(store(FULL[:11], None, 0, 0), store(SW[:11], None, 0, 1, "sliding_window", WINDOW)))
    assert idx.stats()["engines"]["h"]["reannounced"] == 4
    assert idx.stats()["engines"]["h"]["kv_groups"]["1"]["blocks"] == 8  # null positions 0-3 not taken as resident
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 192
    idx.apply("h", wire(BlockRemoved([FULL[11]], "GPU", 0)))
    assert idx.stats()["engines"]["h"]["entries"] == 11  # no phantom copy left behind
    # an 11-block hit needs sliding blocks 3-10; block 3 is gone and blocks 0-3 do not start a run: vLLM reuses 0
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 0
    idx.apply("h", wire(BlockRemoved([SW[10]], "GPU", 1)))
    assert idx.stats()["engines"]["h"]["kv_groups"]["1"]["blocks"] == 7


def test_without_full_mode_a_second_store_is_a_copy():
    idx = KVIndex()
    hybrid(idx)
    hybrid(idx)
    idx.apply("h", wire(BlockRemoved([FULL[11]], "GPU", 0)))
    assert idx.lookup(["h"], PROMPT)["h"].tokens == 192


def test_event_fields_seen_are_reported():
    idx = KVIndex()
    hybrid(idx)
    f = idx.stats()["engines"]["h"]["event_fields"]
    assert {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "medium"} <= set(f)
    assert "lora_name" not in f


def test_vllm_dialect_asks_for_full_report_mode_when_configured():
    d = VLLMDialect()
    cand = SimpleNamespace(backend=SimpleNamespace(drop_fields=(), priority_scheduling=False,
                                                   kv_cache_report_mode="full"))
    body = {"model": "m", "vllm_xargs": {"session_id": "s"}}
    d.adjust(None, cand, body)
    assert body["vllm_xargs"] == {"session_id": "s", "kv_cache_report_mode": "full"}
    cand.backend.kv_cache_report_mode = "incremental"
    body = {"model": "m"}
    d.adjust(None, cand, body)
    assert "vllm_xargs" not in body


async def test_fleet_snapshot_shows_event_fields_groups_and_report_mode():
    cfg = parse_config(yaml.safe_dump({"backends": [
        {"name": "h", "kind": "vllm", "url": f"http://127.0.0.1:{free_port()}/v1", "models": ["m"],
         "kv_events": f"tcp://127.0.0.1:{free_port()}", "kv_cache_report_mode": "full"}]}))
    svc = TelemetryService(cfg)
    await svc.start()
    try:
        hybrid(svc.index)
        e = svc.fleet_snapshot()["engines"]["h"]
        assert "kv_cache_spec_sliding_window" in e["kv_event_fields"]
        assert e["kv_groups"] == {"1": {"kind": "sliding_window", "sliding_window": WINDOW, "blocks": 12}}
        assert svc.index.stats()["engines"]["h"]["report_full"] is True
    finally:
        await svc.close()


# Made by vLLM 0.32.0's own classes (vllm.distributed.kv_events BlockStored / BlockRemoved / KVEventBatch, encoded
# with msgspec.msgpack as ZmqEventPublisher does) in .venv-vllm: group 0 full attention and group 1 sliding window
# (128 tokens) store PROMPT's 12 blocks (hashes 1000+i and 2000+i); then group 1 loses blocks 4-11.
VLLM_HYBRID_STORE = bytes.fromhex(
    "93cb0000000000000000928aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739ccd03e8cd03e9cd"
    "03eacd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3b1706172656e745f626c6f636b5f68617368c0a974"
    "6f6b656e5f696473dc00c00102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f2021222324252627"
    "28292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f50515253545556575859"
    "5a5b5c5d5e5f606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83cc84cc85"
    "cc86cc87cc88cc89cc8acc8bcc8ccc8dcc8ecc8fcc90cc91cc92cc93cc94cc95cc96cc97cc98cc99cc9acc9bcc9ccc9dcc9e"
    "cc9fcca0cca1cca2cca3cca4cca5cca6cca7cca8cca9ccaaccabccacccadccaeccafccb0ccb1ccb2ccb3ccb4ccb5ccb6ccb7"
    "ccb8ccb9ccbaccbbccbcccbdccbeccbfccc0aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055"
    "a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474"
    "656e74696f6e8ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739ccd07d0cd07d1cd07d2cd07d3"
    "cd07d4cd07d5cd07d6cd07d7cd07d8cd07d9cd07dacd07dbb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f"
    "696473dc00c00102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c"
    "2d2e2f303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e"
    "5f606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83cc84cc85cc86cc87cc"
    "88cc89cc8acc8bcc8ccc8dcc8ecc8fcc90cc91cc92cc93cc94cc95cc96cc97cc98cc99cc9acc9bcc9ccc9dcc9ecc9fcca0cc"
    "a1cca2cca3cca4cca5cca6cca7cca8cca9ccaaccabccacccadccaeccafccb0ccb1ccb2ccb3ccb4ccb5ccb6ccb7ccb8ccb9cc"
    "baccbbccbcccbdccbeccbfccc0aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f7261"
    "5f6e616d65c0a967726f75705f69647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77696e646f"
    "77bc6b765f63616368655f737065635f736c6964696e675f77696e646f77cc8000"
)
VLLM_SLIDING_EVICT = bytes.fromhex(
    "93cb00000000000000009184a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657398cd07d4cd07d5"
    "cd07d6cd07d7cd07d8cd07d9cd07dacd07dba66d656469756da3475055a967726f75705f6964780100"
)


# The same case made by vLLM 0.34.0's classes (the newest release, installed beside the CPU build: `pip download
# vllm==0.34.0 --no-deps`, the wheel unpacked without its .so files, imported by .venv-vllm's Python with
# PYTHONPATH on it; the script is the one above). 0.34's BlockStored has four more optional fields (locality,
# ownership, session_id, lookahead_token_ids), so msgspec writes a map16 header: other bytes, the same events. Its
# BlockRemoved of the sliding group encodes to VLLM_SLIDING_EVICT byte for byte.
VLLM034_HYBRID_STORE = bytes.fromhex(
    "93cb000000000000000092de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739ccd03e8cd03"
    "e9cd03eacd03ebcd03eccd03edcd03eecd03efcd03f0cd03f1cd03f2cd03f3b1706172656e745f626c6f636b5f68617368c0"
    "a9746f6b656e5f696473dc00c00102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425"
    "262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f5051525354555657"
    "58595a5b5c5d5e5f606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83cc84"
    "cc85cc86cc87cc88cc89cc8acc8bcc8ccc8dcc8ecc8fcc90cc91cc92cc93cc94cc95cc96cc97cc98cc99cc9acc9bcc9ccc9d"
    "cc9ecc9fcca0cca1cca2cca3cca4cca5cca6cca7cca8cca9ccaaccabccacccadccaeccafccb0ccb1ccb2ccb3ccb4ccb5ccb6"
    "ccb7ccb8ccb9ccbaccbbccbcccbdccbeccbfccc0aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da347"
    "5055a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f61"
    "7474656e74696f6ede000ba474797065ab426c6f636b53746f726564ac626c6f636b5f6861736865739ccd07d0cd07d1cd07"
    "d2cd07d3cd07d4cd07d5cd07d6cd07d7cd07d8cd07d9cd07dacd07dbb1706172656e745f626c6f636b5f68617368c0a9746f"
    "6b656e5f696473dc00c00102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728"
    "292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f404142434445464748494a4b4c4d4e4f505152535455565758595a"
    "5b5c5d5e5f606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7fcc80cc81cc82cc83cc84cc85cc"
    "86cc87cc88cc89cc8acc8bcc8ccc8dcc8ecc8fcc90cc91cc92cc93cc94cc95cc96cc97cc98cc99cc9acc9bcc9ccc9dcc9ecc"
    "9fcca0cca1cca2cca3cca4cca5cca6cca7cca8cca9ccaaccabccacccadccaeccafccb0ccb1ccb2ccb3ccb4ccb5ccb6ccb7cc"
    "b8ccb9ccbaccbbccbcccbdccbeccbfccc0aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a9"
    "6c6f72615f6e616d65c0a967726f75705f69647801b26b765f63616368655f737065635f6b696e64ae736c6964696e675f77"
    "696e646f77bc6b765f63616368655f737065635f736c6964696e675f77696e646f77cc8000"
)
# vLLM 0.34.0: a store and a removal carrying the new fields (locality LOCAL, an ownership tier, a session id,
# lookahead tokens), as an offloading tier or a session-tagged engine sends them.
VLLM034_NEW_FIELDS = bytes.fromhex(
    "93cb3ff000000000000092de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920708b17061"
    "72656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00200102030405060708090a0b0c0d0e0f101112131415"
    "161718191a1b1c1d1e1f20aa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e"
    "616d65c0a86c6f63616c697479a54c4f43414ca96f776e657273686970a57469657232aa73657373696f6e5f6964a6736573"
    "732d31b36c6f6f6b61686561645f746f6b656e5f696473929111912185a474797065ac426c6f636b52656d6f766564ac626c"
    "6f636b5f6861736865739108a66d656469756da3475055a86c6f63616c697479a54c4f43414ca96f776e657273686970a574"
    "69657232c0"
)


@pytest.mark.parametrize("version,store", [("0.32.0", VLLM_HYBRID_STORE), ("0.34.0", VLLM034_HYBRID_STORE)])
def test_hybrid_eviction_inside_the_window_from_vllms_own_bytes(version, store):
    idx = KVIndex()
    idx.apply("v", decode_batch(store))
    assert idx.lookup(["v"], PROMPT)["v"].tokens == 192, version
    idx.apply("v", decode_batch(VLLM_SLIDING_EVICT))
    assert idx.lookup(["v"], PROMPT)["v"].tokens == 64, version  # what vLLM reuses; group 0 alone would say 192


def test_vllm_034_events_with_its_new_fields_decode_and_index():
    """0.34's locality/ownership/session_id decode and index like any store; the removal drops its one copy."""
    batch = decode_batch(VLLM034_NEW_FIELDS)
    st, rm = batch.events
    assert (st.locality, st.ownership, st.session_id) == ("LOCAL", "tier2", "sess-1")
    assert (rm.locality, rm.ownership) == ("LOCAL", "tier2")
    idx = KVIndex()
    idx.apply("v", KVEventBatch(batch.ts, [st]))
    assert idx.lookup(["v"], list(range(1, 41)))["v"].tokens == 32  # 40 tokens: both full blocks
    idx.apply("v", KVEventBatch(batch.ts, [rm]))
    assert idx.lookup(["v"], list(range(1, 41)))["v"].tokens == 16
