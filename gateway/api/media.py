"""Request body media types: how an endpoint's body is read at the ingress and written for the upstream.

An endpoint entry (gateway/api/endpoints.py) names its `Media`; the ingress checks the request's Content-Type
against it and decodes the body with it, the exchange (gateway/proxy/dialects/base.py) encodes the upstream body
with it and sends the content type it names. Two exist:

- `JSON`: `application/json`, a JSON object (every API but the audio ones);
- `FORM`: `multipart/form-data` (RFC 7578), as OpenAI's audio APIs take it. The decoded body is a dict of the
  form's fields: a text field as a str, a file as an `Upload` (the bytes stay in the request body, never copied
  or decoded), a name given more than once as a list. It is encoded for the upstream as a new form with the same
  fields, files byte for byte, plus what the gateway set (the upstream model, caps) as text fields.

An `Upload` is not a str, dict or list, so nothing that walks a body for content (evidence, logs, spans) ever
sees the file's bytes, and its repr says only its size and type. The multipart reader is shared with batch file
uploads (gateway/batch/upload.py), which run it over a memory-mapped spool file.
"""
from __future__ import annotations

import email.message
import email.parser
import email.policy
import mmap
import secrets
import time
from dataclasses import dataclass
from typing import Any, Iterator, Union

import orjson

from gateway.api.parse import decode_json
from gateway.errors import GatewayError, bad_request

Body = dict[str, Any]  # a decoded request body: a JSON object, or a form's fields
Buffer = Union[bytes, mmap.mmap]  # what the multipart reader reads: a body in memory, or a memory-mapped spool file
HEADER_MAX = 16384  # the most header bytes one multipart part may have
FIND_WINDOW = 1 << 20  # a search through a large body looks at this much at a time, letting the GIL go in between


class MultipartError(ValueError):
    """The body is not well-formed multipart/form-data; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a multipart body: its name, its filename (None: a text field), its declared content type
    (None: none given) and where its content lies in the body: [start, end)."""

    name: str
    filename: str | None
    content_type: str | None
    start: int
    end: int


class Upload:
    """A file field of a form: its bytes are a slice of the request body (not copied)."""

    __slots__ = ("filename", "content_type", "_source", "_start", "_end")

    def __init__(self, filename: str, content_type: str, source: bytes, start: int = 0, end: int | None = None) -> None:
        self.filename = filename
        self.content_type = content_type
        self._source = source
        self._start = start
        self._end = len(source) if end is None else end

    @property
    def size(self) -> int:
        return self._end - self._start

    @property
    def data(self) -> memoryview:
        return memoryview(self._source)[self._start:self._end]

    def contains(self, sub: bytes) -> bool:
        return self._source.find(sub, self._start, self._end) >= 0

    def __repr__(self) -> str:  # never the bytes nor the filename: a body may be logged or recorded
        return f"<upload {self.size} bytes {self.content_type}>"

    __str__ = __repr__


def _find(body: Buffer, sub: bytes, start: int, end: int | None = None) -> int:
    """body.find(sub, start, end), a window at a time: one C-speed search over a 100 MB mapping holds the GIL
    (and takes its page faults) for tens of milliseconds, which the event loop would wait out."""
    stop = len(body) if end is None else min(end, len(body))
    pos = start
    while pos < stop:
        upto = min(stop, pos + FIND_WINDOW + len(sub) - 1)
        at = body.find(sub, pos, upto)
        if at >= 0:
            return int(at)
        pos += FIND_WINDOW
        time.sleep(0)
    return -1


def boundary_of(content_type: str) -> str:
    """The boundary parameter of a multipart Content-Type (MultipartError when there is none usable)."""
    msg = email.message.Message()
    msg["content-type"] = content_type
    boundary = msg.get_boundary()
    if not boundary or len(boundary) > 200:
        raise MultipartError("no boundary")
    return boundary


def iter_parts(body: Buffer, size: int, content_type: str) -> Iterator[Part]:
    """The parts of multipart/form-data (RFC 7578) over `body` (bytes or a memory map), in order, found with
    C-speed searches for the boundary; nothing is copied but each part's headers."""
    delim = b"--" + boundary_of(content_type).encode("latin-1", "replace")
    if body[:len(delim)] == delim:
        pos = 0
    else:
        pos = _find(body, b"\r\n" + delim, 0)
        if pos < 0:
            raise MultipartError("no part")
        pos += 2
    headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP)
    while True:
        pos += len(delim)
        if body[pos:pos + 2] == b"--":  # the close delimiter
            return
        eol = body.find(b"\r\n", pos, pos + 256)  # transport padding may precede the CRLF
        if eol < 0 or body[pos:eol].strip(b" \t"):
            raise MultipartError("a malformed boundary line")
        start = eol + 2
        if body[start:start + 2] == b"\r\n":  # a part without headers
            raw_headers, data = b"", start + 2
        else:
            hend = body.find(b"\r\n\r\n", start, start + HEADER_MAX)
            if hend < 0:
                raise MultipartError("a part's headers do not end")
            raw_headers, data = body[start:hend], hend + 4
        nxt = _find(body, b"\r\n" + delim, data)
        if nxt < 0:
            raise MultipartError("the body ends inside a part")
        part = headers.parsebytes(raw_headers + b"\r\n\r\n")
        name = part.get_param("name", header="content-disposition")
        ctype = part.get("content-type")
        yield Part(str(name) if name else "", part.get_filename(), str(ctype) if ctype else None, data, nxt)
        pos = nxt + 2
        if pos > size:
            raise MultipartError("the body ends inside a part")


