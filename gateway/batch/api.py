"""OpenAI Files and Batch API routes: /v1/files and /v1/batches, shaped so the official SDK works unchanged.

Every route authenticates like the data plane (the same IdentityService) and scopes everything to the owner:
the tenant, team, project, partner and restriction labels of the caller (`owner_of`, gateway/batch/scope.py).
Another principal asking for an id it does not own gets 404, the same answer as for an id that does not exist.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.batch.jsonl import ENDPOINTS
from gateway.batch.store import new_id
from gateway.batch.upload import create_file
from gateway.errors import GatewayError
from gateway.types import Principal

if TYPE_CHECKING:
    from gateway.batch.service import BatchService

log = logging.getLogger("gateway.batch")

COMPLETION_WINDOWS = {"24h": 86400.0}
METADATA_MAX_KEYS = 16


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": int(row["bytes"]), "created_at": int(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "expires_at": int(row["expires_at"]) if row.get("expires_at") else None, "status_details": None}


def _ts(v: Any) -> int | None:
    return int(v) if v is not None else None


def batch_object(job: dict[str, Any]) -> dict[str, Any]:
    total = int(job["total"])
    obj = {
        "id": job["id"], "object": "batch", "endpoint": job["endpoint"], "errors": job["errors"],
        "input_file_id": job["input_file_id"], "completion_window": job["completion_window"],
        "status": job["status"], "output_file_id": job["output_file_id"], "error_file_id": job["error_file_id"],
        "created_at": _ts(job["created_at"]), "in_progress_at": _ts(job["in_progress_at"]),
        "expires_at": _ts(job["expires_at"]), "finalizing_at": _ts(job["finalizing_at"]),
        "completed_at": _ts(job["completed_at"]), "failed_at": _ts(job["failed_at"]),
        "expired_at": _ts(job["expired_at"]), "cancelling_at": _ts(job["cancelling_at"]),
        "cancelled_at": _ts(job["cancelled_at"]),
        "request_counts": {"total": total, "completed": int(job["completed"]), "failed": int(job["failed"])},
        "metadata": job["metadata"],
    }
    # gateway extension (the SDK keeps unknown fields): what happens to the files of a zero-retention batch
    obj["retention"] = ({"zero_data_retention": True, "files_deleted_at": _ts(job["delete_files_at"]),
                         "note": "input deleted when the batch ends; output and error files "
                                 "deleted at files_deleted_at"}
                        if job["zero_retention"] else {"zero_data_retention": False})
    return obj


def _store_error(e: BaseException) -> bool:
    """The state store failed (SQLite file locked or gone, Postgres down or dropping the connection)."""
    import sqlite3

    return isinstance(e, (OSError, TimeoutError, sqlite3.OperationalError)) or \
        type(e).__module__.split(".")[0] == "asyncpg"


def _err(e: GatewayError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _not_found(what: str, ident: str) -> GatewayError:
    return GatewayError(404, f"No such {what}: '{ident[:80]}'.", code="not_found", param="id")


def _bad_cursor(what: str) -> GatewayError:
    return GatewayError(400, f"after must be the id of a {what} in this list (the last_id of the previous page).",
                        code="invalid_request", param="after")


def list_page(objects: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """OpenAI's cursor page over `limit + 1` fetched objects: the first `limit`, their first/last ids, and
    has_more when the extra one came back."""
    data = objects[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(objects) > limit}


def _limit(request: Request, default: int = 20, most: int = 100) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise GatewayError(400, f"limit must be an integer between 1 and {most}.", code="invalid_request",
                           param="limit")
    return int(raw)


_BatchHandler = Callable[[Request, Principal], Awaitable[Response]]


def _guarded(svc: "BatchService", handler: _BatchHandler) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint running `handler` for the caller authenticated like the data plane: a GatewayError becomes its
    JSON error, a failing state store a 503 with retry-after."""
    async def run(request: Request) -> Response:
        try:
            client = request.client.host if request.client else ""
            identity = svc.gw.identity
            if identity is None:  # the lane is wired only with an identity layer (gateway/wiring.py _wire_batch)
                raise GatewayError(503, "No identity layer is configured.", code="identity_unavailable")
            p = await identity.authenticate(request.headers, client)
            return await handler(request, p)
        except GatewayError as e:
            return _err(e)
        except Exception as e:
            if not _store_error(e):
                raise
            log.warning("batch store unavailable on %s: %s", request.url.path, type(e).__name__)
            return _err(GatewayError(503, "The batch store is unavailable; retry shortly.",
                                     code="batch_store_unavailable", headers={"retry-after": "1"}))
    return run


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except Exception:
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_request") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "The body must be a JSON object.", code="invalid_request")
    return body


