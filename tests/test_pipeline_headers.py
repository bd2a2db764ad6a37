"""RequestHeaders: the data plane's per-request header map (gateway/pipeline.py)."""
from __future__ import annotations

from starlette.datastructures import Headers

from gateway.pipeline import RequestHeaders
from gateway.policy.stage import lower_headers


def test_built_from_the_asgi_scope_like_starlette_reads_it() -> None:
    raw = [(b"authorization", b"Bearer a"), (b"x-session-id", b"s1"), (b"authorization", b"Bearer b"),
           (b"x-note", "caf\xe9".encode("latin-1"))]
    h = RequestHeaders.from_scope({"headers": raw})
    assert RequestHeaders.from_scope({"headers": [(b"X-Session-Id", b"s1")]}) == {"x-session-id": "s1"}
    s = Headers(scope={"type": "http", "headers": raw})
    # the first of a repeated header wins, as starlette's Headers.get: a second Authorization cannot override
    assert h.get("authorization") == s.get("authorization") == "Bearer a"
    assert h["X-SESSION-ID"] == h.get("x-session-id") == s.get("x-session-id") == "s1"  # case-insensitive
    assert "X-Session-Id" in h and "x-missing" not in h and h.get("x-missing", "d") == "d"
    assert h["x-note"] == "café"  # latin-1, as ASGI servers decode
    assert dict(h) == {"authorization": "Bearer a", "x-session-id": "s1", "x-note": "café"}


def test_policy_reads_it_without_copying() -> None:
    h = RequestHeaders.from_scope({"headers": [(b"x-data-class", b"secret"), (b"x-data-class", b"public")]})
    assert h.get("x-data-class") == "secret"
    assert lower_headers(h) is h  # already lower-case: no per-request copy
    assert lower_headers(Headers(headers={"X-A": "1"})) == {"x-a": "1"}
