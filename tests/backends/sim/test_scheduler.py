"""Cache semantics and timing of the pure scheduler, driven by a virtual clock (no sleeping)."""
from __future__ import annotations

import itertools

import pytest

from backends.sim.hashing import NONE_HASH, block_extra_keys, hash_block, hash_blocks
from backends.sim.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored
from backends.sim.profiles import PROFILES, EngineProfile, get_profile
from backends.sim.scheduler import FINISHED, Scheduler, SimRequest

PROF = EngineProfile(name="t", step_overhead_s=0.01, prefill_s_per_token=0.001, decode_s_per_seq=0.002,
                     attn_s_per_ctx_token=0.0, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=16,
                     block_size=4, max_model_len=64)
_ids = itertools.count()


def req(tokens, max_tokens=1, salt=None, lora=None, at=0.0, priority=0):
    return SimRequest(rid=f"r{next(_ids)}", prompt_len=len(tokens), tokens=list(tokens), max_tokens=max_tokens,
                      cache_salt=salt, lora_name=lora, lora_id=1 if lora else None, arrival=at, priority=priority)


def new_sched(profile=PROF, **kw):
    return Scheduler(profile, lambda r: 7, **kw)


def run_until_idle(s, t=0.0, max_steps=10_000):
    """Step the scheduler with a virtual clock; returns (end time, all events, steps)."""
    events, steps = [], []
    while s.has_work():
        plan = s.schedule(t)
        assert plan is not None
        t += plan.duration
        out = s.commit(plan, t)
        events += out.events
        steps.append(plan)
        assert len(steps) < max_steps
    return t, events, steps


def stored(events):
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


# ------------------------------------------------------------------------------------------- hashing
def test_hashes_are_chained_uint64_with_salt_on_first_block_and_lora_on_all():
    toks = list(range(12))
    plain = hash_blocks(toks, 4)
    assert len(plain) == 3 and all(0 <= h < 2**64 for h in plain)
    assert plain[1] == hash_block(plain[0], toks[4:8], None)
    assert plain[0] == hash_block(None, toks[:4], None) == hash_block(NONE_HASH, toks[:4], None)
    salted = hash_blocks(toks, 4, cache_salt="a")
    assert all(a != b for a, b in zip(plain, salted))  # the salt changes the first hash, hence the chain
    assert block_extra_keys(0, None, "a") == ("a",) and block_extra_keys(1, None, "a") is None
    assert block_extra_keys(1, "lora1", "a") == ("lora1",) and block_extra_keys(0, "l", "s") == ("l", "s")
    many = [h for i in range(300) for h in hash_blocks([i] * 4, 4)]
    assert any(h >= 2**63 for h in many)  # values above 2^63 occur, like vLLM's uint64 hashes


# ------------------------------------------------------------------------------------------- cache semantics
def test_repeat_prompt_hits_full_blocks_but_recomputes_last_token():
    s = new_sched()
    a = req(range(10))
    s.add(a)
    _, ev, _ = run_until_idle(s)
    assert a.num_cached_tokens == 0 and a.status == FINISHED
    assert stored(ev) == hash_blocks(list(range(10)), 4)  # two full prompt blocks; the partial one is not cached
    b = req(range(10))
    s.add(b)
    run_until_idle(s)
    assert b.num_cached_tokens == 8
    c = req(range(8))  # exactly two blocks: vLLM caps the hit at len-1 tokens, so one block is reused
    s.add(c)
    run_until_idle(s)
    assert c.num_cached_tokens == 4
    assert s.stats.prefix_hits == 12 and s.stats.prefix_queries == 28


def test_event_fields_match_vllm():
    s = new_sched()
    a = req(range(9), salt="tenant-a")
    s.add(a)
    _, ev, _ = run_until_idle(s)
    (e,) = ev
    assert isinstance(e, BlockStored)
    assert e.parent_block_hash is None and e.block_size == 4 and e.medium == "GPU"
    assert e.token_ids == list(range(8)) and e.extra_keys == [("tenant-a",), None]
    assert e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
    # a continuation event names its parent
    b = req(list(range(9)) + [100, 101, 102, 103], salt="tenant-a")
    s.add(b)
    _, ev, _ = run_until_idle(s)
    (e2,) = [x for x in ev if isinstance(x, BlockStored)]
    assert e2.parent_block_hash == e.block_hashes[-1] and e2.token_ids == [8, 100, 101, 102]


def test_salt_and_lora_isolate_cache():
    s = new_sched()
    for kw in ({}, {"salt": "x"}, {"salt": "y"}, {"lora": "ad1"}):
        r = req(range(12), **kw)
        s.add(r)
        run_until_idle(s)
        assert r.num_cached_tokens == 0, kw
    for kw in ({}, {"salt": "x"}, {"lora": "ad1"}):
        r = req(range(12), **kw)
        s.add(r)
        run_until_idle(s)
        assert r.num_cached_tokens == 8, kw


def test_lru_eviction_emits_block_removed_and_keeps_recent_prefixes():
    s = new_sched()  # 16 blocks of 4 tokens
    prompts = [[p * 100 + i for i in range(17)] for p in range(5)]  # 4 full blocks + 1 partial each
    for p in prompts[:3]:  # 15 blocks used then freed; 12 hashes cached
        s.add(req(p))
        run_until_idle(s)
    assert len(s.pool.cached) == 12 and s.pool.num_free == 16
    s.add(req(prompts[3]))  # needs 5 blocks: 1 never used + 4 evicted from the LRU head (oldest prompt's tail)
    _, ev, _ = run_until_idle(s)
    removed = [h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes]
    h0 = hash_blocks(prompts[0], 4)
    assert removed and set(removed) <= set(h0)
    assert removed[0] == h0[-1]  # tail blocks go first
    r1 = req(prompts[1])  # a more recent prompt is still fully cached
    s.add(r1)
    run_until_idle(s)
    assert r1.num_cached_tokens == 16


