"""Pending cache: prompt blocks this gateway dispatched to an engine that the KV index does not hold yet.

An engine caches a prompt's blocks chunk by chunk while it prefills, and a request that arrives meanwhile with
the same prefix reuses them, but their BlockStored events arrive only step by step (after the step that computed
them). Counting only the index then under-predicts the cached tokens of exactly those requests (the slowest
engine of a mixed fleet, with the longest prefills, agreed on 96%). So the route stage records, per engine, the
own keys of each dispatched request's blocks beyond what the index held at dispatch, and a later lookup extends
the index's cached prefix through them. Entries expire when their request finishes (`remove`) or when the index
holds the block (`extend` drops the pending entries the index has caught up with). Pure; O(blocks) per call.
"""
from __future__ import annotations

from typing import Sequence


class PendingCache:
    def __init__(self) -> None:
        self._by_engine: dict[str, dict[int, int]] = {}  # engine -> own key -> requests that will store it
        self._by_rid: dict[str, tuple[str, list[int]]] = {}

    def add(self, rid: str, engine: str, keys: Sequence[int]) -> None:
        """Request `rid` was dispatched to `engine` with these own keys not yet in the index."""
        if not keys:
            return
        self.remove(rid)
        pend = self._by_engine.setdefault(engine, {})
        for k in keys:
            pend[k] = pend.get(k, 0) + 1
        self._by_rid[rid] = (engine, list(keys))

    def remove(self, rid: str) -> None:
        """The request finished (or failed): its blocks are stored by now, or never will be."""
        ent = self._by_rid.pop(rid, None)
        if ent is None:
            return
        engine, keys = ent
        pend = self._by_engine.get(engine)
        if pend is None:
            return
        for k in keys:
            c = pend.get(k)
            if c is not None:
                if c <= 1:
                    del pend[k]
                else:
                    pend[k] = c - 1
        if not pend:
            del self._by_engine[engine]

    def extend(self, engine: str, keys: Sequence[int], held: int, limit: int) -> int:
        """Blocks of the request cached on `engine` at its turn: the index holds the first `held` of `keys`;
        continue through the engine's pending keys, up to `limit` blocks (vLLM recomputes the last token).
        The index's blocks are no longer pending: their entries are dropped here."""
        pend = self._by_engine.get(engine)
        if not pend:
            return held
        for k in keys[:held]:
            pend.pop(k, None)  # BlockStored arrived: the index counts it now
        n = held
        while n < limit and keys[n] in pend:
            n += 1
        return n

    def blocks(self, engine: str) -> int:
        return len(self._by_engine.get(engine, ()))

    def __len__(self) -> int:
        return len(self._by_rid)
