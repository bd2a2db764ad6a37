"""vLLM's KV-event wire format: the msgspec structs, frame layout and a tolerant decoder.

Written from vLLM's source (`vllm/distributed/kv_events.py`): `KVCacheEvent` is a tagged msgspec Struct
(`tag=True`: the tag key is "type", the value is the class name) with `omit_defaults=True`; newer vLLM
encodes events as maps, older ones (array_like=True) as arrays whose first element is the tag. The batch is
`EventBatch(ts, events, data_parallel_rank)`. Frames on the PUB socket are `(topic, seq 8-byte big-endian,
payload)`; vLLM 0.32's replay ROUTER answers `(identity, b"", topic, seq, payload)` per buffered batch and
ends with `(identity, b"", b"", END_SEQ, b"")` where END_SEQ is -1 as 8 signed big-endian bytes (a DEALER
sees the frames without the identity). Captured 0.32 traffic: batch = array, events = tagged maps.

The decoder accepts both the map and the array forms of events and of the batch, so it reads every vLLM
version we know of; the encoder writes the form selected by `WireForm`.

SGLang's wire (`Wire` "sglang"; written from reading sglang/srt/disaggregation/kv_events.py and
mem_cache/events.py of 0.5.23 and 0.5.10, no code taken): the same frames, replay and batch
(`EventBatch(ts, events, attn_dp_rank)`, always an array); 0.5.23's events are tagged maps with a BlockStored of
`block_hashes, parent_block_hash, token_ids, block_size, lora_id` (no default: always sent, nil),
`medium, cache_salt, session_id, lora_name` (omitted when nil) and no extra_keys or KV-cache group fields, a
BlockRemoved of `block_hashes, medium`; 0.5.10's are arrays `["BlockStored", hashes, parent, token_ids,
block_size, lora_id, medium]` / `["BlockRemoved", hashes, medium]`. Hashes are signed int64 (SHA-256 of the
page chain, first 8 bytes), the salt of a salted chain rides on every one of its BlockStored, and SGLang
coalesces consecutive removals of one medium into one BlockRemoved (one per radix node).
"""
from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

# ExternalBlockHash in vLLM: int (uint64, the default) or bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
BlockHash = Union[int, bytes]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"

WireForm = Literal["map", "array"]
Wire = Literal["vllm", "sglang"]


# ------------------------------------------------------------------------------------------ map form
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-form events (vLLM >= the version that dropped array_like)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, kept for compatibility
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # one entry per block (LoRA name, cache_salt, ...)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The batch as a map: {"ts", "events", "data_parallel_rank"}."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventBatchArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The batch as an array: [ts, events, data_parallel_rank]."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------------------------- array form
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-form events (older vLLM: ["BlockStored", hashes, parent, ...])."""


class BlockStoredArray(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None


class BlockRemovedArray(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksClearedArray(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatchOfArrays(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStoredArray | BlockRemovedArray | AllBlocksClearedArray]
    data_parallel_rank: int | None = None


# ------------------------------------------------------------------------------------- SGLang's wire
class _SGLEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """SGLang 0.5.23's KVCacheEvent: tagged maps, omit_defaults."""


class SGLBlockStored(_SGLEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SGLBlockRemoved(_SGLEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SGLAllBlocksCleared(_SGLEvent, tag="AllBlocksCleared"):
    pass


class _SGLArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """SGLang 0.5.10's KVCacheEvent: tagged arrays."""


class SGLBlockStoredArray(_SGLArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SGLBlockRemovedArray(_SGLArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SGLAllBlocksClearedArray(_SGLArrayEvent, tag="AllBlocksCleared"):
    pass


class SGLEventBatch(msgspec.Struct, array_like=True, gc=False):
    """[ts, events, attn_dp_rank] (0.5.23: no omit_defaults on the batch, the rank is always sent)."""

    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


def int64(h: int) -> int:
    """A uint64 hash as SGLang's signed int64 (its `hash_str_to_int64`, `namespaced_block_hash`)."""
    return h - (1 << 64) if h >= (1 << 63) else h


def _first_salt(e: BlockStored) -> str | None:
    """The cache_salt in a chain's first block's extra keys (vLLM's order: LoRA name, then the salt)."""
    x = e.extra_keys[0] if e.extra_keys else None
    rest = list(x or ())
    if rest and e.lora_name and rest[0] == e.lora_name:
        rest = rest[1:]
    return rest[0] if len(rest) == 1 and isinstance(rest[0], str) else None


def sglang_events(events: list[Any], event_form: WireForm = "map", salts: dict[int, str] | None = None) -> list[Any]:
    """The sim's events in SGLang's classes: signed hashes, the chain's salt on every stored event, consecutive
    removals of one medium coalesced (SGLang's `KVCacheEventRecorder.enqueue`). `salts` (a publisher's, kept
    across batches): block hash -> the salt of its chain, since the sim's events, vLLM's, carry the salt only in a
    chain's first block."""
    out: list[Any] = []
    arr = event_form == "array"
    salts = {} if salts is None else salts
    for e in events:
        if isinstance(e, BlockStored):
            salt = _first_salt(e) if e.parent_block_hash is None else salts.get(int(e.parent_block_hash))
            if salt is not None:
                for h in e.block_hashes:
                    salts[int(h)] = salt
            hs = [int64(int(h)) for h in e.block_hashes]
            p = None if e.parent_block_hash is None else int64(int(e.parent_block_hash))
            if arr:
                out.append(SGLBlockStoredArray(hs, p, list(e.token_ids), e.block_size, None, e.medium))
            else:
                out.append(SGLBlockStored(hs, p, list(e.token_ids), e.block_size, None, e.medium, salt,
                                          None, e.lora_name))
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                salts.pop(int(h), None)
            hs = [int64(int(h)) for h in e.block_hashes]
            tail = out[-1] if out else None
            if isinstance(tail, (SGLBlockRemoved, SGLBlockRemovedArray)) and tail.medium == e.medium:
                tail.block_hashes.extend(hs)
            else:
                out.append(SGLBlockRemovedArray(hs, e.medium) if arr else SGLBlockRemoved(hs, e.medium))
        else:
            salts.clear()
            out.append(SGLAllBlocksClearedArray() if arr else SGLAllBlocksCleared())
    return out


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]

_ENC = msgspec.msgpack.Encoder()
_RAW_BATCH_ARRAY = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw], int | None])
_RAW_BATCH_ARRAY2 = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw]])
_MAP_EVENT = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
_ARRAY_EVENT = msgspec.msgpack.Decoder(BlockStoredArray | BlockRemovedArray | AllBlocksClearedArray)


