"""The gateway against two real vLLM CPU engines serving a generated tiny Llama (no download).

Proves on real engines what the simulator tests assume: the OpenAI surface end to end, KV events decoded and
indexed, gap replay, evictions, cache_salt isolation, /metrics, predicted vs actual cached tokens, routing of a
repeated long prompt to the engine holding it, and TTFT predictions learned from real timings. The checks
live in tests/vllm/checks.py (bench/gpu_check.py runs the same ones on a GPU). Tests run in file order and
share one stack; each uses fresh prompts so it does not depend on another's cache state.
"""
from __future__ import annotations

import pytest

from tests.vllm import checks

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]

_rows: dict[str, dict] = {}


def test_openai_sdk_end_to_end(vllm_stack):
    _rows["sdk"] = checks.check_openai_sdk(vllm_stack)


def test_kv_events_decoded_and_indexed(vllm_stack):
    if "sdk" not in _rows:  # run alone: make sure some requests produced events
        checks.check_openai_sdk(vllm_stack)
    _rows["kv"] = checks.check_kv_events_indexed(vllm_stack)


def test_metrics_parsed(vllm_stack):
    _rows["metrics"] = checks.check_metrics(vllm_stack)


def test_predicted_cached_tokens_agree_with_engines(vllm_stack):
    _rows["agreement"] = checks.check_agreement(vllm_stack)


def test_repeated_long_prompt_routed_to_engine_holding_it(vllm_stack):
    _rows["routing"] = checks.check_routing_repeat(vllm_stack)


def test_ttft_predictions_learned_from_real_timings(vllm_stack):
    _rows["ttft"] = checks.check_ttft_learned(vllm_stack, _rows.get("routing"))


async def test_replay_after_forced_gap(vllm_stack):
    _rows["replay"] = await checks.check_replay_gap(vllm_stack)


async def test_evictions_with_small_kv_cache(vllm_stack):
    _rows["evictions"] = await checks.check_evictions(vllm_stack)


async def test_cache_salt_isolation(vllm_stack):
    _rows["salt"] = await checks.check_cache_salt(vllm_stack)


def test_client_cache_salt_through_gateway(vllm_stack):
    _rows["salt_gateway"] = checks.check_cache_salt_gateway(vllm_stack)


def test_priority_reaches_only_priority_scheduling_engines(vllm_stack):
    _rows["priority"] = checks.check_priority_forwarding(vllm_stack)


def test_local_tokenizer_matches_the_engine(vllm_stack):
    from tests.vllm.stack import MODEL_DIR

    _rows["local_tokenizer"] = checks.check_local_tokenizer(vllm_stack, str(MODEL_DIR))


def test_responses_api_against_a_real_engine(vllm_stack):
    _rows["responses"] = checks.check_responses_api(vllm_stack)


def test_anthropic_messages_against_a_real_engine(vllm_stack):
    _rows["messages"] = checks.check_messages_api(vllm_stack)


def test_report(vllm_stack):
    """Prints what was measured (pytest -s shows it); fails only if the stack was never exercised."""
    print("\nreal vLLM e2e:", vllm_stack.timings)
    for k, v in _rows.items():
        print(f"  {k}: {v}")
    assert _rows
