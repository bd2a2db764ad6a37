"""An engine's chunked-prefill token budget per step (vLLM `--max-num-batched-tokens`), learned from its KV events.

vLLM does not publish the budget, and engines of one fleet differ (2048 on one, 8192 on another). Its KV events
show it: the engine publishes one KVEventBatch per step, with one BlockStored per request that filled blocks in
that step. A prefill chunk that was cut by the budget continues in the next step, so the next batch holds a
multi-block BlockStored whose parent is the last block of the cut chunk. The tokens stored by multi-block
events of a step that such a continuation follows are (up to a partial block per request) that step's whole
prefill, i.e. the budget; the learned value is the largest of them. It is a lower bound that reaches the budget
after the first long prompt that needed more than one chunk; until then there is no estimate (None).
Decode steps store at most one block per request, so they never count. Pure: fed by `KVIndex.apply`.
"""
from __future__ import annotations

from typing import Iterable


class ChunkBudgetLearner:
    """Per engine. `observe(batch)` with the batch's BlockStored as (parent hash, last hash, blocks, block size)."""

    __slots__ = ("budget", "limited_steps", "_tails", "_prev_tokens")

    def __init__(self) -> None:
        self.budget: int | None = None  # the learned budget (tokens per step), None until a cut chunk was seen
        self.limited_steps = 0  # steps seen to be cut by the budget
        self._tails: set[int] = set()  # last block of each multi-block event of the previous batch
        self._prev_tokens = 0  # tokens those events stored

    def observe(self, stored: Iterable[tuple[int | None, int, int, int]]) -> None:
        tails: set[int] = set()
        tokens = 0
        cut = False
        for parent, last, blocks, block_size in stored:
            if blocks < 2:  # a decode (or a one-block tail): says nothing about the budget
                continue
            if parent is not None and parent in self._tails:
                cut = True  # continues a chunk of the previous step: that step was cut by the budget
            tails.add(last)
            tokens += blocks * block_size
        if cut:
            self.limited_steps += 1
            if self._prev_tokens > (self.budget or 0):
                self.budget = self._prev_tokens
        self._tails = tails
        self._prev_tokens = tokens
