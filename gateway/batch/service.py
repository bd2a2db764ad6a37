"""The batch lane's service: validates jobs, runs their lines through the realtime pipeline at priority
`batch` in the fleet's spare capacity, and finalizes output and error files.

A line is an ordinary request of the job's owner: the authenticate stage re-checks the owner's principal
(a revoked key stops the batch), then policy, budget (reserve per line, settle per line, batch prices),
routing (residency filters, admission with the batch headroom) and the dispatcher run exactly as for a
realtime request, and the evidence recorder writes one audit record per line naming its batch and line.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import orjson

from gateway.batch.api import principal_from
from gateway.batch.jsonl import ENDPOINTS, parse_input, prompt_prefix
from gateway.batch.scheduler import Pacer, pick_jobs
from gateway.batch.scope import ALWAYS_RESTRICTED, owner_of, record_decisions
from gateway.batch.store import BatchStore, Line, PostgresBatchStore, SqliteBatchStore
from gateway.batch.upload import UploadSlots
from gateway.errors import GatewayError
from gateway.pipeline import Lifecycle, Pipeline, RequestContext, RequestHeaders

if TYPE_CHECKING:
    from gateway.app import Gateway
    from gateway.config import Config
    from gateway.types import Principal

log = logging.getLogger("gateway.batch")

# refusals that mean "not now" (the fleet or a rate window is full): the line goes back, nothing is recorded
DEFER_CODES = {"ttft_slo_unattainable", "request_shed", "rate_limit_exceeded", "budget_store_unavailable",
               "auth_rate_limited", "flow_queue_timeout", "flow_queue_full"}
RETRY_STATUSES = {502, 503, 504}
STOP_CODES = {"revoked_api_key", "expired_api_key", "invalid_api_key", "wrong_plane"}
TRANSIENT_SQLSTATE = ("08", "40", "53", "57", "58", "XX")  # connection, rollback, resources, operator, system


def store_unavailable(e: BaseException) -> bool:
    """The store itself failed (connection gone, database locked or busy, disk trouble): a condition of the
    store, not of one job, so the lane tries again later. Anything else the lane hits on a job (a row it cannot
    read or write, a value a serializer refuses, a bug) is that job's failure: the job fails, the others go on."""
    import sqlite3

    if isinstance(e, (ValueError, TypeError, KeyError, AttributeError)):
        return False  # data the job holds (asyncpg's client-side DataError is a ValueError too)
    if isinstance(e, (OSError, TimeoutError, sqlite3.OperationalError)):
        return True
    if type(e).__module__.split(".")[0] == "asyncpg":
        state = getattr(e, "sqlstate", None)
        return state is None or str(state)[:2] in TRANSIENT_SQLSTATE
    return False


def make_store(config: Config) -> BatchStore:
    """Postgres when the identity store is Postgres (replicas share jobs), else SQLite beside the identity DB."""
    ic, bc = config.raw.identity, config.raw.batch
    if ic.store == "postgres":
        dsn = ic.postgres_dsn or (os.environ.get(ic.postgres_dsn_env) if ic.postgres_dsn_env else None)
        if not dsn:  # the identity store refuses the same config (gateway/identity/service.py make_store)
            raise GatewayError(500, "identity.store is postgres (batches share its database) but no "
                               "postgres_dsn/postgres_dsn_env is set", code="config_error")
        return PostgresBatchStore(dsn, schema=ic.postgres_schema)
    if bc.sqlite_path:
        return SqliteBatchStore(config.resolve_path(bc.sqlite_path))
    return SqliteBatchStore(config.resolve_path(ic.sqlite_path).parent / "batch.db")


class BatchPriorityStage:
    """Runs after `decide` in the batch lane's own pipeline only: the line's decision gets priority `batch`
    (routing then holds it to the batch headroom, and the engine's scheduler runs it after realtime)."""

    name = "batch_priority"

    async def run(self, ctx: RequestContext) -> None:
        d = ctx.decision
        if ctx.batch is not None and d is not None and d.priority != "batch":
            ctx.decision = dataclasses.replace(d, priority="batch")
            if isinstance(ctx.evidence.get("decision"), dict):
                ctx.evidence["decision"]["priority"] = "batch"


