"""Audit records are pinned byte for byte: the JSON line the recorder writes for a fixed request must not move
when the recorder is made cheaper. `golden_records.jsonl` holds one line per case below, as the recorder wrote
them before its hot path was reworked (build_record, the strip, the encoding, the timestamp).

A change that means to alter records regenerates the file on purpose: `.venv/bin/python -m
tests.evidence.test_record_bytes > tests/evidence/golden_records.jsonl`, and the diff is reviewed.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import sys
from pathlib import Path
from typing import Any, Callable

import orjson
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.config import BackendConfig, Location
from gateway.evidence import recorder as R
from gateway.pipeline import RequestContext
from gateway.policy.compiler import compile_text
from gateway.policy.stage import PolicyStage
from gateway.types import Principal, Usage

GOLDEN = Path(__file__).with_name("golden_records.jsonl")
PROMPT = "CANARY-PROMPT-7f3a9c1e secret merger plans"
COMPLETION = "CANARY-COMPLETION-b24d88aa the answer"
POL = compile_text("rules:\n  - id: opper\n    match: {partner: opper}\n    require: {jurisdiction: EEA, retention: zero}\n"
)
BACKEND = BackendConfig(name="up", url="http://up/v1", models=["m"], location=Location(country="DE"),
                        retention="zero", operator="self")
EU = BackendConfig(name="eu-1", url="http://eu-1", models=["q"],
                   location=Location(country="DE", storage_country="NL", region="fra"), retention="zero")


@dataclasses.dataclass
class _Plan:
    backend: str
    score: float


class _Slots:
    __slots__ = ("a", "b")

    def __init__(self) -> None:
        self.a = 1  # b left unset: recorded as None


class _ToEvidence:
    def to_evidence(self) -> dict[str, Any]:
        return {"kind": "handle", "n": 2}


class _Key(str):
    pass


class _Opaque:
    def __str__(self) -> str:
        return "opaque"


def _ctx(rid: str, *, partner: str | None = None, labels: dict[str, str] | None = None, wall: float = 1764636388.437885,
         content: str = "hello there") -> RequestContext:
    c = RequestContext(request_id=rid, endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 16},
                       received_wall=wall)
    c.principal = Principal(id="static:0", kind="static_key", tenant="bench", key_id="static:0", partner=partner,
                            labels=labels or {})
    c.model, c.model_chain = "m", ("m",)
    return c


async def _decided(c: RequestContext) -> RequestContext:
    await PolicyStage(lambda: POL).run(c)
    return c


def _served(c: RequestContext) -> RequestContext:
    """What a served non-streaming chat request carries when it reaches the recorder (bench/instructions.py)."""
    ev = c.evidence
    ev["principal"] = c.principal.to_evidence() if c.principal else None
    ev["dropped"] = []
    ev["candidates"] = [{"backend": "up", "model": "m", "country": "DE", "predicted_ttft_ms": 38.163,
                         "predicted_cached_tokens": 0, "predicted_ttft_upper_ms": 57.225, "ahead_tokens": 61,
                         "running": 0.0, "waiting": 0.0, "inflight": 30, "operator": "self"}]
    ev["predicted_ttft_ms"] = 38.163
    ev["predicted_cached_tokens"] = 0
    ev["route"] = {"strategy": "predicted_ttft", "pick": "up", "ttft_slo_ms": None, "admission": "admit",
                   "token_source": "estimate", "cache_isolation": False, "decided_us": 70.3, "since_arrival_ms": 0.095,
                   "queue": {"class": "standard", "flow": "bench", "share": 1.0, "lane": "short", "queued": False,
                             "waited_ms": 0.0, "predicted_wait_ms": 0.0, "ahead_tokens": 0.0, "outcome": "dispatched"}}
    ev["unit_cost"] = {"engine": "up", "method": "apportioned", "gpu_seconds": 0.0025775254287741657,
                       "prefill_gpu_seconds": 0.000625, "shared_gpu_seconds": 0.0019525254287741656,
                       "engine_prefill_share": 0.5480726070167222, "s_per_prefill_token": 0.000125, "gpus": 1,
                       "cached_prefill_gpu_seconds": 0.0, "category": "served", "backend": "up", "cost": None,
                       "cost_basis": None, "currency": "EUR", "retries": 0, "saved_gpu_seconds": {},
                       "wasted_gpu_seconds": {}, "saved_tokens": 0, "saved_cost": 0.0, "charged": 0.0,
                       "charged_currency": "EUR", "margin": None}
    ev["actual_ttft_ms"] = None
    ev["actual_cached_tokens"] = None
    ev["cost"] = {"amount": 0.0, "currency": "EUR", "model": "m", "prompt_tokens": 5, "completion_tokens": 2,
                  "cached_tokens": None, "gpu_seconds": None}
    c.attempts = [{"backend": "up", "status": 200}]
    c.backend, c.backend_model, c.status = "up", "m", 200
    c.usage = Usage(prompt_tokens=5, completion_tokens=2)
    c.response_id, c.finish_reasons = "x", ("stop",)
    c.total_s = 0.024996
    c.stage_timings_us = {"observe": 1.0, "authenticate": 5.0, "decide": 8.1, "cache": 0.5, "reserve": 0.4,
                          "route": 85.8, "meter": 0.3}
    return c


async def case_served() -> tuple[RequestContext, bool, Any]:
    return _served(await _decided(_ctx("req-served"))), False, BACKEND


async def case_served_capture() -> tuple[RequestContext, bool, Any]:
    c = _served(await _decided(_ctx("req-capture", labels={"tier": "gold"})))
    c.evidence["completion_text"] = COMPLETION
    c.client_request_id = "client-1"
    return c, True, BACKEND


async def case_zero_retention() -> tuple[RequestContext, bool, Any]:
    """Zero retention with content everywhere a careless stage or an upstream echo could put it."""
    c = _served(await _decided(_ctx("req-zr", partner="opper", content=PROMPT)))
    c.evidence["completion_text"] = COMPLETION
    c.evidence["debug"] = {"messages": [{"content": PROMPT}], "note": "ok", "echo": f"prefix {PROMPT[:30]}"}
    c.attempts = [{"backend": "eu-2", "error": f"400 bad request: '{PROMPT}' too long"}, {"backend": "eu-1", "status": 200}]
    c.backend, c.ttft_s = "eu-1", 0.131
    c.usage = Usage(prompt_tokens=40, completion_tokens=10, cached_tokens=32)
    return c, True, EU


async def case_unknown_retention() -> tuple[RequestContext, bool, Any]:
    """Refused before the decision (no principal): retention unknown, scrubbed as zero."""
    c = _ctx("req-refused", content=PROMPT, wall=1764636388.0)
    c.principal = None
    c.status, c.error = 401, "invalid_api_key"
    c.evidence["auth"] = {"error": f"bad key for {PROMPT}", "input": PROMPT}
    c.stage_timings_us = {"observe": 0.7, "authenticate": 12.25}
    c.total_s = 0.000125
    return c, True, None


async def case_stashed_content() -> tuple[RequestContext, bool, Any]:
    """Not zero retention, but stages stashed content keys deep in their evidence: stripped, nothing else."""
    c = _served(await _decided(_ctx("req-stash")))
    c.evidence["debug"] = {"messages": [{"content": "x"}], "note": "ok",
                           "nested": ({"text": "t", "keep": [1, 2, {"delta": "d", "ok": True}]}, [])}
    c.evidence["candidates"].append({"backend": "b2", "prompt": "p", "tool_calls": [], "dropped": "full"})
    c.attempts = [{"backend": "up", "status": 200, "choices": [{"text": "c"}]}]
    c.evidence["route"]["queue"]["input"] = "i"
    return c, False, BACKEND


async def case_odd_values() -> tuple[RequestContext, bool, Any]:
    """Values the encoder and _plain special-case: non-str keys, objects, sets, datetimes, odd floats."""
    c = _served(await _decided(_ctx("req-odd", wall=1.5)))
    ev = c.evidence
    ev["plan"] = _Plan("up", 0.5)
    ev["slots"] = _Slots()
    ev["handle"] = _ToEvidence()
    ev["opaque"] = _Opaque()
    ev["by_code"] = {1: "one", None: "none", 2.5: "x", False: "f"}
    ev["keys"] = {_Key("k"): 1, _Key("text"): "a str subclass key equal to a content key"}
    ev["when"] = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    ev["tags"] = ("a", "b")
    ev["big"] = 2 ** 60
    ev["floats"] = [float("inf"), -0.0, 1e-300, float("nan")]
    c.batch = {"batch_id": "b1", "line": 3, "custom_id": "c"}
    c.evidence["session"] = "trace-1"
    c.ttft_s = 0.0135
    c.total_s = 0.0125
    c.stage_timings_us = {"observe": 0.05, "authenticate": 0.15, "decide": 0.25, "cache": 0.35, "reserve": 2.675,
                          "route": -0.04, "meter": 3, "weird": 1e12 + 0.05, "tie": 0.45, "neg": -2.5}
    return c, False, lambda n: None  # the backend was removed by a reload: no location


async def case_not_encodable() -> tuple[RequestContext, bool, Any]:
    c = _served(await _decided(_ctx("req-huge")))
    c.evidence["huge"] = 2 ** 70  # orjson refuses integers over 64 bits: the record is dropped, not the request
    return c, False, BACKEND


CASES: list[Callable[[], Any]] = [case_served, case_served_capture, case_zero_retention, case_unknown_retention,
                                  case_stashed_content, case_odd_values]


def _lookup(b: Any) -> Callable[[str], Any] | None:
    if b is None:
        return None
    return b if callable(b) else (lambda name: b)


async def _line(case: Callable[[], Any]) -> bytes:
    c, capture, backend = await case()
    rec = R.EvidenceRecorder(None, capture_content=capture, backend_lookup=_lookup(backend))
    assert rec.record(c)
    line = rec._recent[c.request_id]
    # the recorder writes exactly what build_record returns, encoded
    assert line == R._dumps(R.build_record(c, capture_content=capture, backend_lookup=_lookup(backend)))
    return line


async def test_records_are_byte_for_byte_the_pinned_ones():
    want = GOLDEN.read_bytes().splitlines()
    got = [await _line(case) for case in CASES]
    assert len(got) == len(want)
    for case, g, w in zip(CASES, got, want):
        assert g == w, case.__name__


async def test_zero_retention_golden_has_no_content():
    for case in (case_zero_retention, case_unknown_retention):
        line = await _line(case)
        # (a partial echo shorter than the prompt's 64-character head is not caught: "echo" in case_zero_retention)
        assert PROMPT.encode() not in line and COMPLETION.encode() not in line
        assert b"[redacted: zero retention]" in line


async def test_a_record_the_encoder_refuses_is_dropped_and_logged(caplog):
    c, capture, backend = await case_not_encodable()
    rec = R.EvidenceRecorder(None, capture_content=capture, backend_lookup=_lookup(backend))
    assert rec.record(c) is False
    assert c.request_id not in rec._recent and rec._queue.empty()
    assert "encoding evidence for req-huge failed" in caplog.text


_keys = st.one_of(st.text(max_size=6), st.sampled_from(sorted(R.CONTENT_KEYS)), st.integers(-5, 5), st.none(),
                  st.booleans(), st.floats(allow_nan=False, width=32))
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=8)
    | st.datetimes(timezones=st.just(dt.timezone.utc)),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=10)


@given(_values)
def test_encoding_equals_the_non_str_keys_encoding(value):
    """_dumps tries the plain encoding first (str keys: the common case, cheaper) and falls back: the bytes are
    the ones the OPT_NON_STR_KEYS encoding gives, and a value that encoding refuses is refused too."""
    try:
        want = orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        try:
            R._dumps(value)
        except TypeError:
            return
        raise AssertionError("encoded a value the reference refuses")
    assert R._dumps(value) == want


@given(st.floats(min_value=0, max_value=253402300799.0) | st.integers(0, 4102444800))
@example(1764636388.0)
@example(1764636388.9999995)
@example(1764636388.0000005)
@example(0)
def test_timestamp_equals_isoformat(t):
    assert R._iso_utc(t) == dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def _scrub_before(value: Any, secrets: list[str]) -> Any:
    """recorder._scrub as it was written before its walk was made cheaper (the reference)."""
    if isinstance(value, dict):
        return {k: _scrub_before(v, secrets) for k, v in value.items() if k not in R.CONTENT_KEYS}
    if isinstance(value, (list, tuple)):
        return [_scrub_before(v, secrets) for v in value]
    if isinstance(value, str) and secrets:
        for s in secrets:
            if s in value:
                return R._REDACTED
            if len(s) > 64 and s[:64] in value:
                return R._REDACTED
        return value
    return value


_LONG = "L" * 70 + "tail"
_texts = st.sampled_from(["", "abc", "abcd", "secret", "a secret here", _LONG, _LONG[:64] + "x", "LLLL"]) | st.text(
    alphabet="abcLs ", max_size=8)
_scrub_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | _texts | _texts.map(_Key),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.sampled_from(["backend", "content", "messages", "note", "delta", "x", 1]), inner, max_size=3)
    | st.builds(lambda d: __import__("collections").OrderedDict(d), st.dictionaries(st.sampled_from(["a", "text"]),
                                                                                     inner, max_size=2)),
    max_leaves=12)


@given(_scrub_values, st.lists(_texts, max_size=3))
@example({"a": ["a secret here", ("x", _LONG + "!")], "b": _LONG[:64]}, ["secret", _LONG])
@example({"a": "anything"}, [""])
@example({"a": "secret", "b": ["secre", _Key("secret")]}, ["secret"])  # exactly a needle's length
@example({"a": _LONG[:63] + "Q", "b": "x" + _LONG[:64]}, [_LONG])  # a 64-character head, not 63
@settings(max_examples=400)
def test_scrub_equals_the_scrub_before(value, secrets):
    assert orjson.dumps(R._scrub(value, secrets), option=orjson.OPT_NON_STR_KEYS) == orjson.dumps(
        _scrub_before(value, secrets), option=orjson.OPT_NON_STR_KEYS)


def test_strip_content_walks_container_subclasses_as_the_scrub_does():
    """The identity checks are a fast path only: dict, list and tuple subclasses are still walked."""
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    value = {"od": OrderedDict(note="n", nested=OrderedDict(messages=["x"], keep=1)),
             "nt": Pair({"prompt": "p", "ok": 1}, [_Key("v"), {"text": "t"}]),
             "sub": _Key("just a str subclass"), "obj": _Plan("up", 1.0)}
    out = R._strip_content(value)
    assert orjson.dumps(out, default=str) == orjson.dumps(R._scrub(value, []), default=str)
    assert out["od"]["nested"] == {"keep": 1} and out["nt"] == [{"ok": 1}, ["v", {}]] and out["obj"] is value["obj"]
    clean = {"od": OrderedDict(a=1, b=[Pair(1, 2)]), "s": _Key("x")}
    assert R._strip_content(clean) is clean


async def _golden() -> None:
    for case in CASES:
        sys.stdout.buffer.write(await _line(case) + b"\n")


if __name__ == "__main__":
    import asyncio

    asyncio.run(_golden())
