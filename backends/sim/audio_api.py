"""The simulator's `POST /v1/audio/transcriptions`, in vLLM's shapes for a Whisper-class model (no model runs).

The form is vLLM's: `file`, `model`, `language`, `prompt`, `response_format` (json, text or verbose_json;
srt/vtt refused as vLLM does), `temperature`, `stream`, `stream_include_usage`, `max_completion_tokens`.
The audio is never decoded: a file is accepted when it starts like a container vLLM's librosa reads (WAV, MP3,
FLAC, Ogg, WebM, MP4/M4A), else a 400 "Invalid or unsupported audio file." Its duration is the WAV header's,
or its size at 128 kbit/s for the compressed ones.

The transcript is derived from the audio alone: `duration * 2.5` words (speech at 150 words a minute, at least
one), drawn from the simulator's one-token words with the audio's SHA-256 as the seed, so the same file always
reads the same. The engine runs it as a request: the decoder prompt (Whisper's 4 special tokens, a
`<|prev|>` and the prompt's tokens when there is one) is prefilled and the words are generated, paced like
any other request. Usage is vLLM's: JSON and text answer `{"text", "usage": {"type": "duration", "seconds"}}`
(seconds rounded up); verbose_json `{duration, language, text, segments}` without usage; a stream
`transcription.chunk` events with `choices[].delta.content`, a final usage chunk `{prompt_tokens,
completion_tokens, total_tokens}` when `stream_include_usage` is true (prompt tokens: the decoder prompt plus
the audio's, 100 per second as vLLM's Whisper counts them), then `[DONE]`.
"""
from __future__ import annotations

import email.message
import hashlib
import io
import math
import random
import time
import uuid
import wave
from typing import TYPE_CHECKING, Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from backends.sim.http import ApiError, json_response
from backends.sim.streaming import text_deltas
from backends.sim.tokenizer import OUTPUT_PIECES

if TYPE_CHECKING:
    from backends.sim.scheduler import SimRequest
    from backends.sim.server import EngineServer

WORDS_PER_S = 2.5
AUDIO_TOKENS_PER_S = 100  # vLLM's Whisper: sample rate / hop length (16000 / 160)
COMPRESSED_BYTES_PER_S = 16_000  # 128 kbit/s
DECODER_SPECIAL_TOKENS = 4  # <|startoftranscript|><|lang|><|transcribe|><|notimestamps|>
SEGMENT_WORDS = 12
_MAGIC = (b"RIFF", b"ID3", b"\xff\xfb", b"\xff\xf3", b"\xff\xf2", b"fLaC", b"OggS", b"\x1a\x45\xdf\xa3")


def parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """A multipart/form-data body: text fields as str, files as (filename, content type, bytes)."""
    msg = email.message.Message()
    msg["content-type"] = content_type
    boundary = msg.get_boundary()
    if msg.get_content_type() != "multipart/form-data" or not boundary:
        raise ApiError(400, "expected a multipart/form-data body")
    out: dict[str, Any] = {}
    delim = b"--" + boundary.encode("latin-1")
    for chunk in body.split(delim)[1:]:
        if chunk.startswith(b"--"):
            break
        head, sep, content = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            raise ApiError(400, "malformed multipart body")
        part = email.message.Message()
        for line in head.decode("latin-1").split("\r\n"):
            k, _, v = line.partition(":")
            part[k.strip()] = v.strip()
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        content = content.removesuffix(b"\r\n")
        filename = part.get_filename()
        out[name] = (filename, part.get("content-type", ""), content) if filename is not None else \
            content.decode("utf-8")
    return out


def duration_s(audio: bytes) -> float:
    """The audio's length: a WAV's from its header, any other container's at 128 kbit/s; 400 for bytes that
    are no audio container vLLM reads."""
    if audio[:4] == b"RIFF":
        try:
            with wave.open(io.BytesIO(audio)) as w:
                return w.getnframes() / float(w.getframerate())
        except (wave.Error, EOFError, ZeroDivisionError):
            raise ApiError(400, "Invalid or unsupported audio file.") from None
    if audio.startswith(_MAGIC) or audio[4:8] == b"ftyp":
        return len(audio) / COMPRESSED_BYTES_PER_S
    raise ApiError(400, "Invalid or unsupported audio file.")


def transcript_words(audio: bytes, seconds: float) -> list[str]:
    """The words the simulator hears in this audio: as many as its length says, chosen by its content hash."""
    rng = random.Random(hashlib.sha256(audio).digest())
    return [rng.choice(OUTPUT_PIECES) for _ in range(max(1, round(seconds * WORDS_PER_S)))]


