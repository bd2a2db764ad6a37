"""The simulator's HTTP plumbing shared by its API modules (server.py, anthropic_api.py, extra_api.py): vLLM's error
shape and reading a JSON body."""
from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

_ERR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> Response:
        body = {"error": {"message": self.message, "type": _ERR_TYPES.get(self.status, "BadRequestError"),
                          "param": self.param, "code": self.status}}
        return Response(orjson.dumps(body), self.status, media_type="application/json")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status, media_type="application/json")


async def read_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data
