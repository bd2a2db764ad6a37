"""Batch file uploads (`POST /v1/files`) without holding up the event loop or the process's memory.

The request body is streamed to an anonymous temporary file as it arrives (bounded by `batch.max_file_bytes`,
within `batch.upload_timeout_s`). A worker thread then finds the multipart fields in that file (memory-mapped:
the file is never read into one bytes object) and checks every line as the realtime endpoint its url names
checks the same body (`LineChecker`, gateway/batch/jsonl.py), keeping only each line's custom_id, url, model
and prefix key. The lines are then stored a chunk at a time in `batch_file_lines` (blank lines too, so the
content is exactly the upload), which is what `batches.create` and the lane read later: the file is parsed
once, at upload.

Bounds: concurrent uploads per process and per tenant in it (`batch.max_concurrent_uploads[_per_tenant]`,
429 `too_many_uploads`: what they protect, this process's threads, disk and memory, is per process), and the
files and bytes a tenant stores (`batch.max_files_per_tenant`, 429 `file_limit_exceeded`;
`batch.max_stored_bytes_per_tenant`, 413 `storage_limit_exceeded`), checked against the batch store, which
every worker and replica shares, in the same transaction that reserves the upload's row.
"""
from __future__ import annotations

import asyncio
import contextlib
import mmap
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Awaitable, Callable, Iterator

from starlette.requests import Request

from gateway.api.media import MultipartError, iter_parts
from gateway.batch.jsonl import LineChecker, prompt_prefix
from gateway.batch.store import QuotaExceeded, new_id
from gateway.errors import GatewayError
from gateway.types import Principal

if TYPE_CHECKING:
    from gateway.batch.service import BatchService

YIELD_LINES = 32  # the checking thread lets the GIL go this often, so the event loop never waits a switch interval
RELEASE_BYTES = 8 << 20  # pages of the mapped upload read this far back are dropped from the process's RSS
CHUNK_LINES = 1000  # lines per insert while storing an upload
CHUNK_BYTES = 4 << 20  # or this many bytes of them, whichever comes first
FIELD_MAX = 4096  # the most of a non-file field (purpose) that is read


def _close(e: GatewayError) -> GatewayError:
    """A refusal sent before the body was read: the connection is closed rather than drained."""
    e.headers = {**e.headers, "connection": "close"}
    return e


@dataclass
class UploadSlots:
    """Uploads in progress in this process, in all and per tenant."""

    total: int = 0
    by_tenant: dict[str, int] = field(default_factory=dict)
    parsing: int = 0  # uploads whose lines a worker thread is checking now (or is about to)

    @contextlib.contextmanager
    def take(self, tenant: str, most: int, most_per_tenant: int) -> Iterator[None]:
        mine = self.by_tenant.get(tenant, 0)
        if self.total >= most or mine >= most_per_tenant:
            which = (f"{mine} upload(s) of this tenant are" if mine >= most_per_tenant
                     else f"{self.total} uploads are")
            raise _close(GatewayError(429, f"Too many concurrent uploads: {which} in progress here; retry when one "
                                           "has finished.", code="too_many_uploads", headers={"retry-after": "1"}))
        self.total += 1
        self.by_tenant[tenant] = mine + 1
        try:
            yield
        finally:
            self.total -= 1
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]


def _quota_error(e: QuotaExceeded, size: int | None = None) -> GatewayError:
    if e.kind == "files":
        return GatewayError(429, f"This tenant stores {e.used} files, the limit (batch.max_files_per_tenant: "
                                 f"{e.limit}); delete files it no longer needs.", code="file_limit_exceeded",
                            param="file")
    more = f" and this file is {size} bytes" if size is not None else ""
    return GatewayError(413, f"This tenant stores {e.used} bytes of files{more}, over its limit of {e.limit} bytes "
                             "(batch.max_stored_bytes_per_tenant); delete files it no longer needs.",
                        code="storage_limit_exceeded", param="file")


