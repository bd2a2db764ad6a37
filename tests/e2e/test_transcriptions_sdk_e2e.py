"""POST /v1/audio/transcriptions end to end: a real gateway process (`python -m gateway serve`) in front of a
simulated fleet process (vLLM's transcription shapes), the official openai SDK's `audio.transcriptions.create`.

Pins: the transcript the engine made, usage in tokens (vLLM's stream usage, asked for by the gateway) and the
spend ledger charged exactly those tokens; only backends with the `transcription` capability serve it; a policy
deny and an EEA-only rule refuse it like any other request (403, the non-EEA backend never tried), while the
EEA backend serves the EEA tenant; the audit record never holds the audio (its content capture holds the text
prompt only, and under zero retention not even that), nor does the gateway's log; bad input is an OpenAI-shaped
4xx: 415 not multipart, 400 naming the field, 413 over the file limit, 401 before any of them without a key."""
from __future__ import annotations

import io
import json
import sqlite3
import time
import wave

import httpx
import openai
import pytest

from backends.sim.audio_api import transcript_words
from backends.sim.fleet import FleetProcess
from gateway.api.parse_audio import MAX_FILE_BYTES
from tests.support.procs import audit_record, free_port, start_gateway

pytestmark = pytest.mark.e2e
KEY = "stt-e2e-key-0123456789"
EU_KEY = "stt-eu-key-0123456789"
DENIED_KEY = "stt-denied-key-0123456789"
SMALL_KEY = "stt-small-key-0123456789"
SMALL_BUDGET = 1000
ADMIN = "stt-admin-key-0123456789"
MARK = b"AUDIO-NEVER-KEPT"  # in the audio's samples: must never show up in a record or a log
PROMPT = "Glossary: Kubernetes, vLLM, Whisper."


