"""The OpenAPI 3.1 description of the gateway's public data-plane API, served at GET /openapi.json.

Hand-written (the data plane is raw ASGI, nothing to introspect) and kept to what `gateway.api.parse` accepts,
so a schema-driven fuzzer (bench/fuzz_api.py, tests/hardening/test_schema_fuzz.py) can check that every
request, valid or not, gets a non-5xx answer and every refusal is the OpenAI error shape.
"""
from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_STOP = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}, {"type": "null"}]}
_SAMPLING = {
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 4},
    "stop": _STOP,
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": ["boolean", "null"]}}},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 64},
    "user": {"type": "string"},
    "seed": {"type": ["integer", "null"]},
    # OpenRouter-style provider preferences, tighten only (gateway/policy/provider_prefs.py): what the gateway
    # honours; anything else is refused with 400
    "provider": {"type": "object", "additionalProperties": False, "properties": {
        "zdr": {"type": "boolean"}, "data_collection": {"type": "string", "enum": ["allow", "deny"]},
        "allow_fallbacks": {"type": "boolean"},
        **{k: {"type": "array", "minItems": 1, "maxItems": 64, "uniqueItems": True,
               "items": {"type": "string", "minLength": 1, "maxLength": 256}} for k in ("only", "ignore", "order")}}},
}
_MODEL = {"type": "string", "minLength": 1, "maxLength": 256, "description": "a model or alias from GET /v1/models"}
_CONTENT_PART = {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string"}, "text": {"type": "string"}}}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _CONTENT_PART}, {"type": "null"}]},
        "name": {"type": "string"},
    },
}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "Invalid request (names the param)", 401: "Missing or invalid API key",
            403: "Denied by policy", 404: "Unknown model", 405: "Method not allowed",
            413: "Body larger than server.max_body_bytes", 415: "Content-Type is not application/json",
            429: "Budget, rate limit or admission refusal (Retry-After)", 502: "Upstream failed",
            503: "No healthy backend in the allowed residency class (Retry-After)", 504: "Upstream timed out"}
    return {str(s): {"description": text[s], "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


_POST_ERRORS = (400, 401, 403, 404, 413, 415, 429, 502, 503, 504)


def _completion_op(op_id: str, summary: str, schema_ref: str, streams: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {
        "operationId": op_id, "summary": summary,
        "requestBody": _json_body({"$ref": schema_ref}),
        "responses": {"200": {"description": "The upstream's answer (SSE when stream is true)", "content": ok},
                      **_errors(*_POST_ERRORS)},
    }}


def openapi_spec(server_url: str | None = None) -> dict[str, Any]:
    """The spec as a dict (JSON-able). `server_url` goes into `servers` when given."""
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Policy-engine LLM gateway", "version": "1",
                 "description": "OpenAI-compatible data plane. Every refusal is {error: {message, type, param, code}}."},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": _completion_op("createChatCompletion", "Chat completion (OpenAI-compatible)",
                                                   "#/components/schemas/ChatRequest", True),
            "/v1/completions": _completion_op("createCompletion", "Text completion (OpenAI-compatible)",
                                              "#/components/schemas/CompletionRequest", True),
            "/v1/embeddings": _completion_op("createEmbedding", "Embeddings (OpenAI-compatible)",
                                             "#/components/schemas/EmbeddingRequest", False),
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "Models with where they run and what they retain",
                "responses": {"200": {"description": "model list", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                        "type": "object", "required": ["id", "object"],
                        "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                       "context_window": {"type": ["integer", "null"]},
                                       "context_length": {"type": ["integer", "null"]}}}}}}}}},
                              **_errors(401)},
            }},
            "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness", "security": [],
                                 "responses": {"200": {"description": "alive", "content": {"application/json": {
                                     "schema": {"type": "object", "required": ["status"]}}}}}}},
            "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness (server.readiness): the process can serve; per-model health in the body",
                                "security": [],
                                "responses": {"200": {"description": "ready", "content": {"application/json": {
                                    "schema": {"type": "object", "required": ["status"]}}}},
                                    "503": {"description": "not ready", "content": {"application/json": {
                                        "schema": {"type": "object", "required": ["status"]}}}}}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "an API key (gw_<id>_<secret>, static key) or a JWT"}},
            "schemas": {
                "Error": _ERROR,
                "ChatRequest": {"type": "object", "required": ["model", "messages"], "properties": {
                    "model": _MODEL, "messages": {"type": "array", "minItems": 1, "maxItems": 8, "items": _MESSAGE},
                    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 64},
                    **_SAMPLING}},
                "CompletionRequest": {"type": "object", "required": ["model", "prompt"], "properties": {
                    "model": _MODEL,
                    "prompt": {"oneOf": [{"type": "string"},
                                         {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                         {"type": "array", "minItems": 1, "items": {"type": "integer"}}]},
                    **_SAMPLING}},
                "EmbeddingRequest": {"type": "object", "required": ["model", "input"], "properties": {
                    "model": _MODEL,
                    "input": {"oneOf": [{"type": "string"},
                                        {"type": "array", "minItems": 1, "items": {"type": "string"}},
                                        {"type": "array", "minItems": 1, "items": {"type": "integer"}}]},
                    "encoding_format": {"type": "string", "enum": ["float", "base64"]},
                    "user": {"type": "string"}}},
            },
        },
    }
    if server_url:
        spec["servers"] = [{"url": server_url}]
    return spec
