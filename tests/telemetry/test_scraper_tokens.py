"""Metrics parsing on real vLLM /metrics text; token sources (approx fallback, engine /tokenize via the sim)."""
from pathlib import Path

from gateway.telemetry.scraper import parse_metrics
from gateway.telemetry.tokens import TokenSource, approx_tokens

DATA = Path(__file__).resolve().parents[1] / "data"


def test_parse_real_vllm_metrics():
    load = parse_metrics((DATA / "vllm_metrics.txt").read_text(), now=1.0)
    assert load.healthy and load.block_size == 32 and load.num_gpu_blocks == 80
    assert load.prefix_queries >= load.prefix_hits > 0
    assert 0.0 <= load.kv_usage <= 1.0 and load.running == 0


async def test_approx_source_shares_prefix_blocks_and_caches():
    ts = TokenSource("approx")
    a, src = await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "a"}]})
    b, _ = await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "b"}]})
    assert src == "approx" and a[:90] == b[:90] and a != b
    await ts.tokens(None, {"model": "m", "messages": [{"role": "user", "content": "x" * 400 + "a"}]})
    assert ts.hits == 1 and ts.misses == 2
    assert approx_tokens("abcd") == approx_tokens("abcd")


async def test_unreachable_engine_falls_back_to_approx():
    ts = TokenSource("auto", timeout_s=0.2)
    toks, src = await ts.tokens("http://127.0.0.1:9", {"model": "m", "prompt": "hello world"})
    assert src == "approx" and toks
    await ts.close()
