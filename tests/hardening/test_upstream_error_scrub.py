"""Issue 35, finding 5: an upstream's error text never carries the gateway's secrets or internal addresses to
a client.

The real gateway process in front of a hostile upstream (tests/support/hostile.py) whose errors echo the
gateway's credentials for it (as sent, URL-encoded, base64-encoded alone and inside `Bearer ...` and
`user:...` blobs; the `api_key_env` one of an OpenAI-kind backend and the `api_key_file` one of an
Anthropic-kind backend), internal URLs, configured hosts, addresses and a traceback: in an upstream 400 (the
client's error, relayed scrubbed), an upstream 500 (replaced by the gateway's own message), OpenAI's and
Anthropic's error shapes, an error event in the middle of a stream, and a batch's output and error files.
The upstream's original, credentials masked, stays in the audit record for operators.

Before the fix an upstream 500 came back as `502 "Upstream error: internal at http://10.0.0.5:9999/secret
key=<the secret>"`, and a 400 with its whole message, traceback included.
"""
from __future__ import annotations

import base64
import io
import json
import re
import time
import uuid
from urllib.parse import quote, quote_plus

import httpx
import orjson
import pytest
from openai import OpenAI

from tests.resilience.stack import ADMIN_KEY, GW_KEY, write_config
from tests.support.hostile import HostileUpstream
from tests.support.procs import audit_record, start_gateway

pytestmark = pytest.mark.e2e
ENV_SECRET = "upstream-secret-XYZZY/k+9=q"  # sent as `Bearer <it>` to the OpenAI-kind backend
FILE_SECRET = "anthropic-file-secret 42/ab+c"  # sent as `x-api-key: <it>` to the Anthropic-kind backend
OTHER_HOST = "engine-7.gpu-pool"  # a configured backend host that matches no generic pattern
USEFUL = "This model's maximum context length is 512 tokens."


def b64(s: str, urlsafe: bool = False) -> str:
    return (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(s.encode()).decode()


def lower_hex(s: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), s)


def hostile_message(port: int) -> str:
    """Everything an upstream could echo back about the gateway and itself."""
    parts = [USEFUL]
    for s in (ENV_SECRET, FILE_SECRET):
        parts += [f"internal at http://10.0.0.5:9999/secret key={s}", f"auth was Bearer {s}",
                  f"enc={quote(s, safe='')}", f"plus={quote_plus(s)}", f"lower={lower_hex(quote(s, safe=''))}",
                  f"b64={b64(s)}", f"b64url={b64(s, True).rstrip('=')}", f"hdr={b64('Bearer ' + s)}",
                  f"basic=Basic {b64('gateway:' + s)}", f"x-api-key: {s}"]
    parts += [f"peer {OTHER_HOST} and 127.0.0.1:{port} and 10.0.0.5",
              'Traceback (most recent call last):\n  File "/srv/vllm/entrypoints/openai/serving_chat.py", line 12, '
              f"in create\n    raise ValueError(key)\nValueError: {ENV_SECRET}"]
    return " | ".join(parts)


def assert_clean(text: str, port: int) -> None:
    """No secret in any encoding, no URL, configured host, address or traceback of the upstream's."""
    for s in (ENV_SECRET, FILE_SECRET):
        for enc in (s, quote(s, safe=""), quote_plus(s), lower_hex(quote(s, safe="")), b64(s),
                    b64(s, True).rstrip("=")):
            assert enc not in text, f"{enc!r} leaked: {text[:600]}"
        for i in range(len(s) - 11):  # nor any 12 characters of it (a partial echo: the 400's `code` below)
            assert s[i:i + 12] not in text, f"part of a secret leaked: {s[i:i + 12]!r}"
        # any base64 run in the text, decoded at each alignment, must not hold the secret
        for run in re.findall(r"[A-Za-z0-9+/_\-]{8,}={0,2}", text):
            for i in range(4):
                piece = run[i:]
                piece = piece[: len(piece) - len(piece) % 4]
                for dec in (base64.b64decode, base64.urlsafe_b64decode):
                    try:
                        raw = dec(piece)
                    except ValueError:
                        continue
                    assert s.encode() not in raw, f"base64 of the secret leaked: {run}"
    for bad in ("http://", "10.0.0.5", OTHER_HOST, f"127.0.0.1:{port}", "Traceback", "serving_chat.py"):
        assert bad not in text, f"{bad!r} leaked: {text[:600]}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scrub")
    (tmp / "anthropic.key").write_text(FILE_SECRET + "\n")
    up = HostileUpstream()
    base = {"location": {"country": "DE"}, "retention": "zero", "health": {"enabled": False},
            "timeouts": {"connect_s": 5, "first_token_s": 30, "idle_s": 30, "total_s": 60}}
    backends = [
        {"name": "hostile", "kind": "openai", "url": f"http://127.0.0.1:{up.port}/v1", "models": ["m"],
         "api_key_env": "UP_KEY", "capabilities": ["chat", "completions"], **base},
        {"name": "hostile-anthropic", "kind": "anthropic", "url": f"http://127.0.0.1:{up.port}/v1",
         "models": ["claude-x"], "api_key_file": str(tmp / "anthropic.key"), "capabilities": ["chat", "messages"],
         **base},
        {"name": "spare", "kind": "openai", "url": f"http://{OTHER_HOST}:8000/v1", "models": ["spare-model"], **base},
    ]
    cfg = write_config(tmp, backends, batch={"max_attempts": 1, "lease_s": 2.0})
    gw, port = start_gateway(cfg, env={"UP_KEY": ENV_SECRET})
    yield {"up": up, "base": f"http://127.0.0.1:{port}", "gw": gw, "up_port": up.port, "tmp": tmp}
    gw.stop()
    up.stop()


