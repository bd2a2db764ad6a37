"""complete_json (gateway/api/reply.py): the one way a whole JSON answer completes a request, for the HTTP ingress
and the batch lane. Pins: a 200's usage and facts are read before the completion steps run (the budget settles
on them); a 200 that is not JSON completes as 502 upstream_bad_json; an error answer that is not JSON passes as it
is, except where the caller needs JSON (a batch line); the request completes exactly once."""
from __future__ import annotations

import pytest

from gateway.api.reply import complete_json
from gateway.api.wire.openai import OPENAI
from gateway.completion import Completion, Step
from gateway.pipeline import Lifecycle, Pipeline, RequestContext
from gateway.proxy.forward import JsonResult


class Answer:
    name = "dispatch"

    def __init__(self, result: JsonResult) -> None:
        self.result = result

    async def run(self, ctx: RequestContext) -> None:
        ctx.result = self.result


async def complete(status: int, body: bytes, json_errors: bool = False) -> tuple[RequestContext, list, object]:
    seen: list = []

    async def settle(ctx: RequestContext) -> None:  # what the completion sees
        seen.append((ctx.status, ctx.error, ctx.usage.total_tokens if ctx.usage else None))

    ctx = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    life = Lifecycle(Pipeline([], Answer(JsonResult(status, body, None)), Completion([Step("settle", settle)])), ctx)
    result = await life.run()
    obj, err = await complete_json(life, result, OPENAI, json_errors=json_errors)
    await life.finish()  # a second finish (the batch lane's finally) does nothing
    return ctx, seen, (obj, err)


async def test_a_200_is_read_before_the_request_completes() -> None:
    body = b'{"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}'
    ctx, seen, (obj, err) = await complete(200, body)
    assert err is None and obj["id"] == "chatcmpl-1"
    assert seen == [(200, None, 5)]
    assert ctx.response_id == "chatcmpl-1"


@pytest.mark.parametrize("json_errors", [False, True])
async def test_a_200_that_is_not_json_completes_as_502(json_errors: bool) -> None:
    ctx, seen, (obj, err) = await complete(200, b"<html>oops", json_errors)
    assert obj is None and err is not None and err.status == 502 and err.code == "upstream_error"
    assert seen == [(502, "upstream_bad_json", None)]


async def test_an_error_answer_that_is_not_json_passes_unless_json_is_needed() -> None:
    _, seen, (obj, err) = await complete(503, b"upstream overloaded")
    assert (obj, err) == (None, None) and seen == [(503, None, None)]
    _, seen, (obj, err) = await complete(503, b"upstream overloaded", json_errors=True)
    assert obj is None and err is not None and seen == [(502, "upstream_bad_json", None)]
    _, seen, (obj, err) = await complete(429, b'{"error": {"message": "slow down"}}', json_errors=True)
    assert err is None and obj == {"error": {"message": "slow down"}} and seen == [(429, None, None)]
