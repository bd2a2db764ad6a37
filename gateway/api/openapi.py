"""The OpenAPI 3.1 description of the gateway's public data-plane API, served at GET /openapi.json.

The request bodies' schemas are generated from the Structs the parsers validate with (gateway/api/bodies.py);
the operations around them are written here (the data plane is raw ASGI, nothing to introspect). A
schema-driven fuzzer (bench/fuzz_api.py, tests/hardening/test_schema_fuzz.py) can check that every
request, valid or not, gets a non-5xx answer and every refusal is the OpenAI error shape.
"""
from __future__ import annotations

from typing import Any

import msgspec

from gateway.api import bodies
from gateway.api.endpoints import ENDPOINTS, Doc, Endpoint
from gateway.api.media import FORM
from gateway.api.wire.anthropic import ANTHROPIC

_Json = dict[str, Any]  # a JSON object of the document

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

# Anthropic's error shape: every refusal on /v1/messages (gateway/api/wire/anthropic.py)
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}
# every endpoint's request body, in the endpoint table's order (gateway/api/endpoints.py Endpoint.doc)
REQUEST_BODIES: tuple[type[msgspec.Struct], ...] = tuple(e.doc.body for e in ENDPOINTS if e.doc is not None)


def _ref(cls: type[msgspec.Struct]) -> str:
    return bodies.REF.format(name=cls.__name__)


def _json_body(schema: _Json) -> _Json:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int, schema: str = "Error") -> _Json:
    text = {400: "Invalid request (names the param)", 401: "Missing or invalid API key",
            403: "Denied by policy", 404: "Unknown model", 405: "Method not allowed",
            413: "Body larger than server.max_body_bytes", 415: "Content-Type is not application/json",
            429: "Budget, rate limit or admission refusal (Retry-After)", 502: "Upstream failed",
            503: "No healthy backend in the allowed residency class (Retry-After)", 504: "Upstream timed out"}
    return {str(s): {"description": text[s], "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}
            for s in statuses}


_POST_ERRORS = (400, 401, 403, 404, 413, 415, 429, 502, 503, 504)


def _completion_op(doc: Doc) -> _Json:
    """An OpenAI-shaped JSON endpoint (chat, completions, embeddings, responses, pooling, tokenize, and any new one
    whose entry declares its Doc): nothing here names it."""
    ok: _Json = {"application/json": {"schema": {"type": "object"}}}
    if doc.streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {
        "operationId": doc.op_id, "summary": doc.summary,
        "requestBody": _json_body({"$ref": _ref(doc.body)}),
        "responses": {"200": {"description": "The upstream's answer (SSE when stream is true)", "content": ok},
                      **_errors(*_POST_ERRORS)},
    }}


def _transcription_op(doc: Doc) -> _Json:
    """POST /v1/audio/transcriptions: a multipart form in, JSON out (the transcript as text/plain for
    response_format text)."""
    errors = _errors(*_POST_ERRORS)
    errors["413"]["description"] = "The file is over 25 MiB (or the form over 26 MiB)"
    errors["415"]["description"] = "Content-Type is not multipart/form-data"
    return {"post": {
        "operationId": doc.op_id, "summary": doc.summary,
        "requestBody": {"required": True, "content": {"multipart/form-data": {
            "schema": {"$ref": _ref(doc.body)},
            "encoding": {"file": {"contentType": "audio/*, application/octet-stream"}}}}},
        "responses": {"200": {"description": "{text, usage: {type: tokens, input_tokens, output_tokens, "
                                             "total_tokens}}; verbose_json: {duration, language, text, segments}",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/plain": {"schema": {"type": "string"}}}},
                      **errors},
    }}


def _messages_op(doc: Doc) -> _Json:
    """POST /v1/messages: Anthropic-shaped, with its own auth header and error body."""
    return {"post": {
        "operationId": doc.op_id, "summary": doc.summary,
        "security": [{"bearer": []}, {"x-api-key": []}],
        "requestBody": _json_body({"$ref": _ref(doc.body)}),
        "responses": {"200": {"description": "A message (typed SSE events when stream is true)",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(*_POST_ERRORS, schema="AnthropicError")},
    }}


def _models_op() -> _Json:
    """GET /v1/models."""
    return {"get": {
        "operationId": "listModels", "summary": "Models with where they run and what they retain",
        "responses": {"200": {"description": "model list", "content": {"application/json": {"schema": {
            "type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
                "type": "object", "required": ["id", "object"],
                "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                               "context_window": {"type": ["integer", "null"]},
                               "context_length": {"type": ["integer", "null"]}}}}}}}}},
                      **_errors(401)},
    }}


def _probe_paths() -> _Json:
    """/healthz and /readyz: unauthenticated."""
    return {
        "/healthz": {"get": {"operationId": "healthz", "summary": "Liveness", "security": [],
                             "responses": {"200": {"description": "alive", "content": {"application/json": {
                                 "schema": {"type": "object", "required": ["status"]}}}}}}},
        "/readyz": {"get": {"operationId": "readyz", "summary": "Readiness (server.readiness): the process can serve; per-model health in the body",
                            "security": [],
                            "responses": {"200": {"description": "ready", "content": {"application/json": {
                                "schema": {"type": "object", "required": ["status"]}}}},
                                "503": {"description": "not ready", "content": {"application/json": {
                                    "schema": {"type": "object", "required": ["status"]}}}}}}},
    }


def _operation(ep: Endpoint, doc: Doc) -> _Json:
    """An endpoint's operation: Anthropic's wire and a multipart form have their own shapes; every other is an
    OpenAI-shaped JSON endpoint, documented from its entry alone."""
    if ep.wire is ANTHROPIC:
        return _messages_op(doc)
    if ep.media is FORM:
        return _transcription_op(doc)
    return _completion_op(doc)


def _paths() -> _Json:
    """The `paths` object: the endpoint table's entries in its order, then /v1/models and the probes."""
    return {**{ep.path: _operation(ep, ep.doc) for ep in ENDPOINTS if ep.doc is not None},
            "/v1/models": _models_op(), **_probe_paths()}


def request_schemas() -> _Json:
    """The request bodies' schemas and the schemas they refer to, generated from their Structs
    (gateway/api/bodies.py): the same declarations the parsers validate with."""
    _, schemas = msgspec.json.schema_components((*REQUEST_BODIES, *bodies.DOC_STRUCTS), ref_template=bodies.REF)
    return schemas


def _components() -> _Json:
    """The `components` object: security schemes and schemas."""
    return {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "an API key (gw_<id>_<secret>, static key) or a JWT"},
                            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                          "description": "the same API key, as Anthropic's SDKs send it"}},
        "schemas": {"Error": _ERROR, "AnthropicError": _ANTHROPIC_ERROR, **request_schemas()},
    }


def openapi_spec(server_url: str | None = None) -> _Json:
    """The spec as a dict (JSON-able). `server_url` goes into `servers` when given."""
    spec: _Json = {
        "openapi": "3.1.0",
        "info": {"title": "Policy-engine LLM gateway", "version": "1",
                 "description": "OpenAI-compatible data plane. Every refusal is {error: {message, type, param, code}}; "
                                "on /v1/messages Anthropic's {type: error, error: {type, message}}."},
        "security": [{"bearer": []}],
        "paths": _paths(),
        "components": _components(),
    }
    if server_url:
        spec["servers"] = [{"url": server_url}]
    return spec
