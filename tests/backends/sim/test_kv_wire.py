"""Wire compatibility with real vLLM, not with ourselves.

Golden frames in tests/data/vllm_kv_events/ were captured from a live vLLM 0.32 CPU engine (PUB stream and
replay replies). We decode them with backends.sim.kv_wire (written from vllm/distributed/kv_events.py),
re-encode with our structs and demand identical bytes, and check that the simulator's own frames have the
same shape (batch form, event keys in order, frame layout of PUB and replay).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from backends.sim.engine import SimEngine
from backends.sim.kv_wire import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch,
                                  encode_batch, parse_seq)
from backends.sim.profiles import get_profile

GOLDEN = Path(__file__).resolve().parents[2] / "data" / "vllm_kv_events"


def _rows(name: str) -> list[dict]:
    path = GOLDEN / name
    if not path.exists():
        pytest.fail(f"golden capture {path} is missing (it is committed test data)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _frames(row: dict) -> list[bytes]:
    return [bytes.fromhex(x) for x in row["frames"]]


def test_golden_pub_frames_decode_and_reencode_byte_exact():
    rows = _rows("pub.jsonl")
    kinds: set[str] = set()
    big = False
    for expect_seq, row in enumerate(rows):
        topic, seq, payload = _frames(row)
        assert topic == b"kv" and len(seq) == 8 and parse_seq(seq) == expect_seq
        b = decode_batch(payload)
        assert b.batch_form == "array" and b.event_form == "map" and b.data_parallel_rank == 0
        for e in b.events:
            kinds.add(type(e).__name__)
            if isinstance(e, (BlockStored, BlockRemoved)):
                big |= any(isinstance(h, int) and h >= 2**63 for h in e.block_hashes)
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
        assert encode_batch(b.ts, b.events, b.data_parallel_rank, "array", "map") == payload
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert big  # uint64 hashes above 2^63 are in the capture and survive the round trip


def test_golden_salt_shows_on_first_block_only():
    rows = _rows("pub.jsonl")
    salted = [e for r in rows if "salt" in r["step"] for e in decode_batch(_frames(r)[2]).events]
    assert salted and isinstance(salted[0], BlockStored)
    assert salted[0].extra_keys[0] == ("tenant-a",) and all(k is None for k in salted[0].extra_keys[1:])


def test_golden_replay_frames():
    for name in ("replay_from_0.jsonl", "replay_from_mid.jsonl"):
        rows = _rows(name)
        *body, end = [_frames(r) for r in rows]
        assert end == [b"", b"", END_SEQ, b""] and parse_seq(END_SEQ) == -1
        seqs = [parse_seq(f[2]) for f in body]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        for f in body:
            assert f[0] == b"" and f[1] == b"kv"
            decode_batch(f[3])


def test_decoder_reads_older_array_form_events():
    ev = [BlockStored([2**64 - 1], None, [1, 2], 2, None, "GPU", None), BlockRemoved([5], "GPU"),
          AllBlocksCleared()]
    for bf, ef in (("array", "array"), ("map", "map"), ("array", "map")):
        b = decode_batch(encode_batch(1.0, ev, 0, bf, ef))
        assert b.events == ev and b.batch_form == bf and b.event_form == ef
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\xc1garbage")


async def test_sim_frames_have_vllms_shape_and_replay_layout():
    eng = SimEngine(get_profile("tiny"), name="w0")
    await eng.start()
    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(eng.publisher.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(eng.publisher.replay_endpoint)
    try:
        await asyncio.sleep(0.2)  # let SUB join before anything is published
        r = eng.submit(list(range(100, 140)), 2, cache_salt="s1")
        await asyncio.wait_for(r.listener.done, 5)
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert topic == b"" and parse_seq(seq) == 0  # vLLM's default topic (KVEventsConfig.topic = "")
        assert payload[0] == 0x93  # fixarray(3): [ts, events, data_parallel_rank] as vLLM 0.32 sends
        raw = msgspec.msgpack.decode(payload)
        ev = raw[1][0]
        golden_keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
        assert list(ev) == golden_keys and raw[2] == 0
        assert ev["extra_keys"][0] == ["s1"]
        rows = [r for r in (GOLDEN / "pub.jsonl").read_text().splitlines()] if (GOLDEN / "pub.jsonl").exists() else []
        if rows:
            g = msgspec.msgpack.decode(bytes.fromhex(json.loads(rows[0])["frames"][2]))
            assert list(g[1][0]) == list(ev)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert got == [b"", b"", seq, payload]  # the (empty, default) topic frame, then seq and payload
        end = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert end == [b"", b"", END_SEQ, b""]
    finally:
        sub.close(0)
        dealer.close(0)
        await eng.stop()


async def test_sim_removed_and_cleared_events_have_vllms_shape():
    """BlockRemoved (evictions) and AllBlocksCleared (reset_prefix_cache) as the sim publishes them carry the
    same fields in the same order as the golden capture from a real vLLM 0.32 engine."""
    golden: dict[str, list[str]] = {}
    for row in (GOLDEN / "pub.jsonl").read_text().splitlines():
        for e in msgspec.msgpack.decode(bytes.fromhex(json.loads(row)["frames"][-1]))[1]:
            golden.setdefault(e["type"], list(e))
    assert {"BlockRemoved", "AllBlocksCleared"} <= set(golden)
    eng = SimEngine(get_profile("tiny").with_overrides(num_gpu_blocks=8), name="w1")  # 8 blocks: evictions
    await eng.start()
    try:
        for i in range(4):  # 4 x 3 distinct blocks through an 8-block cache
            r = eng.submit([1000 * (i + 1) + t for t in range(48)], 1)
            await asyncio.wait_for(r.listener.done, 5)
        assert eng.reset_prefix_cache()
        r = eng.submit(list(range(7, 23)), 1)  # the clear goes out with the next step's batch
        await asyncio.wait_for(r.listener.done, 5)
        seen: dict[str, list[str]] = {}
        for _, payload in eng.publisher._buffer:
            for e in msgspec.msgpack.decode(payload)[1]:
                seen.setdefault(e["type"], list(e))
        for kind in ("BlockRemoved", "AllBlocksCleared"):
            assert seen.get(kind) == golden[kind], (kind, seen.get(kind), golden[kind])
    finally:
        await eng.stop()