async def spool(request: Request, out: IO[bytes], limit: int, within_s: float) -> int:
    """Write the request body to `out` as it arrives: 413 past `limit` bytes, 408 when it takes longer than
    `within_s`. Returns its size."""
    size = 0
    try:
        async with asyncio.timeout(within_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _close(GatewayError(413, f"The upload is larger than the limit of {limit} bytes.",
                                              code="file_too_large"))
                out.write(chunk)
    except TimeoutError:
        raise _close(GatewayError(408, f"The upload did not arrive within {within_s:g} s.",
                                  code="request_timeout")) from None
    out.flush()
    return size


@dataclass
class Form:
    fields: dict[str, bytes]
    filename: str | None = None
    start: int = 0  # the file part's bytes in the spooled body: [start, end)
    end: int = -1

    @property
    def has_file(self) -> bool:
        return self.end >= self.start


def _not_multipart(why: str) -> GatewayError:
    return GatewayError(400, f"The upload must be multipart/form-data with fields 'file' and 'purpose' ({why}).",
                        code="invalid_request")


def parse_form(body: Any, size: int, ctype: str) -> Form:
    """multipart/form-data (RFC 7578) over `body` (bytes or a memory map), read by the gateway's multipart reader
    (gateway/api/media.py): the small fields' values, and where the 'file' field's content lies; no part is
    copied but the small fields."""
    form = Form({})
    try:
        for part in iter_parts(body, size, ctype):
            if not part.name:
                continue
            if part.name == "file":
                form.filename, form.start, form.end = part.filename, part.start, part.end
            else:
                form.fields[part.name] = body[part.start:min(part.end, part.start + FIELD_MAX)]
    except MultipartError as e:
        raise _not_multipart(str(e)) from None
    return form


@dataclass
class Scanned:
    """What checking an upload's lines produced: per request line (line_no, custom_id, url, model, prefix_key),
    the number of lines (blank ones included) and the models named."""

    lines: list[tuple[int, str, str, str, str]]
    segments: int
    models: set[str]


class _Pacer:
    """What a thread reading a mapped upload does between lines: it lets the GIL go every YIELD_LINES lines
    (`time.sleep(0)`: an event loop waiting for it runs now, not after the 5 ms switch interval), and drops the
    pages it has read from this process's resident memory (they stay in the page cache)."""

    def __init__(self, body: Any, start: int) -> None:
        self.body, self.released, self.n = body, start - start % mmap.PAGESIZE, 0

    def __call__(self, pos: int) -> None:
        self.n += 1
        if self.n % YIELD_LINES == 0:
            time.sleep(0)
        if pos - self.released >= RELEASE_BYTES and isinstance(self.body, mmap.mmap):
            upto = pos - pos % mmap.PAGESIZE
            self.body.madvise(mmap.MADV_DONTNEED, self.released, upto - self.released)
            self.released = upto


def scan_lines(body: Any, start: int, end: int, checker: LineChecker, prefix_chars: int) -> Scanned:
    """Every line of body[start:end] through `checker` (400 naming the first bad one), one at a time: only the
    small facts of each line are kept, never the parsed bodies."""
    out: list[tuple[int, str, str, str, str]] = []
    models: set[str] = set()
    pos, i = start, 0
    pace = _Pacer(body, start)
    while True:
        pace(pos)
        i += 1
        most = pos + checker.max_line_bytes + 1  # a newline is looked for no further than a line may be long
        nl = body.find(b"\n", pos, min(end, most))
        if nl < 0 and most < end:
            raise GatewayError(400, f"Line {i}: the line is over the limit of {checker.max_line_bytes} bytes.",
                               code="line_too_large", param="file", extra={"line": i})
        stop = end if nl < 0 else nl
        ln = checker.check(i, body[pos:stop])
        if ln is not None:
            model = ln.body["model"]
            models.add(model)
            out.append((i, ln.custom_id, ln.url, model, prompt_prefix(ln.body, prefix_chars)))
        if nl < 0:
            break
        pos = nl + 1
    if not out:
        raise GatewayError(400, "The file is empty; a batch input file has one JSON request per line.",
                           code="invalid_batch_file", param="file")
    return Scanned(out, i, models)


def line_rows(body: Any, start: int, end: int, scanned: Scanned) -> Iterator[list[tuple[Any, ...]]]:
    """The rows of batch_file_lines for body[start:end] in chunks: (line_no, raw text, custom_id, url, model,
    prefix_key), blank lines with only their text."""
    facts = iter(scanned.lines)
    nxt = next(facts, None)
    chunk: list[tuple[Any, ...]] = []
    held = 0
    pos, i = start, 0
    pace = _Pacer(body, start)
    while True:
        pace(pos)
        i += 1
        nl = body.find(b"\n", pos, end)
        stop = end if nl < 0 else nl
        try:
            text = body[pos:stop].decode("utf-8")
        except UnicodeDecodeError:  # a request line was valid JSON (UTF-8); a blank one is whitespace
            raise GatewayError(400, f"Line {i}: not valid UTF-8.", code="invalid_batch_line", param="file",
                               extra={"line": i}) from None
        if nxt is not None and nxt[0] == i:
            chunk.append((i, text, nxt[1], nxt[2], nxt[3], nxt[4]))
            nxt = next(facts, None)
        else:
            chunk.append((i, text, None, None, None, None))
        held += stop - pos
        if len(chunk) >= CHUNK_LINES or held >= CHUNK_BYTES:
            yield chunk
            chunk, held = [], 0
        if nl < 0:
            break
        pos = nl + 1
    if chunk:
        yield chunk


def _map(f: IO[bytes], size: int) -> Any:
    if size == 0:
        raise _not_multipart("an empty body")
    return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)