def test_reset_prefix_cache_refused_while_busy_then_cleared():
    s = new_sched()
    r = req(range(12), max_tokens=3)
    s.add(r)
    plan = s.schedule(0.0)
    s.commit(plan, plan.duration)
    assert s.reset_prefix_cache() is False
    run_until_idle(s, plan.duration)
    assert s.reset_prefix_cache() is True
    assert isinstance(s.pool.take_events()[-1], AllBlocksCleared)
    r2 = req(range(12))
    s.add(r2)
    run_until_idle(s)
    assert r2.num_cached_tokens == 0


def test_output_tokens_fill_blocks_that_get_cached():
    s = new_sched()
    r = req(range(6), max_tokens=5)  # 6 + 5 tokens; 4 outputs enter the KV -> 10 computed -> 2 full blocks
    s.add(r)
    _, ev, _ = run_until_idle(s)
    assert r.num_output == 5
    hs = stored(ev)
    assert hs == hash_blocks(r.tokens[:8], 4)


# ------------------------------------------------------------------------------------------- timing
def test_single_request_ttft_is_the_cost_model():
    s = new_sched()
    r = req(range(50))
    s.add(r)
    t, _, steps = run_until_idle(s)
    assert len(steps) == 1
    assert r.first_token_at == pytest.approx(PROF.step_time(50, 0, 0)) == pytest.approx(0.01 + 0.05)


def test_chunked_prefill_splits_long_prompts_over_steps():
    prof = PROF.with_overrides(max_num_batched_tokens=16)
    s = new_sched(prof)
    r = req(range(40), max_tokens=3)
    s.add(r)
    t, _, steps = run_until_idle(s)
    assert [p.prefill_tokens for p in steps[:3]] == [16, 16, 8]
    assert r.first_token_at == pytest.approx(3 * 0.01 + 0.040)
    assert [p.decode_seqs for p in steps[3:]] == [1, 1]
    assert t == pytest.approx(r.first_token_at + 2 * (0.01 + 0.002))


def test_decode_step_time_grows_with_running_sequences_and_context():
    prof = PROF.with_overrides(attn_s_per_ctx_token=0.0001)
    s = new_sched(prof)
    for _ in range(3):
        s.add(req(range(10), max_tokens=4))
    p1 = s.schedule(0.0)
    s.commit(p1, p1.duration)
    p2 = s.schedule(p1.duration)
    assert p2.decode_seqs == 3 and p2.prefill_tokens == 0
    assert p2.duration == pytest.approx(0.01 + 3 * 0.002 + 0.0001 * 30)


def test_queueing_appears_at_max_num_seqs():
    s = new_sched()  # max 4 running
    rs = [req([i] * 4 + [j for j in range(3)], max_tokens=10) for i in range(6)]
    for r in rs:
        s.add(r)
    plan = s.schedule(0.0)
    assert len(plan.entries) == 4 and len(s.waiting) == 2
    run_until_idle(s)
    ttft = [r.first_token_at for r in rs]
    assert max(ttft[:4]) < min(ttft[4:])  # the last two waited for a slot


def test_queueing_appears_when_kv_space_is_short():
    s = new_sched(PROF.with_overrides(max_num_seqs=16))  # 16 blocks; each request needs 5
    rs = [req([i * 50 + j for j in range(18)], max_tokens=1) for i in range(4)]
    for r in rs:
        s.add(r)
    plan = s.schedule(0.0)
    assert len(plan.entries) == 3 and len(s.waiting) == 1  # 15 blocks taken; the 4th waits for space
    run_until_idle(s)
    assert rs[3].first_token_at > rs[2].first_token_at and rs[3].scheduled_at > 0


def test_preemption_when_running_sequences_outgrow_kv():
    s = new_sched(PROF.with_overrides(max_num_seqs=16))
    rs = [req([i * 50 + j for j in range(14)], max_tokens=12) for i in range(4)]  # 4 blocks now, 7 later each
    for r in rs:
        s.add(r)
    run_until_idle(s)
    assert all(r.status == FINISHED and r.num_output == 12 for r in rs)
    assert s.stats.preemptions > 0
    assert s.pool.num_free == 16


def test_priority_policy_admits_lower_value_first():
    s = new_sched(PROF.with_overrides(max_num_seqs=1), priority_policy=True)
    lo = req(range(5), priority=5, at=0.0)
    hi = req(range(100, 105), priority=-1, at=0.1)
    s.add(lo)
    s.add(hi)
    run_until_idle(s)
    assert hi.first_token_at < lo.first_token_at


def test_profiles_are_documented_and_sane():
    h, l = get_profile("h200-8b"), get_profile("l40s-8b")
    assert 10_000 <= 1 / h.prefill_s_per_token <= 20_000
    assert 0.010 <= h.step_time(0, 32, 32 * 1000) <= 0.015  # a decode step at moderate batch
    assert l.step_time(1000, 0, 0) > h.step_time(1000, 0, 0)
    for p in PROFILES.values():
        assert p.kv_capacity_tokens >= p.max_model_len
    with pytest.raises(ValueError):
        get_profile("nope")
