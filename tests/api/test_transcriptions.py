"""POST /v1/audio/transcriptions without a network: the multipart media type (gateway/api/media.py) read from
what a real client library writes and written back for the upstream with the file byte for byte, the parser's
400/413 refusals naming the field (gateway/api/parse_audio.py), the exchange's upstream form for vLLM (stream
asked, caps as form fields, model mapped), and the wire folding vLLM's stream into OpenAI's JSON with token
usage (gateway/api/wire/audio.py)."""
from __future__ import annotations

import os

import httpx
import orjson
import pytest

from gateway.api import media
from gateway.api.endpoints import BY_NAME, BY_PATH, prepare
from gateway.api.media import FORM, JSON, Upload
from gateway.api.parse_audio import MAX_FILE_BYTES, parse_transcription
from gateway.api.wire.audio import TRANSCRIPTION, fold
from gateway.config import BackendConfig, parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.proxy.dialects import dialect_for
from gateway.routing.plan import Candidate

EP = BY_NAME["transcriptions"]
AUDIO = b"RIFF" + bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n"  # binary, CRLFs and dashes inside


def client_form(data: dict | None = None, files: dict | None = None) -> tuple[bytes, str]:
    """A multipart body as httpx (the openai SDK's transport) writes it, and its Content-Type."""
    req = httpx.Request("POST", "http://x/v1/audio/transcriptions", data=data,
                        files=files if files is not None else {"file": ("a.wav", AUDIO, "audio/wav")})
    return req.read(), req.headers["content-type"]


def decoded(data: dict | None = None, files: dict | None = None) -> dict:
    raw, ctype = client_form({"model": "whisper", **(data or {})}, files)
    assert FORM.accepts(ctype) and not JSON.accepts(ctype)
    return FORM.decode(raw, ctype)


def refusal(body: dict) -> GatewayError:
    with pytest.raises(GatewayError) as ei:
        parse_transcription(body)
    return ei.value


def test_the_form_is_read_as_fields_and_an_upload_that_is_never_shown():
    body = decoded({"language": "de", "prompt": "Grüße", "timestamp_granularities[]": ["word", "segment"]})
    assert body["model"] == "whisper" and body["language"] == "de" and body["prompt"] == "Grüße"
    assert body["timestamp_granularities[]"] == ["word", "segment"]  # a repeated name is a list
    f = body["file"]
    assert isinstance(f, Upload) and bytes(f.data) == AUDIO and f.size == len(AUDIO)
    assert (f.filename, f.content_type) == ("a.wav", "audio/wav")
    assert repr(f) == str(f) == f"<upload {len(AUDIO)} bytes audio/wav>"  # no bytes, no filename
    assert orjson.dumps(body, default=str).count(b"RIFF") == 0  # what a recorder writing the body would keep


def test_the_upstream_form_carries_the_file_byte_for_byte():
    body = decoded({"temperature": "0.2"})
    body.update({"stream": True, "n": 1, "vllm_xargs": {"a": 1}, "skip": None})
    out = FORM.encode(body)
    ctype = FORM.content_type(out)
    assert ctype.startswith("multipart/form-data; boundary=gw-")
    again = FORM.decode(out, ctype)
    assert bytes(again["file"].data) == AUDIO and again["file"].filename == "a.wav"
    assert (again["stream"], again["n"], again["vllm_xargs"], again["temperature"]) == ("true", "1", '{"a":1}', "0.2")
    assert "skip" not in again
    # read by another multipart implementation too: the stdlib's
    import email.parser
    import email.policy
    msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(b"content-type: " + ctype.encode() + b"\r\n\r\n" + out)
    parts = {p.get_param("name", header="content-disposition"): p for p in msg.iter_parts()}
    assert parts["file"].get_payload(decode=True) == AUDIO and parts["model"].get_content() == "whisper"


def test_a_boundary_found_in_the_file_is_drawn_again(monkeypatch):
    drawn = iter(["0" * 32, "1" * 32])
    monkeypatch.setattr(media.secrets, "token_hex", lambda n: next(drawn))
    out = FORM.encode({"file": Upload("a", "audio/wav", b"xx--gw-" + b"0" * 32 + b"xx")})
    assert FORM.content_type(out).endswith("boundary=gw-" + "1" * 32)
    assert bytes(FORM.decode(out, FORM.content_type(out))["file"].data) == b"xx--gw-" + b"0" * 32 + b"xx"


