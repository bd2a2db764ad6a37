"""/openapi.json's operations come from the endpoint table (gateway/api/endpoints.py Endpoint.doc): every entry is
documented at its path with its operationId and the schema of the Struct its parser validates with, so a new JSON
endpoint is one entry, its body Struct and its parser (issue 36's files-per-change measure), nothing in openapi.py."""
from __future__ import annotations

import dataclasses

from gateway.api import bodies, openapi
from gateway.api.endpoints import BY_NAME, ENDPOINTS, Doc


def test_every_endpoint_is_documented_from_its_entry() -> None:
    paths = openapi.openapi_spec()["paths"]
    for ep in ENDPOINTS:
        assert ep.doc is not None, ep.name
        op = paths[ep.path]["post"]
        assert op["operationId"] == ep.doc.op_id and op["summary"] == ep.doc.summary
        body = op["requestBody"]["content"]
        (media,) = body
        assert body[media]["schema"] == {"$ref": bodies.REF.format(name=ep.doc.body.__name__)}
    assert openapi.REQUEST_BODIES == tuple(ep.doc.body for ep in ENDPOINTS if ep.doc is not None)


def test_a_new_json_endpoint_needs_nothing_in_openapi_py() -> None:
    """An OpenAI-shaped JSON entry with a Doc gets the completion operation, streaming where it says so."""
    ep = dataclasses.replace(BY_NAME["rerank"], name="classify", path="/v1/classify",
                             doc=Doc("classify", "Classify text", bodies.ScoreRequest, streams=True))
    op = openapi._operation(ep, ep.doc)["post"]
    assert op["operationId"] == "classify"
    assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": bodies.REF.format(name="ScoreRequest")}
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "400" in op["responses"] and "429" in op["responses"]