class _RawBatchMap(msgspec.Struct):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_RAW_BATCH_MAP = msgspec.msgpack.Decoder(_RawBatchMap)


class DecodedBatch(msgspec.Struct, frozen=True):
    """A decoded batch, normalised to the map-form event classes whatever the wire form was."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    batch_form: str  # "array" | "map"
    event_form: str  # "map" | "array" | "mixed" | "none"


def _is_array(b: bytes | msgspec.Raw) -> bool:
    first = bytes(b[:1]) if not isinstance(b, msgspec.Raw) else bytes(memoryview(b)[:1])
    return bool(first) and (0x90 <= first[0] <= 0x9F or first[0] in (0xDC, 0xDD))


def _to_map(e: Any) -> Event:
    if isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)):
        return e
    if isinstance(e, BlockStoredArray):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                           e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                           e.kv_cache_spec_sliding_window, e.locality, e.ownership, e.session_id)
    if isinstance(e, BlockRemovedArray):
        return BlockRemoved(e.block_hashes, e.medium, e.group_idx, e.locality, e.ownership)
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode a KVEventBatch payload in any form vLLM has used; raises msgspec.DecodeError on garbage."""
    if _is_array(payload):
        try:
            ts, raws, dp = _RAW_BATCH_ARRAY.decode(payload)
        except msgspec.ValidationError:
            ts, raws = _RAW_BATCH_ARRAY2.decode(payload)
            dp = None
        batch_form = "array"
    else:
        rb = _RAW_BATCH_MAP.decode(payload)
        ts, raws, dp = rb.ts, rb.events, rb.data_parallel_rank
        batch_form = "map"
    events: list[Event] = []
    forms: set[str] = set()
    for raw in raws:
        if _is_array(raw):
            forms.add("array")
            events.append(_to_map(_ARRAY_EVENT.decode(raw)))
        else:
            forms.add("map")
            events.append(_MAP_EVENT.decode(raw))
    event_form = "none" if not forms else (forms.pop() if len(forms) == 1 else "mixed")
    return DecodedBatch(ts, events, dp, batch_form, event_form)


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int | None = 0,
                 batch_form: WireForm = "map", event_form: WireForm = "map", wire: Wire = "vllm",
                 salts: dict[int, str] | None = None) -> bytes:
    """Encode a batch in the chosen form (vLLM's current source: map batch with map events; SGLang's: an array
    batch, `event_form` map for 0.5.23, array for 0.5.10; `salts`: see `sglang_events`)."""
    if wire == "sglang":
        return _ENC.encode(SGLEventBatch(ts, sglang_events(events, event_form, salts), data_parallel_rank))
    if event_form == "array":
        arr: list[Any] = []
        for e in events:
            if isinstance(e, BlockStored):
                arr.append(BlockStoredArray(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size,
                                            e.lora_id, e.medium, e.lora_name, e.extra_keys, e.group_idx,
                                            e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window))
            elif isinstance(e, BlockRemoved):
                arr.append(BlockRemovedArray(e.block_hashes, e.medium, e.group_idx))
            else:
                arr.append(AllBlocksClearedArray())
        return _ENC.encode(KVEventBatchOfArrays(ts, arr, data_parallel_rank))
    if batch_form == "array":
        return _ENC.encode(KVEventBatchArray(ts, list(events), data_parallel_rank))
    return _ENC.encode(KVEventBatch(ts, list(events), data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    """vLLM: `seq.to_bytes(8, "big")` (unsigned, from 0 per publisher)."""
    return seq.to_bytes(8, "big")


def parse_seq(b: bytes) -> int:
    """Inverse of `seq_bytes`; the replay end marker decodes to -1."""
    return int.from_bytes(b, "big", signed=True)


def pub_frames(topic: str, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """The three frames vLLM's ZmqEventPublisher sends per batch."""
    return topic.encode("utf-8"), seq_bytes(seq), payload
