"""/metrics in vLLM's names and labels (vllm/v1/metrics/loggers.py), read from engine state at scrape time.

A custom prometheus-client collector on a per-engine CollectorRegistry: no work per step, and one engine's
numbers never leak into another's. Labels are `model_name` and `engine` (the engine index as a string).
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
        # sim only (no vLLM counterpart): the engine's true busy time, what apportioned cost is checked against
        yield counter("sim:engine_busy_seconds", "Modelled time of all committed engine steps (sim only).", st.busy_s)
        yield counter("sim:engine_busy_prefill_seconds", "Part of the busy time spent on prefill tokens (sim only).",
                      st.busy_prefill_s)
        yield counter("sim:engine_steps", "Engine steps committed (sim only).", st.steps)
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
