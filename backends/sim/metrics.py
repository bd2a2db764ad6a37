"""/metrics in vLLM's names and labels (vllm/v1/metrics/loggers.py), or SGLang's for an engine presenting as
SGLang, read from engine state at scrape time.

A custom prometheus-client collector on a per-engine CollectorRegistry: no work per step, and one engine's
numbers never leak into another's. vLLM's labels are `model_name` and `engine` (the engine index as a string).
SGLang's (sglang/srt/observability/metrics_collector.py, 0.5.23, read for names and labels): the scheduler's
gauges carry `model_name, engine_type, tp_rank, pp_rank, moe_ep_rank` (+ `priority` with priority scheduling:
the queue counts' total under `priority=""`, one series per priority seen besides), the tokenizer manager's
counters `model_name, engine_type` (+ `is_streaming`; `cache_source` on sglang:cached_tokens_total).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from backends.sim.scheduler import QUEUE_BUCKETS, TTFT_BUCKETS

if TYPE_CHECKING:
    from backends.sim.engine import SimEngine


def _hist(name: str, doc: str, labels: list[str], values: list[str], bounds: tuple[float, ...],
          counts: list[int], total: float) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=labels)
    acc = 0
    buckets: list[tuple[str, float]] = []
    for b, c in zip(bounds, counts):
        acc += c
        buckets.append((repr(float(b)), acc))
    acc += counts[-1]
    buckets.append(("+Inf", acc))
    h.add_metric(values, buckets, total)
    return h


class EngineCollector:
    """Yields vLLM's metric families for one engine."""

    def __init__(self, engine: "SimEngine") -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.engine.present_as == "sglang":
            yield from self._collect_sglang()
        else:
            yield from self._collect_vllm()
        yield from self._collect_sim()

    def _collect_sim(self) -> Iterator[Metric]:
        e = self.engine
        st = e.sched.stats
        labels = ["model_name", "engine"]
        lv = [e.model, str(e.engine_index)]
        # sim only (no engine counterpart): the engine's true busy time, what apportioned cost is checked against
        for name, doc, v in (("sim:engine_busy_seconds", "Modelled time of all committed engine steps (sim only).",
                              st.busy_s),
                             ("sim:engine_busy_prefill_seconds", "Part of the busy time spent on prefill tokens "
                              "(sim only).", st.busy_prefill_s),
                             ("sim:engine_steps", "Engine steps committed (sim only).", st.steps)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, v)
            yield c

    def _collect_sglang(self) -> Iterator[Metric]:
        e = self.engine
        s = e.sched
        st = s.stats
        prio = e.priority_policy
        sl = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"] + (["priority"] if prio else [])
        sv = [e.model, "unified", "0", "0", "0"] + ([""] if prio else [])
        tl = ["model_name", "engine_type"] + (["priority"] if prio else [])
        tv = [e.model, "unified"] + ([""] if prio else [])

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=sl)
            g.add_metric(sv, v)
            return g

        def queue(name: str, doc: str, reqs: list) -> GaugeMetricFamily:  # type: ignore[type-arg]
            g = gauge(name, doc, len(reqs))
            if prio:  # SGLang's per-priority breakdown (the engine stores the negated value: see SimEngine.submit)
                by: dict[int, int] = {}
                for r in list(s.running) + list(s.waiting):
                    by.setdefault(-r.priority, 0)
                for r in reqs:
                    by[-r.priority] += 1
                for p, n in sorted(by.items()):
                    g.add_metric(sv[:-1] + [str(p)], n)
            return g

        def counter(name: str, doc: str, v: float, extra: dict[str, str] | None = None,
                    scheduler: bool = False) -> CounterMetricFamily:
            ls, vs = (sl, sv) if scheduler else (tl, tv)
            c = CounterMetricFamily(name, doc, labels=ls + list(extra or {}))
            c.add_metric(vs + list((extra or {}).values()), v)
            return c

        p = e.profile
        bs = p.block_size
        yield queue("sglang:num_running_reqs", "The number of running requests.", s.running)
        yield queue("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.waiting)
        yield gauge("sglang:num_grammar_queue_reqs", "The number of requests in the grammar waiting queue.", 0)
        up = max(1e-9, time.time() - e.started_at)
        yield gauge("sglang:gen_throughput", "The generation throughput (token/s).", st.generation_tokens / up)
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.",
                    st.prefix_hits / st.prefix_queries if st.prefix_queries else 0.0)
        yield gauge("sglang:token_usage", "The token usage.", s.pool.usage())
        used = (s.pool.num_blocks - s.pool.num_free) * bs
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", used)
        yield gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
                    p.num_gpu_blocks * bs)
        yield gauge("sglang:page_size", "KV cache page size in tokens.", bs)
        yield gauge("sglang:num_pages", "Number of KV cache pages.", p.num_gpu_blocks)
        yield gauge("sglang:context_len", "Maximum context length.", p.max_model_len)
        yield counter("sglang:num_retracted_requests", "Total number of retracted requests.", st.preemptions,
                      scheduler=True)
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens,
                      {"is_streaming": "false"})
        yield counter("sglang:generation_tokens", "Number of generation tokens processed.", st.generation_tokens,
                      {"is_streaming": "false"})
        yield counter("sglang:cached_tokens", "Number of cached prompt tokens by source (device/host/storage).",
                      st.prompt_tokens_cached, {"cache_source": "device"})
        yield counter("sglang:num_requests", "Number of requests processed.", sum(st.success.values()),
                      {"is_streaming": "false"})
        yield _hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    tl + ["is_streaming"], tv + ["false"], TTFT_BUCKETS, st.ttft_buckets, st.ttft_sum)
        yield _hist("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", sl, sv, QUEUE_BUCKETS,
                    st.queue_buckets, st.queue_sum)

    def _collect_vllm(self) -> Iterator[Metric]:
        e = self.engine
        s = e.sched
        st = s.stats
        labels = ["model_name", "engine"]
        lv = [e.model, str(e.engine_index)]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lv, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(lv, v)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", len(s.running))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(s.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.pool.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      st.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      st.prefix_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local prefix cache hits).",
                      st.prompt_tokens_cached)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
        succ = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                   labels=labels + ["finished_reason"])
        for reason in ("stop", "length", "abort", "error", "repetition"):
            succ.add_metric(lv + [reason], st.success.get(reason, 0))
        yield succ
        yield _hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels, lv,
                    TTFT_BUCKETS, st.ttft_buckets, st.ttft_sum)
        yield _hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                    labels, lv, QUEUE_BUCKETS, st.queue_buckets, st.queue_sum)
        p = e.profile
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching", "engine",
                                         "num_gpu_blocks", "prefix_caching_hash_algo"])
        info.add_metric([str(p.block_size), "auto", str(e.enable_prefix_caching), str(e.engine_index),
                         str(p.num_gpu_blocks), "xxhash64-sim"], 1.0)
        yield info
        if e.max_loras is not None:  # vLLM exports it with --enable-lora: the labels carry the state, the value
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",  # is the time of
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            if st.steps:  # the last update (set_to_current_time), and no sample before the first step, as vLLM
                run, wait = s.lora_adapters()
                lora.add_metric([str(e.max_loras), ",".join(wait), ",".join(run)], time.time())
            yield lora


def make_registry(engine: "SimEngine") -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine))  # type: ignore[arg-type]
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
