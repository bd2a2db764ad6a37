"""gateway/proxy/scrub.py: what of an upstream's error text reaches a client (issue 35, finding 5). The end to
end checks are tests/hardening/test_upstream_error_scrub.py; these pin the scrub itself."""
from __future__ import annotations

import base64
import re
from types import SimpleNamespace
from urllib.parse import quote, quote_plus

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.forward import client_error_body
from gateway.proxy.scrub import UPSTREAM_FAILED, Scrubber

SECRET = "sk-live/9f+Q=abc DEF"
S = Scrubber.for_backends([SimpleNamespace(url="http://vllm-a.gpu:8000/v1", proxy="http://egress.corp:3128",
                                           kv_events="tcp://10.1.2.3:5557", replay=None, metrics=None,
                                           discovery=SimpleNamespace(dns="vllm.pool.example"))], [SECRET])


def lower_hex(s: str) -> str:
    """Percent-escapes with lower-case hex digits (the secret's own letters keep their case)."""
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), s)


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_every_encoding_of_a_configured_secret_is_masked():
    for enc in (SECRET, quote(SECRET, safe=""), quote_plus(SECRET), lower_hex(quote(SECRET, safe="")), b64(SECRET),
                base64.urlsafe_b64encode(SECRET.encode()).decode().rstrip("=")):
        out = S.client_text(f"bad key {enc} here")
        assert out == "bad key [redacted] here", (enc, out)
    for wrapped in ("Bearer " + SECRET, "user:" + SECRET, "x" + SECRET + "y"):  # inside longer base64 blobs
        out = S.client_text("blob " + b64(wrapped))
        assert SECRET.encode() not in _decodes(out), out
    assert S.client_text("prefix " + SECRET[:14] + "!") == "prefix [redacted]!"  # a partial echo


def _decodes(text: str) -> bytes:
    out = b""
    for word in text.split():
        for i in range(4):
            piece = word[i:][: len(word[i:]) - len(word[i:]) % 4]
            try:
                out += base64.b64decode(piece) + b"|"
            except ValueError:
                pass
    return out


def test_urls_hosts_addresses_and_tracebacks_are_removed_and_ordinary_messages_kept():
    text = ("failed at http://10.0.0.5:9999/x?key=1 via vllm-a.gpu and egress.corp:3128, 10.1.2.3, [fd00::1]:80, "
            "vllm.pool.example, engine-2.svc, localhost:8000\nTraceback (most recent call last):\n  File \"/a.py\"")
    out = S.client_text(text)
    for bad in ("http", "10.0.0.5", "vllm-a.gpu", "egress.corp", "10.1.2.3", "fd00", "vllm.pool.example",
                "engine-2.svc", "localhost", "Traceback", "a.py"):
        assert bad not in out, (bad, out)
    for ok in ("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
               "(1000 in the messages, 4000 in the completion). Please reduce the length of the messages.",
               "temperature must be between 0 and 2, got 3.5", "Invalid value for 'n': 1.5.",
               "a basic explanation of Bearer authentication"):
        assert S.client_text(ok) == ok


def test_the_bound_applies_after_scrubbing():
    out = S.client_text("x" * 495 + SECRET)
    assert len(out) <= 500 and SECRET[:5] not in out[495:]


def test_client_error_body_scrubs_message_and_short_fields():
    body = orjson.dumps({"error": {"message": f"no: {SECRET}", "type": SECRET, "param": "messages",
                                   "code": "http://10.0.0.5/x"}})
    err = orjson.loads(client_error_body(400, body, scrub=S))["error"]
    assert err == {"message": "no: [redacted]", "type": "[redacted]", "param": "messages", "code": "[url]"}


