"""Upstream 4xx answers reach the client in OpenAI's error shape (gateway/proxy/forward.py client_error_body)."""
from __future__ import annotations

import orjson

from gateway.proxy.forward import client_error_body


def _err(status: int, body: bytes) -> dict:
    out = orjson.loads(client_error_body(status, body))
    assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    return out["error"]


def test_vllm_numeric_code_becomes_a_string_code_and_message_type_param_are_kept() -> None:
    vllm = orjson.dumps({"error": {"message": "This model's maximum context length is 512 tokens.",
                                   "type": "BadRequestError", "param": "messages", "code": 400}})
    e = _err(400, vllm)
    assert e == {"message": "This model's maximum context length is 512 tokens.", "type": "BadRequestError",
                 "param": "messages", "code": "upstream_rejected"}


def test_partner_string_code_kept_extra_fields_dropped_message_bounded() -> None:
    body = orjson.dumps({"error": {"message": "m" * 2000, "type": "invalid_request_error", "code": "bad_model",
                                   "internal_trace": "secret-partner-detail"}, "debug": {"x": 1}})
    e = _err(404, body)
    assert e["code"] == "bad_model" and len(e["message"]) == 500 and e["type"] == "invalid_request_error"
    assert b"secret-partner-detail" not in client_error_body(404, body)


def test_non_json_or_odd_shapes_get_a_generic_openai_error() -> None:
    for body in (b"<html>Bad Request</html>", b"", b'{"detail": "nope"}', b'{"error": "flat string"}',
                 b'{"error": {"code": {"nested": 1}, "type": 5}}', b"[1, 2]",
                 orjson.dumps({"error": {"message": "x", "type": "t" * 65, "code": "c" * 65, "param": "p" * 65}})):
        e = _err(422, body)
        assert e["code"] == "upstream_rejected" and e["type"] == "invalid_request_error" and e["param"] is None
        assert isinstance(e["message"], str) and e["message"]