async def create_file(svc: "BatchService", request: Request, p: Principal, owner: str,
                      decide: Callable[[set[str]], Awaitable[dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Receive, check and store one upload; returns the stored file's row. `decide(models)` may add fields
    to the row once the models the file names are known (checked before anything is stored)."""
    bc = svc.gw.config.raw.batch
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise _close(GatewayError(415, "Upload files as multipart/form-data with fields 'file' and 'purpose'.",
                                  code="unsupported_media_type"))
    limit = bc.max_file_bytes + 65536  # the file and its multipart framing
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise _close(GatewayError(413, f"The upload is larger than the limit of {limit} bytes.",
                                  code="file_too_large"))
    with svc.upload_slots.take(p.tenant, bc.max_concurrent_uploads, bc.max_concurrent_uploads_per_tenant):
        files, used = await svc.store.usage(p.tenant)  # refuse before reading when the quota is already spent
        if files >= bc.max_files_per_tenant:
            raise _close(_quota_error(QuotaExceeded("files", files, bc.max_files_per_tenant)))
        least = int(cl) - 65536 if cl is not None and cl.isdigit() else 0  # the file is at least this large
        if used >= bc.max_stored_bytes_per_tenant or used + least > bc.max_stored_bytes_per_tenant:
            raise _close(_quota_error(QuotaExceeded("bytes", used, bc.max_stored_bytes_per_tenant)))
        with tempfile.TemporaryFile(prefix="gw-upload-") as f:
            size = await spool(request, f, limit, bc.upload_timeout_s)
            checker = LineChecker(bc.max_lines, svc.line_limit())

            def check() -> tuple[Any, Form, Scanned]:
                body = _map(f, size)
                try:
                    form = parse_form(body, size, ctype)
                    purpose = form.fields.get("purpose", b"").decode("utf-8", "replace").strip()
                    if purpose != "batch":
                        raise GatewayError(400, "purpose must be 'batch' (the only purpose this gateway stores "
                                                "files for).", code="invalid_request", param="purpose")
                    if not form.has_file:
                        raise GatewayError(400, "The upload has no 'file' field.", code="invalid_request",
                                           param="file")
                    n = form.end - form.start
                    if n > bc.max_file_bytes:
                        raise GatewayError(413, f"The file is {n} bytes, over the limit of {bc.max_file_bytes} "
                                                "bytes.", code="file_too_large", param="file")
                    return body, form, scan_lines(body, form.start, form.end, checker, bc.prefix_chars)
                except BaseException:
                    body.close()
                    raise

            svc.upload_slots.parsing += 1
            try:
                body, form, scanned = await asyncio.get_running_loop().run_in_executor(svc.upload_pool, check)
            finally:
                svc.upload_slots.parsing -= 1
            try:
                row: dict[str, Any] = {"id": new_id("file-"), "owner": owner, "tenant": p.tenant, "purpose": "batch",
                                       "filename": (form.filename or "input.jsonl")[:256],
                                       "bytes": form.end - form.start, "created_at": time.time()}
                if decide is not None:
                    row.update(await decide(scanned.models))
                await _store(svc, row, body, form, scanned)
            finally:
                body.close()
    return row


async def _store(svc: "BatchService", row: dict[str, Any], body: Any, form: Form, scanned: Scanned) -> None:
    bc = svc.gw.config.raw.batch
    try:
        await svc.store.reserve_file(row, bc.max_files_per_tenant, bc.max_stored_bytes_per_tenant)
    except QuotaExceeded as e:
        raise _quota_error(e, row["bytes"]) from None
    try:
        chunks = line_rows(body, form.start, form.end, scanned)
        while True:
            chunk = await asyncio.get_running_loop().run_in_executor(svc.upload_pool, next, chunks, None)
            if chunk is None:
                break
            await svc.store.add_file_lines(row["id"], chunk)
        if not await svc.store.commit_file(row["id"]):
            raise GatewayError(503, "The upload could not be stored; retry shortly.", code="batch_store_unavailable",
                               headers={"retry-after": "1"})
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.shield(svc.store.drop_upload(row["id"]))
        raise
