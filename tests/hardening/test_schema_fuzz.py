"""Schemathesis against the running gateway (in front of a simulated engine): a few hundred generated
requests from /openapi.json, valid and invalid, with good, bad and missing credentials: no 5xx, no hang,
every refusal OpenAI-shaped. The long run (thousands of requests) is bench/fuzz_api.py."""
from __future__ import annotations

import httpx
import pytest

from gateway.api.openapi import openapi_spec
from tests.hardening.fuzzing import fuzz
from tests.hardening.stack import GW_KEY, start_stack, wait_ready

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    st = start_stack(tmp_path_factory.mktemp("fuzz"), engines=1, locations="DE")
    wait_ready(st.base)
    yield st
    st.stop()


def test_served_spec_is_the_module_spec(gw):
    assert httpx.get(gw.base + "/openapi.json", timeout=5).json() == openapi_spec()


def test_schemathesis_finds_no_5xx_no_hang_and_only_openai_errors(gw):
    report = fuzz(gw.base, GW_KEY, examples_per_operation=40, timeout_s=20)
    assert report.requests >= 250, report
    assert not report.failures, "\n".join(report.failures[:20])
    assert any(s == 200 for s in report.statuses) and any(400 <= s < 500 for s in report.statuses), report.statuses
    log = gw.gw.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