def _flag(form: dict[str, Any], name: str) -> bool:
    v = str(form.get(name, "false")).lower()
    if v not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{name} must be a boolean", name)
    return v in ("true", "1")


def _int(form: dict[str, Any], name: str) -> int | None:
    v = form.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or not v.lstrip("-").isdigit():
        raise ApiError(400, f"{name} must be an integer", name)
    return int(v)


async def transcriptions(server: EngineServer, request: Request) -> Response:
    form = parse_form(await request.body(), request.headers.get("content-type", ""))
    f = form.get("file")
    if not isinstance(f, tuple):
        raise ApiError(400, "Field required: file (a file part)", "file")
    audio: bytes = f[2]
    fmt = form.get("response_format", "json")
    if fmt not in ("text", "json", "verbose_json"):
        raise ApiError(400, "Currently only support response_format: `text`, `json` or `verbose_json`")
    stream, include_usage = _flag(form, "stream"), _flag(form, "stream_include_usage")
    if include_usage and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.", "stream_include_usage")
    if fmt == "verbose_json" and stream:
        raise ApiError(400, "verbose_json format doesn't support streaming case")
    lora = server._resolve_model(form.get("model"))
    seconds = duration_s(audio)
    prompt = form.get("prompt") or ""
    tok = server.engine.tokenizer
    ids = list(range(4, 4 + DECODER_SPECIAL_TOKENS)) + ([5] + tok.encode(prompt) if prompt else [])
    words = transcript_words(audio, seconds)
    mml = server.engine.profile.max_model_len
    if len(ids) >= mml:
        raise ApiError(400, f"This model's maximum context length is {mml} tokens; the prompt has {len(ids)}.")
    words = words[:mml - len(ids)]
    cap = _int(form, "max_completion_tokens")
    if cap is not None and cap < 1:
        raise ApiError(400, "max_completion_tokens must be an integer >= 1", "max_completion_tokens")
    n, reason = (cap, "length") if cap is not None and cap < len(words) else (len(words), "stop")
    prio = _int(form, "priority") or 0
    salt = form.get("cache_salt") if isinstance(form.get("cache_salt"), str) else None
    await server._gate()
    req = server.engine.submit(ids, n, stop_reason=reason, cache_salt=salt, lora_name=lora, priority=prio)
    req.external_id = request.headers.get("x-request-id")
    audio_tokens = math.ceil(seconds * AUDIO_TOKENS_PER_S)
    model = form.get("model") or server.engine.model
    if stream:
        return StreamingResponse(_stream(server, req, words, model, audio_tokens, include_usage),
                                 media_type="text/event-stream")
    await server._await(req, req.listener.done)
    text = "".join(words[:req.num_output])
    if fmt == "verbose_json":
        return json_response(_verbose(server, words[:req.num_output], seconds, form, text))
    return json_response({"text": text, "usage": {"type": "duration", "seconds": math.ceil(seconds)}})


def _verbose(server: EngineServer, words: list[str], seconds: float, form: dict[str, Any], text: str) -> dict[str, Any]:
    segs: list[dict[str, Any]] = []
    per = seconds / max(1, len(words))
    tok = server.engine.tokenizer
    temp = float(form.get("temperature") or 0.0)
    for i in range(0, len(words), SEGMENT_WORDS):
        part = words[i:i + SEGMENT_WORDS]
        segs.append({"id": len(segs), "avg_logprob": -0.25, "compression_ratio": 1.5, "end": (i + len(part)) * per,
                     "no_speech_prob": None, "seek": 0, "start": i * per, "temperature": temp,
                     "text": "".join(part), "tokens": [tok.piece_id(w) for w in part]})
    return {"duration": str(seconds), "language": form.get("language") or "en", "text": text, "segments": segs,
            "words": None}


async def _stream(server: EngineServer, req: SimRequest, words: list[str], model: str, audio_tokens: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    rid = f"transcribe-{uuid.uuid4().hex}"
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({"id": rid, "object": "transcription.chunk", "created": created,
                                         "model": model, "choices": choices, **extra}) + b"\n\n"

    def delta(text: str) -> bytes:
        return chunk([{"delta": {"content": text}}])

    async for ev in text_deltas(server, req, delta, delta, lambda a, b: "".join(words[a:b])):
        yield ev
    yield chunk([{"delta": {"content": ""}, "finish_reason": req.finish_reason, "stop_reason": None}])
    if include_usage:
        p = req.prompt_len + audio_tokens
        yield chunk([], usage={"prompt_tokens": p, "completion_tokens": req.num_output,
                               "total_tokens": p + req.num_output})
    yield b"data: [DONE]\n\n"
