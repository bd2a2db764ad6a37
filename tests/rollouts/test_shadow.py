"""Shadow copies: the sample, the copy's body, principal and decision (the caller's residency, the scope's
budgets, no cache), and the config rules of a shadow target."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.rollouts.service import rollouts_of
from gateway.rollouts.shadow import sampled, shadow_body, shadow_decision, shadow_principal
from gateway.types import BudgetSpec, Decision, Principal


def test_the_sample_share_holds_and_one_request_is_decided_once() -> None:
    n = 10_000
    got = sum(sampled("support", "v3", f"req_{i}", 0.1) for i in range(n))
    assert abs(got / n - 0.1) < 0.01
    assert all(sampled("support", "v3", f"req_{i}", 1.0) for i in range(100))
    assert [sampled("support", "v3", f"req_{i}", 0.5) for i in range(50)] == \
        [sampled("support", "v3", f"req_{i}", 0.5) for i in range(50)]


def test_the_copy_is_the_same_request_to_the_shadow_model_not_streamed() -> None:
    body = {"model": "support", "stream": True, "stream_options": {"include_usage": True}, "messages": [],
            "max_tokens": 7, "user": "u"}
    assert shadow_body(body, "v3") == {"model": "v3", "messages": [], "max_tokens": 7, "user": "u"}
    assert body["model"] == "support"  # the primary's body is untouched


def test_the_copy_runs_as_the_operator_scope_keeping_only_the_end_user() -> None:
    caller = Principal(id="key:1", kind="api_key", tenant="acme", team="t", key_id="1", end_user="eu-7",
                       labels={"residency": "eea"})
    p = shadow_principal(caller, "support", "shadow-ops")
    assert (p.id, p.tenant, p.team, p.key_id, p.end_user) == ("shadow:support", "shadow-ops", None, None, "eu-7")
    assert p.budget_scopes() == [("tenant", "shadow-ops")]


def test_the_copys_decision_is_the_callers_residency_with_the_scopes_budgets_and_no_cache() -> None:
    caller = Decision(allowed_countries=frozenset({"DE", "FR"}), jurisdiction="EEA", retention="zero",
                      matched_rules=("eu",), allowed_models=("support*",), cache=object(),
                      budgets=(BudgetSpec(window="day", tokens=10),))
    own = Decision(matched_rules=("ops-budget",), budgets=(BudgetSpec(window="month", money=5.0),))
    d = shadow_decision(caller, own)
    assert (d.allowed_countries, d.jurisdiction, d.retention, d.allowed_models) == (
        frozenset({"DE", "FR"}), "EEA", "zero", ("support*",))
    assert d.budgets == own.budgets and d.cache is None and d.matched_rules == ("eu", "ops-budget")


def _cfg(targets: list) -> object:
    data = {"backends": [{"name": "b", "url": "http://127.0.0.1:9/v1", "models": ["m1", "m2", "m3"]}],
            "aliases": [{"name": "a", "targets": targets}]}
    return parse_config(yaml.safe_dump(data), source="t.yaml", base_dir=Path("."))


def test_a_shadow_target_is_neither_an_arm_nor_a_fallback() -> None:
    c = _cfg([{"model": "m1", "weight": 1}, {"model": "m3", "shadow": {"budget_scope": "ops", "sample": 0.2}}])
    assert c.resolve_model("a") == ("m1",)
    r = rollouts_of(c)["a"]
    assert r.arms == ("m1",) and [(m, s.sample, s.budget_scope) for m, s in r.shadows] == [("m3", 0.2, "ops")]


@pytest.mark.parametrize("shadow,extra,where", [
    ({"budget_scope": "ops", "sample": 0}, {}, r"targets\[1\]\.shadow\.sample"),
    ({"budget_scope": "ops", "sample": 1.5}, {}, r"targets\[1\]\.shadow\.sample"),
    ({"budget_scope": " "}, {}, r"targets\[1\]\.shadow\.budget_scope"),
    ({"budget_scope": "ops"}, {"weight": 3}, r"targets\[1\]\.shadow"),
    ({"sample": 0.5}, {}, "budget_scope"),
])
def test_a_bad_shadow_names_its_key(shadow: dict, extra: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=where):
        _cfg([{"model": "m1", "weight": 1}, {"model": "m3", "shadow": shadow, **extra}])


def test_a_shadow_model_must_be_served() -> None:
    with pytest.raises(ConfigError, match=r"aliases\[0\]\.targets\[1\].*nope"):
        _cfg([{"model": "m1", "weight": 1}, {"model": "nope", "shadow": {"budget_scope": "ops"}}])


def test_a_transcription_is_copied_as_the_same_form_to_the_shadow_model() -> None:
    """A shadow copy of a multipart request is encoded by its endpoint's media type (it was JSON-encoded, which
    failed on the uploaded file): the same audio bytes, the shadow model named in the form."""
    import httpx

    from gateway.api.endpoints import BY_NAME
    from gateway.api.media import FORM

    audio = bytes(range(256)) * 40
    req = httpx.Request("POST", "http://x/v1/audio/transcriptions", data={"model": "stt-v1", "language": "en"},
                        files={"file": ("talk.wav", audio, "audio/wav")})
    raw = req.read()
    body = FORM.decode(raw, req.headers["content-type"])
    ep = BY_NAME["transcriptions"]
    copy = shadow_body(body, "stt-v2")
    ep.parse(copy)  # what the copy's request is prepared from
    encoded = ep.media.encode(copy)
    again = FORM.decode(encoded, ep.media.content_type(encoded))
    assert again["model"] == "stt-v2" and again["language"] == "en"
    assert bytes(again["file"].data) == audio
