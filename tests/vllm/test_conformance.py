"""Issue 17 against real vLLM: cache-aware routing works with vLLM as it ships, and says loudly when it cannot.

The suite's engines (tests/vllm/stack.py) are started with vLLM's documented --kv-events-config, which names no
topic (KVEventsConfig.topic defaults to ""), and default scheduler settings; the suite's gateway config names no
topic either. Reuses the session's engines: the wrong-topic check starts only a second gateway process."""
from __future__ import annotations

import pytest

from tests.vllm import checks

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]


def test_default_topic_events_arrive_and_repeats_are_predicted_exactly(vllm_stack):
    print("\nconformance:", checks.check_default_topic_conformance(vllm_stack))


def test_a_gateway_on_the_wrong_topic_reports_it_stale_within_the_grace_period(vllm_stack):
    print("\nwrong topic:", checks.check_wrong_topic_reported(vllm_stack))