def wav(seconds: float, marker: bytes = MARK) -> bytes:
    frames = int(seconds * 16000)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((marker * (frames * 2 // len(marker) + 1))[:frames * 2])
    return buf.getvalue()


AUDIO = wav(2.0)
WORDS = "".join(transcript_words(AUDIO, 2.0))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stt")
    fleet = FleetProcess(["--engines", "2", "--profile", "tiny", "--base-port", "0"], tmp / "fleet.json")
    man = fleet.start()
    try:
        (tmp / "policy.yaml").write_text(json.dumps({"version": 1, "rules": [
            {"id": "acme", "match": {"tenant": "acme"}, "budgets": [{"window": "day", "tokens": 1_000_000}]},
            {"id": "eu-only", "match": {"tenant": "eu"}, "require": {"jurisdiction": "EEA", "retention": "zero"}},
            {"id": "no-whisper", "match": {"tenant": "denied"}, "deny": {"models": ["whisper-1"]}},
            {"id": "small", "match": {"tenant": "small"}, "budgets": [{"window": "day", "tokens": SMALL_BUDGET}]}]}))
        e0, e1 = man["engines"]
        stt = {"kind": "sim", "capabilities": ["transcription"], "retention": "zero"}
        backends = [{"name": "stt-eu", "url": e0["url"], "models": ["whisper-1"], "location": {"country": "DE"},
                     "model_map": {"whisper-1": "sim-model"}, **stt},
                    {"name": "stt-us", "url": e1["url"], "models": ["whisper-us"], "location": {"country": "US"},
                     "model_map": {"whisper-us": "sim-model"}, **stt},
                    {"name": "chat", "kind": "sim", "url": e1["url"], "models": ["sim-model"]}]
        port = free_port()
        cfg = tmp / "gateway.yaml"
        cfg.write_text(json.dumps({
            "server": {"host": "127.0.0.1", "port": port, "access_log": True}, "backends": backends,
            "keys": [{"key": KEY, "tenant": "acme"}, {"key": EU_KEY, "tenant": "eu"},
                     {"key": DENIED_KEY, "tenant": "denied"}, {"key": SMALL_KEY, "tenant": "small"}],
            "admin": {"key": ADMIN},
            "policy": {"files": [str(tmp / "policy.yaml")], "audit_path": str(tmp / "audit.jsonl")},
            "identity": {"sqlite_path": str(tmp / "id.db")},
            "budgets": {"sqlite_path": str(tmp / "ledger.db"), "spool_path": str(tmp / "spool.jsonl"),
                        "ledger_flush_s": 0.05},
            "observability": {"log_level": "debug", "capture_content": True}}))
        gw, _ = start_gateway(cfg)
        try:
            yield {"base": f"http://127.0.0.1:{port}", "tmp": tmp, "gw": gw}
        finally:
            gw.stop()
    finally:
        fleet.stop()


def sdk(stack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["base"] + "/v1", api_key=key, max_retries=0)


def ledger_row(tmp, client_rid: str) -> dict:
    for _ in range(100):  # the ledger outbox flushes every 50 ms
        db = sqlite3.connect(tmp / "ledger.db")
        db.row_factory = sqlite3.Row
        try:
            rows = db.execute("select * from budget_ledger where client_request_id = ?", (client_rid,)).fetchall()
        except sqlite3.OperationalError:
            rows = []
        finally:
            db.close()
        if rows:
            assert len(rows) == 1
            return dict(rows[0])
        time.sleep(0.05)
    raise AssertionError(f"no ledger row for {client_rid}")


def test_json_transcript_with_token_usage_is_what_the_ledger_charges(stack):
    r = sdk(stack).audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("talk.wav", AUDIO, "audio/wav"), prompt=PROMPT, language="en", temperature=0.2,
        extra_headers={"x-request-id": "stt-json-1"})
    t = r.parse()
    assert t.text == WORDS and r.headers["x-gateway-backend"] == "stt-eu"
    u = t.usage
    assert u.type == "tokens" and u.output_tokens == 5
    assert u.input_tokens > 200 and u.total_tokens == u.input_tokens + 5  # the audio's 200 tokens and the prompt
    row = ledger_row(stack["tmp"], "stt-json-1")
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (
        u.input_tokens, u.output_tokens, u.total_tokens)
    assert row["status"] == 200 and row["tenant"] == "acme" and row["backend"] == "stt-eu"

    # the record: the decision, the usage, the text prompt as captured content; never the audio
    rec = audit_record(stack["base"], "stt-json-1", ADMIN)
    assert rec["endpoint"] == "transcriptions" and rec["status"] == 200
    assert rec["content"] == {"prompt": PROMPT}
    text = json.dumps(rec)
    assert MARK.decode() not in text and "RIFF" not in text


def test_a_token_budget_is_spent_by_the_engine_s_usage_then_refuses(stack):
    """The reservation holds the text prompt's bound and the completion, not the upload's 64 KB: a 1000-token
    budget serves 2-second clips (209 tokens each, 200 of them the audio's) until it is spent. The audio's tokens
    are known only from the engine's usage, so the request that crosses the limit is served whole: the spend
    passes the limit by less than one request (docs/budgets.md)."""
    c = sdk(stack, SMALL_KEY)
    spent, served = 0, 0
    for _ in range(10):
        try:
            t = c.audio.transcriptions.create(model="whisper-1", file=("a.wav", AUDIO, "audio/wav"))
        except openai.RateLimitError as e:
            assert e.code == "insufficient_quota"
            break
        served += 1
        spent += t.usage.total_tokens
    assert served == 5 and t.usage.total_tokens == 209
    assert SMALL_BUDGET <= spent < SMALL_BUDGET + t.usage.total_tokens


def test_verbose_json_is_served_and_charged_its_segment_tokens(stack):
    r = sdk(stack).audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("talk.wav", AUDIO, "audio/wav"), response_format="verbose_json",
        extra_headers={"x-request-id": "stt-verbose-1"})
    v = r.parse()
    assert v.text == WORDS and v.language == "en" and float(v.duration) == 2.0 and len(v.segments) == 1
    row = ledger_row(stack["tmp"], "stt-verbose-1")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (0, len(v.segments[0].tokens))


def test_text_format_is_the_transcript_alone(stack):
    r = sdk(stack).audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("talk.wav", AUDIO, "audio/wav"), response_format="text",
        extra_headers={"x-request-id": "stt-text-1"})
    assert r.headers["content-type"].startswith("text/plain")
    assert r.parse() == WORDS


