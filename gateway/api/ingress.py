"""HTTP ingress of the data plane: raw ASGI endpoints for the inference APIs of the endpoint table.

Everything about HTTP lives here and nowhere in the composition root (gateway/app.py): method and content
type checks, the body limit and timeout, client disconnects (which cancel the upstream at once), request ids,
error responses in the endpoint's shape, Server-Timing, and writing the JSON response or the stream. The
request itself runs as one `Lifecycle` (gateway/pipeline.py) over the gateway's pipeline.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers

from gateway.api.endpoints import Endpoint, prepare
from gateway.api.reply import client_request_id, complete_json, new_request_id, request_id, send_bytes, send_error
from gateway.api.unserved import ON_SERVED_PATHS, answer as unserved_answer
from gateway.cache.replay import CachedStream
from gateway.errors import GatewayError
from gateway.pipeline import Lifecycle, RequestContext, RequestHeaders
from gateway.proxy.forward import JsonResult, abandon, stream_body
from gateway.server_protocol import direct_body, response_started

log = logging.getLogger("gateway")


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



class InferenceEndpoint:
    """One inference API of the endpoint table: HTTP checks -> parse -> Lifecycle (stages, dispatch) -> respond."""

    def __init__(self, gw: Any, ep: Endpoint) -> None:
        self.gw = gw
        self.ep = ep
        self.endpoint = ep.name
        self.wire = ep.wire

    async def __call__(self, scope, receive, send) -> None:
        headers = RequestHeaders.from_scope(scope)
        # The client's x-request-id is echoed, never trusted as a key: budgets (reservation, settle marker),
        # the spend ledger, routing's in-flight table and the audit record are keyed by an id the gateway
        # generates for every request, so a client reusing an id cannot merge, skip or overwrite them.
        t0 = time.perf_counter()
        cid = client_request_id(headers)
        rid = cid or new_request_id()
        if scope["method"] != "POST":
            await self._not_post(scope, send, headers, rid, t0)
            return
        got = await self._read(scope, receive, send, headers, rid, t0)
        if got is None:
            return
        raw, body, parsed = got
        client = scope.get("client")
        ctx = RequestContext(request_id=rid if cid is None else new_request_id(), endpoint=self.endpoint,
                             headers=headers, body=body, client_addr=client[0] if client else "", ep=self.ep)
        if cid is not None:  # echoed as x-request-id; the gateway's own id rides along for the audit lookup
            ctx.client_request_id = cid
            ctx.extra_headers["x-request-id"] = cid
            ctx.extra_headers["x-gateway-request-id"] = ctx.request_id
        prepare(ctx, parsed, raw, self.gw.config)
        await self._serve(ctx, scope, receive, send)

    async def _not_post(self, scope, send, headers: RequestHeaders, rid: str, t0: float) -> None:
        other = ON_SERVED_PATHS.get(scope["path"])  # OpenAI's GET /v1/chat/completions lists stored ones
        if other is not None and scope["method"] in other.methods:
            await send_error(send, await unserved_answer(self.gw, other, scope, headers, rid), rid,
                             {"server-timing": server_timing(None, t0)}, self.wire)
            return
        await send_error(send, GatewayError(405, "Method not allowed; use POST.", code="method_not_allowed"), rid,
                         {"allow": "POST", "server-timing": server_timing(None, t0)}, self.wire)

    async def _read(self, scope, receive, send, headers: RequestHeaders, rid: str,
                    t0: float) -> tuple[bytes, Any, Any] | None:
        """(raw body, decoded body, parsed request), or None once the refusal was sent: the media type, the
        declared and the actual size, the upload's time limit, then the body (authenticated first when the
        body is refused, so an unauthenticated caller learns nothing about validation: 401, not 400)."""
        gw, wire, media = self.gw, self.wire, self.ep.media
        limit = self.ep.max_body_bytes or gw.config.server.max_body_bytes
        try:
            ctype = headers.get("content-type", "")
            if not media.accepts(ctype):
                raise media.refusal()
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
                await send_error(send, err, rid, {"connection": "close", "server-timing": server_timing(None, t0)},
                                 wire)
                return None
            try:
                body = media.decode(raw, ctype)
                parsed = self.ep.parse(body)
            except GatewayError as bad_body:
                await self._authenticate(headers, rid, scope)  # only on this refusal path (the pipeline does it)
                raise bad_body
        except GatewayError as e:
            stage = "authenticate" if e.status in (401, 403) or e.code == "auth_rate_limited" else "parse"
            gw.metrics.rejections.labels(stage, e.code or "error").inc()
            # a 413 leaves the body unread: close the connection (the server drains a bounded amount first,
            # gateway/server_protocol.py) instead of reading an unbounded body on a kept-alive connection
            extra = {"server-timing": server_timing(None, t0)}
            if e.status == 413:
                extra["connection"] = "close"
            await send_error(send, e, rid, extra, wire)
            return None
        except asyncio.CancelledError:
            return None
        return raw, body, parsed

    async def _serve(self, ctx: RequestContext, scope, receive, send) -> None:
        """Run the request's lifecycle and answer, cancelled at once when the client vanishes: this task is
        cancelled, which unwinds the handler (closing the upstream connection) right away, except while the
        request settles (Lifecycle.cancel defers it to the end of finish). Under the gateway's own server
        protocol the connection tells us (no extra task); under any other ASGI server a watcher task waits on
        receive() instead."""
        life = Lifecycle(self.gw.pipeline, ctx, shielded=False)
        me = asyncio.current_task()
        gone = False

        def lost() -> None:
            nonlocal gone
            gone = True
            if me is not None:
                life.cancel(me)

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
            await self._handle(ctx, send, life)
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

    def _timing(self, ctx: RequestContext) -> str:
        return server_timing(ctx, ctx.received_at, ctx.dispatched_at, ctx.answered_at)

    async def _handle(self, ctx: RequestContext, send, life: Lifecycle) -> None:
        gw = self.gw
        try:
            try:
                result = await life.run()
            except GatewayError as e:
                gw.metrics.rejections.labels(gw.pipeline.refusing_stage(ctx), e.code or "error").inc()
                await send_error(send, e, ctx.request_id, {**ctx.extra_headers, "server-timing": self._timing(ctx)},
                                 self.wire)
                return
            hdrs = {"x-request-id": ctx.request_id, **ctx.extra_headers}
            if isinstance(result, JsonResult):
                await self._answer_json(ctx, send, life, result, hdrs)
            else:
                await self._answer_stream(ctx, send, life, result, hdrs)
        except asyncio.CancelledError:
            ctx.status = ctx.status if ctx.status and ctx.status != 200 else 499
            ctx.error = ctx.error or "client_disconnected"
            # the client left after the dispatch opened a stream and before its relay began (which closes it
            # itself): the upstream request ends here, not when the engine finishes for nobody
            await abandon(ctx.result)
            raise
        finally:
            await life.finish(shield=ctx.stream)

    async def _answer_json(self, ctx: RequestContext, send, life: Lifecycle, result: JsonResult,
                           hdrs: dict[str, str]) -> None:
        """A whole answer: its usage and facts read (invalid JSON from the upstream is a 502), the request
        finished (settled, recorded) before the bytes go out, in the form the client asked for (the wire's
        `client_body`: a transcription's `response_format: text` is the text itself)."""
        obj, err = await complete_json(life, result, self.wire)
        if err is not None:
            await send_error(send, err, ctx.request_id, {**ctx.extra_headers, "server-timing": self._timing(ctx)},
                             self.wire)
            return
        hdrs["server-timing"] = self._timing(ctx)
        if result.status != 200:
            await send_bytes(send, result.status, result.body, hdrs)
            return
        body, ctype = self.wire.client_body(ctx, obj, result.body)
        await send_bytes(send, 200, body, hdrs, ctype)

    async def _answer_stream(self, ctx: RequestContext, send, life: Lifecycle, result: Any,
                             hdrs: dict[str, str]) -> None:
        """A stream: relayed in push mode (straight to the connection) unless the cache captures what is sent
        or replays a hit; finished once it ends (499 with what was delivered when the client left), cut with a
        last error event at the drain deadline."""
        ctx.status = 200

        async def on_end() -> None:
            if not life.finished:
                task = asyncio.current_task()
                if task is not None and task.cancelling() and not ctx.cut_by_shutdown:
                    # the client left mid-stream (its connection dropped and cancelled us): record 499 and
                    # what was delivered, not the 200 the response started with
                    ctx.status = 499 if ctx.status in (0, 200) else ctx.status
                    ctx.error = ctx.error or "client_disconnected"
                await life.finish(shield=True)  # the drain deadline cancels stream tasks directly

        hdrs["server-timing"] = self._timing(ctx)
        raw = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
        raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        hit = result if isinstance(result, CachedStream) else None  # a cache hit (gateway/cache/replay.py)
        capture = ctx.cache.capture if ctx.cache is not None and hit is None else None
        if hit is not None:
            gen = hit.replay(ctx, on_end)
        else:
            gen = stream_body(ctx, result, on_end, direct_body(send) if capture is None else None)
        me = asyncio.current_task()
        assert me is not None  # the server runs each request in a task of its own
        self.gw.streams[me] = ctx
        try:
            try:
                async for chunk in gen:
                    if capture is not None:
                        capture.chunk(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except asyncio.CancelledError:
                if not ctx.cut_by_shutdown:
                    raise
                me.uncancel()  # our own cut at the drain deadline
                await on_end()  # settle what was delivered before the client sees the end
                err = GatewayError(503, "The gateway is shutting down and cut this stream at its drain deadline; "
                                   "retry the request.", code="server_shutting_down")
                await send({"type": "http.response.body", "body": self.wire.error_event(err), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.gw.streams.pop(me, None)
            await gen.aclose()


class GatewayApp(Starlette):
    """Starlette for the admin plane and probes; the data-plane paths go straight to their ASGI
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
            if ep is not None and response_started(send) is False:  # uvicorn's cycle knows if a response began
                try:
                    await ep(scope, receive, send)
                except Exception:
                    log.exception("unhandled error on %s", scope["path"])
                    if not response_started(send):
                        await self._internal_error(send, scope, ep)
                return
            if ep is not None:  # another ASGI server: track the messages to know
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
                        await self._internal_error(send, scope, ep)
                return
        await super().__call__(scope, receive, send)

    @staticmethod
    async def _internal_error(send, scope, ep: Any) -> None:
        err = GatewayError(500, "Internal gateway error.", code="internal_error")
        await send_error(send, err, request_id(Headers(scope=scope)), None, ep.wire)


