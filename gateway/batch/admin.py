"""Admin routes of the batch lane over every owner's batches: `GET /admin/batches` and
`POST /admin/batches/{batch_id}/cancel`.

A platform admin sees and cancels any tenant's batch; a tenant admin only its own tenant's (another tenant's
batch is 404, as if it did not exist; asking to list another tenant is 403 `tenant_forbidden`). Without these,
only the principal that created a batch could cancel it.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.routing import Route

from gateway.admin_guard import PLATFORM_ADMIN, TENANT_ADMIN, AdminGuard
from gateway.batch.api import _bad_cursor, _limit, _not_found, _store_error, batch_object, list_page
from gateway.batch.store import OPEN_STATES, TERMINAL_STATES
from gateway.errors import GatewayError
from gateway.types import Principal

if TYPE_CHECKING:
    from gateway.batch.service import BatchService

log = logging.getLogger("gateway.batch")
CANCELLABLE = ("validating", "in_progress", "cancelling")


def admin_batch_object(job: dict[str, Any]) -> dict[str, Any]:
    """The batch object as its owner sees it, and whose it is."""
    return {**batch_object(job), "tenant": job["tenant"], "owner": job["owner"]}


def _store_guard(handler: Any) -> Any:
    async def run(request: Request, p: Principal) -> Any:
        try:
            return await handler(request, p)
        except GatewayError:
            raise
        except Exception as e:
            if not _store_error(e):
                raise
            log.warning("batch store unavailable on %s: %s", request.url.path, type(e).__name__)
            raise GatewayError(503, "The batch store is unavailable; retry shortly.", code="batch_store_unavailable",
                               headers={"retry-after": "1"}) from None
    return run


def batch_admin_routes(svc: "BatchService", guard: AdminGuard) -> list[Route]:
    def platform(p: Principal) -> bool:
        return PLATFORM_ADMIN in p.roles

    async def list_batches(request: Request, p: Principal) -> Any:
        q = request.query_params
        tenant = q.get("tenant")
        if not platform(p):
            if tenant is not None and tenant != p.tenant:
                raise GatewayError(403, "You may not access this tenant.", code="tenant_forbidden", param="tenant")
            tenant = p.tenant
        status = q.get("status")
        if status is not None and status not in OPEN_STATES + TERMINAL_STATES:
            raise GatewayError(400, f"status must be one of {', '.join(OPEN_STATES + TERMINAL_STATES)}.",
                               code="invalid_request", param="status")
        limit = _limit(request)
        try:
            rows = await svc.store.list_jobs_admin(tenant, status, q.get("after"), limit + 1)
        except LookupError:
            raise _bad_cursor("batch") from None
        return list_page([admin_batch_object(r) for r in rows], limit)

    async def cancel_batch(request: Request, p: Principal) -> Any:
        bid = request.path_params["batch_id"]
        job = await svc.store.get_job(bid)
        if job is None or (not platform(p) and job["tenant"] != p.tenant):
            raise _not_found("batch", bid)
        if job["status"] not in CANCELLABLE:
            raise GatewayError(409, f"Batch {bid} is {job['status']}; only a validating or in-progress batch can be "
                                    "cancelled.", code="batch_not_cancellable")
        got = await svc.store.cancel_job(bid, job["owner"], time.time())
        assert got is not None  # read above, and jobs are never deleted
        log.info("batch %s cancelled by admin %s (tenant %s)", bid, p.id, job["tenant"])
        svc.kick()
        return admin_batch_object(got)

    both = (PLATFORM_ADMIN, TENANT_ADMIN)
    return [guard.route("/admin/batches", _store_guard(list_batches), ["GET"], both),
            guard.route("/admin/batches/{batch_id}/cancel", _store_guard(cancel_batch), ["POST"], both)]
