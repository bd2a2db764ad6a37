"""Refusal headers the openai SDKs act on (gateway/api/reply.py::error_headers): `x-should-retry: false` on every
403 (whatever its code), on `residency_unsatisfiable`, and on a 429/503 whose reset is beyond the 60 s the SDKs
honour; never where a retry can help (a short reset, a 5xx without one gets the default 1 s). The SDK's view of
the same headers, end to end: tests/e2e/test_sdk_refusals.py."""
from __future__ import annotations

import pytest

from gateway.api.reply import SDK_MAX_RETRY_AFTER_S, error_headers
from gateway.errors import GatewayError, retry_headers


def headers(status: int, code: str, retry_after_s: float | None = None) -> dict[str, str]:
    extra = retry_headers(retry_after_s) if retry_after_s is not None else {}
    return error_headers(GatewayError(status, "refused", code=code, headers=extra), "rid-1")


@pytest.mark.parametrize("status, code", [(403, "wrong_plane"), (403, "admin_required"), (403, "policy_denied"),
                                          (403, "residency_unsatisfiable"), (503, "residency_unsatisfiable")])
def test_permission_and_residency_refusals_are_not_retried(status, code):
    assert headers(status, code)["x-should-retry"] == "false"


@pytest.mark.parametrize("status", [429, 503])
def test_a_reset_beyond_what_the_sdk_honours_is_not_retried(status):
    h = headers(status, "insufficient_quota", 3600)
    assert h["x-should-retry"] == "false" and h["retry-after"] == "3600"
    h = headers(status, "insufficient_quota", SDK_MAX_RETRY_AFTER_S + 0.5)
    assert h["x-should-retry"] == "false"


@pytest.mark.parametrize("status, code, after", [(429, "rate_limited", 5), (429, "rate_limited", SDK_MAX_RETRY_AFTER_S),
                                                 (503, "no_healthy_backend", None), (401, "invalid_api_key", None),
                                                 (400, "invalid_request", None), (502, "upstream_error", None)])
def test_where_a_retry_can_help_the_sdk_decides(status, code, after):
    h = headers(status, code, after)
    assert "x-should-retry" not in h
    if status in (429, 503):
        assert float(h["retry-after-ms"]) / 1000 <= SDK_MAX_RETRY_AFTER_S  # the SDK honours this Retry-After


def test_a_stage_that_decided_itself_is_not_overridden():
    err = GatewayError(403, "refused", code="policy_denied", headers={"x-should-retry": "true"})
    assert error_headers(err, "rid")["x-should-retry"] == "true"
