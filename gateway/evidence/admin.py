"""GET /admin/decisions/{request_id}: the audit record of one request (wired behind the admin guard).

A platform admin reads every record; a tenant admin only records of its own tenant: another tenant's id is
404 exactly like an unknown one, so ids are not confirmed to outsiders."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.evidence.recorder import EvidenceRecorder, _dumps


def make_decision_handler(recorder: EvidenceRecorder | Callable[[], EvidenceRecorder],
                          ) -> Callable[..., Awaitable[Response]]:
    """A Starlette endpoint for Route("/admin/decisions/{request_id}", ...); 404 OpenAI-shaped when unknown.
    Behind the guard it is called with the admin principal, which scopes the answer to its tenant."""

    async def handler(request: Request, principal: Any = None) -> Response:
        rec_obj = recorder() if callable(recorder) and not isinstance(recorder, EvidenceRecorder) else recorder
        rid = request.path_params["request_id"]
        rec = await rec_obj.get(rid)
        if rec is not None and principal is not None and "admin" not in principal.roles:
            owner = (rec.get("principal") or {}).get("tenant") if isinstance(rec.get("principal"), dict) else None
            if owner != principal.tenant:
                rec = None
        if rec is None:
            err = GatewayError(404, f"no decision recorded for request {rid!r}", code="not_found")
            return Response(err.to_bytes(), status_code=404, media_type="application/json")
        return Response(_dumps(rec), media_type="application/json")

    return handler
