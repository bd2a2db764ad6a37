"""Schema-driven fuzzing of the gateway's public API with schemathesis (shared by the in-suite test and
bench/fuzz_api.py): every operation of /openapi.json, positive and negative generation, with and without
credentials; each answer is checked: no 5xx, no hang, every refusal an OpenAI-shaped error (Anthropic-shaped
on /v1/messages)."""
from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hseed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from gateway.api.openapi import openapi_spec


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    max_latency_s: float = 0.0
    codes: Counter = field(default_factory=Counter)  # (status, error code) of refusals

    def merge(self, other: "FuzzReport") -> None:
        self.requests += other.requests
        self.statuses.update(other.statuses)
        self.failures += other.failures
        self.max_latency_s = max(self.max_latency_s, other.max_latency_s)
        self.codes.update(other.codes)


def check_answer(method: str, path: str, status: int, ctype: str, body: bytes) -> str | None:
    """None when the answer is acceptable, else what is wrong with it."""
    if status >= 500 and not (path == "/readyz" and status == 503):
        return f"{method} {path}: {status} {body[:300]!r}"
    if status >= 400 and path != "/readyz":
        if not ctype.startswith("application/json"):
            return f"{method} {path}: {status} refusal is not JSON ({ctype}): {body[:200]!r}"
        anthropic = path == "/v1/messages"  # Anthropic's error shape on its own API (gateway/api/wire/anthropic.py)
        try:
            obj = orjson.loads(body)
            err = obj["error"]
            assert isinstance(err["message"], str) and err["message"] and "type" in err
            if anthropic:
                assert obj["type"] == "error" and set(err) == {"type", "message"}
            else:
                assert "param" in err and "code" in err
        except Exception:
            shape = "Anthropic" if anthropic else "OpenAI"
            return f"{method} {path}: {status} refusal is not {shape}-shaped: {body[:300]!r}"
    return None


def _bytes(v: Any) -> bytes:
    """Any generated value as the bytes of a form part (text as UTF-8, lone surrogates kept as they are)."""
    if isinstance(v, bytes):
        return v
    return (v if isinstance(v, str) else json.dumps(v)).encode("utf-8", "surrogatepass")


def multipart(files: list[tuple[Any, Any]]) -> tuple[bytes, str]:
    """A multipart/form-data body of schemathesis's generated parts, [(name, (filename, content[, type]))],
    written here rather than by a client library, which refuses some generated values (ints, lone surrogates):
    the gateway must answer whatever bytes arrive."""
    boundary = b"fuzz-" + uuid.uuid4().hex.encode()
    out = []
    for name, value in files:
        filename, content, *ctype = value if isinstance(value, tuple) else (None, value)
        head = b'Content-Disposition: form-data; name="' + _bytes(name).replace(b'"', b"%22") + b'"'
        if filename is not None:
            head += b'; filename="' + _bytes(filename).replace(b'"', b"%22") + b'"'
        if ctype:
            head += b"\r\nContent-Type: " + _bytes(ctype[0])
        out.append(b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + _bytes(content) + b"\r\n")
    body = b"".join(out) + b"--" + boundary + b"--\r\n"
    return body, "multipart/form-data; boundary=" + boundary.decode()


# Test-only bounds on what the fuzzer generates (the served document states the API as it is): a generated
# request stays small (arrays of at most 8 items) and quick for the engine (at most 64 tokens, 4 choices).
MAX_ITEMS = 8
MAX_COUNTS = {"max_tokens": 64, "max_completion_tokens": 64, "max_output_tokens": 64, "n": 4}


def bounded(node: Any, name: str | None = None) -> Any:
    """A copy of an OpenAPI document (or part) with `MAX_ITEMS` on every array and `MAX_COUNTS` on the integer
    properties they name."""
    if isinstance(node, list):
        return [bounded(x, name) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():  # a property's name goes down to its schema (and the anyOf branches in it)
        out[k] = {p: bounded(sub, p) for p, sub in v.items()} if k == "properties" else bounded(v, name)
    if out.get("type") == "array":
        out["maxItems"] = min(out.get("maxItems", MAX_ITEMS), MAX_ITEMS)
    if name in MAX_COUNTS and out.get("type") == "integer":
        out["maximum"] = min(out.get("maximum", MAX_COUNTS[name]), MAX_COUNTS[name])
    return out


def fuzz(base: str, key: str, examples_per_operation: int, timeout_s: float = 30.0,
         seed: int | None = None, model: str = "sim-model") -> FuzzReport:
    """Run `examples_per_operation` generated requests per operation and generation mode against `base`."""
    schema = schemathesis.openapi.from_dict(bounded(openapi_spec()))
    report = FuzzReport()
    client = httpx.Client(base_url=base, timeout=timeout_s)
    try:
        for result in schema.get_all_operations():
            op = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                part = FuzzReport()

                @settings(max_examples=examples_per_operation, deadline=None, database=None, derandomize=seed is None,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode), auth=st.sampled_from(["ok", "ok", "ok", "none", "bad"]),
                       real_model=st.booleans())
                def run(case: Any, auth: str, real_model: bool) -> None:
                    if real_model and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = model  # reach routing and the engine, not just the 404
                    kw = case.as_transport_kwargs(base_url=base)
                    headers = {k: v for k, v in (kw.get("headers") or {}).items()
                               if k.lower() not in ("authorization", "content-length", "host", "transfer-encoding")}
                    if auth == "ok":
                        headers["authorization"] = f"Bearer {key}"
                    elif auth == "bad":
                        headers["authorization"] = "Bearer not-a-key"
                    content = kw.get("data") if kw.get("data") is not None else None
                    if content is None and "json" in kw:
                        content = json.dumps(kw["json"]).encode()  # stdlib: big ints, NaN as they come
                        headers.setdefault("content-type", "application/json")
                    if kw.get("files") is not None:  # a multipart form (/v1/audio/transcriptions)
                        content, headers["content-type"] = multipart(kw["files"])
                    t0 = time.perf_counter()
                    try:
                        r = client.request(kw["method"], kw["url"], headers=headers, params=kw.get("params"),
                                           content=content)
                    except httpx.TimeoutException:
                        part.failures.append(f"{op.label}: no answer within {timeout_s}s (hang): {(content or b'')[:300]!r}")
                        return
                    except httpx.HTTPError as e:
                        part.failures.append(f"{op.label}: transport error {e!r}")
                        return
                    part.max_latency_s = max(part.max_latency_s, time.perf_counter() - t0)
                    part.requests += 1
                    part.statuses[r.status_code] += 1
                    bad = check_answer(kw["method"], op.path, r.status_code, r.headers.get("content-type", ""),
                                       r.content)
                    if bad:
                        part.failures.append(f"{bad} <- {(content or b'')[:200]!r}")
                    elif r.status_code >= 400 and op.path.startswith("/v1/"):
                        part.codes[(r.status_code, orjson.loads(r.content)["error"].get("code"))] += 1

                if seed is not None:
                    run = hseed(seed)(run)
                try:
                    run()
                except Unsatisfiable:  # nothing to make invalid (GET without parameters in negative mode)
                    continue
                report.merge(part)
    finally:
        client.close()
    return report