def test_stream_error_events_in_every_shape():
    openai_4xx = b'data: ' + orjson.dumps({"error": {"message": f"too long {SECRET}", "code": 400}})
    out = orjson.loads(S.event(openai_4xx)[6:])
    assert out == {"error": {"message": "too long [redacted]", "code": 400}}
    openai_5xx = b'data: ' + orjson.dumps({"error": {"message": "engine died at http://10.0.0.5", "code": 500}})
    assert orjson.loads(S.event(openai_5xx)[6:])["error"]["message"] == UPSTREAM_FAILED
    anthropic = b"event: error\ndata: " + orjson.dumps({"type": "error", "error": {"type": "overloaded_error",
                                                                                   "message": SECRET}})
    out_a = S.event(anthropic)
    assert out_a.startswith(b"event: error\ndata: ") and SECRET.encode() not in out_a
    responses = b"event: error\ndata: " + orjson.dumps({"type": "error", "code": "invalid_request_error",
                                                        "message": f"bad {SECRET}", "sequence_number": 3})
    out_r = orjson.loads(S.event(responses).split(b"data: ")[1])
    assert out_r["message"] == "bad [redacted]" and out_r["sequence_number"] == 3
    token = b'data: {"choices":[{"delta":{"content":"error"}}]}'  # a token that is the word error: untouched
    assert S.event(token) is token


def test_json_bodies_are_untouched_unless_they_carry_an_error_and_deep_nesting_is_not_a_500():
    ok = orjson.dumps({"choices": [{"message": {"content": "all good"}}]})
    assert S.json_body(ok) is ok
    failed = orjson.dumps({"status": "failed", "error": {"code": "server_error", "message": SECRET}})
    assert SECRET.encode() not in S.json_body(failed)
    deep = b'{"a":' * 900 + b'{"error":"' + SECRET.encode() + b'"}' + b"}" * 900
    assert S.json_body(deep) == deep  # the walk is bounded (errors sit near the top): no RecursionError
    deep_top = b'{"error":"' + SECRET.encode() + b'","a":' + b'{"a":' * 600 + b"1" + b"}" * 601
    assert SECRET.encode() not in S.json_body(deep_top)  # too deep to write back: replaced whole, not a 500


_SECRET_CHARS = st.characters(codec="ascii", categories=["L", "N"], include_characters="-_./+=~ ")


@settings(max_examples=300, deadline=None)
@given(secret=st.text(_SECRET_CHARS, min_size=8, max_size=48).filter(lambda s: s.strip() == s and s.strip()),
       before=st.text(max_size=40), after=st.text(max_size=40),
       how=st.sampled_from(["raw", "quote", "quote_plus", "lower", "b64", "b64url", "bearer_b64", "basic_b64"]))
def test_a_secret_never_survives_in_any_encoding(secret, before, after, how):
    enc = {"raw": secret, "quote": quote(secret, safe=""), "quote_plus": quote_plus(secret),
           "lower": lower_hex(quote(secret, safe="")), "b64": b64(secret),
           "b64url": base64.urlsafe_b64encode(secret.encode()).decode(), "bearer_b64": b64("Bearer " + secret),
           "basic_b64": b64("u:" + secret)}[how]
    sc = Scrubber([secret])
    out = sc.secrets(f"{before} {enc} {after}")
    assert secret not in out and quote(secret, safe="") not in out and quote_plus(secret) not in out
    assert b64(secret).rstrip("=") not in out
    assert secret.encode() not in _decodes(out)
    assert not any(secret[i:i + 12] in out for i in range(len(secret) - 11))


def test_a_secret_cut_by_the_pre_scrub_bound_leaves_no_fragment():
    urls = ("http://h/" + "p" * 45 + " ") * 37  # 2035 characters that scrub down to 222: the cut region shows
    for pad in range(0, 30):  # the secret straddles the 2048-character cut at every offset
        out = S.client_text(urls + "x" * pad + SECRET + " tail")
        assert out.startswith("[url] [url]") and len(out) < 500
        assert not any(SECRET[i:i + 4] in out for i in range(len(SECRET) - 3)), (pad, out[-40:])
