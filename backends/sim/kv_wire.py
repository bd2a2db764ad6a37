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
"""
from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

# ExternalBlockHash in vLLM: int (uint64, the default) or bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
BlockHash = Union[int, bytes]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"

WireForm = Literal["map", "array"]


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
                 batch_form: WireForm = "map", event_form: WireForm = "map") -> bytes:
    """Encode a batch in the chosen form (vLLM's current source: map batch with map events)."""
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
