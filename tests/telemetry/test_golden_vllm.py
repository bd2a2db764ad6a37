"""Decode and index KV-event bytes captured from a real vLLM 0.32 engine (tests/data/vllm_kv_events)."""
import json
from pathlib import Path

from gateway.telemetry.index import KVIndex
from gateway.telemetry.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

D = Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events"


def frames(name):
    return [[bytes.fromhex(f) for f in json.loads(line)["frames"]] for line in (D / name).read_text().splitlines()
            if line.strip()]


def test_golden_pub_stream_indexes_like_the_engine_reused():
    msgs = frames("pub.jsonl")
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(len(seqs))) and all(m[0] == b"kv" for m in msgs)
    batches = [decode_batch(m[2]) for m in msgs]
    idx = KVIndex()
    first = batches[0].events[0]
    assert isinstance(first, BlockStored) and first.block_size == 32 and first.parent_block_hash is None
    prompt_a = first.token_ids + [7] * 6  # 198-token prompt A: 6 full blocks + 6 tail tokens
    idx.apply("vllm", batches[0])
    # step 2 of the capture: the engine reported cached_tokens 192 for prompt A
    assert idx.lookup(["vllm"], prompt_a)["vllm"].tokens == 192
    salted = batches[1].events[0]
    assert salted.extra_keys[0] == ["tenant-a"] and salted.token_ids == first.token_ids
    idx.apply("vllm", batches[1])
    assert idx.lookup(["vllm"], prompt_a, salt="tenant-a")["vllm"].tokens == 192
    assert idx.lookup(["vllm"], prompt_a, salt="tenant-b")["vllm"].tokens == 0
    removed = 0
    for b in batches[2:]:
        removed += sum(len(e.block_hashes) for e in b.events if isinstance(e, BlockRemoved))
        if any(isinstance(e, AllBlocksCleared) for e in b.events):
            assert isinstance(b.events[0], AllBlocksCleared)
        idx.apply("vllm", b)
    assert removed > 0
    # after the cache reset only the last rounds' blocks remain; they fit in 80 blocks
    assert 0 < idx.stats()["engines"]["vllm"]["entries"] <= 80
    assert idx.lookup(["vllm"], prompt_a)["vllm"].tokens == 0


def test_golden_replay_frames():
    pub = {int.from_bytes(m[1], "big"): m[2] for m in frames("pub.jsonl")}
    rep = frames("replay_from_0.jsonl")
    assert rep[-1] == [b"", b"", END_SEQ, b""]
    got = {int.from_bytes(f[2], "big"): f[3] for f in rep[:-1]}
    assert got == pub
    mid = frames("replay_from_mid.jsonl")
    assert min(int.from_bytes(f[2], "big") for f in mid[:-1]) == 7
