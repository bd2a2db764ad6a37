"""Block hashing the way vLLM's prefix cache does it, with a cheap deterministic 64-bit hash.

vLLM (`vllm/v1/core/kv_cache_utils.py`): hash = hash_fn((parent_hash or NONE_HASH, tuple(block_tokens),
extra_keys)), only for full blocks; extra keys carry the LoRA name on every block and cache_salt on the
first block only. We use xxhash64 over the same inputs, so values are uint64 (some above 2^63) like vLLM's
int block hashes, but the sim needs no pickle/sha256.
"""
from __future__ import annotations

from array import array

import xxhash

# The parent of a first block: vLLM seeds NONE_HASH from PYTHONHASHSEED or a fixed string; ours is fixed.
NONE_HASH = xxhash.xxh64_intdigest(b"vllm-sim-none-hash")


def block_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    """Extra keys of one block, in vLLM's order (LoRA keys, then the salt on block 0 only), or None."""
    keys: list[str] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def hash_block(parent: int | None, tokens: list[int] | tuple[int, ...], extra: tuple[str, ...] | None) -> int:
    """One chained block hash: uint64 of (parent, token ids, extra keys)."""
    h = xxhash.xxh64(seed=0)
    h.update((parent if parent is not None else NONE_HASH).to_bytes(8, "little"))
    h.update(array("I", tokens).tobytes())
    if extra:
        h.update(b"\x00".join(k.encode("utf-8") for k in extra))
    return h.intdigest()


def hash_blocks(tokens: list[int], block_size: int, lora_name: str | None = None,
                cache_salt: str | None = None, parent: int | None = None, start_block: int = 0) -> list[int]:
    """Hashes of all full blocks of `tokens` (continuing a chain from `parent` at block `start_block`)."""
    out: list[int] = []
    n_full = len(tokens) // block_size
    for i in range(n_full):
        blk = start_block + i
        parent = hash_block(parent, tokens[i * block_size:(i + 1) * block_size],
                            block_extra_keys(blk, lora_name, cache_salt))
        out.append(parent)
    return out
