"""Assembly: the Gateway object (config snapshot, services, pipeline) and the Starlette app around it.

The data plane (`/v1/...`) is served by raw ASGI endpoints so a client disconnect can cancel the upstream
request at once and the hot path stays short; the admin plane and probes are ordinary Starlette routes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import orjson
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.parse import PARSERS, decode_json
from gateway.config import Config, ConfigError, load_config
from gateway.errors import GatewayError, retry_headers
from gateway.metrics import Metrics
from gateway.observability.logs import current_request
from gateway.observability.semconv import operation_name, provider_name
from gateway.pipeline import Pipeline, RequestContext, RequestHeaders, Stage
from gateway.proxy.forward import Dispatcher, JsonResult, response_facts, stream_body, usage_from
from gateway.proxy.health import Health, probe_loop
from gateway.proxy.upstream import Upstreams
from gateway.routing.plan import Candidate
from gateway.routing.stage import RouteStage, residency_reason
from gateway.types import Principal

log = logging.getLogger("gateway")

_RID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


STREAM_CUT_MARGIN_S = 1.0  # streams are cut this long before uvicorn's graceful-shutdown timeout cancels them


def new_request_id() -> str:
    return "req_" + os.urandom(12).hex()  # what secrets.token_hex does, without its three Python-level calls


def client_request_id(headers: Any) -> str | None:
    """The client's own x-request-id when it is usable (1-128 of [A-Za-z0-9._:-]), else None."""
    rid = headers.get("x-request-id")
    return rid if rid and _RID.match(rid) else None


def request_id(headers: Any) -> str:
    """The id a response echoes in x-request-id: the client's when valid, else a new one."""
    return client_request_id(headers) or new_request_id()


class NoIdentity:
    """The authenticate slot until gateway.wiring attaches the identity layer (gateway/identity): refuses every
    request, so a Gateway that was never wired fails closed instead of serving anonymous traffic."""

    name = "authenticate"

    async def run(self, ctx: RequestContext) -> None:
        raise GatewayError(503, "No identity layer is configured.", code="identity_unavailable")

    async def finish(self, ctx: RequestContext) -> None:
        return None


class ObserveStage:
    """First stage in, last out: on finish records metrics and hands the request to the finish hooks
    (evidence recorder, predictor feedback), so refusals are observed as well as successes."""

    name = "observe"

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw

    async def run(self, ctx: RequestContext) -> None:
        current_request.set(ctx)  # log records of this task carry the request id (gateway.observability.logs)

    async def finish(self, ctx: RequestContext) -> None:
        gw = self.gw
        m = gw.metrics
        ctx.total_s = time.perf_counter() - ctx.received_at
        backend = ctx.backend or "none"
        status = str(ctx.status or 200)
        tclass = (ctx.principal.labels.get("tier", "default") if ctx.principal else "anonymous")
        c = m.child
        model = ctx.model if ctx.model in gw.config.models or ctx.model in gw.config.aliases else "unknown"
        c(m.requests, ctx.endpoint, model, backend, status, tclass).inc()
        genai = (operation_name(ctx.endpoint), self._provider(ctx.backend), model, ctx.backend_model or "")
        c(m.duration, *genai, backend, error_type(ctx)).observe(ctx.total_s)
        if ctx.ttft_s is not None and ctx.backend:
            c(m.ttft, *genai, backend).observe(ctx.ttft_s)
        u = ctx.usage
        if u is not None and ctx.backend_model:
            c(m.tokens, *genai, "input").observe(u.prompt_tokens)
            c(m.tokens, *genai, "output").observe(u.completion_tokens)
            if ctx.stream and ctx.ttft_s is not None and u.completion_tokens > 1 and ctx.total_s > ctx.ttft_s:
                # decode time spread over the tokens after the first (what vLLM calls inter-token latency)
                c(m.tpot, *genai, backend).observe((ctx.total_s - ctx.ttft_s) / (u.completion_tokens - 1))
        for st, us in ctx.stage_timings_us.items():
            c(m.stage_seconds, st).observe(us / 1e6)
        for hook in gw.finish_hooks:
            try:
                await hook(ctx)
            except Exception:
                log.exception("finish hook failed for %s", ctx.request_id)


    def _provider(self, backend: str | None) -> str:
        if not backend:
            return ""
        try:
            return provider_name(self.gw.config.backend(backend).kind)
        except KeyError:  # a backend removed by a reload while the request ran
            return ""


