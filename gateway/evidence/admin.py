"""GET /admin/decisions/{request_id}: the audit record of one request (wire behind the admin auth)."""
from __future__ import annotations

from typing import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.evidence.recorder import EvidenceRecorder, _dumps


def make_decision_handler(recorder: EvidenceRecorder | Callable[[], EvidenceRecorder],
                          ) -> Callable[[Request], Awaitable[Response]]:
    """A Starlette endpoint for Route("/admin/decisions/{request_id}", ...); 404 OpenAI-shaped when unknown."""

    async def handler(request: Request) -> Response:
        rec_obj = recorder() if callable(recorder) and not isinstance(recorder, EvidenceRecorder) else recorder
        rid = request.path_params["request_id"]
        rec = await rec_obj.get(rid)
        if rec is None:
            err = GatewayError(404, f"no decision recorded for request {rid!r}", code="not_found")
            return Response(err.to_bytes(), status_code=404, media_type="application/json")
        return Response(_dumps(rec), media_type="application/json")

    return handler
