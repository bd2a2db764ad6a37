"""OpenAI-shaped errors: every refusal the gateway makes is one of these; and `ConfigError`, a config that cannot
be used.

A stage raises `GatewayError`; the app turns it into `{"error": {message, type, param, code}}` with the
right status and headers. Messages never carry credentials or prompt content.
"""
from __future__ import annotations

from typing import Any

import orjson

# OpenAI's error `type` per status, as its API reports them.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ConfigError(Exception):
    """A config that cannot be used; `str()` names file:line: key: problem. Raised by gateway/config.py; defined
    here so that what the config loader imports (discovery's reload) can catch it without importing the loader."""


class GatewayError(Exception):
    """A refusal with an HTTP status, an OpenAI error body and optional extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        err.update(self.extra)
        return {"error": err}

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.body())

    def sse_event(self) -> bytes:
        """The error as the last SSE event of a stream that already started, followed by [DONE]."""
        return b"data: " + self.to_bytes() + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> GatewayError:
    return GatewayError(400, message, param=param, code=code)


def retry_headers(retry_after_s: float) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) and retry-after-ms, as OpenAI and partners read them."""
    ms = max(1, int(retry_after_s * 1000))
    return {"retry-after": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}