_ERROR_TYPE = re.compile(r"^[a-z0-9_.]{1,64}$")


def error_type(ctx: RequestContext) -> str:
    """The semconv `error.type` of a finished request: "" on success, else the gateway's error code (bounded:
    a code-shaped string, else `_OTHER`), or the HTTP status when the upstream's error carried no code."""
    status = ctx.status or 200
    if status < 400 and not ctx.error:
        return ""
    if ctx.error:
        return ctx.error if _ERROR_TYPE.match(ctx.error) else "_OTHER"
    return str(status)


class Gateway:
    """Holds the current config snapshot and the services built from it. `reload` swaps the snapshot."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.time()
        self.metrics = Metrics()
        self.health = Health(config)
        self.upstreams = Upstreams(config)
        self.dispatcher = Dispatcher(lambda: self.upstreams, self.health, self._residency_check)
        self.finish_hooks: list[Callable[[RequestContext], Awaitable[None]]] = []
        self.services: list[Any] = []  # objects with async start()/close() and optional swap_config(config)
        self.auth: Any = NoIdentity()
        self.admin_auth: Callable[[Headers], Awaitable[Principal]] = self._no_admin_auth
        self._tasks: list[asyncio.Task] = []
        self._reload_lock = asyncio.Lock()
        self.streams: dict[asyncio.Task, RequestContext] = {}  # streams being sent, cut at the drain deadline
        self.draining = False
        self.stages: list[Stage] = self.build_stages()
        self.pipeline = Pipeline(self.stages)
        self.extra_routes: list[Route] = []
        # subsystems attached by gateway.wiring.wire (None when not wired, e.g. in unit tests)
        self.identity: Any = None
        self.policy: Any = None
        self.telemetry: Any = None
        self.evidence: Any = None

    # ---- assembly
    def build_stages(self) -> list[Stage]:
        """The request pipeline, in order. Each stage is one concept; see gateway/pipeline.py."""
        return [
            ObserveStage(self),
            self.auth,
            RouteStage(lambda: self.config, self.health),
        ]

    def _residency_check(self, ctx: RequestContext, cand: Candidate) -> str | None:
        return residency_reason(ctx.decision, cand.backend)

    async def start(self) -> None:
        for s in self.services:
            await s.start()
        import httpx

        self._probe_client = httpx.AsyncClient(trust_env=False)
        self._tasks.append(asyncio.create_task(probe_loop(lambda: self.config, self.health, self._probe_client,
                                                          self.upstreams.probe_client)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in reversed(self.services):
            try:
                await s.close()
            except Exception:
                log.exception("closing %s failed", type(s).__name__)
        await self.upstreams.aclose()
        await self._probe_client.aclose()

    async def reload(self) -> Config:
        """Load the config file again and swap it in whole; a broken file leaves the old snapshot serving."""
        async with self._reload_lock:
            if self.config.path is None:
                raise ConfigError("no config file to reload from")
            try:
                new = await asyncio.to_thread(load_config, self.config.path)
                new = Config(raw=new.raw, path=new.path, base_dir=new.base_dir, models=new.models,
                             aliases=new.aliases, generation=self.config.generation + 1)
                for s in self.services:
                    check = getattr(s, "check_config", None)
                    if check is not None:
                        check(new)  # may raise ConfigError (e.g. a broken policy file)
            except ConfigError:
                self.metrics.reloads.labels("refused").inc()
                raise
            self.upstreams.swap_config(new)
            self.health.swap_config(new)
            for s in self.services:
                swap = getattr(s, "swap_config", None)
                if swap is not None:
                    res = swap(new)
                    if asyncio.iscoroutine(res):
                        await res
            self.config = new
            self.metrics.reloads.labels("ok").inc()
            log.info("config reloaded (generation %d)", new.generation)
            return new

    def begin_drain(self) -> None:
        """Shutdown began (SIGTERM): uvicorn stops accepting and waits `server.graceful_shutdown_s` for open
        requests, then cancels them. Streams still running shortly before that are ended by us instead, with an
        error event (`server_shutting_down`) and [DONE], so the client learns why and what was settled."""
        if self.draining:
            return
        self.draining = True
        grace = self.config.server.graceful_shutdown_s
        asyncio.get_running_loop().call_later(max(0.0, min(grace - STREAM_CUT_MARGIN_S, grace * 0.8)),
                                              self.cut_streams)

    def cut_streams(self) -> int:
        """End every stream still being sent with an error event (see begin_drain); returns how many."""
        n = 0
        for task, ctx in list(self.streams.items()):
            if not task.done():
                ctx.cut_by_shutdown = True
                ctx.status, ctx.error = 503, "server_shutting_down"  # before the cancel: the stream's own
                task.cancel()  # cleanup may settle and record it before the handler sees the CancelledError
                n += 1
        if n:
            log.warning("drain deadline: cut %d stream(s) still running", n)
        return n

    async def _no_admin_auth(self, headers: Headers) -> Principal:
        raise GatewayError(503, "No identity layer is configured.", code="identity_unavailable")


# ------------------------------------------------------------------------------------------- ASGI plumbing


async def send_bytes(send, status: int, body: bytes, headers: dict[str, str], content_type: bytes = b"application/json") -> None:
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


def server_timing(ctx: RequestContext | None, since: float, dispatched: float | None = None,
                  answered: float | None = None) -> str:
    """The Server-Timing value of a response: `gw` is the gateway's own time (ms) from the parsed body (or the
    start of the request, for a refusal before one) to the response headers, the upstream's wait excluded;
    `upstream` the dispatcher's wait for the backend (attempts and fallbacks included, a stream's first bytes
    only); then each pipeline stage's own time."""
    now = time.perf_counter()
    if dispatched is None:
        parts = [f"gw;dur={(now - since) * 1000:.3f}"]
    else:
        up = (answered if answered is not None else now) - dispatched
        parts = [f"gw;dur={(now - since - up) * 1000:.3f}", f"upstream;dur={up * 1000:.3f}"]
    if ctx is not None:
        parts += [f"{st};dur={us / 1000:.3f}" for st, us in ctx.stage_timings_us.items()]
    return ", ".join(parts)