class BatchService:
    def __init__(self, gw: Gateway, store: BatchStore | None = None,
                 pipeline_for: Callable[[Any, bool], Pipeline] | None = None) -> None:
        self.gw = gw
        # a line's pipeline by its input file's restriction and zero retention (gateway/wiring.py
        # `batch_pipeline`); unset (unit tests of the lane): the gateway's own
        self.pipeline_for = pipeline_for or (lambda restriction, zero: gw.pipeline)
        self.store = store or make_store(gw.config)
        self.worker = "w_" + os.urandom(6).hex()  # this replica's lease owner id
        self.pacer = Pacer(gw.config.raw.batch)
        self.inflight: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._rr = 0
        self._hold: dict[str, float] = {}  # batch id -> monotonic time before which it gets no new lines
        self.jobs: list[dict[str, Any]] = []  # in-progress jobs that may get lines (set by _maintain)
        self.upload_slots = UploadSlots()
        # one thread checks uploads, one at a time: Python code holds the GIL, so more threads would check no
        # faster, only take the GIL from the event loop more often (bench/uploads.py)
        self.upload_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-upload")
        self.stats = {"dispatched": 0, "completed": 0, "failed": 0, "deferred": 0, "retried": 0, "discarded": 0,
                      "jobs_failed": 0}

    # ------------------------------------------------------------------ lifecycle
    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: every tick reads `gw.config.raw.batch`."""

    async def start(self) -> None:
        await self.store.open()
        await self.store.migrate()
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        tasks = list(self.inflight.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        with contextlib.suppress(Exception):
            n = await self.store.release_all(self.worker)
            if n:
                log.info("batch lane stopped: %d line(s) in flight returned to pending", n)
        await self.store.close()
        self.upload_pool.shutdown(wait=False, cancel_futures=True)

    def kick(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ API helpers
    def line_limit(self) -> int:
        """The largest request line: batch.max_line_bytes, never above what the realtime API accepts as a body."""
        return min(self.gw.config.raw.batch.max_line_bytes, self.gw.config.server.max_body_bytes)

    def principal_valid_until(self, headers: Mapping[str, str], p: Principal) -> float | None:
        """A JWT principal holds until its token expires (the identity cache knows when); keys are re-checked."""
        if p.kind not in ("jwt", "partner") or not p.id.startswith("jwt:"):
            return None
        auth = headers.get("authorization") or ""
        token = auth.partition(" ")[2].strip() or (headers.get("x-api-key") or "").strip()
        until = self.gw.identity.token_valid_until(token) if self.gw.identity is not None else None
        return until if until is not None else time.time() + 300.0

    def owner(self, p: Principal) -> str:
        """The owner scope of what `p` creates or may see: tenant, team, project, partner and its restriction
        labels under the loaded policy (gateway/batch/scope.py)."""
        identity = self.gw.identity
        return owner_of(p, identity.restrictions.labels if identity is not None else ALWAYS_RESTRICTED)

    async def file_restriction(self, p: Principal, models: Iterable[str], headers: Mapping[str, str]
                               ) -> dict[str, Any]:
        """What policy decides for the uploader and this upload request (its headers) for every model the file
        names: the decision the file keeps and every batch over it runs within. A decision policy cannot make
        now (OPA unreachable, fail-closed) refuses the upload, so no file is kept without its decision."""
        from gateway.batch.scope import upload_headers
        from gateway.policy.model import RequestAttrs

        policy = self.gw.policy
        decisions = {}
        if policy is not None:
            hdrs = upload_headers(headers)
            for model in sorted(set(models)):
                attrs = RequestAttrs(model=model, headers=hdrs, max_tokens=None, stream=False, now=time.time())
                d = await policy.adecide(p, attrs)
                if not d.allow and d.deny_status != 403:
                    raise GatewayError(d.deny_status, f"policy decision unavailable ({d.deny_rule}): {d.reason}",
                                       code="policy_unavailable", headers={"retry-after": "1"})
                decisions[model] = d
        return record_decisions(decisions, zero_label=p.labels.get("retention") == "zero")

    async def input_models(self, file_id: str, owner: str) -> list[str] | None:
        """The models an input file names: from its upload's scan (nothing parsed again), or, for a file stored
        whole before uploads were scanned, from its content parsed in a worker thread. None: no such file, or
        (old files only) content that does not validate."""
        models = await self.store.file_models(file_id, owner)
        if models is not None:
            return models
        data = await self.store.file_content(file_id, owner)
        if data is None:
            return None
        bc = self.gw.config.raw.batch
        try:
            lines = await asyncio.to_thread(parse_input, data, bc.max_lines, self.line_limit())
        except GatewayError:
            return None
        return sorted({ln.body["model"] for ln in lines})

    async def zero_retention(self, p: Principal, file_id: str, owner: str) -> bool:
        """Whether policy says zero retention for this owner and any model the input file names."""
        models = await self.input_models(file_id, owner)
        policy = self.gw.policy
        if models is None or policy is None:
            return False
        from gateway.policy.model import RequestAttrs

        for model in models:
            attrs = RequestAttrs(model=model, headers={}, max_tokens=None, stream=False, now=time.time())
            d = await policy.adecide(p, attrs)
            if d.retention == "zero":
                return True
        return p.labels.get("retention") == "zero"

    # ------------------------------------------------------------------ the loop
    async def _loop(self) -> None:
        last_maint = last_renew = 0.0
        while not self._closing:
            bc = self.gw.config.raw.batch
            try:
                now = time.time()
                if now - last_renew >= bc.lease_s / 3:
                    last_renew = now
                    await self.store.renew(self.worker, now, bc.lease_s, list(self.inflight))
                if now - last_maint >= 0.25 or self._wake.is_set():
                    last_maint = now
                    self._wake.clear()
                    await self._maintain(now)
                await self._dispatch()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("batch loop step failed")
                await asyncio.sleep(1.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), bc.tick_s)

    async def _maintain(self, now: float) -> None:
        """Validate, expire and finalize the open jobs, each on its own: whatever fails on one job fails that job
        (`_job_failed`) and the step goes on with the next, so no job can stop the lane for the others."""
        bc = self.gw.config.raw.batch
        jobs = await self.store.jobs_in(("validating", "in_progress", "cancelling"))
        keep: list[dict[str, Any]] = []
        for job in jobs:
            phase = "reading"
            try:
                if job.get("corrupt"):
                    raise ValueError(f"its stored state cannot be read ({job['corrupt']})")
                if job["status"] == "validating":
                    phase = "validating"
                    await self._validate(job, now)
                    continue
                if job["status"] == "in_progress" and now >= job["expires_at"] and not job["stop_reason"]:
                    phase = "expiring"
                    await self.store.expire(job["id"], now)
                    self._cancel_lines(job["id"])
                phase = "finalizing"
                final = await self.store.finalize(job, now, lambda kind, data, j=job: self._file_row(j, kind, data),
                                                  bc.zero_retention_delete_after_s)
                if final is not None:
                    log.info("batch %s %s", job["id"], final)
                    continue
                keep.append(job)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await self._job_failed(job, phase, e, now)
        await self.store.purge_expired_files(now)
        self.jobs = [j for j in keep if j["status"] == "in_progress" and not j["stop_reason"]
                     and now < j["expires_at"]]

    def _cancel_lines(self, batch_id: str) -> None:
        for key, t in list(self.inflight.items()):
            if key[0] == batch_id:
                t.cancel()

    async def _job_failed(self, job: dict[str, Any], phase: str, e: BaseException, now: float) -> None:
        """The lane failed on one job. If the store itself is unavailable the job is tried again later (held
        back from dispatch a while); otherwise that job, and only it, fails with the reason: a validating job
        at once; an in-progress one stops (its unanswered lines end `batch_failed`) and is finalized `failed`
        with the answers it has; one whose finalizing failed ends `failed` without files."""
        bid = job["id"]
        self.jobs = [j for j in self.jobs if j["id"] != bid]
        if store_unavailable(e):
            log.warning("batch %s: the store failed while %s (%s); trying again", bid, phase, type(e).__name__)
            self._hold[bid] = time.monotonic() + 1.0
            return
        log.error("batch %s failed while %s; the job is failed, the lane goes on", bid, phase, exc_info=e)
        self.stats["jobs_failed"] += 1
        msg = (f"The gateway failed while {phase} this batch ({type(e).__name__}); the batch was stopped so other "
               "batches go on.")
        err = {"code": "batch_failed", "message": msg, "param": None, "line": None}
        self._cancel_lines(bid)
        try:
            if job["status"] == "validating":
                await self.store.fail_job(bid, [err], now)
            elif phase in ("finalizing", "reading"):
                await self.store.abort_job(bid, [err], now)
            else:
                await self.store.fail_open_job(bid, now, "batch_failed", msg)
                self.kick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: recording its failure failed; it is held back and tried again", bid)
            self._hold[bid] = time.monotonic() + 30.0

    def _file_row(self, job: dict[str, Any], kind: str, data: bytes) -> dict[str, Any]:
        return {"id": "file-" + os.urandom(12).hex(), "owner": job["owner"], "tenant": job["tenant"],
                "purpose": "batch_output", "filename": f"{job['id']}_{kind}.jsonl", "bytes": len(data),
                "created_at": time.time(), "content": data}

    async def _validate(self, job: dict[str, Any], now: float) -> None:
        """validating -> in_progress: the lines the upload's scan stored are copied to the job (nothing is
        parsed); a file stored whole before uploads were scanned is parsed in a worker thread, with the same
        checks as an upload."""
        bc = self.gw.config.raw.batch
        gone = [{"code": "file_not_found", "message": "The input file was deleted.", "param": "input_file_id",
                 "line": None}]
        if await self.store.get_file(job["input_file_id"], job["owner"]) is None:
            await self.store.fail_job(job["id"], gone, now)
            return
        state, errs = await self.store.start_job_from_file(job["id"], job["input_file_id"], job["endpoint"], now)
        if state == "mismatched":
            await self.store.fail_job(job["id"], errs, now)
            return
        if state == "started":
            log.info("batch %s in progress", job["id"])
        if state != "not_scanned":
            return
        data = await self.store.file_content(job["input_file_id"], job["owner"])
        if data is None:
            await self.store.fail_job(job["id"], gone, now)
            return
        try:
            lines = await asyncio.to_thread(parse_input, data, bc.max_lines, self.line_limit())
        except GatewayError as e:
            await self.store.fail_job(job["id"], [{"code": e.code, "message": e.message, "param": "input_file_id",
                                                   "line": e.extra.get("line")}], now)
            return
        bad = [ln for ln in lines if ln.url != job["endpoint"]]
        if bad:
            errs = [{"code": "mismatched_endpoint", "message": f"Line {ln.line_no}: url {ln.url} does not match the "
                     f"batch's endpoint {job['endpoint']}.", "param": "url", "line": ln.line_no} for ln in bad[:100]]
            await self.store.fail_job(job["id"], errs, now)
            return
        rows = [(ln.line_no, ln.custom_id, ln.body, prompt_prefix(ln.body, bc.prefix_chars)) for ln in lines]
        if await self.store.start_job(job["id"], rows, now):
            log.info("batch %s in progress: %d lines", job["id"], len(rows))

    async def _dispatch(self) -> None:
        if self.gw.draining:  # shutting down: start nothing new
            return
        mono = time.monotonic()
        jobs = [j for j in self.jobs if self._hold.get(j["id"], 0.0) <= mono]
        if not jobs:
            return
        room = self.pacer.allowance(self.gw, jobs, len(self.inflight))
        if room <= 0:
            return
        bc = self.gw.config.raw.batch
        order, self._rr = pick_jobs(jobs, self._rr)
        tenants = {j["tenant"] for j in order}
        share = max(1, -(-room // len(tenants)))  # each tenant's turn this tick: an equal part of the free slots
        left = dict.fromkeys(tenants, share)
        dry: set[str] = set()  # jobs with no line left to claim
        now = time.time()
        for first_pass in (True, False):  # then what a tenant could not use goes to the others, in the same order
            for job in order:
                if room <= 0:
                    return
                if job["id"] in dry:
                    continue
                want = min(room, left[job["tenant"]]) if first_pass else room
                while want > 0:  # a tenant's earliest-deadline job takes its part before its next job gets any
                    ask = min(want, 32)
                    try:
                        lines = await self.store.claim(job["id"], self.worker, now, bc.lease_s, ask)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # this job's failure, not the lane's: the other jobs still get lines
                        await self._job_failed(job, "dispatching", e, now)
                        dry.add(job["id"])
                        break
                    for ln in lines:
                        key = (ln.batch_id, ln.line_no)
                        if key in self.inflight:  # our own lapsed lease taken again: the running task records
                            continue
                        room -= 1
                        want -= 1
                        left[job["tenant"]] -= 1
                        self.stats["dispatched"] += 1
                        self.inflight[key] = asyncio.create_task(self._run_line(job, ln))
                        self.inflight[key].add_done_callback(self._forget(key))
                    if len(lines) < ask:
                        dry.add(job["id"])
                        break

    # ------------------------------------------------------------------ one line
    def _forget(self, key: tuple[str, int]) -> Callable[[asyncio.Task[None]], None]:
        """The done-callback of a line's task: it is no longer in flight."""
        def done(_t: asyncio.Task[None]) -> None:
            self.inflight.pop(key, None)
        return done

    async def _run_line(self, job: dict[str, Any], ln: Line) -> None:
        try:
            await self._run_line_once(job, ln)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if store_unavailable(e):  # the store failed after the engine answered: the lease lapses, it runs again
                log.exception("batch %s line %d: recording its result failed", ln.batch_id, ln.line_no)
                return
            # a result the store cannot take (it would fail the same way every time the line ran): the line ends
            # with a 500 of the gateway's own instead, and if even that cannot be recorded the job fails
            log.exception("batch %s line %d: its result cannot be recorded; it ends internal_error", ln.batch_id,
                          ln.line_no)
            err = GatewayError(500, "The gateway could not record this request's result.", code="internal_error")
            result = {"id": "batch_req_" + os.urandom(12).hex(), "custom_id": ln.custom_id,
                      "response": {"status_code": 500, "request_id": None, "body": err.body()}, "error": None}
            try:
                if await self.store.record(ln, self.worker, False, result, time.time()):
                    self.stats["failed"] += 1
            except asyncio.CancelledError:
                raise
            except Exception as e2:
                await self._job_failed(job, "dispatching", e2, time.time())

    async def _run_line_once(self, job: dict[str, Any], ln: Line) -> None:
        bc = self.gw.config.raw.batch
        try:
            status, body, rid, err = await self.execute(job, ln)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed in the gateway", ln.batch_id, ln.line_no)
            status, body, rid, err = 500, {"error": {"message": "Internal gateway error.", "type": "server_error",
                                                     "code": "internal_error"}}, None, None
        now = time.time()
        code = err.code if err is not None else None
        if err is not None and code in DEFER_CODES:
            self.stats["deferred"] += 1
            self.pacer.pressure()
            try:  # the job waits as long as the refusal said (Retry-After), at least half a second
                wait = float(err.headers.get("retry-after-ms", 0)) / 1000
            except ValueError:
                wait = 0.0
            self._hold[ln.batch_id] = time.monotonic() + min(60.0, max(0.5, wait))
            await self.store.release(ln, self.worker, retried=False)
            return
        if err is not None and code in STOP_CODES:  # the owner's credential is gone: the whole job stops
            await self.store.release(ln, self.worker, retried=False)
            await self.store.stop_job(ln.batch_id, now, code, err.message, status="failed",
                                      response={"status_code": err.status, "request_id": rid, "body": err.body()})
            self.kick()
            return
        if status in RETRY_STATUSES and ln.tries + 1 < bc.max_attempts:
            self.stats["retried"] += 1
            await self.store.release(ln, self.worker, retried=True)
            return
        ok = status == 200
        result = {"id": "batch_req_" + os.urandom(12).hex(), "custom_id": ln.custom_id,
                  "response": {"status_code": status, "request_id": rid, "body": body}, "error": None}
        if await self.store.record(ln, self.worker, ok, result, now):
            self.stats["completed" if ok else "failed"] += 1
        else:
            self.stats["discarded"] += 1  # our lease lapsed and another replica took the line: its answer counts
        if code == "insufficient_quota":  # the budget ran out: stop dispatching this job, say why per line
            await self.store.stop_job(ln.batch_id, now, code, err.message if err else "budget exhausted",
                                      response={"status_code": 429, "request_id": None,
                                                "body": err.body() if err else None})
            self.kick()

    async def execute(self, job: dict[str, Any], ln: Line) -> tuple[int, Any, str | None, GatewayError | None]:
        """Run one line through the realtime pipeline and dispatcher as its owner, at priority `batch`.
        Returns (status, response body, the gateway request id, the refusal if one)."""
        from gateway.api.endpoints import BY_NAME, prepare
        from gateway.api.reply import complete_json, new_request_id
        from gateway.proxy.forward import JsonResult

        gw = self.gw
        ep = BY_NAME[ENDPOINTS[job["endpoint"]]]
        body = ln.body
        ctx = RequestContext(request_id=new_request_id(), endpoint=ep.name, headers=RequestHeaders(), body=body,
                             client_addr="batch")
        ctx.principal = principal_from(job["principal"])
        ctx.batch = {"batch_id": ln.batch_id, "line": ln.line_no, "custom_id": ln.custom_id,
                     "principal_valid_until": job.get("principal_valid_until")}
        try:
            parsed = ep.parse(body)
        except GatewayError as e:
            return e.status, e.body(), ctx.request_id, e
        prepare(ctx, parsed, orjson.dumps(body), gw.config)
        ctx.stream = False
        # never looser than the input file's decision, nor than the batch's zero retention (gateway/wiring.py)
        life = Lifecycle(self.pipeline_for(job.get("restriction"), bool(job.get("zero_retention"))), ctx)
        try:
            try:
                result = await life.run()
            except GatewayError as e:
                return e.status, e.body(), ctx.request_id, e
            if not isinstance(result, JsonResult):  # a stream (the body asked for none): read it to the end
                ctx.status, ctx.error = 502, "upstream_stream"
                with contextlib.suppress(Exception):
                    await result.response.aclose()
                refusal = GatewayError(502, "The upstream answered a batch line with a stream.", code="upstream_error")
                return 502, refusal.body(), ctx.request_id, None
            obj, err = await complete_json(life, result, ep.wire, json_errors=True)
            if err is not None:
                return 502, err.body(), ctx.request_id, None
            return result.status, obj, ctx.request_id, None
        finally:
            await life.finish()

    def snapshot(self) -> dict[str, Any]:
        return {"worker": self.worker, "inflight": len(self.inflight), **self.pacer.snapshot(), **self.stats,
                "uploads": self.upload_slots.total, "uploads_parsing": self.upload_slots.parsing}
