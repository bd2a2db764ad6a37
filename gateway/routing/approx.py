"""The gateway's own approximate prefix tree (SGLang router style): what it sent where, by chained text-block
hashes. Read by the prefix_hash scorer (via EngineView.approx_match) and by the stage's cached-token estimate
when there is no KV-event telemetry."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import xxhash


def text_blocks(text: str, block_chars: int = 256) -> list[int]:
    """Chained hashes of fixed-size text chunks: requests sharing a text prefix share leading hashes."""
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = xxhash.xxh3_64_intdigest(text[i:i + block_chars].encode("utf-8", "surrogatepass"), seed=h)
        out.append(h)
    return out


class ApproxPrefixIndex:
    """What the gateway itself sent where (SGLang's approximate tree): per engine, an LRU of chained block
    hashes. Used by prefix_hash, and by predicted_ttft when there is no KV-event telemetry."""

    def __init__(self, capacity_blocks: int = 50_000) -> None:
        self.capacity = capacity_blocks
        self._by_engine: dict[str, OrderedDict[int, None]] = {}

    def match(self, engine: str, blocks: Sequence[int]) -> int:
        lru = self._by_engine.get(engine)
        if not lru:
            return 0
        n = 0
        for b in blocks:
            if b not in lru:
                break
            n += 1
        return n

    def insert(self, engine: str, blocks: Sequence[int]) -> None:
        lru = self._by_engine.get(engine)
        if lru is None:  # (not setdefault: that built an OrderedDict on every insert)
            lru = self._by_engine[engine] = OrderedDict()
        for b in blocks:
            lru[b] = None
            lru.move_to_end(b)
        while len(lru) > self.capacity:
            lru.popitem(last=False)
