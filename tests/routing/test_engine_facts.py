"""Engine facts the router models are learned, not assumed (issue 17a): the chunked-prefill budget per step
from the engine's own KV events (real sim scheduler -> vLLM wire bytes -> KVIndex), per engine."""
from __future__ import annotations

import random

from backends.sim.kv_wire import encode_batch
from backends.sim.profiles import PROFILES
from backends.sim.scheduler import Scheduler, SimRequest
from gateway.telemetry.chunk_budget import ChunkBudgetLearner
from gateway.telemetry.index import KVIndex
from gateway.telemetry.kv_events import decode_batch


def _drive(index: KVIndex, name: str, budget: int, prompts: list[int], concurrent: bool = False) -> None:
    prof = PROFILES["h200-8b"].with_overrides(max_num_batched_tokens=budget)
    sch = Scheduler(prof, lambda r: 7)
    rng = random.Random(budget)
    now = 0.0
    for i, n in enumerate(prompts):
        toks = [rng.randrange(1, 30000) for _ in range(n)]
        sch.add(SimRequest(f"{name}-{i}", n, toks, 2, arrival=now))
        if concurrent and i % 3 != 2:
            continue
        while sch.has_work():
            plan = sch.schedule(now)
            if plan is None:
                break
            now += plan.duration
            out = sch.commit(plan, now)
            if out.events:
                index.apply(name, decode_batch(encode_batch(now, out.events, 0)))


def test_each_engine_gets_its_own_budget_from_its_events():
    idx = KVIndex()
    _drive(idx, "small", 2048, [300, 5000, 700, 9000])
    _drive(idx, "big", 8192, [300, 5000, 700, 20000])
    assert idx.chunk_budget("small") == 2048
    assert idx.chunk_budget("big") == 8192
    assert idx.stats()["engines"]["small"]["chunk_budget"] == 2048


def test_no_estimate_before_a_prompt_needed_two_chunks_and_decodes_never_count():
    idx = KVIndex()
    _drive(idx, "e", 2048, [300, 1500, 2000, 900])  # every prompt fits one chunk: the budget is not observable
    assert idx.chunk_budget("e") is None
    _drive(idx, "e", 2048, [6000])
    assert idx.chunk_budget("e") == 2048


def test_concurrent_prompts_sharing_steps_still_give_the_budget_as_a_lower_bound():
    idx = KVIndex()
    _drive(idx, "e", 4096, [3000, 2500, 7000, 1200, 5100, 9000], concurrent=True)
    b = idx.chunk_budget("e")
    assert b is not None and 4096 - 3 * 16 <= b <= 4096


def test_learner_unit_cut_chunk_then_continuation():
    lr = ChunkBudgetLearner()
    lr.observe([(None, 11, 128, 16)])  # 2048 tokens stored in one step
    assert lr.budget is None
    lr.observe([(11, 12, 40, 16)])  # the next step continues that chain: the previous step was cut
    assert lr.budget == 2048 and lr.limited_steps == 1
    lr.observe([(99, 13, 1, 16)])  # a decode block
    lr.observe([(13, 14, 1, 16)])
    assert lr.budget == 2048 and lr.limited_steps == 1
