"""Pending cache: prompt blocks this gateway dispatched to an engine that the KV index does not hold yet.

An engine caches a prompt's blocks chunk by chunk while it prefills, and a request that arrives meanwhile with
the same prefix reuses them, but their BlockStored events arrive only step by step (after the step that computed
them). Counting only the index then under-predicts the cached tokens of exactly those requests (the slowest
engine of a mixed fleet, with the longest prefills, agreed on 96%). So the route stage records, per engine, the
own keys of each dispatched request's blocks beyond what the index held at dispatch, and a later lookup extends
the index's cached prefix through them. Entries expire when their request finishes (`remove`) or when the index
holds the block (`extend` drops the pending entries the index has caught up with). Pure; O(blocks) per call.

The tail: a prompt that needs several chunks stores them step by step, and the engine schedules a waiting request
in the first step with budget left after the running prefills, i.e. alongside the earlier request's last (partial)
chunk. A request arriving before that last step started finds only the full chunks cached, one arriving after it
finds everything. The gateway sees which: the last step has started once at most one chunk of the prompt is
left uncomputed, i.e. once the index holds its first (prompt - budget) tokens (the previous step's BlockStored
arrived; this holds also when the earlier request's chunks were shifted by sharing steps with others), or, when
events lag (a busy gateway or engine), once the time the prediction gives for it has passed. So `add` marks the
last chunk's blocks as the tail with that block count (`tail_trigger`) and time, and `extend` walks into a tail
only when the index holds that many blocks or that time has come.
"""
from __future__ import annotations

from typing import Sequence


class PendingCache:
    def __init__(self) -> None:
        self._by_engine: dict[str, dict[int, int]] = {}  # engine -> own key -> requests that will store it
        # engine -> own key in a multi-chunk prompt's last chunk -> [requests, earliest time that step starts,
        # fewest index-held blocks that show it started]
        self._tail: dict[str, dict[int, list[float]]] = {}
        self._by_rid: dict[str, tuple[str, list[int], list[int]]] = {}

    def add(self, rid: str, engine: str, keys: Sequence[int], tail_from: int | None = None,
            tail_at: float = float("inf"), tail_trigger: int = 0) -> None:
        """Request `rid` was dispatched to `engine` with these own keys not yet in the index; keys[tail_from:]
        are computed in its last prefill step (None: no earlier step, see the module docstring), which has
        started once the index holds `tail_trigger` leading blocks of the prompt, or is predicted to start at
        `tail_at` (the caller's clock)."""
        if not keys:
            return
        self.remove(rid)
        pend = self._by_engine.setdefault(engine, {})
        for k in keys:
            pend[k] = pend.get(k, 0) + 1
        tail = list(keys[tail_from:]) if tail_from is not None and tail_from > 0 else []
        if tail:
            tl = self._tail.setdefault(engine, {})
            for k in tail:
                e = tl.get(k)
                if e is None:
                    tl[k] = [1, tail_at, tail_trigger]
                else:
                    e[0] += 1
                    e[1] = min(e[1], tail_at)
                    e[2] = min(e[2], tail_trigger)
        self._by_rid[rid] = (engine, list(keys), tail)

    def remove(self, rid: str) -> None:
        """The request finished (or failed): its blocks are stored by now, or never will be."""
        ent = self._by_rid.pop(rid, None)
        if ent is None:
            return
        engine, keys, tail = ent
        pend = self._by_engine.get(engine)
        if pend is not None:
            for k in keys:
                c = pend.get(k)
                if c is not None:
                    if c <= 1:
                        del pend[k]
                    else:
                        pend[k] = c - 1
            if not pend:
                del self._by_engine[engine]
        tl = self._tail.get(engine)
        if tl is not None:
            for k in tail:
                e = tl.get(k)
                if e is not None:
                    if e[0] <= 1:
                        del tl[k]
                    else:
                        e[0] -= 1
            if not tl:
                del self._tail[engine]

    def extend(self, engine: str, keys: Sequence[int], held: int, limit: int, now: float = 0.0) -> int:
        """Blocks of the request cached on `engine` at its turn: the index holds the first `held` of `keys`;
        continue through the engine's pending keys, up to `limit` blocks (vLLM recomputes the last token).
        The index's blocks are no longer pending: their entries are dropped here."""
        pend = self._by_engine.get(engine)
        if not pend:
            return held
        tail = self._tail.get(engine) or {}
        for k in keys[:held]:
            pend.pop(k, None)  # BlockStored arrived: the index counts it now
            tail.pop(k, None)
        n = held
        while n < limit and keys[n] in pend:
            t = tail.get(keys[n])
            if t is not None and n > held and keys[n - 1] not in tail and now < t[1] and held < t[2]:
                break  # the earlier request's last chunk: not started yet, shares this request's step
            n += 1
        return n

    def blocks(self, engine: str) -> int:
        return len(self._by_engine.get(engine, ()))

    def __len__(self) -> int:
        return len(self._by_rid)


def last_chunk_from(n_tokens: int, cached: int, budget: int, block_size: int | None, held: int) -> int | None:
    """Where the last prefill chunk of a prompt starts, as an index into its blocks past the `held` ones the
    index holds (the pending cache's tail), or None when the prompt is computed in one step or in full chunks.
    The engine computes n_tokens - cached tokens in chunks of `budget` from `cached`; blocks that complete in the
    last (partial) chunk are the tail."""
    if not block_size or budget <= 0:
        return None
    work = n_tokens - cached
    if work <= budget or work % budget == 0:
        return None
    end = cached + (work // budget) * budget  # tokens computed before the last step
    return max(0, end // block_size - held)