def test_text_format_is_charged_the_engine_s_tokens(stack):
    r = sdk(stack).audio.transcriptions.with_raw_response.create(
        model="whisper-1", file=("talk.wav", AUDIO, "audio/wav"), response_format="text",
        extra_headers={"x-request-id": "stt-text-2"})
    assert r.status_code == 200 and WORDS in r.parse()
    row = ledger_row(stack["tmp"], "stt-text-2")
    assert row["completion_tokens"] == 5 and row["prompt_tokens"] > 200


def test_a_policy_deny_refuses_it_like_any_request(stack):
    with pytest.raises(openai.PermissionDeniedError) as ei:
        sdk(stack, DENIED_KEY).audio.transcriptions.create(model="whisper-1", file=("a.wav", AUDIO, "audio/wav"))
    assert ei.value.status_code == 403 and "no-whisper" in ei.value.message


def test_an_eea_only_tenant_is_served_in_the_eea_and_refused_outside_it(stack):
    c = sdk(stack, EU_KEY)
    r = c.audio.transcriptions.with_raw_response.create(model="whisper-1", file=("a.wav", AUDIO, "audio/wav"),
                                                        prompt=PROMPT, extra_headers={"x-request-id": "stt-eu-1"})
    assert r.parse().text == WORDS and r.headers["x-gateway-backend"] == "stt-eu"
    rec = audit_record(stack["base"], "stt-eu-1", ADMIN)
    assert "content" not in rec and PROMPT not in json.dumps(rec)  # zero retention: not even the text prompt
    with pytest.raises(openai.PermissionDeniedError) as ei:
        c.audio.transcriptions.create(model="whisper-us", file=("a.wav", AUDIO, "audio/wav"),
                                      extra_headers={"x-request-id": "stt-eu-2"})
    assert ei.value.code == "residency_unsatisfiable" and "eu-only" in ei.value.message
    rec = audit_record(stack["base"], "stt-eu-2", ADMIN)
    assert rec["status"] == 403 and not rec.get("attempts")  # the US engine was never asked


def test_only_backends_that_transcribe_serve_it(stack):
    with pytest.raises(openai.BadRequestError) as ei:
        sdk(stack).audio.transcriptions.create(model="sim-model", file=("a.wav", AUDIO, "audio/wav"))
    assert ei.value.code == "model_not_supported" and "transcription" in ei.value.message


def _post(stack, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(stack["base"] + "/v1/audio/transcriptions", headers=headers, timeout=30, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_input_is_an_openai_shaped_4xx(stack):
    f = {"file": ("a.wav", AUDIO, "audio/wav")}
    assert _error(_post(stack, json={"model": "whisper-1"}), 415)["code"] == "unsupported_media_type"
    assert _error(_post(stack, files={"model": (None, "whisper-1")}), 400)["param"] == "file"
    assert _error(_post(stack, files=f), 400)["param"] == "model"
    assert _error(_post(stack, files=f, data={"model": "whisper-1", "response_format": "srt"}), 400)["param"] == \
        "response_format"
    assert _error(_post(stack, files=f, data={"model": "whisper-1", "stream": "true"}), 400)["param"] == "stream"
    err = _error(_post(stack, files={"file": ("a.wav", b"not audio", "audio/wav")}, data={"model": "whisper-1"}), 400)
    assert err["message"] == "Invalid or unsupported audio file."  # the engine's own refusal, passed on
    big = {"file": ("big.wav", b"\0" * (MAX_FILE_BYTES + 1), "audio/wav")}
    err = _error(_post(stack, files=big, data={"model": "whisper-1"}), 413)
    assert (err["code"], err["param"]) == ("file_too_large", "file")
    _error(_post(stack, key=None, files={"model": (None, "whisper-1")}), 401)  # who asks comes first


def test_the_audio_is_in_no_log_line_nor_audit_file(stack):
    log = stack["gw"].log()
    assert "/v1/audio/transcriptions" in log  # the access log saw these requests
    assert MARK.decode() not in log and "Traceback" not in log
    audit = (stack["tmp"] / "audit.jsonl").read_text()
    assert "stt-json-1" in audit and MARK.decode() not in audit and "RIFF" not in audit
