"""Parse and validate OpenAI's `POST /v1/audio/transcriptions` (pure): a multipart form (gateway/api/media.py)
with `file` (the audio), `model`, and optionally `language`, `prompt`, `response_format` (json, text or
verbose_json: the formats vLLM serves), `temperature` (0 to 1) and vLLM's `max_completion_tokens`. Every bad
field is a 400 naming it; a file over `MAX_FILE_BYTES` is a 413. Streaming is refused (the gateway answers a
transcription whole). Other fields go upstream as the client sent them.

The fields and their types are `TranscriptionRequest`'s (gateway/api/bodies.py), which also documents the form;
here: a form's text read as the number, integer or boolean its field declares (`typed`), the file's checks, and
streaming refused.

Sizes: `Parsed.prompt_chars` is the UTF-8 size of the text `prompt` (a bound on its tokens). The audio's own
tokens (vLLM counts Whisper's at 100 per second of audio) are known only from the engine's usage, once the
engine has decoded the audio: budgets reserve the text prompt and the completion and settle what the engine
counted (docs/budgets.md).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from msgspec import inspect as mi

from gateway.api.bodies import TranscriptionRequest
from gateway.api.media import Body, Upload
from gateway.api.parse import Parsed
from gateway.api.validate import Fault, Rules, core, struct_fields, validate
from gateway.errors import GatewayError, bad_request

MAX_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's limit; vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25) by default
FORM_OVERHEAD_BYTES = 1024 * 1024  # the other fields and the multipart framing
RESPONSE_FORMATS = ("json", "text", "verbose_json")
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _file(body: Body, param: str) -> None:
    f = body["file"]
    if not isinstance(f, Upload):
        raise bad_request("'file' must be a file (a form part with a filename), one per request.", param="file",
                          code="invalid_type")
    if f.size == 0:
        raise bad_request("'file' is empty.", param="file", code="invalid_value")
    if f.size > MAX_FILE_BYTES:
        raise GatewayError(413, f"'file' is {f.size} bytes, over the limit of {MAX_FILE_BYTES} bytes.",
                           param="file", code="file_too_large")


def _no_stream(body: Body, param: str) -> None:
    if body.get("stream") is True:
        raise bad_request("Streaming transcriptions are not supported; send stream=false or leave it out.",
                          param="stream", code="invalid_value")


RULES: Rules = {TranscriptionRequest: {"file": _file, "stream": _no_stream}}


def _number(name: str, text: str, t: mi.FloatType) -> float | Fault:
    try:
        v = float(text)
    except ValueError:
        return Fault(bad_request(f"'{name}' must be a number, got {text[:32]!r}.", param=name, code="invalid_type"))
    if not math.isfinite(v) or (t.ge is not None and v < t.ge) or (t.le is not None and v > t.le):
        return Fault(bad_request(f"'{name}' must be between {t.ge} and {t.le}, got {text[:32]!r}.", param=name,
                                 code="invalid_value"))
    return v


def _integer(name: str, text: str, t: mi.IntType) -> int | Fault:
    lo = t.ge if t.ge is not None else 0
    if not text.isdecimal() or int(text) < lo:
        return Fault(bad_request(f"'{name}' must be an integer >= {lo}, got {text[:32]!r}.", param=name,
                                 code="invalid_value"))
    return int(text)


def _boolean(name: str, text: str) -> bool | Fault:
    low = text.lower()
    if low in _TRUE + _FALSE:
        return low in _TRUE
    return Fault(bad_request(f"'{name}' must be true or false.", param=name, code="invalid_value"))


def _reader(t: mi.Type) -> Callable[[str, str], Any] | None:
    """How a form's text is read as the type a field declares (None: it stays text)."""
    t = core(t)
    if isinstance(t, mi.FloatType):
        return lambda name, text: _number(name, text, t)
    if isinstance(t, mi.IntType):
        return lambda name, text: _integer(name, text, t)
    if isinstance(t, mi.BoolType):
        return _boolean
    return None


READERS = tuple((f.encode_name, r) for f in struct_fields(TranscriptionRequest) if (r := _reader(f.type)) is not None)


def typed(body: Body) -> Body:
    """The form's fields as the types `TranscriptionRequest` declares: the text of a number, an integer or a
    boolean field read as one (a text that is none, or out of range, is a `Fault` in its place)."""
    out = dict(body)
    for name, read in READERS:
        text = body.get(name)
        if isinstance(text, str):
            out[name] = read(name, text)
    return out


def parse_transcription(body: Body) -> Parsed:
    values = typed(body)
    req = validate(values, TranscriptionRequest, RULES)
    _file(values, "")
    _no_stream(values, "")
    max_tokens = req.max_completion_tokens if isinstance(req.max_completion_tokens, int) else None
    return Parsed(req.model, False, False, max_tokens, len(req.prompt.encode()) if isinstance(req.prompt, str) else 0)


def response_format(body: Body) -> str:
    """The format the client asked for (json when none)."""
    fmt = body.get("response_format")
    return fmt if isinstance(fmt, str) and fmt in RESPONSE_FORMATS else "json"
