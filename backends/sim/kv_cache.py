"""The KV block pool with vLLM's prefix-cache semantics (cf. `vllm/v1/core/block_pool.py`).

Blocks are reference counted. Full blocks get a chained hash and stay findable after their requests end:
a freed block goes to the tail of an LRU free queue and keeps its hash until the block is reallocated,
which evicts it (BlockRemoved). Requests free their blocks tail-first so a prefix outlives its suffix.
Usage is `1 - free/total` where free includes evictable cached blocks, as vLLM reports it.
"""
from __future__ import annotations

from collections import OrderedDict

from backends.sim.kv_wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event

# vLLM 0.32 (captured bytes in tests/data/vllm_kv_events) always sends extra_keys as a per-block list,
# group_idx 0 and kv_cache_spec_kind "full_attention" on stores, and group_idx 0 on removals.
GROUP_IDX = 0
SPEC_KIND = "full_attention"


class BlockPool:
    """Reference-counted KV blocks, a hash -> block map for prefix hits, and the events they cause."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.events: list[Event] = []
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def lookup(self, hashes: list[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, at most `max_blocks` long."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        cached = self.cached
        for h in hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (touching them consumes free space)."""
        return sum(1 for b in block_ids if self.ref[b] == 0)

    def touch(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks from the LRU head, evicting cached ones (BlockRemoved); None if space is short."""
        if n > len(self.free):
            return None
        out: list[int] = []
        removed: list[int] = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash[b]
            if h is not None:
                self.hash[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                removed.append(h)
                self.evictions += 1
            self.ref[b] = 1
            out.append(b)
        if removed:
            # vLLM emits one BlockRemoved per evicted block.
            self.events.extend(BlockRemoved([h], MEDIUM_GPU, GROUP_IDX) for h in removed)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, tail first, so suffixes are evicted before prefixes."""
        for b in reversed(block_ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache_blocks(self, block_ids: list[int], hashes: list[int], parent: int | None, token_ids: list[int],
                     extra_keys: list[tuple[str, ...] | None], lora_id: int | None, lora_name: str | None) -> None:
        """Mark newly full blocks as cached and emit one BlockStored for them (vLLM: cache_full_blocks)."""
        if not self.enable_caching or not block_ids:
            return
        stored_hashes: list[int] = []
        for b, h in zip(block_ids, hashes):
            if h in self.cached:  # the same content is already cached in another block: keep that one
                continue
            self.hash[b] = h
            self.cached[h] = b
            stored_hashes.append(h)
        if len(stored_hashes) != len(hashes):
            if not stored_hashes:
                return
            # Rare (two requests computed the same block concurrently): report only the blocks we keep,
            # each as its own event so parent links stay right.
            bs = self.block_size
            prev = parent
            for i, h in enumerate(hashes):
                if h in stored_hashes and self.cached.get(h) == block_ids[i]:
                    self.events.append(BlockStored([h], prev, token_ids[i * bs:(i + 1) * bs], bs, lora_id,
                                                   MEDIUM_GPU, lora_name, [extra_keys[i]], GROUP_IDX, SPEC_KIND))
                prev = h
            return
        self.events.append(BlockStored(list(hashes), parent, list(token_ids), self.block_size, lora_id,
                                       MEDIUM_GPU, lora_name, list(extra_keys), GROUP_IDX, SPEC_KIND))

    def reset(self) -> bool:
        """Drop every cached hash (AllBlocksCleared); refused, like vLLM, while any block is in use."""
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.hash = [None] * self.num_blocks
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[Event]:
        ev, self.events = self.events, []
        return ev
