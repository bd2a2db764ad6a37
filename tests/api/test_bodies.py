"""The request-body Structs (gateway/api/bodies.py) as validator and document: the walk that words a refusal
(gateway/api/validate.py) finds a fault exactly where msgspec refuses, for every body Struct, and the OpenAPI
request schemas are the Structs' own."""
from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from gateway.api import bodies
from gateway.api.endpoints import BY_NAME
from gateway.api.media import Upload
from gateway.api.openapi import REQUEST_BODIES, openapi_spec
from gateway.api.validate import explain, validate
from gateway.errors import GatewayError

junk = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**31) | st.floats(-3, 3) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
                    max_leaves=6)


def _near(t: mi.Type, depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of type `t`, mostly well-formed, with junk in their place now and then (at any depth)."""
    good = _valid(t, depth)
    return st.integers(0, 9).flatmap(lambda i: good if i < 8 else junk)


def _valid(t: mi.Type, depth: int) -> st.SearchStrategy[Any]:
    if isinstance(t, mi.Metadata):
        return _valid(t.type, depth)
    if isinstance(t, mi.UnionType):
        return st.one_of([_valid(m, depth) for m in t.types])
    if isinstance(t, mi.StructType):
        fields = {f.encode_name: _near(f.type, depth + 1) for f in t.fields}
        required = {f.encode_name for f in t.fields if f.required}
        return st.fixed_dictionaries({k: v for k, v in fields.items() if k in required},
                                     optional={k: v for k, v in fields.items() if k not in required})
    if isinstance(t, mi.ListType):
        return st.lists(_near(t.item_type, depth + 1), max_size=3 if depth < 3 else 0)
    simple = {mi.StrType: st.text(max_size=3), mi.IntType: st.integers(-2, 70), mi.FloatType: st.floats(-3, 3),
              mi.BoolType: st.booleans(), mi.NoneType: st.none(), mi.AnyType: junk,
              mi.DictType: st.dictionaries(st.text(max_size=3), junk, max_size=2)}
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    return simple[type(t)]


@pytest.mark.parametrize("cls", REQUEST_BODIES, ids=lambda c: c.__name__)
def test_the_walk_finds_a_fault_exactly_where_msgspec_refuses(cls):
    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(_valid(mi.type_info(cls), 0))
    def check(body: dict[str, Any]) -> None:
        try:
            msgspec.convert(body, cls)
            refused = False
        except msgspec.ValidationError:
            refused = True
        try:
            explain(body, cls)
            found = None
        except GatewayError as e:
            found = e
        assert refused == (found is not None), (body, found and found.message)
        if found is not None:
            assert found.status == 400 and found.param and found.code in (
                "missing_required_parameter", "invalid_type", "invalid_value"), found.body()

    check()


def test_a_refusal_names_the_first_fault_in_declared_order():
    body = {"stop": 5, "model": 7}  # msgspec meets `stop` first; the declared order puts `model` first
    with pytest.raises(GatewayError) as e:
        validate(body, bodies.ChatRequest)
    assert (e.value.param, e.value.code) == ("model", "invalid_type")
    assert e.value.message == "Invalid type for 'model': expected a string, got int."


def test_unknown_fields_pass_and_the_body_is_left_as_sent():
    body = {"model": "m", "messages": [{"role": "user", "content": "x", "weird": [1]}], "guided_json": {"a": 1},
            "top_k": 5}
    sent = msgspec.json.encode(body)
    req = validate(body, bodies.ChatRequest)
    assert req.model == "m" and msgspec.json.encode(body) == sent


def test_the_openapi_request_schemas_are_the_structs():
    _, generated = msgspec.json.schema_components((*REQUEST_BODIES, *bodies.DOC_STRUCTS), ref_template=bodies.REF)
    schemas = openapi_spec()["components"]["schemas"]
    for name, schema in generated.items():
        assert schemas[name] == schema
    refs = {op["post"]["requestBody"]["content"][ctype]["schema"]["$ref"].rsplit("/", 1)[1]
            for op in openapi_spec()["paths"].values() if "post" in op
            for ctype in op["post"]["requestBody"]["content"]}
    assert {c.__name__ for c in REQUEST_BODIES} <= refs


@pytest.mark.parametrize("name,body,param,code", [
    # a content part's rule comes before a later field's type
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}], "temperature": 9},
     "messages[0].content[0].text", "invalid_type"),
    # stream_options without stream is named before what is inside it
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": 5}},
     "stream_options", "invalid_value"),
    # content blocks in order: the first block's type before the second's shape
    ("messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{}, None]}], "top_k": -1},
     "messages[0].content[0].type", "invalid_type"),
    ("responses", {"model": "m", "input": [{"role": "x", "content": "y"}], "store": True}, "store", "unsupported_value"),
    ("responses", {"model": "m", "input": [{"role": "user", "content": [{"type": "nope"}]}], "stream_options": {}},
     "input[0].content[0].type", "invalid_value"),
    ("tokenize", {"messages": 5}, "model", "missing_required_parameter"),
    ("transcriptions", {"model": ["a", "b"], "file": Upload("a.wav", "audio/wav", b"x"), "temperature": "hot"},
     "model", "invalid_type"),
    ("transcriptions", {"model": "w", "file": Upload("a.wav", "audio/wav", b"x"), "temperature": "hot",
                        "language": "x" * 40}, "language", "invalid_value"),
])
def test_with_several_faults_the_first_in_the_fields_order_is_named(name, body, param, code):
    """Types and rules report in one order (the Struct's fields, each rule after its field), whichever finds the
    fault: the order the hand-written parsers checked in."""
    with pytest.raises(GatewayError) as e:
        BY_NAME[name].parse(body)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message
