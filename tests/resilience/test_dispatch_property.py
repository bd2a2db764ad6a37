"""Property: the real Dispatcher (gateway/proxy/forward.py) never sends an attempt to a backend outside the
request's residency class, whatever the candidate list and whatever faults the backends answer with; it
retries only retryable failures, never after the first byte, never past max_attempts, and its answer is a
complete result or a clear GatewayError.

The backends here are in-process scripted transports (the `Transport` interface of gateway/proxy/transport.py,
the I/O edge): each answers with a drawn behaviour, so hypothesis can explore thousands of fault mixes.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import msgspec
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.config import BackendConfig, parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.policy.eea import EEA_COUNTRIES
from gateway.policy.residency import backend_allowed
from gateway.proxy.forward import Dispatcher, JsonResult, StreamStart, stream_body
from gateway.proxy.health import Health
from gateway.proxy.transport import UpstreamBroken, UpstreamConnectError
from gateway.routing.plan import Candidate, RoutePlan
from gateway.app import Gateway
from gateway.types import Decision

BEHAVIOURS = ["ok", "connect_error", "http500", "http502", "http503", "http400", "http429", "die_before_first",
              "die_after_first", "timeout"]
RETRYABLE = {"connect_error", "http500", "http502", "http503", "http429", "die_before_first"}
RETRYABLE_JSON = RETRYABLE | {"die_after_first"}  # a broken JSON body reached nobody yet
COUNTRIES = ["DE", "FR", "SE", "FI", "NL", "NO", "US", "GB", "CH", "JP"]

CHUNK = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
DONE = b"data: [DONE]\n\n"


class _Resp:
    def __init__(self, status: int, chunks: list[bytes], die_after: int | None = None) -> None:
        self.status = status
        self.headers = {"retry-after": "1"} if status == 429 else {}
        self._chunks = chunks
        self._die_after = die_after

    async def aread(self) -> bytes:
        if self._die_after is not None:
            raise UpstreamBroken("engine died")
        return b"".join(self._chunks)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for i, c in enumerate(self._chunks):
            if self._die_after is not None and i >= self._die_after:
                raise UpstreamBroken("engine died")
            yield c
        if self._die_after is not None:
            raise UpstreamBroken("engine died")

    async def aclose(self) -> None:
        return None


class ScriptedTransport:
    """One backend: answers every POST with its drawn behaviour and records that it was called."""

    def __init__(self, name: str, behaviour: str, log: list[str], stream: bool) -> None:
        self.name, self.behaviour, self.log, self.stream = name, behaviour, log, stream

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> _Resp:
        self.log.append(self.name)
        b = self.behaviour
        if b == "connect_error":
            raise UpstreamConnectError("refused")
        if b == "timeout":
            await asyncio.sleep(10)
        if b.startswith("http"):
            code = int(b[4:])
            return _Resp(code, [orjson.dumps({"error": {"message": "x", "type": "t", "code": "c"}})])
        if b == "die_before_first":
            return _Resp(200, [b": keepalive\n\n"], die_after=1)
        if not self.stream and b == "die_after_first":  # a JSON answer broken half way: nothing was sent
            return _Resp(200, [b'{"choices": ['], die_after=1)
        if not self.stream:
            return _Resp(200, [orjson.dumps({"choices": [{"message": {"content": "hi"}}],
                                             "usage": {"prompt_tokens": 3, "completion_tokens": 1}})])
        if b == "die_after_first":
            return _Resp(200, [CHUNK, CHUNK], die_after=2)
        return _Resp(200, [CHUNK, USAGE, DONE])

    async def get(self, path: str, timeout: float) -> int:
        return 200

    async def aclose(self) -> None:
        return None


class ScriptedUpstreams:
    from gateway.proxy.scrub import GENERIC as scrubber  # Upstreams.scrubber: no configured secret

    def __init__(self, transports: dict[str, ScriptedTransport]) -> None:
        self._t = transports

    def client(self, name: str) -> ScriptedTransport:
        return self._t[name]

    def auth(self, name: str) -> str | None:
        return None


backend_st = st.fixed_dictionaries({
    "country": st.sampled_from(COUNTRIES),
    "storage": st.one_of(st.none(), st.sampled_from(COUNTRIES)),
    "located": st.booleans(),
    "retention": st.sampled_from(["zero", "none", "30d"]),
    "behaviour": st.sampled_from(BEHAVIOURS),
})
decision_st = st.fixed_dictionaries({
    "countries": st.one_of(st.none(), st.just("EEA"), st.lists(st.sampled_from(COUNTRIES), min_size=1, max_size=3)),
    "zero": st.booleans(),
})


def _decision(d: dict) -> Decision:
    if d["countries"] == "EEA":
        allowed, jur = EEA_COUNTRIES, "EEA"
    elif d["countries"] is None:
        allowed, jur = None, None
    else:
        allowed, jur = frozenset(d["countries"]), ",".join(sorted(d["countries"]))
    return Decision(allowed_countries=allowed, jurisdiction=jur, residency_rule="r" if allowed else None,
                    retention="zero" if d["zero"] else None, retention_rule="z" if d["zero"] else None)


def _backend(i: int, spec: dict) -> BackendConfig:
    loc = None
    if spec["located"]:
        loc = {"country": spec["country"], **({"storage_country": spec["storage"]} if spec["storage"] else {})}
    raw = {"name": f"b{i}", "url": "http://127.0.0.1:1/v1", "models": ["m"], "retention": spec["retention"],
           "timeouts": {"first_token_s": 0.05, "total_s": 0.05, "idle_s": 0.05},
           "health": {"failures_to_open": 1000}}
    if loc:
        raw["location"] = loc
    return msgspec.convert(raw, BackendConfig)


async def _run_one(specs: list[dict], dspec: dict, stream: bool, order: list[int]) -> None:
    backends = [_backend(i, s) for i, s in enumerate(specs)]
    cfg = parse_config(orjson.dumps({"backends": [msgspec.to_builtins(b) for b in backends]}).decode())
    log: list[str] = []
    ups = ScriptedUpstreams({b.name: ScriptedTransport(b.name, specs[i]["behaviour"], log, stream)
                             for i, b in enumerate(backends)})
    health = Health(cfg)
    # the very check Gateway wires into its Dispatcher (app.py Gateway._residency_check)
    disp = Dispatcher(lambda: ups, health, lambda c, cand: Gateway._residency_check(None, c, cand))  # type: ignore[arg-type]
    decision = _decision(dspec)
    ctx = RequestContext(request_id="r", endpoint="chat", headers={}, body={"model": "m", "messages": []})
    ctx.model, ctx.stream, ctx.decision, ctx.model_chain = "m", stream, decision, ("m",)
    # the candidate list may contain anything (a buggy or stale router): the dispatcher must still hold
    ctx.route = RoutePlan(candidates=[Candidate(backend=backends[i], model="m") for i in order])
    allowed = {b.name for b in backends if backend_allowed(decision, b) is None}
    try:
        res = await disp.open(ctx)
    except GatewayError as e:
        res = e
    # 1. residency: no attempt ever reached a backend outside the decision's class
    assert set(log) <= allowed, (log, allowed)
    # 2. bounded: at most max_attempts sends, each backend of the plan once per occurrence
    assert len(log) <= disp.max_attempts
    # 3. retries only after retryable failures: every attempt but the last failed retryably
    for name in log[:-1]:
        assert specs[int(name[1:])]["behaviour"] in (RETRYABLE if stream else RETRYABLE_JSON), log
    if isinstance(res, GatewayError):
        assert res.status in (400, 403, 429, 502, 503, 504) and res.code  # a clear error
        if log and specs[int(log[-1][1:])]["behaviour"] == "ok":
            raise AssertionError("an ok backend was tried but the request failed")
        if res.status in (429, 503):
            assert "retry-after" in res.headers and "retry-after-ms" in res.headers
        return
    assert ctx.backend in allowed and log and log[-1] == ctx.backend
    beh = specs[int(ctx.backend[1:])]["behaviour"]
    if isinstance(res, JsonResult):
        assert beh in ("ok", "http400")
        return
    assert isinstance(res, StreamStart) and beh in ("ok", "die_after_first")
    ended: list[bool] = []

    async def on_end() -> None:
        ended.append(True)

    out = b"".join([c async for c in stream_body(ctx, res, on_end)])
    assert ended == [True]
    assert out.rstrip().endswith(b"data: [DONE]")  # complete, or a clear error event then [DONE]
    if beh == "die_after_first":
        assert b'"upstream_error"' in out
    assert log[-1] == ctx.backend and len(log) <= disp.max_attempts  # nothing retried after the first byte


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(backend_st, min_size=1, max_size=6), dspec=decision_st, stream=st.booleans(),
       data=st.data())
def test_dispatch_never_leaves_residency_class(specs, dspec, stream, data):
    order = data.draw(st.lists(st.integers(0, len(specs) - 1), min_size=1, max_size=8), label="candidate order")
    asyncio.run(_run_one(specs, dspec, stream, order))


def test_retry_budget_bounds_amplification():
    """Under a total outage the retry budget caps retries at ratio x requests + floor per window."""
    from gateway.proxy.forward import RetryBudget

    rb = RetryBudget(ratio=0.2, floor_per_s=1.0, window_s=10.0)
    granted = 0
    for _ in range(1000):
        rb.request()
        granted += rb.try_retry()
    assert granted <= 0.2 * 1000 + 10
    assert granted >= 0.2 * 1000  # and they are not refused below the budget
