"""A continuous-batching scheduler shaped like vLLM v1's, driven by an injectable clock.

`schedule(now)` plans one step (running sequences first, then waiting ones while sequence slots, the
chunked-prefill budget and KV blocks allow) and prices it with the profile's cost model; `commit(plan,
t_end)` applies it as of the step's end: prefills advance, each sequence whose prompt is done emits one token,
full blocks are cached (BlockStored), finished requests free their blocks. No I/O and no real time here, so
tests can drive it step by step.
"""
from __future__ import annotations

from collections import OrderedDict

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

from backends.sim.hashing import block_extra_keys, hash_block
from backends.sim.kv_cache import BlockPool
from backends.sim.kv_wire import Event
from backends.sim.profiles import EngineProfile

WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"

# vLLM's TTFT histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
QUEUE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(eq=False)
class SimRequest:
    """One request inside the engine; `tokens` grows with generated ids."""

    rid: str
    prompt_len: int
    tokens: list[int]
    max_tokens: int
    stop_reason: str = "length"  # finish_reason when max_tokens is reached ("stop" when the sim chose the length)
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    priority: int = 0
    arrival: float = 0.0
    seed: int = 0
    status: str = WAITING
    num_computed: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (usage.cached_tokens)
    num_output: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # blocks of this request already marked cached
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    listener: Any = None  # set by the driver: gets first-token / finish notifications
    external_id: str | None = None  # the client's x-request-id (sim only: keys the per-request truth)
    true_s: float = 0.0  # sim only: this request's share of the steps it was in (see Scheduler.commit)

    def full_hashes(self, n_tokens: int, block_size: int) -> list[int]:
        """Chained hashes of the full blocks among the first n_tokens tokens (computed lazily, memoised)."""
        need = n_tokens // block_size
        hs = self.block_hashes
        while len(hs) < need:
            i = len(hs)
            hs.append(hash_block(hs[-1] if hs else None, self.tokens[i * block_size:(i + 1) * block_size],
                                 block_extra_keys(i, self.lora_name, self.cache_salt)))
        return hs[:need] if len(hs) != need else hs


@dataclass
class StepPlan:
    entries: list[tuple[SimRequest, int, bool]]  # (request, tokens computed this step, is a decode)
    prefill_tokens: int
    decode_seqs: int
    decode_ctx_tokens: int
    duration: float
    started: float


@dataclass
class StepOutput:
    first_tokens: list[SimRequest]
    finished: list[SimRequest]
    events: list[Event]
    tokens: int