def _check_batch_request(body: dict[str, Any]) -> tuple[str, str, dict[str, str] | None, str]:
    """The endpoint, completion window, metadata and input file id of a batch creation body, checked in that order."""
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise GatewayError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}.", code="invalid_request",
                           param="endpoint")
    window = body.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise GatewayError(400, "completion_window must be '24h'.", code="invalid_request",
                           param="completion_window")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > METADATA_MAX_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in meta.items())):
        raise GatewayError(400, f"metadata must map at most {METADATA_MAX_KEYS} strings (keys <= 64 chars) to "
                           "strings (<= 512 chars).", code="invalid_request", param="metadata")
    fid = body.get("input_file_id")
    if not isinstance(fid, str):
        raise GatewayError(400, "input_file_id must be the id of an uploaded file.", code="invalid_request",
                           param="input_file_id")
    return endpoint, window, meta, fid


class _Handlers:
    """The route handlers, over the batch service; every one gets the authenticated caller."""

    def __init__(self, svc: "BatchService") -> None:
        self.svc = svc

    # ------------------------------------------------------------------ files
    async def files_create(self, request: Request, p: Principal) -> Response:
        svc = self.svc

        async def decide(models: set[str]) -> dict[str, Any]:
            # the decision it is uploaded under: every batch over it runs within it, whoever creates the batch
            return {"restriction": await svc.file_restriction(p, models, request.headers)}

        # streamed to disk, its lines checked in a worker thread and stored as scanned (gateway/batch/upload.py)
        row = await create_file(svc, request, p, svc.owner(p), decide)
        return JSONResponse(file_object(row))

    async def files_list(self, request: Request, p: Principal) -> Response:
        limit = _limit(request, 10000, 10000)
        try:
            rows = await self.svc.store.list_files(self.svc.owner(p), request.query_params.get("purpose"),
                                                   request.query_params.get("after"), limit + 1)
        except LookupError:
            raise _bad_cursor("file") from None
        return JSONResponse(list_page([file_object(r) for r in rows], limit))

    async def file_get(self, request: Request, p: Principal) -> Response:
        fid = request.path_params["file_id"]
        owner = self.svc.owner(p)
        row = await self.svc.store.get_file(fid, owner)
        if row is None:
            raise _not_found("file", fid)
        if request.method == "DELETE":
            await self.svc.store.delete_file(fid, owner)
            return JSONResponse({"id": fid, "object": "file", "deleted": True})
        return JSONResponse(file_object(row))

    async def file_content(self, request: Request, p: Principal) -> Response:
        fid = request.path_params["file_id"]
        data = await self.svc.store.file_content(fid, self.svc.owner(p))
        if data is None:
            raise _not_found("file", fid)
        return Response(data, media_type="application/octet-stream")

    # ------------------------------------------------------------------ batches
    async def batches_create(self, request: Request, p: Principal) -> Response:
        svc = self.svc
        endpoint, window, meta, fid = _check_batch_request(await _json_object(request))
        owner = svc.owner(p)
        frow = await svc.store.get_file(fid, owner)
        if frow is None:
            raise GatewayError(404, f"No such file: '{fid[:80]}'.", code="not_found", param="input_file_id")
        if frow["purpose"] != "batch":
            raise GatewayError(400, f"File {fid} has purpose {frow['purpose']!r}; a batch needs a file uploaded with "
                               "purpose 'batch'.", code="invalid_request", param="input_file_id")
        now, bid = time.time(), new_id("batch_")
        job = {"id": bid, "owner": owner, "tenant": p.tenant, "principal": principal_row(p),
               "principal_valid_until": svc.principal_valid_until(request.headers, p), "endpoint": endpoint,
               "input_file_id": fid, "completion_window": window, "metadata": meta, "created_at": now,
               "expires_at": now + COMPLETION_WINDOWS[window],
               "zero_retention": await svc.zero_retention(p, fid, owner)}
        await svc.store.insert_job(job)
        svc.kick()
        got = await svc.store.get_job(bid, owner)
        assert got is not None  # just inserted for this owner, and jobs are never deleted
        return JSONResponse(batch_object(got))

    async def batches_list(self, request: Request, p: Principal) -> Response:
        limit = _limit(request)
        try:
            rows = await self.svc.store.list_jobs(self.svc.owner(p), request.query_params.get("after"), limit + 1)
        except LookupError:
            raise _bad_cursor("batch") from None
        return JSONResponse(list_page([batch_object(r) for r in rows], limit))

    async def batch_get(self, request: Request, p: Principal) -> Response:
        bid = request.path_params["batch_id"]
        job = await self.svc.store.get_job(bid, self.svc.owner(p))
        if job is None:
            raise _not_found("batch", bid)
        return JSONResponse(batch_object(job))

    async def batch_cancel(self, request: Request, p: Principal) -> Response:
        bid = request.path_params["batch_id"]
        owner = self.svc.owner(p)
        job = await self.svc.store.get_job(bid, owner)
        if job is None:
            raise _not_found("batch", bid)
        if job["status"] not in ("validating", "in_progress", "cancelling"):
            raise GatewayError(409, f"Batch {bid} is {job['status']}; only a validating or in-progress batch can be "
                               "cancelled.", code="batch_not_cancellable")
        job = await self.svc.store.cancel_job(bid, owner, time.time())
        assert job is not None  # read above for this owner, and jobs are never deleted
        self.svc.kick()
        return JSONResponse(batch_object(job))


