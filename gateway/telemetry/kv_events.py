"""The KV-cache event wire format of vLLM and SGLang, decoded with msgspec.

Field order follows vLLM's `vllm/distributed/kv_events.py` (0.32): events are tagged structs (tag key "type",
value = class name) sent as msgpack maps by current vLLM and as arrays `["BlockStored", ...]` by older
versions; the batch is `EventBatch(ts, events, data_parallel_rank)`, as an array or a map. One decoder
accepts every combination, and normalises array-form events to the map-form classes.

SGLang (read in sglang/srt/disaggregation/kv_events.py and mem_cache/events.py; no code taken) publishes the
same frames and batch (`[ts, events, attn_dp_rank]`, an array): 0.5.10 as array-form events in vLLM's older
positions (`block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium`), 0.5.23 as tagged maps
whose BlockStored carries `lora_id` (always, nil), `medium` ("GPU", "CPU_PINNED", "DISK", "EXTERNAL"), and
fields of its own: `cache_salt` (the salt of the request that stored the blocks, on every event of a salted
chain: vLLM puts it in the first block's extra_keys instead), `session_id`, `lora_name`. Its hashes are
signed int64; one BlockStored may carry several pages (coalesced), one BlockRemoved a whole radix node. With
EAGLE's bigram radix keys a page's `token_ids` are pairs `(t[j], t[j+1])`: read as t[j] (`_pairs`).
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]  # vLLM's ExternalBlockHash: uint64 by default, 32 bytes when int hashes are off
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # replay terminator (ZmqEventPublisher.END_SEQ)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-form events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # deprecated upstream
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block: tuple of keys or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None
    cache_salt: str | None = None  # SGLang's: the salt of the chain these blocks belong to


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the array-form events of older vLLM: ["BlockStored", block_hashes, parent, ...]."""


class _BlockStoredA(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block: tuple of keys or None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: Any = None


class _BlockRemovedA(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: Any = None
    ownership: Any = None


class _AllBlocksClearedA(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _BlockStoredPairs(KVCacheEvent, tag="BlockStored"):
    """SGLang's BlockStored of a bigram (EAGLE) radix key: token_ids are pairs."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[tuple[int, int]]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: Any = None
    lora_name: str | None = None


def _pairs(e: _BlockStoredPairs) -> BlockStored:
    """A bigram page as its tokens: position j holds (t[j], t[j+1]), so t[j] is the token there."""
    return BlockStored(e.block_hashes, e.parent_block_hash, [p[0] for p in e.token_ids], e.block_size, e.lora_id,
                       e.medium, e.lora_name, session_id=e.session_id, cache_salt=e.cache_salt)


_MapEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_ArrEvent = Union[_BlockStoredA, _BlockRemovedA, _AllBlocksClearedA]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """[ts, events, data_parallel_rank]: the form vLLM's publisher puts on the wire."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def _batch_types(ev: Any) -> tuple[type, type]:
    arr = msgspec.defstruct("BatchArray", [("ts", float), ("events", list[ev]), ("data_parallel_rank", int | None, None)],
                            array_like=True, gc=False)
    mp = msgspec.defstruct("BatchMap", [("ts", float), ("events", list[ev]), ("data_parallel_rank", int | None, None)],
                           gc=False)
    return arr, mp


_BatchArray, _BatchMap = _batch_types(_MapEvent)
_BatchArrayA, _BatchMapA = _batch_types(_ArrEvent)
_BatchArrayR, _BatchMapR = _batch_types(msgspec.Raw)
# (batch is array?, events are array?) -> decoder; tried in order, the current vLLM form first. The batch types are
# made at run time (defstruct), so what a decoder returns is typed Any.
_DECODERS: dict[tuple[bool, bool], msgspec.msgpack.Decoder[Any]] = {
    (True, False): msgspec.msgpack.Decoder(_BatchArray), (False, False): msgspec.msgpack.Decoder(_BatchMap),
    (True, True): msgspec.msgpack.Decoder(_BatchArrayA), (False, True): msgspec.msgpack.Decoder(_BatchMapA),
}
_RAW: dict[bool, msgspec.msgpack.Decoder[Any]] = {True: msgspec.msgpack.Decoder(_BatchArrayR), False: msgspec.msgpack.Decoder(_BatchMapR)}
_EV_MAP = msgspec.msgpack.Decoder(_MapEvent)
_EV_PAIRS = msgspec.msgpack.Decoder(_BlockStoredPairs)
_EV_ARR = msgspec.msgpack.Decoder(_ArrEvent)
_ENC = msgspec.msgpack.Encoder()


def _normalise(e: Any) -> Event:
    if isinstance(e, _BlockStoredA):
        return BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id, e.medium,
                           e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
                           e.kv_cache_spec_sliding_window, e.locality, e.ownership, e.session_id)
    if isinstance(e, _BlockRemovedA):
        return BlockRemoved(e.block_hashes, e.medium, e.group_idx, e.locality, e.ownership)
    if isinstance(e, _AllBlocksClearedA):
        return AllBlocksCleared()
    return e


def _is_array(b: bytes | memoryview) -> bool:
    first = b[0] if len(b) else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one KV-event payload (array or map batch, array or map events); raises msgspec.DecodeError."""
    batch_arr = _is_array(payload)
    try:
        raw = _DECODERS[(batch_arr, False)].decode(payload)
        return KVEventBatch(raw.ts, raw.events, raw.data_parallel_rank)
    except msgspec.ValidationError:
        pass
    try:
        raw = _DECODERS[(batch_arr, True)].decode(payload)
        return KVEventBatch(raw.ts, [_normalise(e) for e in raw.events], raw.data_parallel_rank)
    except msgspec.ValidationError:
        pass
    rawb = _RAW[batch_arr].decode(payload)  # mixed forms or bigram pages: decode event by event
    evs = [_normalise(_EV_ARR.decode(r)) if _is_array(memoryview(r)) else _map_event(r) for r in rawb.events]
    return KVEventBatch(rawb.ts, evs, rawb.data_parallel_rank)


def _map_event(r: msgspec.Raw) -> Event:
    try:
        return _EV_MAP.decode(r)
    except msgspec.ValidationError:
        return _pairs(_EV_PAIRS.decode(r))  # SGLang's bigram pages; anything else raises


def encode_batch(batch: KVEventBatch, array_events: bool = False) -> bytes:
    """Encode a batch the way vLLM does (array batch, map events; `array_events` for the older form)."""
    if not array_events:
        return _ENC.encode(batch)
    evs: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):  # the array form's fields are a prefix of the map form's (no cache_salt)
            evs.append(_BlockStoredA(*msgspec.structs.astuple(e)[:len(_BlockStoredA.__struct_fields__)]))
        elif isinstance(e, BlockRemoved):
            evs.append(_BlockRemovedA(*msgspec.structs.astuple(e)))
        else:
            evs.append(_AllBlocksClearedA())
    return _ENC.encode(_BatchArray(batch.ts, evs, batch.data_parallel_rank))
