"""End to end (issue 18, item 7): partner routes serve a model our engines also serve only when the policy decision
sets `spill_to_partner`, also when every own engine is excluded (retention) or down. A model only partners serve
is their ordinary route. Real gateway process, two mock OpenAI upstreams (own, partner) and a dead own engine."""
from __future__ import annotations

import time

import httpx
import pytest
import yaml

from tests.resilience.stack import write_config
from tests.support.procs import free_port, start_gateway, start_upstream

pytestmark = pytest.mark.e2e

PLAIN = "spill-plain-key-0123456789"
ZERO = "spill-zero-key-0123456789"  # label residency=eea: EEA + zero retention, no spill
SPILL = "spill-allowed-key-0123456789"  # label spill=yes: zero retention, spill_to_partner


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spill")
    own, own_port = start_upstream(tmp)
    partner, partner_port = start_upstream(tmp)
    gw = None
    try:
        (tmp / "policy.yaml").write_text(yaml.safe_dump({"version": 1, "rules": [
            {"id": "eea-zero", "match": {"labels": {"residency": "eea"}},
             "require": {"jurisdiction": "EEA", "retention": "zero"}},
            {"id": "may-spill", "match": {"labels": {"spill": "yes"}},
             "require": {"retention": "zero"}, "set": {"spill_to_partner": True}}]}))
        de = {"country": "DE"}
        backends = [
            # our engine for m: in DE, but keeps data (retention none): zero-retention requests cannot use it
            {"name": "own-m", "kind": "openai", "url": f"http://127.0.0.1:{own_port}/v1", "models": ["m"],
             "location": de, "retention": "none"},
            # our engine for down-m: nothing listens; the active health check opens its circuit at once
            {"name": "own-down", "kind": "openai", "url": f"http://127.0.0.1:{free_port()}/v1",
             "models": ["down-m"], "location": de, "retention": "zero",
             "health": {"interval_s": 0.2, "failures_to_open": 1, "open_s": 60},
             "timeouts": {"connect_s": 0.3, "first_token_s": 1, "idle_s": 1, "total_s": 2}},
            {"name": "partner", "kind": "openai", "operator": "partner", "url": f"http://127.0.0.1:{partner_port}/v1",
             "models": ["m", "down-m", "p-only"], "location": de, "retention": "zero"},
        ]
        cfg = write_config(tmp, backends, keys=[
            {"key": PLAIN, "tenant": "acme"},
            {"key": ZERO, "tenant": "zr-co", "labels": {"residency": "eea"}},
            {"key": SPILL, "tenant": "spill-co", "labels": {"spill": "yes"}}])
        gw, port = start_gateway(cfg)
        base = f"http://127.0.0.1:{port}"
        yield {"base": base, "partner_port": partner_port, "own_port": own_port}
    finally:
        if gw is not None:
            gw.stop()
        partner.stop()
        own.stop()


def _partner_requests(stack) -> int:
    return httpx.get(f"http://127.0.0.1:{stack['partner_port']}/stats", timeout=5).json()["requests"]


def _chat(stack, key: str, model: str) -> httpx.Response:
    return httpx.post(stack["base"] + "/v1/chat/completions", timeout=10, headers={"authorization": f"Bearer {key}"},
                      json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})


def test_zero_retention_request_is_refused_not_sent_to_a_partner_without_spill(stack):
    before = _partner_requests(stack)
    r = _chat(stack, ZERO, "m")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "residency_unsatisfiable"
    assert "'eea-zero'" in r.json()["error"]["message"]
    assert _partner_requests(stack) == before


def test_own_engines_down_do_not_open_the_partner_route_without_spill(stack):
    """The dead engine's circuit opens after its first failed probe (or request); no answer before or after
    comes from the partner, and once the circuit is open the answer is 503 with Retry-After."""
    before = _partner_requests(stack)
    deadline = time.monotonic() + 10
    while True:
        r = _chat(stack, PLAIN, "down-m")
        assert r.status_code != 200, r.headers.get("x-gateway-backend")
        if r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available":
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    assert r.headers.get("retry-after")
    for _ in range(3):
        assert _chat(stack, PLAIN, "down-m").status_code == 503
    assert _partner_requests(stack) == before


def test_with_spill_allowed_the_partner_serves_what_own_engines_cannot(stack):
    before = _partner_requests(stack)
    r = _chat(stack, SPILL, "m")  # own-m keeps data: the zero-retention partner is the allowed spill
    assert r.status_code == 200, r.text
    assert r.headers["x-gateway-backend"] == "partner"
    assert _partner_requests(stack) == before + 1


def test_a_model_only_partners_serve_is_their_route_and_own_traffic_stays_own(stack):
    r = _chat(stack, PLAIN, "p-only")
    assert r.status_code == 200 and r.headers["x-gateway-backend"] == "partner"
    r = _chat(stack, PLAIN, "m")
    assert r.status_code == 200 and r.headers["x-gateway-backend"] == "own-m"
