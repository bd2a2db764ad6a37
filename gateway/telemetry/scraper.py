"""Scrape an engine's Prometheus /metrics into an EngineLoad snapshot (vLLM's or SGLang's names, any label set).

vLLM (`vllm/v1/metrics/loggers.py`): the `vllm:*` names of `_SUMS`, block size and capacity from
`vllm:cache_config_info`'s labels. SGLang (`sglang/srt/observability/metrics_collector.py`, 0.5.23, read for the
names and labels; `--enable-metrics`): the scheduler's gauges carry `model_name, engine_type, tp_rank, pp_rank,
moe_ep_rank` (+ `dp_rank`, + `priority` with `--enable-priority-scheduling`, whose queue counts are the total
under `priority=""` and a breakdown under `priority="<n>"`: only the totals are summed); the tokenizer manager's
counters carry `model_name, engine_type` (+ `priority`, filled in per request, + `is_streaming`, + `cache_source`
on the cached-token counter), all summed.
  running      sglang:num_running_reqs          waiting       sglang:num_queue_reqs
  kv_usage     sglang:token_usage (mean)        preemptions   sglang:num_retracted_requests_total
  prompt_tokens sglang:prompt_tokens_total      prompt_tokens_cached  sglang:cached_tokens_total (every source)
  block_size   sglang:page_size                 num_gpu_blocks        sglang:num_pages
SGLang exports no prefix-cache query counters (its `sglang:cache_hit_rate` is a gauge of recent batches), so
prefix_hits / prefix_queries stay 0 and the stream watch reads prompt_tokens - prompt_tokens_cached.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineLoad:
    """One engine's load as last scraped; counters are cumulative (diff two snapshots for rates)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_hits: float = 0.0  # tokens (vllm:prefix_cache_hits_total)
    prefix_queries: float = 0.0  # tokens (vllm:prefix_cache_queries_total)
    prompt_tokens: float = 0.0
    prompt_tokens_cached: float = 0.0
    preemptions: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # vLLM --enable-lora (vllm:lora_requests_info, its newest sample): adapters with requests running / waiting
    # in the engine, from every gateway replica, and the engine's --max-loras; None: not exported
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int | None = None
    healthy: bool = False
    scraped_at: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SumField = Literal["running", "waiting", "kv_usage", "prefix_hits", "prefix_queries", "prompt_tokens",
                    "prompt_tokens_cached", "preemptions"]


class _Sums(TypedDict, total=False):
    """The summed EngineLoad fields seen in one scrape (the keys of _SUMS' values)."""

    running: float
    waiting: float
    kv_usage: float
    prefix_hits: float
    prefix_queries: float
    prompt_tokens: float
    prompt_tokens_cached: float
    preemptions: float


_SUMS: dict[str, _SumField] = {  # sample name -> field (samples of every engine/model label set are summed)
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # older vLLM
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prompt_tokens_cached_total": "prompt_tokens_cached",
    "vllm:num_preemptions_total": "preemptions",
}


_SGL_SUMS: dict[str, _SumField] = {  # SGLang's sample names (see the module docstring)
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "sglang:prompt_tokens_total": "prompt_tokens",
    "sglang:cached_tokens_total": "prompt_tokens_cached",
    "sglang:num_retracted_requests_total": "preemptions",
}


def _parse_sglang(text: str, now: float | None) -> EngineLoad:
    vals: _Sums = {}
    usage: list[float] = []
    page = pages = total_tokens = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            f = _SGL_SUMS.get(s.name)
            if f is not None:
                if f in ("running", "waiting") and s.labels.get("priority", ""):
                    continue  # a per-priority breakdown of the total under priority=""
                if f == "kv_usage":
                    usage.append(s.value)
                else:
                    vals[f] = vals.get(f, 0.0) + s.value
            elif s.name == "sglang:page_size" and s.value >= 1:
                page = int(s.value)
            elif s.name == "sglang:num_pages" and s.value >= 1:
                pages = max(pages or 0, int(s.value))
            elif s.name == "sglang:max_total_num_tokens" and s.value >= 1:
                total_tokens = max(total_tokens or 0, int(s.value))
    if usage:
        vals["kv_usage"] = sum(usage) / len(usage)  # mean over DP ranks
    if pages is None and page and total_tokens:
        pages = total_tokens // page
    return EngineLoad(block_size=page, num_gpu_blocks=pages, healthy=True,
                      scraped_at=time.time() if now is None else now, **vals)


def parse_metrics(text: str, now: float | None = None, form: str = "vllm") -> EngineLoad:
    """Pure parse of Prometheus text exposition into EngineLoad; `form`: the engine's (vllm | sglang)."""
    if form == "sglang":
        return _parse_sglang(text, now)
    vals: _Sums = {}
    seen_usage: dict[str, list[float]] = {}
    block_size = num_blocks = None
    lora: Any = None  # the newest vllm:lora_requests_info sample (its value is the time it was set)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:lora_requests_info":
                if lora is None or s.value > lora.value:
                    lora = s
                continue
            f = _SUMS.get(s.name)
            if f == "kv_usage":
                seen_usage.setdefault(s.name, []).append(s.value)
            elif f:
                vals[f] = vals.get(f, 0.0) + s.value
            elif s.name in ("vllm:cache_config_info", "vllm:cache_config_info_info") or fam.name == "vllm:cache_config":
                bs = s.labels.get("block_size")
                nb = s.labels.get("num_gpu_blocks")
                if bs and bs.isdigit():
                    block_size = int(bs)
                if nb and nb.isdigit():
                    num_blocks = int(nb)
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if seen_usage.get(name):
            u = seen_usage[name]
            vals["kv_usage"] = sum(u) / len(u)  # mean over DP engines
            break
    return EngineLoad(block_size=block_size, num_gpu_blocks=num_blocks, healthy=True,
                      scraped_at=time.time() if now is None else now, **_lora(lora), **vals)


def _lora(sample: Any) -> dict[str, Any]:
    """vllm:lora_requests_info's labels: running/waiting adapters (comma-separated names) and max_lora."""
    if sample is None:
        return {}
    lab = sample.labels
    ml = lab.get("max_lora", "")
    return {"lora_running": tuple(n for n in lab.get("running_lora_adapters", "").split(",") if n),
            "lora_waiting": tuple(n for n in lab.get("waiting_lora_adapters", "").split(",") if n),
            "max_lora": int(ml) if ml.isdigit() else None}


async def scrape(client: httpx.AsyncClient, url: str, timeout_s: float = 1.0, form: str = "vllm") -> EngineLoad:
    """GET url and parse; an unreachable or failing engine yields healthy=False with the error."""
    try:
        r = await client.get(url, timeout=timeout_s)
        r.raise_for_status()
        return parse_metrics(r.text, form=form)
    except (httpx.HTTPError, ValueError) as e:
        return EngineLoad(healthy=False, scraped_at=time.time(), error=f"{type(e).__name__}: {e}"[:200])
