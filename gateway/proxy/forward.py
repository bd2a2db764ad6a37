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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson

from gateway.errors import GatewayError, retry_headers
from gateway.pipeline import RequestContext, Usage
from gateway.proxy import sse
from gateway.proxy.health import Health
from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError, UpstreamResponse
from gateway.proxy.upstream import Upstreams
from gateway.routing.plan import Candidate, RoutePlan

log = logging.getLogger("gateway.proxy")

PATHS = {"chat": "chat/completions", "completions": "completions", "embeddings": "embeddings"}
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


@dataclass(slots=True)
class JsonResult:
    status: int
    body: bytes
    candidate: Candidate | None


@dataclass(slots=True)
class _StreamState:
    done: bool = False
    delivered_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def upstream_body(ctx: RequestContext, cand: Candidate) -> bytes:
    """The body sent upstream: the client's, with the upstream model name, usage always requested for
    streams, policy caps and the routing stage's overrides (cache_salt, priority); never the client's
    `provider` preferences."""
    body = dict(ctx.body)
    body["model"] = cand.backend.upstream_model(cand.model)
    body.pop("provider", None)  # the client's provider preferences are ours (gateway/policy/provider_prefs.py)
    if ctx.stream:
        so = dict(body.get("stream_options") or {})
        so["include_usage"] = True
        body["stream_options"] = so
    if ctx.max_tokens is not None and ctx.endpoint != "embeddings":
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = ctx.max_tokens
        else:
            body["max_tokens"] = ctx.max_tokens
    if ctx.body_overrides:
        body.update(ctx.body_overrides)
    if cand.backend.kind == "openai":  # partner routes are plain OpenAI: drop vLLM-only fields
        body.pop("cache_salt", None)
        if not cand.backend.priority_scheduling:
            body.pop("priority", None)
    elif not cand.backend.priority_scheduling:
        body.pop("priority", None)
    return orjson.dumps(body)


def response_facts(ctx: RequestContext, obj: Any) -> None:
    """The completion id and the finish reasons of a response body or of a stream chunk (for traces and the
    audit record; finish reasons are what tells a length cut from a natural stop)."""
    if not isinstance(obj, dict):
        return
    rid = obj.get("id")
    if isinstance(rid, str) and ctx.response_id is None:
        ctx.response_id = rid[:128]
    choices = obj.get("choices")
    if isinstance(choices, list):
        reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)]
        found = tuple(r for r in reasons if isinstance(r, str))
        if found:
            ctx.finish_reasons = ctx.finish_reasons + found


def usage_from(obj: dict[str, Any]) -> Usage | None:
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens=int(u.get("prompt_tokens") or 0), completion_tokens=int(u.get("completion_tokens") or 0),
                 cached_tokens=int(cached) if isinstance(cached, int) else None)