def _quote(s: str) -> str:
    """A name or filename inside a quoted Content-Disposition parameter (the HTML form encoding's escapes)."""
    return s.replace('"', "%22").replace("\r", "%0D").replace("\n", "%0A")


def _text(v: object) -> bytes:
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, bool):
        return b"true" if v else b"false"
    if isinstance(v, (int, float)):
        return str(v).encode()
    return orjson.dumps(v)  # an object or nested array (vLLM reads e.g. vllm_xargs from a form as JSON text)


def _form_parts(body: Body) -> list[tuple[bytes, bytes | Upload]]:
    """(part headers, content) of each field; a list is the same name repeated, None is left out."""
    out: list[tuple[bytes, bytes | Upload]] = []
    for name, value in body.items():
        for v in value if isinstance(value, list) else (value,):
            if v is None:
                continue
            disp = f'Content-Disposition: form-data; name="{_quote(name)}"'
            if isinstance(v, Upload):
                head = f'{disp}; filename="{_quote(v.filename)}"\r\nContent-Type: {v.content_type}\r\n\r\n'
                out.append((head.encode(), v))
            else:
                out.append(((disp + "\r\n\r\n").encode(), _text(v)))
    return out


def encode_form(body: Body) -> bytes:
    """A multipart/form-data body of these fields; the boundary (read back by `content_type`) is random and
    checked to occur in no part's content."""
    parts = _form_parts(body)
    while True:
        boundary = ("gw-" + secrets.token_hex(16)).encode()
        if not any(boundary in c if isinstance(c, bytes) else c.contains(boundary) for _, c in parts):
            break
    chunks: list[bytes | memoryview] = []
    for head, content in parts:
        chunks += [b"--", boundary, b"\r\n", head, content.data if isinstance(content, Upload) else content, b"\r\n"]
    chunks += [b"--", boundary, b"--\r\n"]
    return b"".join(chunks)


class Media:
    """How a request body of one media type is decoded from the client and encoded for the upstream."""

    mime = ""
    bounds_prompt = False  # the raw body is the prompt as text: its size bounds the prompt's tokens

    def accepts(self, content_type: str) -> bool:
        return content_type.split(";", 1)[0].strip().lower() == self.mime

    def refusal(self) -> GatewayError:
        return GatewayError(415, f"Content-Type must be {self.mime}.", code="unsupported_media_type")

    def decode(self, raw: bytes, content_type: str) -> Body:
        raise NotImplementedError

    def encode(self, body: Body) -> bytes:
        raise NotImplementedError

    def content_type(self, encoded: bytes) -> str:
        """The Content-Type of a body `encode` produced."""
        return self.mime


class JsonMedia(Media):
    mime = "application/json"
    bounds_prompt = True

    def decode(self, raw: bytes, content_type: str) -> Body:
        return decode_json(raw)

    def encode(self, body: Body) -> bytes:
        return orjson.dumps(body)


class FormMedia(Media):
    mime = "multipart/form-data"

    def decode(self, raw: bytes, content_type: str) -> Body:
        """The form's fields (see the module docstring); 400 naming what is wrong when it is not a form."""
        if not raw:
            raise bad_request("Request body is empty; expected multipart/form-data.", code="invalid_request")
        out: Body = {}
        try:
            for p in iter_parts(raw, len(raw), content_type):
                if not p.name:
                    raise MultipartError("a part without a name")
                if p.filename is not None:
                    value: str | Upload = Upload(p.filename, p.content_type or "application/octet-stream", raw, p.start, p.end)
                else:
                    try:
                        value = raw[p.start:p.end].decode("utf-8")
                    except UnicodeDecodeError:
                        raise bad_request(f"Form field '{p.name}' is not valid UTF-8.", param=p.name,
                                          code="invalid_value") from None
                have = out.get(p.name)
                out[p.name] = value if have is None else [*have, value] if isinstance(have, list) else [have, value]
        except MultipartError as e:
            raise bad_request(f"Request body is not valid multipart/form-data ({e}).", code="invalid_request") from None
        return out

    def encode(self, body: Body) -> bytes:
        return encode_form(body)

    def content_type(self, encoded: bytes) -> str:
        first = encoded[2:encoded.find(b"\r\n")]  # encode_form starts with "--<boundary>"
        return f"{self.mime}; boundary={first.removesuffix(b'--').decode('ascii')}"


JSON = JsonMedia()
FORM = FormMedia()