@pytest.mark.parametrize("raw,ctype,why", [
    (b"", "multipart/form-data; boundary=b", "empty"),
    (b"--b\r\nx", "multipart/form-data", "no boundary"),
    (b"hello", "multipart/form-data; boundary=b", "no part"),
    (b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper', "multipart/form-data; boundary=b",
     "ends inside a part"),
    (b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b", "without a name"),
    (b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n\xff\xfe\r\n--b--',
     "multipart/form-data; boundary=b", "UTF-8"),
])
def test_a_body_that_is_not_a_form_is_a_400(raw, ctype, why):
    with pytest.raises(GatewayError) as ei:
        FORM.decode(raw, ctype)
    assert ei.value.status == 400 and why in ei.value.message


def test_the_media_type_is_the_entry_s():
    assert EP.media is FORM and BY_NAME["chat"].media is JSON and BY_PATH["/v1/audio/transcriptions"] is EP
    assert FORM.refusal().status == JSON.refusal().status == 415
    assert FORM.refusal().message == "Content-Type must be multipart/form-data."
    assert JSON.refusal().message == "Content-Type must be application/json."  # unchanged for every JSON API
    assert EP.max_body_bytes is not None and EP.max_body_bytes > MAX_FILE_BYTES and EP.capability == "transcription"


def test_a_valid_request_parses():
    p = parse_transcription(decoded({"prompt": "Ünïcode", "response_format": "text", "temperature": "0",
                                     "stream": "false", "max_completion_tokens": "40"}))
    assert (p.model, p.stream, p.max_tokens, p.prompt_chars) == ("whisper", False, 40, len("Ünïcode".encode()))
    assert parse_transcription(decoded()).max_tokens is None


@pytest.mark.parametrize("data,files,param,status", [
    ({}, {"language": (None, "en")}, "file", 400),  # no file
    ({"file": "text, not a file"}, {"x": ("x", b"1")}, "file", 400),
    ({}, {"file": ("a.wav", b"", "audio/wav")}, "file", 400),  # empty
    ({"response_format": "srt"}, None, "response_format", 400),
    ({"temperature": "hot"}, None, "temperature", 400),
    ({"temperature": "1.5"}, None, "temperature", 400),
    ({"temperature": "nan"}, None, "temperature", 400),
    ({"stream": "true"}, None, "stream", 400),
    ({"stream": "maybe"}, None, "stream", 400),
    ({"max_completion_tokens": "0"}, None, "max_completion_tokens", 400),
    ({"max_completion_tokens": "\u00b2"}, None, "max_completion_tokens", 400),  # a digit int() does not read: a 500 once
    ({"language": "x" * 40}, None, "language", 400),
])
def test_bad_fields_are_a_400_naming_them(data, files, param, status):
    e = refusal(decoded(data, files))
    assert (e.status, e.param) == (status, param) and e.body()["error"]["type"] == "invalid_request_error"


def test_no_model_and_a_file_as_model_are_400s():
    raw, ctype = client_form(files={"file": ("a.wav", AUDIO, "audio/wav")})
    assert refusal(FORM.decode(raw, ctype)).param == "model"
    raw, ctype = client_form(files={"file": ("a.wav", AUDIO, "audio/wav"), "model": ("m.txt", b"whisper")})
    assert refusal(FORM.decode(raw, ctype)).param == "model"


def test_a_file_over_the_limit_is_a_413():
    big = os.urandom(MAX_FILE_BYTES + 1)
    e = refusal({"model": "w", "file": Upload("a.wav", "audio/wav", big)})
    assert (e.status, e.code, e.param) == (413, "file_too_large", "file")
    assert parse_transcription({"model": "w", "file": Upload("a.wav", "audio/wav", big, 1)}).model == "w"


def _ctx(body: dict, max_tokens: int | None = None) -> RequestContext:
    c = RequestContext(request_id="r", endpoint="transcriptions", headers={}, body=body)
    raw, _ = client_form({"model": "whisper"})
    prepare(c, EP.parse(body), raw, parse_config("backends: []"))
    if max_tokens is not None:
        c.max_tokens = max_tokens
    return c


@pytest.mark.parametrize("fmt,streamed", [(None, True), ("text", True), ("verbose_json", False)])
def test_the_vllm_exchange_asks_for_a_stream_with_usage_and_sends_caps_as_fields(fmt, streamed):
    body = decoded({"prompt": "p", **({"response_format": fmt} if fmt else {})})
    c = _ctx(body, max_tokens=33)
    assert c.prompt_tokens_max == 1 + 32  # the text prompt's bound, not the audio's bytes
    cand = Candidate(backend=BackendConfig(name="w", url="http://w/v1", kind="vllm", models=["whisper"],
                                           model_map={"whisper": "openai/whisper-large-v3"}), model="whisper")
    ex = dialect_for("vllm").exchange(EP)
    assert ex is not None and ex.path == "audio/transcriptions" and ex.translates
    out = ex.body(c, cand)
    sent = FORM.decode(out, ex.content_type(out))
    assert sent["model"] == "openai/whisper-large-v3" and sent["max_completion_tokens"] == "33"
    assert bytes(sent["file"].data) == AUDIO and sent["prompt"] == "p"
    if streamed:
        assert (sent["stream"], sent["stream_include_usage"], sent["response_format"]) == ("true", "true", "json")
    else:
        assert "stream" not in sent and sent["response_format"] == "verbose_json"
    assert "stream" not in body and "max_completion_tokens" not in body  # the client's body is untouched
    # kinds that do not speak it do not serve it
    assert dialect_for("openai").exchange(EP) is None and dialect_for("sim").exchange(EP) is not None


VLLM_STREAM = (
    b'data: {"id":"transcribe-1","object":"transcription.chunk","created":1,"model":"w",'
    b'"choices":[{"delta":{"content":" Hello"}}]}\n\n'
    b'data: {"id":"transcribe-1","object":"transcription.chunk","created":1,"model":"w",'
    b'"choices":[{"delta":{"content":" world."},"finish_reason":"stop","stop_reason":null}]}\n\n'
    b'data: {"id":"transcribe-1","object":"transcription.chunk","created":1,"model":"w","choices":[],'
    b'"usage":{"prompt_tokens":104,"completion_tokens":3,"total_tokens":107}}\n\n'
    b"data: [DONE]\n\n")


def test_vllm_s_stream_folds_into_openai_s_json_with_token_usage():
    obj = orjson.loads(TRANSCRIPTION.from_upstream(VLLM_STREAM))
    assert obj == {"text": " Hello world.",
                   "usage": {"type": "tokens", "input_tokens": 104, "output_tokens": 3, "total_tokens": 107}}
    u = TRANSCRIPTION.usage(obj)
    assert (u.prompt_tokens, u.completion_tokens) == (104, 3)
    assert orjson.loads(fold(VLLM_STREAM.replace(b"\n", b"\r\n")))["text"] == " Hello world."
    # a JSON answer (an engine that did not stream) passes as it is; duration usage counts no tokens
    plain = b'{"text":"hi","usage":{"type":"duration","seconds":3}}'
    assert TRANSCRIPTION.from_upstream(plain) == plain and TRANSCRIPTION.usage(orjson.loads(plain)) is None
    verbose = {"text": "a b", "segments": [{"tokens": [1, 2]}, {"tokens": [3]}, {"text": "no tokens"}]}
    u = TRANSCRIPTION.usage(verbose)
    assert (u.prompt_tokens, u.completion_tokens) == (0, 3)


@pytest.mark.parametrize("raw,why", [
    (VLLM_STREAM.replace(b"data: [DONE]\n\n", b""), "ended early"),
    (b'data: {"error":{"message":"boom /secret/path","code":500}}\n\ndata: [DONE]\n\n', "failed"),
    (b"data: not json\n\ndata: [DONE]\n\n", "not JSON"),
])
def test_a_broken_stream_is_a_502_without_the_upstream_s_words(raw, why):
    with pytest.raises(GatewayError) as ei:
        fold(raw)
    assert ei.value.status == 502 and why in ei.value.message and "secret" not in ei.value.message


def test_text_is_answered_as_plain_text():
    obj = {"text": " Hello world.", "usage": {"type": "tokens", "input_tokens": 1, "output_tokens": 2,
                                              "total_tokens": 3}}
    raw = orjson.dumps(obj)
    c = RequestContext(request_id="r", endpoint="transcriptions", headers={}, body={"response_format": "text"})
    assert TRANSCRIPTION.client_body(c, obj, raw) == (b" Hello world.", b"text/plain; charset=utf-8")
    c.body = {}
    assert TRANSCRIPTION.client_body(c, obj, raw) == (raw, b"application/json")
    assert BY_NAME["chat"].wire.client_body(c, obj, raw) == (raw, b"application/json")