def batch_routes(svc: "BatchService") -> list[Route]:
    h = _Handlers(svc)
    return [
        Route("/v1/files", _guarded(svc, h.files_create), methods=["POST"]),
        Route("/v1/files", _guarded(svc, h.files_list), methods=["GET"]),
        Route("/v1/files/{file_id}", _guarded(svc, h.file_get), methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", _guarded(svc, h.file_content), methods=["GET"]),
        Route("/v1/batches", _guarded(svc, h.batches_create), methods=["POST"]),
        Route("/v1/batches", _guarded(svc, h.batches_list), methods=["GET"]),
        Route("/v1/batches/{batch_id}", _guarded(svc, h.batch_get), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", _guarded(svc, h.batch_cancel), methods=["POST"]),
    ]


def principal_row(p: Principal) -> dict[str, Any]:
    """What the job keeps of its owner: enough to rebuild the Principal and to re-check it per line."""
    return {"id": p.id, "kind": p.kind, "tenant": p.tenant, "team": p.team, "project": p.project,
            "key_id": p.key_id, "partner": p.partner, "end_user": p.end_user, "labels": dict(p.labels),
            "scopes": list(p.scopes), "allowed_models": list(p.allowed_models)}


def principal_from(row: dict[str, Any]) -> Principal:
    return Principal(id=row["id"], kind=row["kind"], tenant=row["tenant"], team=row.get("team"),
                     project=row.get("project"), key_id=row.get("key_id"), partner=row.get("partner"),
                     end_user=row.get("end_user"), labels=dict(row.get("labels") or {}),
                     scopes=tuple(row.get("scopes") or ()), allowed_models=tuple(row.get("allowed_models") or ()))