def _upstream_error_message(status: int, body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        msg = obj.get("error", {}).get("message") if isinstance(obj.get("error"), dict) else obj.get("message")
        if isinstance(msg, str):
            return msg[:500]
    except (orjson.JSONDecodeError, AttributeError):
        pass
    return f"upstream answered HTTP {status}"


def client_error_body(status: int, body: bytes) -> bytes:
    """An upstream 4xx the client must fix, in OpenAI's error shape whatever the upstream sent: its message
    (at most 500 chars), type and param when they are strings, and a string code (vLLM sends the HTTP status as
    a number in `code`; partners add fields of their own, which are not passed on)."""
    err: dict = {}
    try:
        obj = orjson.loads(body)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            err = obj["error"]
    except orjson.JSONDecodeError:
        pass
    def short(v: Any) -> str | None:
        return v if isinstance(v, str) and 0 < len(v) <= 64 else None

    return GatewayError(status, _upstream_error_message(status, body), code=short(err.get("code")) or "upstream_rejected",
                        param=short(err.get("param")), type=short(err.get("type"))).to_bytes()


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

    def _headers(self, ctx: RequestContext, cand: Candidate) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": ctx.request_id}
        auth = self._upstreams().auth(cand.backend.name)
        if auth:
            h["authorization"] = auth
        tp = ctx.headers.get("traceparent")
        if tp:
            h["traceparent"] = tp
        h.update(ctx.upstream_headers)
        return h

    async def open(self, ctx: RequestContext) -> StreamStart | JsonResult:
        plan: RoutePlan = ctx.route
        if not plan or not plan.candidates:
            raise GatewayError(503, f"No backend is available for model '{ctx.model}'.", code="no_backend_available",
                               headers=retry_headers(1.0))
        self.retry_budget.request()
        last_error: GatewayError | None = None
        attempts = 0
        for cand in plan.candidates:
            name = cand.backend.name
            why = self._residency_check(ctx, cand)
            if why is not None:  # defence in depth: never send outside the decision's residency class
                ctx.attempts.append({"backend": name, "skipped": why})
                continue
            if not self.health.available(name):
                ctx.attempts.append({"backend": name, "skipped": "circuit open"})
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
            try:
                result = await self._attempt(ctx, cand)
            except GatewayError as e:
                retryable = bool(e.extra.pop("_retryable", False))
                ctx.attempts.append({"backend": name, "error": e.code, "status": e.status})
                last_error = e
                if retryable:
                    continue
                raise
            ctx.attempts.append({"backend": name, "status": 200 if isinstance(result, StreamStart) else result.status})
            ctx.backend = name
            ctx.backend_model = cand.model
            return result
        if last_error is not None:
            raise last_error
        raise GatewayError(503, f"No healthy backend is available for model '{ctx.model}'.",
                           code="no_backend_available", headers=retry_headers(1.0))

    async def _attempt(self, ctx: RequestContext, cand: Candidate) -> StreamStart | JsonResult:
        b = cand.backend
        client = self._upstreams().client(b.name)
        self.health.begin(b.name)
        body = upstream_body(ctx, cand)
        t0 = time.perf_counter()
        limit = b.timeouts.first_token_s if ctx.stream else b.timeouts.total_s
        resp: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(limit):
                resp = await client.post(PATHS[ctx.endpoint], body, self._headers(ctx, cand))
                if resp.status != 200:
                    err_body = await _read_limited(resp, _MAX_ERROR_BODY)
                    await resp.aclose()
                    return self._upstream_status(ctx, cand, resp.status, err_body, resp.headers)
                if not ctx.stream:
                    body = await resp.aread()
                    await resp.aclose()
                    self.health.success(b.name)
                    return JsonResult(200, body, cand)
                splitter = sse.EventSplitter()
                it = resp.aiter_raw()
                first: list[bytes] = []
                while True:  # read until the first generated token (or the end) arrives
                    try:
                        chunk = await it.__anext__()
                    except StopAsyncIteration:
                        break
                    events = splitter.feed(chunk)
                    first.extend(events)
                    if any(_is_first_token(e) for e in events):
                        break
                if not first:
                    raise UpstreamBroken("upstream closed the stream before any event")
                self.health.success(b.name)
                return StreamStart(resp, cand, first, splitter, it, t0, health=self.health)
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

    def _upstream_status(self, ctx: RequestContext, cand: Candidate, status: int, body: bytes,
                         headers) -> JsonResult:
        name = cand.backend.name
        msg = _upstream_error_message(status, body)
        if status >= 500:
            self.health.failure(name, f"HTTP {status}")
            raise GatewayError(502, f"Upstream error: {msg}", code="upstream_error",
                               extra={"_retryable": status in _RETRYABLE_STATUS or status == 500})
        if status == 429:
            ra = headers.get("retry-after")
            try:
                secs = float(ra) if ra else 1.0
            except ValueError:
                secs = 1.0
            raise GatewayError(429, "Upstream is rate limiting; retry later.", code="upstream_rate_limited",
                               headers=retry_headers(secs), extra={"_retryable": True})
        if status in (401, 403):  # our credential for the upstream is wrong: the client cannot fix it
            self.health.failure(name, f"HTTP {status}")
            raise GatewayError(502, "Upstream rejected the gateway's credentials.", code="upstream_auth_error",
                               extra={"_retryable": True})
        self.health.success(name)
        # 4xx about the request itself (context too long, bad parameter): the client's to fix.
        return JsonResult(status, client_error_body(status, body), cand)


def _is_first_token(event: bytes) -> bool:
    data = sse.event_data(event)
    if data is None:
        return False
    return data == sse.DONE or sse.has_usage(data) or sse.has_token(data)


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


async def stream_body(ctx: RequestContext, start: StreamStart,
                      on_end: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """Forward a started stream event by event; capture usage; strip the usage-only chunk the client did
    not ask for; cut at the budget allowance; end with an error event if the upstream breaks."""
    b = start.candidate.backend
    st = _StreamState()
    deadline = start.started_at + b.timeouts.total_s
    it = start.iterator
    try:
        observe_first_events(ctx, start)
        # Events that arrived in one upstream read leave in one write: same timing, far fewer sends.
        out = _process_all(ctx, st, start.first)
        if out:
            yield out
        if ctx.cut_by_budget:
            return
        while not st.done:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError("total")
            try:
                async with asyncio.timeout(min(b.timeouts.idle_s, remaining)):
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                break
            out = _process_all(ctx, st, start.splitter.feed(chunk))
            if out:
                yield out
            if ctx.cut_by_budget:
                return
        if not st.done:
            ctx.error = "upstream_stream_broken"
            ctx.status = 502
            _mid_stream_failure(start, "stream closed before [DONE]")
            yield GatewayError(502, "Upstream closed the stream before it finished.", code="upstream_error").sse_event()
    except TimeoutError:
        ctx.error = "upstream_timeout"
        ctx.status = 504
        _mid_stream_failure(start, "stream idle or total timeout")
        yield GatewayError(504, "Upstream stopped sending (idle or total timeout).", code="upstream_timeout").sse_event()
    except (UpstreamBroken, OSError):
        ctx.error = "upstream_stream_broken"
        ctx.status = 502
        _mid_stream_failure(start, "connection broke mid-stream")
        yield GatewayError(502, "Upstream connection broke mid-stream.", code="upstream_error").sse_event()
    finally:
        if ctx.usage is None:
            ctx.usage = Usage(prompt_tokens=ctx.prompt_tokens_est, completion_tokens=st.delivered_tokens)
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()
        await start.response.aclose()
        await on_end()


def _mid_stream_failure(start: StreamStart, reason: str) -> None:
    """Passive outlier detection: an engine that dies or stalls mid-stream is as unhealthy as one that fails
    before its first token (the client cannot be retried, but the next requests should avoid it)."""
    if start.health is not None:
        start.health.failure(start.candidate.backend.name, reason)


def _process_all(ctx: RequestContext, st: _StreamState, events: list[bytes]) -> bytes:
    outs = []
    for ev in events:
        out = _process(ctx, st, ev)
        if out is not None:
            outs.append(out)
        if ctx.cut_by_budget:
            break
    return b"".join(outs)


def _process(ctx: RequestContext, st: _StreamState, ev: bytes) -> bytes | None:
    data = sse.event_data(ev)
    if data is None:
        return ev + b"\n\n"
    if data == sse.DONE:
        st.done = True
        return ev + b"\n\n"
    if ((b'"finish_reason"' in data and b'"finish_reason":null' not in data)
            or (ctx.response_id is None and b'"id"' in data)):
        response_facts(ctx, sse.parse_chunk(data))  # the first chunk (id) and the last of each choice only
    if sse.has_usage(data):
        chunk = sse.parse_chunk(data)
        if chunk is not None:
            u = usage_from(chunk)
            if u is not None:
                ctx.usage = u
            if sse.is_usage_only(chunk) and not ctx.client_wants_usage:
                return None
    allowance = ctx.completion_token_allowance
    if allowance is None:  # cheap lower bound (one token per content event) in case the usage never arrives
        st.delivered_tokens += 1
        ctx.delivered_completion_tokens = st.delivered_tokens
    else:
        chunk = sse.parse_chunk(data)
        n = sse.chunk_text_len(chunk) if chunk else 0
        if n:
            st.delivered_tokens += max(1, (n + 3) // 4)
            ctx.delivered_completion_tokens = st.delivered_tokens
            if st.delivered_tokens >= allowance:
                ctx.cut_by_budget = True
                ctx.error = "insufficient_quota"
                return ev + b"\n\n" + GatewayError(
                    429, "Budget exhausted: the stream was stopped at the remaining budget.",
                    code="insufficient_quota").sse_event()
    return ev + b"\n\n"
