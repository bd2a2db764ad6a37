"""Scrape an engine's Prometheus /metrics into an EngineLoad snapshot (vLLM metric names, any label set)."""
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


def parse_metrics(text: str, now: float | None = None) -> EngineLoad:
    """Pure parse of Prometheus text exposition into EngineLoad."""
    vals: _Sums = {}
    seen_usage: dict[str, list[float]] = {}
    block_size = num_blocks = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
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
                      scraped_at=time.time() if now is None else now, **vals)


async def scrape(client: httpx.AsyncClient, url: str, timeout_s: float = 1.0) -> EngineLoad:
    """GET url and parse; an unreachable or failing engine yields healthy=False with the error."""
    try:
        r = await client.get(url, timeout=timeout_s)
        r.raise_for_status()
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError) as e:
        return EngineLoad(healthy=False, scraped_at=time.time(), error=f"{type(e).__name__}: {e}"[:200])
