"""Decode the golden KV-event bytes captured from a real vLLM 0.32 engine (tests/data/vllm_kv_events).

The structs below mirror vllm/distributed/kv_events.py (EventBatch, BlockStored, BlockRemoved,
AllBlocksCleared) field for field; re-encoding them must reproduce vLLM's bytes exactly, which pins the
field order, the omit_defaults behaviour and the map-with-"type"-tag layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

DATA = Path(__file__).resolve().parents[2] / "data"
KV = DATA / "vllm_kv_events"
END_SEQ = b"\xff" * 8
BLOCK_SIZE = 32

BlockHash = int | bytes  # vLLM's ExternalBlockHash: uint64 by default, 32 bytes with int hashes off


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def frames(name: str) -> list[list[bytes]]:
    return [[bytes.fromhex(f) for f in json.loads(line)["frames"]] for line in (KV / name).read_text().splitlines()]


def pub() -> list[tuple[bytes, int, bytes, KVEventBatch]]:
    out = []
    for fr in frames("pub.jsonl"):
        assert len(fr) == 3, "PUB messages are (topic, seq, payload)"
        topic, seq, payload = fr
        assert len(seq) == 8
        out.append((topic, int.from_bytes(seq, "big"), payload, DECODER.decode(payload)))
    return out


def test_pub_messages_are_kv_topic_with_contiguous_seq_from_zero() -> None:
    msgs = pub()
    assert len(msgs) >= 10
    assert all(topic == b"kv" for topic, *_ in msgs)
    assert [seq for _, seq, *_ in msgs] == list(range(len(msgs)))
    ts = [b.ts for *_, b in msgs]
    assert ts == sorted(ts) and all(isinstance(t, float) for t in ts)
    assert all(b.data_parallel_rank == 0 for *_, b in msgs)


def test_reencoding_reproduces_vllms_bytes_exactly() -> None:
    for _, _, payload, batch in pub():
        assert ENCODER.encode(batch) == payload


def test_payload_is_an_array_of_events_tagged_maps() -> None:
    _, _, payload, _ = pub()[0]
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3
    assert isinstance(raw[1][0], dict) and raw[1][0]["type"] == "BlockStored"


def test_all_three_event_types_occur_in_the_expected_order() -> None:
    kinds = [type(e).__name__ for *_, b in pub() for e in b.events]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    assert kinds.count("AllBlocksCleared") == 1
    first_removed = kinds.index("BlockRemoved")
    assert first_removed > 0 and set(kinds[:first_removed]) == {"BlockStored"}  # evictions only once full


def test_block_hashes_are_uint64_and_stores_are_consistent() -> None:
    stored: dict[int, list[int]] = {}
    big = False
    salted = 0
    for *_, batch in pub():
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                stored.clear()
                continue
            for h in e.block_hashes:
                assert type(h) is int and 0 <= h < 2**64
                big |= h >= 2**63
            if isinstance(e, BlockStored):
                assert e.block_size == BLOCK_SIZE and e.medium == "GPU" and e.lora_name is None
                assert len(e.token_ids) == BLOCK_SIZE * len(e.block_hashes)
                assert e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes)
                if e.parent_block_hash is not None:
                    assert e.parent_block_hash in stored, "a continuation chains onto a stored block"
                if e.extra_keys[0] is not None:
                    assert list(e.extra_keys[0]) == ["tenant-a"]  # cache_salt only on the first block
                    assert all(k is None for k in e.extra_keys[1:])
                    salted += 1
                for i, h in enumerate(e.block_hashes):
                    stored[h] = e.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            else:
                assert e.medium == "GPU" and len(e.block_hashes) == 1
                assert stored.pop(e.block_hashes[0], None) is not None, "only stored blocks are removed"
    assert salted == 1
    assert big, "sample holds hashes above 2**63: decoders must treat them as unsigned"


def test_salted_prompt_gets_different_hashes_for_the_same_tokens() -> None:
    firsts = [e for *_, b in pub() for e in b.events if isinstance(e, BlockStored) and e.parent_block_hash is None]
    plain, salted = firsts[0], firsts[1]
    assert salted.extra_keys is not None and salted.extra_keys[0] is not None
    assert plain.token_ids == salted.token_ids
    assert not set(plain.block_hashes) & set(salted.block_hashes)


def test_replay_returns_buffered_batches_then_the_terminator() -> None:
    live = {seq: payload for _, seq, payload, _ in pub()}
    for name in ("replay_from_0.jsonl", "replay_from_mid.jsonl"):
        msgs = frames(name)
        assert msgs[-1] == [b"", b"", END_SEQ, b""]
        body = msgs[:-1]
        seqs = []
        for fr in body:
            assert len(fr) == 4 and fr[0] == b"" and fr[1] == b"kv"
            seq = int.from_bytes(fr[2], "big")
            assert fr[3] == live[seq], "replay sends the very bytes that were published"
            DECODER.decode(fr[3])
            seqs.append(seq)
        assert seqs == list(range(seqs[0], max(live) + 1))
    assert int.from_bytes(frames("replay_from_0.jsonl")[0][2], "big") == 0
    assert int.from_bytes(frames("replay_from_mid.jsonl")[0][2], "big") > 0


def test_recorded_responses_carry_cached_tokens() -> None:
    resp = DATA / "vllm_responses"
    cold = json.loads((resp / "chat_cold.json").read_text())
    cached = json.loads((resp / "chat_cached.json").read_text())
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = cached["usage"]["prompt_tokens"]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == (n // BLOCK_SIZE) * BLOCK_SIZE
    sse = (resp / "chat_stream_usage.sse").read_text()
    events = [line[6:] for line in sse.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    tok = json.loads((resp / "tokenize_messages.json").read_text())
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048


def test_metrics_text_has_the_series_the_gateway_scrapes() -> None:
    text = (DATA / "vllm_metrics.txt").read_text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:cache_config_info"):
        assert f"\n{name}{{" in text, name
    assert 'num_gpu_blocks="80"' in text and 'block_size="32"' in text