async def send_error(send, err: GatewayError, rid: str, extra: dict[str, str] | None = None) -> None:
    await send_bytes(send, err.status, err.to_bytes(), error_headers(err, rid, extra))


async def read_body(receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError("client disconnected")
        body = msg.get("body", b"")
        if body:
            size += len(body)
            if size > limit:
                raise GatewayError(413, f"Request body is larger than the limit of {limit} bytes.",
                                   code="request_too_large")
            chunks.append(body)
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


async def _until_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class CompletionEndpoint:
    """POST /v1/chat/completions, /v1/completions, /v1/embeddings: parse -> pipeline -> dispatch -> respond."""

    def __init__(self, gw: Gateway, endpoint: str) -> None:
        self.gw = gw
        self.endpoint = endpoint
        self.parse = PARSERS[endpoint]

    async def __call__(self, scope, receive, send) -> None:
        gw = self.gw
        headers = RequestHeaders.from_scope(scope)
        # The client's x-request-id is echoed, never trusted as a key: budgets (reservation, settle marker),
        # the spend ledger, routing's in-flight table and the audit record are keyed by an id the gateway
        # generates for every request, so a client reusing an id cannot merge, skip or overwrite them.
        t0 = time.perf_counter()
        cid = client_request_id(headers)
        rid = cid or new_request_id()
        if scope["method"] != "POST":
            await send_error(send, GatewayError(405, "Method not allowed; use POST.", code="method_not_allowed"), rid,
                             {"allow": "POST", "server-timing": server_timing(None, t0)})
            return
        limit = gw.config.server.max_body_bytes
        try:
            ctype = headers.get("content-type", "")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                raise GatewayError(415, "Content-Type must be application/json.", code="unsupported_media_type")
            cl = headers.get("content-length")
            if cl is not None:
                if not cl.isdigit():
                    raise GatewayError(400, "Invalid Content-Length header.", code="invalid_request")
                if int(cl) > limit:
                    raise GatewayError(413, f"Request body is larger than the limit of {limit} bytes.",
                                       code="request_too_large")
            try:
                if scope.get("gateway.body_complete"):  # already buffered by the server protocol: no wait
                    raw = await read_body(receive, limit)
                else:
                    async with asyncio.timeout(gw.config.server.body_timeout_s):  # slow-loris uploads
                        raw = await read_body(receive, limit)
            except TimeoutError:
                err = GatewayError(408, "Request body not received in time.", code="request_timeout")
                gw.metrics.rejections.labels("parse", "request_timeout").inc()
                await send_error(send, err, rid, {"connection": "close", "server-timing": server_timing(None, t0)})
                return
            try:
                body = decode_json(raw)
                parsed = self.parse(body)
            except GatewayError as bad_body:
                # Authenticate before answering about the body: an unauthenticated caller learns nothing about
                # validation (it gets 401, not 400). Only on this refusal path: a good body is authenticated by
                # the pipeline as usual. The cheap checks above (415, 413, 408) still come first.
                await self._authenticate(headers, rid, scope)
                raise bad_body
        except GatewayError as e:
            stage = "authenticate" if e.status in (401, 403) or e.code == "auth_rate_limited" else "parse"
            gw.metrics.rejections.labels(stage, e.code or "error").inc()
            # a 413 leaves the body unread: close the connection (the server drains a bounded amount first,
            # gateway/server_protocol.py) instead of reading an unbounded body on a kept-alive connection
            extra = {"server-timing": server_timing(None, t0)}
            if e.status == 413:
                extra["connection"] = "close"
            await send_error(send, e, rid, extra)
            return
        except asyncio.CancelledError:
            return
        client = scope.get("client")
        ctx = RequestContext(request_id=rid if cid is None else new_request_id(), endpoint=self.endpoint,
                             headers=headers, body=body, client_addr=client[0] if client else "")
        if cid is not None:  # echoed as x-request-id; the gateway's own id rides along for the audit lookup
            ctx.client_request_id = cid
            ctx.extra_headers["x-request-id"] = cid
            ctx.extra_headers["x-gateway-request-id"] = ctx.request_id
        ctx.model = parsed.model
        ctx.stream = parsed.stream
        ctx.client_wants_usage = parsed.include_usage
        ctx.max_tokens = parsed.max_tokens
        ctx.prompt_tokens_est = max(1, parsed.prompt_chars // 4)
        ctx.prompt_tokens_max = prompt_token_bound(raw, body, parsed.prompt_chars)
        ctx.model_chain = gw.config.resolve_model(parsed.model)
        # A vanished client cancels upstream work at once: this task is cancelled, which unwinds the handler
        # (closing the upstream connection) right away. Under the gateway's own server protocol the connection
        # tells us (no extra task); under any other ASGI server a watcher task waits on receive() instead.
        me = asyncio.current_task()
        gone = False

        def lost() -> None:
            nonlocal gone
            gone = True
            if me is not None:
                me.cancel()

        conn = scope.get("gateway.conn")
        watcher: asyncio.Future | None = None
        if conn is not None:
            conn.on_lost = lost
        else:
            async def watch() -> None:
                await _until_disconnect(receive)
                lost()

            watcher = asyncio.ensure_future(watch())
        try:
            await self._handle(ctx, send)
        except asyncio.CancelledError:
            if not gone:
                raise
            if me is not None:
                me.uncancel()  # the cancellation was ours, for a client that left: nothing more to do
        finally:
            if watcher is not None:
                watcher.cancel()
            elif conn.on_lost is lost:
                conn.on_lost = None

    async def _authenticate(self, headers: RequestHeaders, rid: str, scope) -> None:
        """Run the authenticate stage alone (for a request whose body is refused); raises its refusal."""
        client = scope.get("client")
        ctx = RequestContext(request_id=rid, endpoint=self.endpoint, headers=headers, body={},
                             client_addr=client[0] if client else "")
        await self.gw.auth.run(ctx)

    async def _handle(self, ctx: RequestContext, send) -> None:
        gw = self.gw
        started: list[Stage] = []
        finished = False
        dispatched: float | None = None
        answered: float | None = None
        try:
            try:
                started = await gw.pipeline.run(ctx)
                dispatched = time.perf_counter()
                result = ctx.answer if ctx.answer is not None else await gw.dispatcher.open(ctx)
                answered = time.perf_counter()
            except GatewayError as e:
                if dispatched is not None:
                    answered = time.perf_counter()  # the dispatcher refused (no backend answered in time, ...)
                ctx.status = e.status
                ctx.error = e.code
                gw.metrics.rejections.labels(_stage_of(ctx, gw.pipeline.stages), e.code or "error").inc()
                if started:
                    finished = True
                    await Pipeline.finish(ctx, started)
                await send_error(send, e, ctx.request_id,
                                 {**ctx.extra_headers,
                                  "server-timing": server_timing(ctx, ctx.received_at, dispatched, answered)})
                return
            hdrs = {"x-request-id": ctx.request_id, **ctx.extra_headers}
            if isinstance(result, JsonResult):
                ctx.status = result.status
                if result.status == 200:
                    try:
                        obj = orjson.loads(result.body)
                        ctx.usage = usage_from(obj)
                        response_facts(ctx, obj)
                        if ctx.cache is not None:
                            ctx.cache.capture.json(obj)
                    except orjson.JSONDecodeError:
                        ctx.status, ctx.error = 502, "upstream_bad_json"
                        err = GatewayError(502, "Upstream answered with invalid JSON.", code="upstream_error")
                        finished = True
                        await Pipeline.finish(ctx, started)
                        await send_error(send, err, ctx.request_id, {
                            **ctx.extra_headers,
                            "server-timing": server_timing(ctx, ctx.received_at, dispatched, answered)})
                        return
                    ctx.ttft_s = None
                finished = True
                await Pipeline.finish(ctx, started)
                hdrs["server-timing"] = server_timing(ctx, ctx.received_at, dispatched, answered)
                await send_bytes(send, result.status, result.body, hdrs)
                return
            # stream
            ctx.status = 200

            async def on_end() -> None:
                nonlocal finished
                if not finished:
                    finished = True
                    task = asyncio.current_task()
                    if task is not None and task.cancelling() and not ctx.cut_by_shutdown:
                        # the client left mid-stream (its connection dropped and cancelled us): record 499 and
                        # what was delivered, not the 200 the response started with
                        ctx.status = 499 if ctx.status in (0, 200) else ctx.status
                        ctx.error = ctx.error or "client_disconnected"
                    await Pipeline.finish(ctx, started)

            hdrs["server-timing"] = server_timing(ctx, ctx.received_at, dispatched, answered)
            raw = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
            raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]
            await send({"type": "http.response.start", "status": 200, "headers": raw})
            replay = getattr(result, "replay", None)  # a cache hit (gateway/cache/replay.py)
            gen = replay(ctx, on_end) if replay is not None else stream_body(ctx, result, on_end)
            capture = ctx.cache.capture if ctx.cache is not None and replay is None else None
            me = asyncio.current_task()
            gw.streams[me] = ctx  # type: ignore[index]
            try:
                try:
                    async for chunk in gen:
                        if capture is not None:
                            capture.chunk(chunk)
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except asyncio.CancelledError:
                    if not ctx.cut_by_shutdown:
                        raise
                    me.uncancel()  # type: ignore[union-attr]  # our own cut at the drain deadline
                    await on_end()  # settle what was delivered before the client sees the end
                    err = GatewayError(503, "The gateway is shutting down and cut this stream at its drain deadline; "
                                       "retry the request.", code="server_shutting_down")
                    await send({"type": "http.response.body", "body": err.sse_event(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                gw.streams.pop(me, None)  # type: ignore[arg-type]
                await gen.aclose()
        except asyncio.CancelledError:
            ctx.status = ctx.status if ctx.status and ctx.status != 200 else 499
            ctx.error = ctx.error or "client_disconnected"
            raise
        finally:
            if not finished and started:
                finished = True
                await asyncio.shield(Pipeline.finish(ctx, started))


def prompt_token_bound(raw: bytes, body: dict, prompt_chars: int) -> int:
    """An upper bound on the prompt tokens an engine will count, for budget reservations.

    Byte-level BPE tokenizers never emit more tokens than the text has bytes; for ASCII bodies that is the
    content's characters, plus a chat template's special tokens (generously 16 per message, 16 for the
    generation prompt). For non-ASCII bodies the raw body size is used (it bounds content bytes + template).
    """
    if not raw.isascii():
        return len(raw)
    msgs = body.get("messages")
    n = len(msgs) if isinstance(msgs, list) else 1
    return prompt_chars + 16 * n + 16


def _stage_of(ctx: RequestContext, stages: list[Stage]) -> str:
    """The stage that refused a request: the first whose run did not complete (a refusing stage records no
    timing), else "dispatch" (every stage passed; the dispatcher refused). `Pipeline.run` returns nothing when
    a stage raises, so the list of started stages cannot tell (every refusal used to count as dispatch)."""
    timings = ctx.stage_timings_us
    for st in stages:
        if st.name not in timings:
            return st.name
    return "dispatch"


# ------------------------------------------------------------------------------------------- routes


def build_app(gw: Gateway) -> Starlette:
    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def openapi(request: Request) -> Response:
        from gateway.api.openapi import openapi_spec

        return JSONResponse(openapi_spec())

    async def readyz(request: Request) -> Response:
        """Readiness for the load balancer (server.readiness). `process` (default): this process can serve,
        so one dead partner or loading engine does not take every pod out of the Service; per-model health
        is reported in the body either way and fails readiness only under any_model / all_models."""
        cfg = gw.config
        mode = cfg.server.readiness
        models = {m: sorted(n for n in names if gw.health.available(n)) for m, names in cfg.models.items()}
        missing = sorted(m for m, healthy in models.items() if not healthy)
        budgets = next((s for s in gw.services if type(s).__name__ == "BudgetService"), None)
        budget_ok = budgets is None or bool(getattr(budgets, "available", True))
        reasons = []
        if gw.draining:
            reasons.append("draining")
        if not budget_ok and cfg.raw.budgets.on_store_error == "closed":
            reasons.append("budget_store_unavailable")  # every budgeted request would get a 503 here
        if mode == "all_models" and missing:
            reasons.append("model_without_healthy_backend")
        if mode == "any_model" and models and len(missing) == len(models):
            reasons.append("no_model_has_a_healthy_backend")
        body = {"status": "not ready" if reasons else "ready", "readiness": mode, "reasons": reasons,
                "config_generation": cfg.generation, "models_without_healthy_backend": missing,
                "models": {m: {"healthy_backends": healthy, "backends": len(cfg.models[m])}
                           for m, healthy in sorted(models.items())},
                "stores": {"budgets": "ok" if budget_ok else f"unavailable (on_store_error: "
                                                             f"{cfg.raw.budgets.on_store_error})"}}
        if reasons:
            return JSONResponse(body, status_code=503, headers=retry_headers(1.0))
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        for name, st in gw.health.snapshot().items():
            gw.metrics.backend_up.labels(name).set(1.0 if st["state"] == "closed" else 0.0)
        gw.metrics.event_loop_tasks.set(len(asyncio.all_tasks()))
        if gw.telemetry is not None and hasattr(gw.telemetry, "refresh_block_counts"):
            await gw.telemetry.refresh_block_counts()  # the KV index counts, off the event loop
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        rid = request_id(request.headers)
        try:
            ctx = RequestContext(request_id=rid, endpoint="models", headers=request.headers, body={})
            await gw.auth.run(ctx)
        except GatewayError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=error_headers(e, rid))
        return JSONResponse({"object": "list", "data": model_catalog(gw.config)}, headers={"x-request-id": rid})

    from gateway.admin_guard import PLATFORM_ADMIN, gateway_guard

    async def admin_reload(request: Request, principal: Principal | None) -> Response:
        # authenticated and authorized (platform admins only) by the admin guard, whose refusals (429
        # included) carry x-request-id and Retry-After
        try:
            new = await gw.reload()
        except ConfigError as e:
            raise GatewayError(400, f"Config refused, the previous one keeps serving: {e}",
                               code="invalid_config") from None
        return JSONResponse({"status": "reloaded", "generation": new.generation})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        err = GatewayError(status, f"No route for {request.method} {request.url.path}.",
                           code="not_found" if status == 404 else "method_not_allowed")
        return JSONResponse(err.body(), status_code=status, headers={"x-request-id": request_id(request.headers)})

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        err = GatewayError(500, "Internal gateway error.", code="internal_error")
        return JSONResponse(err.body(), status_code=500, headers={"x-request-id": request_id(request.headers)})

    data_plane = {"/v1/chat/completions": CompletionEndpoint(gw, "chat"),
                  "/v1/completions": CompletionEndpoint(gw, "completions"),
                  "/v1/embeddings": CompletionEndpoint(gw, "embeddings")}
    routes = [
        *(Route(path, ep, methods=None) for path, ep in data_plane.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        gateway_guard(gw).route("/admin/reload", admin_reload, ["POST"], (PLATFORM_ADMIN,)),
        *gw.extra_routes,
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await gw.start()
        try:
            yield
        finally:
            await gw.close()

    app = GatewayApp(data_plane, routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: not_found, 500: server_error, Exception: server_error})
    app.state.gateway = gw
    return app


class GatewayApp(Starlette):
    """Starlette for the admin plane and probes; the three data-plane paths go straight to their ASGI
    endpoints (they produce their own OpenAI-shaped errors), skipping the middleware stack and the router on
    the hot path. An unexpected exception there still becomes an OpenAI-shaped 500 when nothing was sent."""

    def __init__(self, data_plane: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        self._data_plane = data_plane
        # Starlette redirects /v1/chat/completions/ to the slash-less URL built from the client's Host header:
        # an open redirect. Unknown paths (a trailing slash included) are an OpenAI-shaped 404 instead.
        self.router.redirect_slashes = False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            ep = self._data_plane.get(scope["path"])
            if ep is not None:
                started = False

                async def tracked(msg) -> None:
                    nonlocal started
                    if msg["type"] == "http.response.start":
                        started = True
                    await send(msg)

                try:
                    await ep(scope, receive, tracked)
                except Exception:
                    log.exception("unhandled error on %s", scope["path"])
                    if not started:
                        err = GatewayError(500, "Internal gateway error.", code="internal_error")
                        await send_error(send, err, request_id(Headers(scope=scope)))
                return
        await super().__call__(scope, receive, send)


def _jurisdiction(countries: set[str | None]) -> str | None:
    """"EEA" when every inference and storage country is in the EEA (else None: no jurisdiction claim)."""
    from gateway.policy.eea import EEA_COUNTRIES

    return "EEA" if countries and all(c in EEA_COUNTRIES for c in countries) else None


def _price(cfg: Config, model: str, backends: list[Any]) -> dict[str, Any] | None:
    """The model's price (budgets.prices[model]; a per-backend `<backend>:<model>` price when all agree)."""
    prices = cfg.raw.budgets.prices
    p = prices.get(model)
    if p is None:
        per = {prices.get(f"{b.name}:{model}") for b in backends}
        p = per.pop() if len(per) == 1 else None
    if p is None:
        return None
    out: dict[str, Any] = {"currency": p.currency, "input_per_mtok": p.input, "output_per_mtok": p.output}
    if p.cached_input is not None:
        out["cached_input_per_mtok"] = p.cached_input
    if p.gpu_second is not None:
        out["gpu_second"] = p.gpu_second
    return out


def model_catalog(cfg: Config) -> list[dict[str, Any]]:
    """/v1/models entries, each with where it runs and what it keeps (what a partner aggregator lists):
    per-backend locations, jurisdiction ("EEA" only when every inference and storage country is in the EEA),
    retention (the weakest guarantee over the serving backends), context window (also as `context_length`, the
    field OpenRouter-style aggregators read: the smallest `context_window` of the serving backends), capabilities,
    prices."""
    out = []
    created = int(cfg.path.stat().st_mtime) if cfg.path and Path(cfg.path).exists() else 0
    entries: dict[str, dict[str, Any]] = {}
    for model, names in sorted(cfg.models.items()):
        bks = [cfg.backend(n) for n in names]
        countries = {b.location.country if b.location else None for b in bks}
        storage = {b.location.storage if b.location else None for b in bks}
        days = [b.retention_days for b in bks]
        retention = ("zero" if all(d == 0 for d in days) else
                     "none" if any(d is None for d in days) else f"{max(d for d in days if d is not None)}d")
        windows = [b.context_window for b in bks if b.context_window]
        caps = sorted(set().union(*(b.capabilities for b in bks)))
        entry = {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "gateway",
            "locations": [{"backend": b.name, "country": b.location.country if b.location else None,
                           "storage_country": b.location.storage if b.location else None,
                           "region": b.location.region if b.location else None,
                           "operator": b.operator, "retention": b.retention} for b in bks],
            "inference_locations": sorted(c for c in countries if c),
            "storage_locations": sorted(c for c in storage if c),
            "jurisdiction": _jurisdiction(countries | storage),
            "retention": retention,
            "retention_by_backend": sorted({b.retention for b in bks}),
            "zero_data_retention": retention == "zero",
            "context_window": min(windows) if windows else None,
            "context_length": min(windows) if windows else None,  # OpenRouter's name for the same number
            "capabilities": caps,
            "pricing": _price(cfg, model, bks),
        }
        entries[model] = entry
        out.append(entry)
    for alias, targets in sorted(cfg.aliases.items()):
        tgt = [entries[t] for t in targets if t in entries]
        out.append({"id": alias, "object": "model", "created": created, "owned_by": "gateway",
                    "alias_of": list(targets),
                    "jurisdiction": "EEA" if tgt and all(t["jurisdiction"] == "EEA" for t in tgt) else None,
                    "retention": "zero" if tgt and all(t["retention"] == "zero" for t in tgt) else "none",
                    "context_window": min((t["context_window"] for t in tgt if t["context_window"]), default=None),
                    "context_length": min((t["context_window"] for t in tgt if t["context_window"]), default=None),
                    "capabilities": sorted(set.intersection(*(set(t["capabilities"]) for t in tgt))) if tgt else []})
    return out
