"""Parse and validate OpenAI's `POST /v1/audio/transcriptions` (pure): a multipart form (gateway/api/media.py)
with `file` (the audio), `model`, and optionally `language`, `prompt`, `response_format` (json, text or
verbose_json: the formats vLLM serves), `temperature` (0 to 1) and vLLM's `max_completion_tokens`. Every bad
field is a 400 naming it; a file over `MAX_FILE_BYTES` is a 413. Streaming is refused (the gateway answers a
transcription whole). Other fields go upstream as the client sent them.

Sizes: `Parsed.prompt_chars` is the UTF-8 size of the text `prompt` (a bound on its tokens). The audio's own
tokens (vLLM counts Whisper's at 100 per second of audio) are known only from the engine's usage, once the
engine has decoded the audio: budgets reserve the text prompt and the completion and settle what the engine
counted (docs/budgets.md).
"""
from __future__ import annotations

import math
from gateway.api.media import Body, Upload
from gateway.api.parse import Parsed, _model, _type_error
from gateway.errors import GatewayError, bad_request

MAX_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's limit; vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25) by default
FORM_OVERHEAD_BYTES = 1024 * 1024  # the other fields and the multipart framing
RESPONSE_FORMATS = ("json", "text", "verbose_json")
_TRUE, _FALSE = ("true", "1"), ("false", "0")


def _opt_text(body: Body, name: str, most: int | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _type_error(name, "a text field", v)
    if most is not None and len(v) > most:
        raise bad_request(f"'{name}' must be at most {most} characters.", param=name, code="invalid_value")
    return v


def _file(body: Body) -> Upload:
    f = body.get("file")
    if f is None:
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    if not isinstance(f, Upload):
        raise bad_request("'file' must be a file (a form part with a filename), one per request.", param="file",
                          code="invalid_type")
    if f.size == 0:
        raise bad_request("'file' is empty.", param="file", code="invalid_value")
    if f.size > MAX_FILE_BYTES:
        raise GatewayError(413, f"'file' is {f.size} bytes, over the limit of {MAX_FILE_BYTES} bytes.",
                           param="file", code="file_too_large")
    return f


def _temperature(body: Body) -> None:
    t = _opt_text(body, "temperature")
    if t is None:
        return
    try:
        v = float(t)
    except ValueError:
        raise bad_request(f"'temperature' must be a number, got {t[:32]!r}.", param="temperature",
                          code="invalid_type") from None
    if not math.isfinite(v) or not 0 <= v <= 1:
        raise bad_request(f"'temperature' must be between 0 and 1, got {t[:32]!r}.", param="temperature",
                          code="invalid_value")


def _max_tokens(body: Body) -> int | None:
    t = _opt_text(body, "max_completion_tokens")
    if t is None:
        return None
    if not t.isdigit() or int(t) < 1:
        raise bad_request(f"'max_completion_tokens' must be an integer >= 1, got {t[:32]!r}.",
                          param="max_completion_tokens", code="invalid_value")
    return int(t)


def parse_transcription(body: Body) -> Parsed:
    model = _model(body)
    _file(body)
    _opt_text(body, "language", 32)
    prompt = _opt_text(body, "prompt") or ""
    fmt = _opt_text(body, "response_format")
    if fmt is not None and fmt not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}, got {fmt[:32]!r}.",
                          param="response_format", code="invalid_value")
    _temperature(body)
    stream = _opt_text(body, "stream")
    if stream is not None and stream.lower() not in _TRUE + _FALSE:
        raise bad_request("'stream' must be true or false.", param="stream", code="invalid_value")
    if stream is not None and stream.lower() in _TRUE:
        raise bad_request("Streaming transcriptions are not supported; send stream=false or leave it out.",
                          param="stream", code="invalid_value")
    return Parsed(model, False, False, _max_tokens(body), len(prompt.encode()))


def response_format(body: Body) -> str:
    """The format the client asked for (json when none)."""
    fmt = body.get("response_format")
    return fmt if isinstance(fmt, str) and fmt in RESPONSE_FORMATS else "json"
