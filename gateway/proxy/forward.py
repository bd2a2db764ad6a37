"""Dispatch: send a request to the first candidate that answers well, retrying only where it is safe.

Retries happen only before anything reached the client; on connect errors, an engine that dies before its
first token, an upstream 502/503 or 500 (vLLM answers 500 when its engine core died), and an upstream that
refused the request without working on it (429 rate limited, 401/403 our credential) - a completion has no
side effects, so a retry can only cost compute, never duplicate an action; never on 504 or other statuses.
Retries go only to candidates the routing stage produced (which already passed the residency filter; it is
checked again here), and only while the retry budget allows. A stream that breaks
after it started ends with an OpenAI error event and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Protocol


from gateway.api.wire.base import StreamState
from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext
from gateway.types import Usage
from gateway.proxy import sse
from gateway.proxy.dialects import Dialect, Exchange, StreamTranslator, dialect_for
from gateway.proxy.health import Health
from gateway.proxy.scrub import GENERIC, Scrubber
from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError, UpstreamResponse, abort
from gateway.proxy.upstream import Upstreams
from gateway.routing.flowkey import flow_id
from gateway.routing.plan import Candidate, RoutePlan

if TYPE_CHECKING:
    from gateway.server_protocol import DirectBody

log = logging.getLogger("gateway.proxy")

_RETRYABLE_STATUS = {502, 503}
_MAX_ERROR_BODY = 64 * 1024


class RetryBudget:
    """Retries may add at most `ratio` of recent requests (plus a small floor), so they cannot amplify an outage."""

    def __init__(self, ratio: float = 0.2, floor_per_s: float = 5.0, window_s: float = 10.0) -> None:
        self.ratio, self.floor, self.window = ratio, floor_per_s, window_s
        self._t0 = time.monotonic()
        self._requests = 0
        self._retries = 0

    def _roll(self) -> None:
        now = time.monotonic()
        if now - self._t0 > self.window:
            self._t0, self._requests, self._retries = now, 0, 0

    def request(self) -> None:
        self._roll()
        self._requests += 1

    def try_retry(self) -> bool:
        self._roll()
        if self._retries < self.ratio * self._requests + self.floor * self.window:
            self._retries += 1
            return True
        return False


@dataclass(slots=True)
class StreamStart:
    """An upstream stream that produced its first event(s); the rest is read by `stream_body`."""

    response: UpstreamResponse
    candidate: Candidate
    first: list[bytes]
    splitter: sse.EventSplitter
    iterator: AsyncIterator[bytes]
    started_at: float
    done: bool = False
    health: Health | None = None  # a break or stall after the first token counts against the backend too
    translator: StreamTranslator | None = None  # upstream events -> the client's API (None: the same API)
    rest: bytes = b""  # complete events of the first reads after the first token, not yet split (no translator)
    scrub: Scrubber = GENERIC  # error events of the upstream's reach the client through it (gateway/proxy/scrub.py)


@dataclass(slots=True)
class JsonResult:
    status: int
    body: bytes
    candidate: Candidate | None
    upstream_message: str | None = None  # an upstream 4xx's own message, secrets masked: the audit's, not the client's


def exchange_for(ctx: RequestContext, cand: Candidate) -> Exchange | None:
    """How this request reaches this candidate: its dialect's exchange for the request's endpoint."""
    return dialect_for(cand.backend.kind).exchange(ctx.ep)


def upstream_body(ctx: RequestContext, cand: Candidate) -> bytes:
    """The body sent upstream (gateway/proxy/dialects/base.py `Exchange.body`)."""
    ex = exchange_for(ctx, cand)
    if ex is None:
        raise ValueError(f"backend kind {cand.backend.kind!r} does not serve {ctx.ep.path}")
    return ex.body(ctx, cand)


def client_error_body(status: int, body: bytes, dialect: Dialect | None = None, ctx: RequestContext | None = None,
                      scrub: Scrubber = GENERIC) -> bytes:
    """An upstream 4xx the client must fix, in the client API's error shape whatever the upstream sent: its
    message, type and param when they are strings, and a string code (vLLM sends the HTTP status as a number in
    `code`; partners add fields of their own, which are not passed on); each through `scrub.client_text` (no
    secret, URL, host or traceback of the upstream's; the message at most 500 chars, the others 64)."""
    d = dialect or dialect_for("openai")
    err = d.error_fields(body)
    msg = scrub.client_text(d.error_message(status, body), fallback=f"The upstream refused the request (HTTP {status}).")
    e = GatewayError(status, msg, code=scrub.field(err.get("code")) or "upstream_rejected",
                     param=scrub.field(err.get("param")), type=scrub.field(err.get("type")))
    return ctx.ep.wire.error_body(e) if ctx is not None and ctx.ep is not None else e.to_bytes()


# The request headers a Gateway API Inference Extension / llm-d endpoint picker (EPP) reads for flow control
# (https://llm-d.ai/docs/api-reference/epp-http-headers): the fairness id groups requests that share capacity
# under the fairness policy, the objective names the InferenceObjective resource whose priority applies (so that
# cluster defines objectives named after the priorities: realtime, standard, batch), the SLO headers are the
# latency targets its admission and SLO-aware scoring use. llm-d's router spells them x-llm-d-* (its 0.8 docs and
# guides); the Gateway API Inference Extension's EPP (and llm-d's unversioned docs page) x-gateway-inference-* and
# x-slo-*, which GIE deployments read.
# A backend's `inference_gateway_headers` picks which it is sent: both (default), llm-d or gie.
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
EPP_SPELLINGS: dict[str, tuple[str, str, str, str]] = {  # (fairness id, objective, TTFT target, TPOT target)
    "llm-d": ("x-llm-d-inference-fairness-id", "x-llm-d-inference-objective", "x-llm-d-slo-ttft-ms",
              "x-llm-d-slo-tpot-ms"),
    "gie": (FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, "x-slo-ttft-ms", "x-slo-tpot-ms"),
}
# Never forwarded as a client sent them, to any backend: an EPP trusts them for who the request is and what it
# may have (its fairness flow, priority, latency targets; a model-name rewrite would swap the model policy
# allowed). The gateway sets the first four kinds from the authenticated identity and policy, and only to an
# inference_gateway backend.
EPP_HEADERS: frozenset[str] = frozenset(
    [h for hs in EPP_SPELLINGS.values() for h in hs] + ["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"])


def inference_gateway_headers(ctx: RequestContext, spelling: str = "both") -> dict[str, str]:
    """What an `inference_gateway: true` backend is told, in `spelling` (both, llm-d, gie): the request's flow, its
    policy priority and the policy decision's TTFT target (none without one: the client's own x-ttft-slo-ms is
    the gateway's to judge, never an EPP's to trust). Decision has no TPOT target, so none is sent."""
    d = ctx.decision
    flow = flow_id(ctx.principal, d)
    objective = d.priority if d is not None else "standard"
    ttft = d.ttft_slo_ms if d is not None and d.ttft_slo_ms is not None and d.ttft_slo_ms > 0 else None
    out: dict[str, str] = {}
    for name in (("llm-d", "gie") if spelling == "both" else (spelling,)):
        fair_h, obj_h, ttft_h, _ = EPP_SPELLINGS[name]
        out[fair_h] = flow
        out[obj_h] = objective
        if ttft is not None:
            out[ttft_h] = str(max(1, round(ttft)))  # whole milliseconds: what the EPP parses
    return out


class DispatchStage:
    """The terminal stage: opens the upstream request (or takes the answer a stage prepared, a cache hit) into
    `ctx.result`. The time it waits is the upstream's (`ctx.dispatched_at` .. `ctx.answered_at`)."""

    name = "dispatch"

    def __init__(self, dispatcher: "Dispatcher") -> None:
        self.dispatcher = dispatcher

    async def run(self, ctx: RequestContext) -> None:
        ctx.dispatched_at = time.perf_counter()
        try:
            ctx.result = ctx.answer if ctx.answer is not None else await self.dispatcher.open(ctx)
        finally:
            ctx.answered_at = time.perf_counter()


class AttemptObserver(Protocol):
    """Told of each attempt on a candidate (the cost meter: engine time per attempt, failed ones as waste)."""

    def attempt_begin(self, ctx: RequestContext, cand: Candidate) -> None: ...

    def attempt_failed(self, ctx: RequestContext, cand: Candidate) -> None: ...


class Dispatcher:
    """Opens the upstream request for a planned request, following the candidate list."""

    def __init__(self, upstreams: Callable[[], Upstreams], health: Health,
                 residency_check: Callable[[RequestContext, Candidate], str | None],
                 max_attempts: int = 3) -> None:
        self._upstreams = upstreams
        self.health = health
        self._residency_check = residency_check
        self.max_attempts = max_attempts
        self.retry_budget = RetryBudget()
        self.attempts: AttemptObserver | None = None  # gateway.cost.meter.CostMeter when cost is enabled
        self.placement: Any = None  # gateway.adapters.placement.Placement: registered adapters on dynamic engines

    def _headers(self, ctx: RequestContext, cand: Candidate, dialect: Dialect,
                 content_type: str = "application/json") -> dict[str, str]:
        h = {"content-type": content_type, "x-request-id": ctx.request_id}
        h.update(dialect.auth_headers(self._upstreams().auth(cand.backend.name)))
        tp = ctx.headers.get("traceparent")
        if tp:
            h["traceparent"] = tp
        if ctx.upstream_headers:  # the gateway's own (a trace context): never an EPP header, whoever set it
            h.update({k: v for k, v in ctx.upstream_headers.items() if k.lower() not in EPP_HEADERS})
        if cand.backend.inference_gateway:
            h.update(inference_gateway_headers(ctx, cand.backend.inference_gateway_headers))
        return h

    async def open(self, ctx: RequestContext) -> StreamStart | JsonResult:
        plan: RoutePlan = ctx.route
        if not plan or not plan.candidates:
            raise GatewayError(503, f"No backend is available for model '{ctx.model}'.", code="no_backend_available",
                               headers=retry_headers(1.0))
        self.retry_budget.request()
        last_error: GatewayError | None = None
        attempts = 0
        placement = self.placement
        if placement is not None:  # a registered adapter: engines holding it first, then the cheapest load
            plan.candidates = placement.order(ctx, plan.candidates)
        for cand in plan.candidates:
            name = cand.backend.name
            why = self._residency_check(ctx, cand)
            if why is not None:  # defence in depth: never send outside the decision's residency class
                ctx.attempts.append({"backend": name, "skipped": why})
                continue
            if not self.health.available(name):
                ctx.attempts.append({"backend": name, "skipped": "circuit open"})
                continue
            ex = exchange_for(ctx, cand)
            if ex is None:  # this backend kind does not serve the endpoint
                ctx.attempts.append({"backend": name, "skipped": f"kind {cand.backend.kind} does not serve "
                                                                 f"{ctx.ep.path}"})
                continue
            if attempts >= self.max_attempts:
                break
            if attempts > 0 and ctx.decision is not None and ctx.decision.no_fallbacks:
                ctx.attempts.append({"backend": name, "skipped": "provider.allow_fallbacks: false"})
                break
            if attempts > 0 and not self.retry_budget.try_retry():
                ctx.attempts.append({"backend": name, "skipped": "retry budget exhausted"})
                break
            attempts += 1
            obs = self.attempts
            if obs is not None:
                obs.attempt_begin(ctx, cand)
            try:
                if placement is None:
                    result = await self._attempt(ctx, cand, ex)
                else:
                    result = await self._placed_attempt(ctx, cand, ex, placement)
            except GatewayError as e:
                if obs is not None:
                    obs.attempt_failed(ctx, cand)
                retryable = bool(e.extra.pop("_retryable", False))
                attempt: dict[str, Any] = {"backend": name, "error": e.code, "status": e.status}
                upstream_message = e.extra.pop("_upstream_message", None)
                if upstream_message is not None:
                    attempt["upstream_status"], attempt["upstream_message"] = upstream_message
                ctx.attempts.append(attempt)
                last_error = e
                if retryable:
                    continue
                raise
            if isinstance(result, StreamStart):
                ctx.attempts.append({"backend": name, "status": 200})
            elif result.upstream_message is not None:
                ctx.attempts.append({"backend": name, "status": result.status,
                                     "upstream_message": result.upstream_message})
            else:
                ctx.attempts.append({"backend": name, "status": result.status})
            ctx.backend = name
            ctx.backend_model = cand.model
            return result
        if last_error is not None:
            raise last_error
        raise GatewayError(503, f"No healthy backend is available for model '{ctx.model}'.",
                           code="no_backend_available", headers=retry_headers(1.0))

    async def _placed_attempt(self, ctx: RequestContext, cand: Candidate, ex: Exchange,
                              placement: Any) -> StreamStart | JsonResult:
        """An attempt on an engine that must hold a registered adapter: made resident first; an engine that
        answers 404 for it (restarted, or unloaded behind the gateway's back) is re-read, and the adapter is
        loaded again and the request retried there once."""
        await placement.prepare(ctx, cand)
        result = await self._attempt(ctx, cand, ex)
        if (isinstance(result, JsonResult) and placement.placed(ctx, cand) is not None
                and placement.not_loaded_answer(result, cand.model)):
            await placement.not_loaded(ctx, cand)
            await placement.prepare(ctx, cand)
            result = await self._attempt(ctx, cand, ex)
        return result

    async def _attempt(self, ctx: RequestContext, cand: Candidate, ex: Exchange) -> StreamStart | JsonResult:
        b = cand.backend
        dialect = ex.dialect
        wire = ctx.ep.wire
        client = self._upstreams().client(b.name)
        self.health.begin(b.name)
        body = ex.body(ctx, cand)
        t0 = time.perf_counter()
        limit = b.timeouts.first_token_s if ctx.stream else b.timeouts.total_s
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await client.post(ex.path, body, self._headers(ctx, cand, dialect, ex.content_type(body)))
                if resp.status != 200:
                    err_body = await _read_limited(resp, _MAX_ERROR_BODY)
                    await resp.aclose()
                    return self._upstream_status(ctx, cand, dialect, resp.status, err_body, resp.headers)
                if not ctx.stream:
                    body = await resp.aread()
                    await resp.aclose()
                    self.health.success(b.name)
                    scrub = self._upstreams().scrubber
                    return JsonResult(200, scrub.json_body(ex.response(body) if ex.translates else body), cand)
                splitter = sse.EventSplitter()
                tr = ex.stream()
                it = resp.aiter_raw()
                first, rest = await _to_first_token(it, splitter, tr, wire)
                if not first:
                    raise UpstreamBroken("upstream closed the stream before any event")
                self.health.success(b.name)
                return StreamStart(resp, cand, first, splitter, it, t0, health=self.health, translator=tr,
                                   rest=rest, scrub=self._upstreams().scrubber)
        except TimeoutError:
            if resp is not None:
                await resp.aclose()
            self.health.failure(b.name, "timeout")
            what = "first token" if ctx.stream else "response"
            raise GatewayError(504, f"Upstream timed out waiting for the {what} after {limit:g}s.",
                               code="upstream_timeout") from None
        except UpstreamConnectError as e:
            self.health.failure(b.name, str(e))
            raise GatewayError(503, "Upstream is unreachable.", code="upstream_unavailable",
                               headers=retry_headers(1.0), extra={"_retryable": True}) from None
        except (UpstreamBroken, OSError) as e:  # died before the first token: nothing reached the client
            if resp is not None:
                await resp.aclose()
            self.health.failure(b.name, str(e) or type(e).__name__)
            raise GatewayError(502, "Upstream failed before the first token.", code="upstream_error",
                               extra={"_retryable": True}) from None
        except BaseException:
            # Cancelled: the client left (gateway/api/ingress.py cancels the request's task at once), before the
            # response headers, before the first token or during a JSON body. The upstream request ends now:
            # its connection is closed, never handed back to the pool, so the engine sees the close and aborts
            # the generation (vLLM aborts a request whose connection closes) instead of running on for nobody.
            if resp is not None:
                await abort(resp)
            raise

    def _upstream_status(self, ctx: RequestContext, cand: Candidate, dialect: Dialect, status: int, body: bytes,
                         headers) -> JsonResult:
        name = cand.backend.name
        scrub = self._upstreams().scrubber
        # the upstream's own words, credentials masked: for the audit record (attempts[].upstream_message) only
        original = scrub.secrets(scrub.bound(dialect.error_message(status, body), 4000))[:2000]
        if status >= 500:  # the upstream's failure: its text (URLs, hosts, tracebacks) never reaches the client
            self.health.failure(name, f"HTTP {status}")
            raise GatewayError(502, f"The upstream failed (HTTP {status}).", code="upstream_error",
                               extra={"_retryable": status in _RETRYABLE_STATUS or status == 500
                                                  or status in dialect.retryable_statuses,
                                      "_upstream_message": (status, original)})
        if status == 429:
            ra = headers.get("retry-after")
            try:
                secs = float(ra) if ra else 1.0
            except ValueError:
                secs = 1.0
            raise GatewayError(429, "Upstream is rate limiting; retry later.", code="upstream_rate_limited",
                               headers=retry_headers(secs), extra={"_retryable": True,
                                                                  "_upstream_message": (status, original)})
        if status in (401, 403):  # our credential for the upstream is wrong: the client cannot fix it
            self.health.failure(name, f"HTTP {status}")
            raise GatewayError(502, "Upstream rejected the gateway's credentials.", code="upstream_auth_error",
                               extra={"_retryable": True, "_upstream_message": (status, original)})
        self.health.success(name)
        # 4xx about the request itself (context too long, bad parameter): the client's to fix, told in the
        # upstream's words once scrubbed (gateway/proxy/scrub.py)
        return JsonResult(status, client_error_body(status, body, dialect, ctx, scrub), cand, original)


async def _read_limited(resp: UpstreamResponse, limit: int) -> bytes:
    out = b""
    async for chunk in resp.aiter_raw():
        out += chunk
        if len(out) >= limit:
            break
    return out[:limit]


def observe_first_events(ctx: RequestContext, start: StreamStart) -> None:
    """TTFT is when the first generated token was available to us (the first-token event)."""
    if ctx.ttft_s is None:
        ctx.ttft_s = time.perf_counter() - ctx.received_at


async def _to_first_token(it: Any, splitter: sse.EventSplitter, tr: Any, wire: Any) -> tuple[list[bytes], bytes]:
    """Read a stream until its first generated token (or its end): (the events so far, the rest of the last
    read). Events up to the first token are looked at one by one; what follows it in the same read stays one
    region for stream_body (relayed whole when it needs no look of its own). A translated stream (`tr`) is
    translated event by event."""
    first: list[bytes] = []
    while True:
        try:
            chunk = await it.__anext__()
        except StopAsyncIteration:
            if tr is not None:
                first.extend(tr.end())
            return first, b""
        region = splitter.feed_region(chunk)
        if tr is not None:
            events = [out for e in sse.split_events(region) for out in tr.feed(e)]
            first.extend(events)
            if any(wire.is_first_token(e) for e in events):
                return first, b""
            continue
        pos = 0
        while (j := region.find(b"\n\n", pos)) >= 0:
            ev = region[pos:j]
            pos = j + 2
            if ev.strip():
                first.append(ev)
                if wire.is_first_token(ev):
                    return first, region[pos:]


async def stream_body(ctx: RequestContext, start: StreamStart, on_end: Callable[[], Awaitable[None]],
                      direct: DirectBody | None = None) -> AsyncGenerator[bytes, None]:
    """Forward a started stream event by event (translated into the client's API when the backend speaks
    another), applying the client wire's rules: capture usage, strip what the client did not ask for, cut at the
    budget allowance; end with the wire's error event if the upstream breaks.

    With `direct` (the client connection's body writer) and an upstream that pushes (the native client's
    `push_within`), the relay after the first read runs inside the upstream connection's read callback: each
    read is processed and written to the client there, with no task switch, future or ASGI message per event
    (a paced stream's per-event cost); what this generator still yields (the first read, error events) goes
    through the caller's send, in order."""
    b = start.candidate.backend
    tr = start.translator
    st = StreamState()
    deadline = start.started_at + b.timeouts.total_s
    idle_s = b.timeouts.idle_s
    it = start.iterator
    splitter = start.splitter
    # the native client times reads with one timer per stream (h1client `read_within`); the others per read
    read_within = getattr(start.response, "read_within", None)
    loop_deadline = asyncio.get_running_loop().time() + (deadline - time.perf_counter())
    push = getattr(start.response, "push_within", None) if direct is not None and tr is None else None
    try:
        observe_first_events(ctx, start)
        # Events that arrived in one upstream read leave in one write: same timing, far fewer sends.
        scrub = start.scrub
        out = _process_all(ctx, st, start.first, scrub)
        if start.rest and not ctx.cut_by_budget:
            out += _process_region(ctx, st, start.rest, scrub)
        if out:
            yield out
        if ctx.cut_by_budget:
            return
        while not st.done:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError("total")
            if push is not None and direct is not None:
                if direct.paused:
                    await direct.drain()
                    continue
                if await push(_push_handler(ctx, st, splitter, direct, scrub), idle_s, loop_deadline):
                    if ctx.cut_by_budget:
                        return
                    continue  # done, or the client's connection paused writing
                chunk = None
            else:
                chunk = await _next_read(it, read_within, idle_s, remaining, loop_deadline)
            if chunk is None:
                if tr is not None:
                    out = _process_all(ctx, st, tr.end(), scrub)
                    if out:
                        yield out
                break
            region = splitter.feed_region(chunk)
            if not region:
                continue
            if tr is not None:
                out = _process_all(ctx, st, [e for ev in sse.split_events(region) for e in tr.feed(ev)], scrub)
            else:
                out = _process_region(ctx, st, region, scrub)
            if out:
                yield out
            if ctx.cut_by_budget:
                return
        if not st.done:
            yield _broken(ctx, start, 502, "upstream_stream_broken", "stream closed before its end",
                          "Upstream closed the stream before it finished.", "upstream_error")
    except TimeoutError:
        yield _broken(ctx, start, 504, "upstream_timeout", "stream idle or total timeout",
                      "Upstream stopped sending (idle or total timeout).", "upstream_timeout")
    except (UpstreamBroken, OSError):
        yield _broken(ctx, start, 502, "upstream_stream_broken", "connection broke mid-stream",
                      "Upstream connection broke mid-stream.", "upstream_error")
    finally:
        await _end_stream(ctx, st, start, it, on_end)


async def _next_read(it: Any, read_within: Any, idle_s: float, remaining: float, loop_deadline: float) -> bytes | None:
    """The upstream's next read, None at its end; TimeoutError past the idle or total limit (the native client
    times reads with one timer per stream, `read_within`; the others per read)."""
    if read_within is not None:
        chunk: bytes | None = await read_within(idle_s, loop_deadline)
        return chunk
    try:
        async with asyncio.timeout(min(idle_s, remaining)):
            return await it.__anext__()  # type: ignore[no-any-return]
    except StopAsyncIteration:
        return None


def _broken(ctx: RequestContext, start: StreamStart, status: int, error: str, reason: str, message: str,
            code: str) -> bytes:
    """The stream failed after it began: recorded on the request and the engine's health, and the client
    wire's error event to end it with."""
    ctx.error = error
    ctx.status = status
    _mid_stream_failure(start, reason)
    return ctx.ep.wire.error_event(GatewayError(status, message, code=code))


async def _end_stream(ctx: RequestContext, st: "StreamState", start: StreamStart, it: Any,
                      on_end: Callable[[], Awaitable[None]]) -> None:
    """Usage from what was delivered when the upstream gave none; the upstream closed (aborted when the client
    left mid-stream, so the engine stops generating for nobody); then the request finishes."""
    if ctx.usage is None:
        ctx.usage = Usage(prompt_tokens=ctx.prompt_tokens_est, completion_tokens=st.delivered_tokens)
    if isinstance(it, AsyncGenerator):  # a transport's aiter_raw: closed, so its finally blocks run now
        await it.aclose()
    task = asyncio.current_task()
    if task is not None and task.cancelling():  # the client left mid-stream: the upstream request ends now
        await abort(start.response)
    else:
        await start.response.aclose()
    await on_end()


async def abandon(result: Any) -> None:
    """A dispatch result that will not be relayed (the client left between the dispatch and the stream's
    start): its upstream request ends now, its connection closed (a no-op for one already closed)."""
    if isinstance(result, StreamStart):
        await abort(result.response)


def _push_handler(ctx: RequestContext, st: StreamState, splitter: sse.EventSplitter,
                  direct: DirectBody, scrub: Scrubber = GENERIC) -> Callable[[bytes], bool]:
    """What push mode runs in the upstream connection's callback for each read: the pull path's region
    processing, written straight to the client; False (hand back to the stream's task) once the stream is done
    or cut, or when the client's connection asks to pause writing or is gone."""
    def on_read(chunk: bytes) -> bool:
        if direct.gone:  # a read between the client's disconnect and its task's cancellation: not delivered
            return False
        region = splitter.feed_region(chunk)
        if region:
            out = _process_region(ctx, st, region, scrub)
            if out:
                direct.write(out)
            if ctx.cut_by_budget or st.done:
                return False
        return not direct.paused
    return on_read


def _mid_stream_failure(start: StreamStart, reason: str) -> None:
    """Passive outlier detection: an engine that dies or stalls mid-stream is as unhealthy as one that fails
    before its first token (the client cannot be retried, but the next requests should avoid it)."""
    if start.health is not None:
        start.health.failure(start.candidate.backend.name, reason)


def _process_region(ctx: RequestContext, st: StreamState, region: bytes, scrub: Scrubber = GENERIC) -> bytes:
    """A region of complete events (no translator): its leading events that need no look of their own leave as
    they came (the wire's `relay`, one pass over the bytes), the rest event by event. A region that may hold
    an upstream error event (one scan for `"error"`) goes event by event, each through the scrub."""
    if b'"error"' in region:
        return _process_all(ctx, st, sse.split_events(region), scrub)
    k = ctx.ep.wire.relay(ctx, st, region)
    if k == len(region):
        return region
    out = _process_all(ctx, st, sse.split_events(region[k:] if k else region), scrub)
    return region[:k] + out if k else out


def _process_all(ctx: RequestContext, st: StreamState, events: list[bytes], scrub: Scrubber = GENERIC) -> bytes:
    """Events on their way to the client (the wire's `process`); an upstream error event's message is scrubbed
    or replaced first (gateway/proxy/scrub.py `Scrubber.event`)."""
    process = ctx.ep.wire.process
    outs = []
    for ev in events:
        if b'"error"' in ev:
            ev = scrub.event(ev)
        out = process(ctx, st, ev)
        if out is not None:
            outs.append(out)
        if ctx.cut_by_budget:
            break
    return b"".join(outs)
