"""The simulator starts with vLLM 0.32's defaults (issue 17): KV events on the empty topic
(vllm/config/kv_events.py KVEventsConfig.topic = "") and a 2048-token chunked-prefill budget
(vllm/engine/arg_utils.py EngineArgs.get_batch_defaults: OpenAI server on a GPU under 70 GiB, or CPU)."""
from __future__ import annotations

import argparse

from backends.sim.cli import add_arguments
from backends.sim.engine import SimEngine
from backends.sim.profiles import get_profile
from backends.sim.publisher import KVEventPublisher
from backends.sim.scheduler import Scheduler, SimRequest


def _defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([])


def test_cli_defaults_are_vllms():
    a = _defaults()
    assert a.topic == "" and a.profile == "vllm-default"
    prof = get_profile(a.profile)
    assert (prof.max_num_batched_tokens, prof.max_num_seqs) == (2048, 256)
    assert KVEventPublisher().topic == "" and SimEngine(prof).topic == ""


def test_default_profile_chunks_a_long_prefill_at_2048_tokens_per_step():
    prof = get_profile("vllm-default")
    s = Scheduler(prof, lambda r: 7)
    s.add(SimRequest(rid="r", prompt_len=5000, tokens=list(range(5000)), max_tokens=1, cache_salt=None,
                     lora_name=None, lora_id=None, arrival=0.0, priority=0))
    t, chunks = 0.0, []
    while s.has_work():
        plan = s.schedule(t)
        t += plan.duration
        s.commit(plan, t)
        chunks.append(plan.prefill_tokens)
    assert chunks == [2048, 2048, 904]