def json_answer(status: int, obj: dict) -> bytes:
    body = orjson.dumps(obj)
    reason = {400: b"Bad Request", 500: b"Internal Server Error"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body))) + body


def openai_error(stack, status: int) -> dict:
    return {"error": {"message": hostile_message(stack["up_port"]), "type": "BadRequestError", "param": FILE_SECRET,
                      "code": ENV_SECRET[:20] if status < 500 else status}}


def tag() -> str:
    return f"probe-{uuid.uuid4().hex[:10]}"


def chat(stack, t: str, **body) -> httpx.Response:
    return httpx.post(stack["base"] + "/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {GW_KEY}"},
                      json={"model": "m", "messages": [{"role": "user", "content": f"q {t}"}], **body})


def test_upstream_400_is_relayed_scrubbed_and_kept_whole_in_the_audit(stack):
    t = tag()
    stack["up"].script(t, json_answer(400, openai_error(stack, 400)), close=True)
    r = chat(stack, t)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(USEFUL)  # the client's to fix: the upstream's words, scrubbed
    assert err["param"] is None or FILE_SECRET not in err["param"]
    assert_clean(r.text, stack["up_port"])
    assert_clean(str(dict(r.headers)), stack["up_port"])
    rec = audit_record(stack["base"], r.headers["x-request-id"], ADMIN_KEY)
    kept = rec["attempts"][-1]["upstream_message"]
    assert "http://10.0.0.5:9999/secret" in kept and USEFUL in kept  # the operator's copy: credentials only masked
    assert ENV_SECRET not in json.dumps(rec) and FILE_SECRET not in json.dumps(rec)


def test_upstream_500_text_is_replaced_by_the_gateways_own(stack):
    t = tag()
    stack["up"].script(t, json_answer(500, openai_error(stack, 500)), close=True)
    r = chat(stack, t)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_error" and USEFUL not in err["message"] and "500" in err["message"]
    assert_clean(r.text, stack["up_port"])
    rec = audit_record(stack["base"], r.headers["x-request-id"], ADMIN_KEY)
    att = rec["attempts"][-1]
    assert att["upstream_status"] == 500 and "http://10.0.0.5:9999/secret" in att["upstream_message"]
    assert ENV_SECRET not in json.dumps(rec)


@pytest.mark.parametrize("status", [400, 500])
def test_anthropic_shaped_errors_on_messages(stack, status):
    t = tag()
    body = {"type": "error", "error": {"type": "invalid_request_error" if status < 500 else "api_error",
                                       "message": hostile_message(stack["up_port"])}}
    seen = stack["up"].script(t, json_answer(status, body), close=True)
    r = httpx.post(stack["base"] + "/v1/messages", timeout=30, headers={"x-api-key": GW_KEY},
                   json={"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": f"q {t}"}]})
    assert seen.headers.get("x-api-key") == FILE_SECRET  # the file secret is what the upstream was sent
    assert r.status_code == (400 if status < 500 else 502), r.text
    out = r.json()
    assert out["type"] == "error" and set(out["error"]) == {"type", "message"}
    assert out["error"]["message"].startswith(USEFUL) == (status < 500)
    assert_clean(r.text, stack["up_port"])


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
            b"connection: close\r\n\r\n")


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@pytest.mark.parametrize("code", [400, 500])
def test_error_event_mid_stream_is_scrubbed(stack, code):
    t = tag()
    token = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": "tokenA1"}, "finish_reason": None}]}
    err = {"error": {"object": "error", "message": hostile_message(stack["up_port"]), "type": "BadRequestError",
                     "param": None, "code": code}}
    raw = (SSE_HEAD + chunked(b"data: " + orjson.dumps(token) + b"\n\n")
           + chunked(b"data: " + orjson.dumps(err) + b"\n\n") + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    stack["up"].script(t, raw, close=True)
    r = chat(stack, t, stream=True)
    assert r.status_code == 200 and "tokenA1" in r.text and "[DONE]" in r.text, r.text
    assert_clean(r.text, stack["up_port"])
    events = [orjson.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    msgs = [e["error"]["message"] for e in events if "error" in e]
    assert len(msgs) == 1 and msgs[0].startswith(USEFUL) == (code < 500), msgs


def test_batch_error_files_are_scrubbed(stack):
    t400, t500 = tag(), tag()
    stack["up"].script(t400, json_answer(400, openai_error(stack, 400)), close=True)
    stack["up"].script(t500, json_answer(500, openai_error(stack, 500)), close=True)
    lines = [{"custom_id": c, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": f"q {t}"}]}}
             for c, t in (("line-400", t400), ("line-500", t500))]
    c = OpenAI(base_url=stack["base"] + "/v1", api_key=GW_KEY, max_retries=0, timeout=30)
    f = c.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                       purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60  # fail instead of hanging
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    assert b.status == "completed", b
    text = "".join(c.files.content(fid).text for fid in (b.output_file_id, b.error_file_id) if fid)
    assert "line-400" in text and "line-500" in text, text
    assert USEFUL in text  # the 400's scrubbed message is there
    assert_clean(text, stack["up_port"])
