"""Pure parts: key format, hashing, the failure limiter, model restrictions, header parsing."""
from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.identity import keys
from gateway.identity.ratelimit import FailureLimiter
from gateway.identity.directory import merge_labels
from gateway.identity.service import clean_end_user, extract_credential
from gateway.identity.stage import model_allowed
from gateway.types import Principal


def test_key_format_roundtrip_and_entropy() -> None:
    ids = {keys.new_key_id() for _ in range(200)}
    assert len(ids) == 200
    kid, secret = keys.new_key_id(), keys.new_secret()
    token = keys.format_key(kid, secret)
    assert token.startswith(f"gw_{kid}_")
    assert keys.parse_key(token) == (kid, secret)
    assert len(secret) == 40 and len(set(secret)) > 10


@pytest.mark.parametrize("bad", ["", "gw_", "gw_abc_def", "gw_" + "A" * 12 + "_" + "a" * 40,
                                 "gw_" + "a" * 12 + "_" + "a" * 39, "gw_" + "a" * 12 + "-" + "a" * 40,
                                 "xx_" + "a" * 12 + "_" + "a" * 40])
def test_malformed_keys_rejected(bad: str) -> None:
    assert keys.parse_key(bad) is None


def test_hash_compare() -> None:
    s = keys.new_secret()
    h = keys.hash_secret(s)
    assert s not in h and len(h) == 64
    assert keys.secret_matches(s, h)
    assert not keys.secret_matches(s[:-1] + ("a" if s[-1] != "a" else "b"), h)


def test_limiter_blocks_after_limit_then_recovers() -> None:
    lim = FailureLimiter(3, window_s=60)
    for _ in range(3):
        lim.check("1.2.3.4", now=0.0)
        lim.failure("1.2.3.4", now=1.0)
    with pytest.raises(GatewayError) as ei:
        lim.check("1.2.3.4", now=2.0)
    assert ei.value.status == 429 and ei.value.code == "auth_rate_limited"
    assert ei.value.headers["retry-after"] == "59"
    lim.check("5.6.7.8", now=2.0)  # other clients unaffected
    lim.check("1.2.3.4", now=61.0)  # window over


def test_limiter_prunes_memory() -> None:
    lim = FailureLimiter(3, window_s=60, max_clients=10)
    for i in range(50):
        lim.failure(f"10.0.0.{i}", now=float(i))
    assert len(lim._state) <= 10


def test_extract_credential() -> None:
    assert extract_credential({"authorization": "Bearer abc"}) == "abc"
    assert extract_credential({"authorization": "bearer  abc "}) == "abc"
    assert extract_credential({"x-api-key": "k"}) == "k"
    for h, code in [({}, "missing_api_key"), ({"authorization": "Basic Zm9vOmJhcg=="}, "invalid_api_key"),
                    ({"authorization": "Bearer"}, "invalid_api_key"), ({"x-api-key": "  "}, "missing_api_key")]:
        with pytest.raises(GatewayError) as ei:
            extract_credential(h)
        assert ei.value.status == 401 and ei.value.code == code
        assert "Zm9v" not in ei.value.message


def test_end_user_cleaning() -> None:
    assert clean_end_user(" user-42 ") == "user-42"
    for bad in ["", "x" * 300, "a\nb", "ü"]:
        with pytest.raises(GatewayError):
            clean_end_user(bad)


def test_merge_labels_later_wins() -> None:
    assert merge_labels({"a": "1", "b": "1"}, None, {"b": "2"}, {"c": "3"}) == {"a": "1", "b": "2", "c": "3"}


def test_model_allowed() -> None:
    p = Principal(id="k", kind="api_key", tenant="t", allowed_models=("qwen*",))
    assert model_allowed(p, "qwen3-8b")
    assert not model_allowed(p, "kimi-k3")
    assert model_allowed(p, "fast", ("qwen3-8b", "qwen3-4b"))
    assert not model_allowed(p, "fast", ("qwen3-8b", "kimi"))
    assert model_allowed(Principal(id="k", kind="api_key", tenant="t"), "anything")
