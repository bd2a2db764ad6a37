"""Request ids and the bytes of a reply that every route shares (inference, unserved paths, the admin guard): the
id echoed in x-request-id, and an error in the endpoint's own shape with the retry headers clients act on."""
from __future__ import annotations

import os
import random
import re
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.wire.base import ClientWire
from gateway.api.wire.openai import OPENAI
from gateway.errors import GatewayError, retry_headers
from gateway.server_protocol import write_response

if TYPE_CHECKING:
    from gateway.pipeline import Lifecycle
    from gateway.proxy.forward import JsonResult

_RID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


_ids = random.Random(os.urandom(32))  # request-id randomness: seeded from the OS, never from random.seed()
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))  # a forked child draws its own ids


def new_request_id() -> str:
    """`req_` + 24 hex digits: the wall clock in milliseconds (12) then 48 random bits (12). Time-ordered ids
    keep the indexes keyed by them (the spend ledger's primary key in SQLite and Postgres, the audit sink)
    appending at their right edge instead of inserting at random pages, so an insert stays cheap as the table
    grows (bench/ledger_ids.py; docs/benchmarks.md, "Hot path choices": request ids).
    48 random bits per millisecond keep ids unique across replicas (two ids of one millisecond collide with
    probability 2^-48) and infeasible to guess; no syscall per request."""
    return "req_%012x%012x" % (int(time.time() * 1000) & 0xFFFFFFFFFFFF, _ids.getrandbits(48))


def client_request_id(headers: Any) -> str | None:
    """The client's own x-request-id when it is usable (1-128 of [A-Za-z0-9._:-]), else None."""
    rid = headers.get("x-request-id")
    return rid if rid and _RID.match(rid) else None


def request_id(headers: Any) -> str:
    """The id a response echoes in x-request-id: the client's when valid, else a new one."""
    return client_request_id(headers) or new_request_id()




async def send_bytes(send, status: int, body: bytes, headers: dict[str, str], content_type: bytes = b"application/json") -> None:
    if write_response(send, status, content_type, headers, body):  # under the gateway's server: one write
        return
    raw = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


SDK_MAX_RETRY_AFTER_S = 60.0  # the openai SDKs honour Retry-After up to this; above it they retry after ~1 s


def error_headers(err: GatewayError, rid: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Headers of an error response: every 429 and 503 carries Retry-After and retry-after-ms (1 s when the
    refusing stage named no better time), so a client or partner aggregator can fail over at once.

    `x-should-retry: false` (read first by the openai SDKs' retry logic) where retrying cannot help: every 403
    (a permission or residency answer does not change by asking again), `residency_unsatisfiable`, and a
    429/503 whose Retry-After is beyond the 60 s the SDKs honour (they would otherwise ignore it and retry at
    once, e.g. a monthly quota refused again and again)."""
    h = {"x-request-id": rid, **(extra or {}), **err.headers}
    lower = {k.lower(): v for k, v in h.items()}
    if err.status in (429, 503) and "retry-after" not in lower:
        h.update(retry_headers(1.0))
        lower = {k.lower(): v for k, v in h.items()}
    if "x-should-retry" not in lower and (err.status == 403 or err.code == "residency_unsatisfiable"
                                          or (err.status in (429, 503) and _retry_after_s(lower) > SDK_MAX_RETRY_AFTER_S)):
        h["x-should-retry"] = "false"
    return h


def _retry_after_s(lower: dict[str, str]) -> float:
    """The retry delay a response announces (retry-after-ms first, as the SDKs read it), 0 when none."""
    try:
        if "retry-after-ms" in lower:
            return float(lower["retry-after-ms"]) / 1000
        return float(lower.get("retry-after", 0))
    except ValueError:  # an HTTP-date Retry-After: the gateway never sends one
        return 0.0


async def send_error(send, err: GatewayError, rid: str, extra: dict[str, str] | None = None,
                     wire: ClientWire = OPENAI) -> None:
    """A refusal in the endpoint's own error shape (OpenAI's unless the endpoint's wire says otherwise)."""
    await send_bytes(send, err.status, wire.error_body(err), error_headers(err, rid, extra))


async def complete_json(life: Lifecycle, result: JsonResult, wire: ClientWire,
                        json_errors: bool = False) -> tuple[Any, GatewayError | None]:
    """A whole JSON answer, for the HTTP ingress and the batch lane alike: its status, and for a 200 its usage,
    its facts and the response cache's capture, read into the request, then the request completed (settled,
    recorded) before its bytes go anywhere. Returns the parsed body (None: an error body that is not JSON, passed
    on as it is) and, for a 200 that is not JSON, the 502 `upstream_bad_json` the request completed with; with
    `json_errors` (a batch line's output is JSON), for any answer that is not JSON."""
    ctx = life.ctx
    ctx.status = result.status
    try:
        obj = orjson.loads(result.body)
    except orjson.JSONDecodeError:
        obj = None
    if result.status == 200 or json_errors:
        if obj is None:
            ctx.status, ctx.error = 502, "upstream_bad_json"
            await life.finish()
            return None, GatewayError(502, "Upstream answered with invalid JSON.", code="upstream_error")
    if result.status == 200:
        ctx.usage = wire.usage(obj)
        wire.facts(ctx, obj)
        if ctx.cache is not None:
            ctx.cache.capture.json(obj)
        ctx.ttft_s = None  # a whole answer has no first token of its own
    await life.finish()
    return obj, None