@dataclass
class Stats:
    """Counters behind /metrics, named after vLLM's."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens_cached: int = 0
    preemptions: int = 0
    steps: int = 0
    success: dict[str, int] = field(default_factory=dict)
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    ttft_count: int = 0
    queue_buckets: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_BUCKETS) + 1))
    queue_sum: float = 0.0
    queue_count: int = 0
    # the truth cost accounting is checked against (sim only, not a vLLM metric): the modelled time of every
    # committed step, i.e. the engine's busy time, and the part of it spent on prefill tokens (b x tokens)
    busy_s: float = 0.0
    busy_prefill_s: float = 0.0
    busy_wall_s: float = 0.0  # wall time from planning each step to committing it (the driver adds it)

    def observe_ttft(self, v: float) -> None:
        self.ttft_buckets[bisect.bisect_left(TTFT_BUCKETS, v)] += 1
        self.ttft_sum += v
        self.ttft_count += 1

    def observe_queue(self, v: float) -> None:
        self.queue_buckets[bisect.bisect_left(QUEUE_BUCKETS, v)] += 1
        self.queue_sum += v
        self.queue_count += 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Waiting queue + running list + block pool; `priority_policy` orders waiting by (priority, arrival)."""

    def __init__(self, profile: EngineProfile, output_token: Callable[[SimRequest], int],
                 enable_prefix_caching: bool = True, priority_policy: bool = False) -> None:
        self.profile = profile
        self.bs = profile.block_size
        self.pool = BlockPool(profile.num_gpu_blocks, profile.block_size, enable_prefix_caching)
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.stats = Stats()
        self.priority_policy = priority_policy
        self._output_token = output_token
        self.slow_factor = 1.0
        self.max_loras: int | None = None  # distinct LoRA adapters one batch may run (vLLM --max-loras)
        # vLLM's cache of adapter weights read into memory (--max-cpu-loras, default --max-loras): an adapter a
        # step runs that is not in it is read from its path first, and that step takes `lora_load_s` longer
        # (the model runner activates the batch's adapters before it runs); None: not modelled
        self.lora_cache_size: int | None = None
        self.lora_load_s = 0.0
        self.lora_cache: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ queue operations
    def add(self, req: SimRequest) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> None:
        if req.status == RUNNING:
            self.running.remove(req)
            self._free(req)
        elif req.status == WAITING:
            self.waiting.remove(req)
        if req.status in (RUNNING, WAITING):
            req.status = ABORTED
            req.finish_reason = "abort"
            self.stats.success["abort"] = self.stats.success.get("abort", 0) + 1

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # ------------------------------------------------------------------ helpers
    def _free(self, req: SimRequest) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0

    def _preempt(self, req: SimRequest) -> None:
        """vLLM's recompute preemption: drop the blocks, go back to the head of the waiting queue."""
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.status = WAITING
        self.waiting.insert(0, req)
        self.stats.preemptions += 1

    def _victim(self) -> SimRequest:
        if self.priority_policy:
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _next_waiting(self, skip: set[int] | None = None) -> SimRequest | None:
        pool = [r for r in self.waiting if id(r) not in skip] if skip else self.waiting
        if not pool:
            return None
        if self.priority_policy:
            return min(pool, key=lambda r: (r.priority, r.arrival))
        return pool[0]

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """(running, waiting) adapter names, each once in first-seen order (vllm:lora_requests_info's labels)."""
        run = list(dict.fromkeys(r.lora_name for r in self.running if r.lora_name))
        wait = list(dict.fromkeys(r.lora_name for r in self.waiting if r.lora_name))
        return run, wait

    def lora_warm(self, name: str) -> bool:
        """`name`'s weights are in the cache now (most recently used; the least recently used beyond its size is
        dropped); True when they had to be read."""
        cold = name not in self.lora_cache
        self.lora_cache[name] = None
        self.lora_cache.move_to_end(name)
        if self.lora_cache_size is not None:
            while len(self.lora_cache) > self.lora_cache_size:
                self.lora_cache.popitem(last=False)
        return cold

    def _lora_reads(self, entries: list[tuple["SimRequest", int, bool]]) -> int:
        """How many of the step's adapters had to be read into the cache first."""
        if self.lora_cache_size is None:
            return 0
        names = dict.fromkeys(r.lora_name for r, _, _ in entries if r.lora_name)
        return sum(self.lora_warm(n) for n in names)

    def _lora_blocked(self, req: SimRequest) -> bool:
        """vLLM's scheduler skips a waiting request whose adapter would be one more than --max-loras in the batch."""
        if self.max_loras is None or not req.lora_name:
            return False
        active = {r.lora_name for r in self.running if r.lora_name}
        return req.lora_name not in active and len(active) >= self.max_loras

    # ------------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan | None:
        """Plan the next step; None when there is nothing runnable."""
        bs = self.bs
        pool = self.pool
        budget = self.profile.max_num_batched_tokens
        entries: list[tuple[SimRequest, int, bool]] = []
        preempted = False
        for req in list(self.running):
            if req.status != RUNNING:
                continue  # preempted earlier in this loop
            remaining = len(req.tokens) - req.num_computed
            is_decode = req.num_output > 0 and remaining == 1
            n = 1 if is_decode else min(remaining, budget)
            if n <= 0:
                continue
            need = _cdiv(req.num_computed + n, bs) - len(req.block_ids)
            while need > pool.num_free:
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RUNNING:
                continue
            if need > 0:
                new = pool.allocate(need)
                assert new is not None
                req.block_ids.extend(new)
            entries.append((req, n, is_decode))
            if not is_decode:
                budget -= n
        if preempted:  # requests planned before a later preemption took them out
            entries = [e for e in entries if e[0].status == RUNNING]
        skipped: set[int] = set()  # waiting requests whose adapter has no slot in this batch
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.profile.max_num_seqs):
            nxt = self._next_waiting(skipped)
            if nxt is None:
                break
            req = nxt
            if self._lora_blocked(req):
                skipped.add(id(req))
                continue
            n_tokens = len(req.tokens)
            hashes = req.full_hashes(n_tokens, bs)
            hit = pool.lookup(hashes, (n_tokens - 1) // bs)  # vLLM always recomputes at least one token
            computed = len(hit) * bs
            n = min(n_tokens - computed, budget)
            need = _cdiv(computed + n, bs) - len(hit)
            if need > pool.num_free - pool.free_among(hit):
                break  # head-of-line waits for KV space: this is where queueing comes from
            pool.touch(hit)
            new = pool.allocate(need)
            assert new is not None
            req.block_ids = hit + new
            req.num_cached_blocks = len(hit)
            req.num_computed = computed
            self.stats.prefix_queries += n_tokens
            self.stats.prefix_hits += computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = computed
                self.stats.prompt_tokens_cached += computed
            if req.scheduled_at is None:
                req.scheduled_at = now
                self.stats.observe_queue(now - req.arrival)
            self.waiting.remove(req)
            req.status = RUNNING
            self.running.append(req)
            entries.append((req, n, False))
            budget -= n
        if not entries:
            return None
        prefill = sum(n for _, n, d in entries if not d)
        decode = sum(1 for _, _, d in entries if d)
        ctx = sum(r.num_computed for r, _, d in entries if d)
        duration = self.profile.step_time(prefill, decode, ctx) * self.slow_factor
        duration += self._lora_reads(entries) * self.lora_load_s
        return StepPlan(entries, prefill, decode, ctx, duration, now)

    def commit(self, plan: StepPlan, t_end: float) -> StepOutput:
        """Apply a planned step as of t_end; returns who got a first token, who finished, and KV events."""
        bs = self.bs
        pool = self.pool
        firsts: list[SimRequest] = []
        finished: list[SimRequest] = []
        ntok = 0
        # the truth per request (sim only): each entry gets its prefill tokens x b, or as a decode c + d x its
        # context, and an equal part of the fixed per-step cost a; the shares sum to the step's duration
        p, sf = self.profile, self.slow_factor
        fixed = p.step_overhead_s * sf / len(plan.entries) if plan.entries else 0.0
        for req, n, is_decode in plan.entries:
            own = ((p.decode_s_per_seq + p.attn_s_per_ctx_token * req.num_computed) if is_decode
                   else p.prefill_s_per_token * n)
            req.true_s += fixed + own * sf
        for req, n, _ in plan.entries:
            if req.status != RUNNING:
                continue  # aborted during the step
            req.num_computed += n
            if req.num_computed >= len(req.tokens):
                req.tokens.append(self._output_token(req))
                req.num_output += 1
                ntok += 1
                if req.num_output == 1 and req.first_token_at is None:
                    req.first_token_at = t_end
                    self.stats.observe_ttft(t_end - req.arrival)
                    self.stats.prompt_tokens += req.prompt_len
                    firsts.append(req)
            # cache the blocks that became full
            full = req.num_computed // bs
            if full > req.num_cached_blocks and pool.enable_caching:
                start = req.num_cached_blocks
                hashes = req.full_hashes(full * bs, bs)[start:full]
                ek = [block_extra_keys(j, req.lora_name, req.cache_salt) for j in range(start, full)]
                parent = req.block_hashes[start - 1] if start > 0 else None
                pool.cache_blocks(req.block_ids[start:full], hashes, parent, req.tokens[start * bs:full * bs],
                                  ek, req.lora_id, req.lora_name)
                req.num_cached_blocks = full
            if req.num_output >= req.max_tokens:
                req.status = FINISHED
                req.finish_reason = req.stop_reason
                req.finished_at = t_end
                self.running.remove(req)
                self._free(req)
                finished.append(req)
                self.stats.success[req.finish_reason] = self.stats.success.get(req.finish_reason, 0) + 1
        self.stats.generation_tokens += ntok
        self.stats.steps += 1
        self.stats.busy_s += plan.duration  # the step ran on the GPU even for sequences aborted during it
        self.stats.busy_prefill_s += self.profile.prefill_s_per_token * plan.prefill_tokens * self.slow_factor
        return StepOutput(firsts, finished, pool.take_events(), ntok)
