"""The evidence (audit) recorder: one structured record per request, written off the request path.

`build_record` is pure: it turns a finished RequestContext into a JSON-able dict. `EvidenceRecorder.record`
only builds and enqueues (bounded queue; drops and counts when full, never blocks a request); a background
task writes JSON lines (and optionally Postgres): to a file, rotated by size when `max_bytes` is set (whole
batches, renamed before the write that would pass the limit, so no record is split or lost), or to stdout
(`path="-"`). Zero-retention requests never carry prompt or completion
text: content keys are stripped everywhere and any remaining string that quotes the prompt is redacted.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import sys
from collections import OrderedDict, deque
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import orjson

from gateway.pipeline import RequestContext

if TYPE_CHECKING:
    from gateway.config import BackendConfig, Config

log = logging.getLogger("gateway.evidence")

_Record = dict[str, Any]  # one audit record, JSON-able
_BackendLookup = Callable[[str], "BackendConfig | None"]  # backend name -> its config, or None (removed)

# Keys whose values are request or response content. Never recorded unless capture_content is on and the
# request is not zero-retention; stripped from every nested evidence entry otherwise.
CONTENT_KEYS = frozenset({"messages", "prompt", "input", "completion", "completion_text", "content", "response_text",
                          "text", "tool_calls", "suffix", "instructions", "choices", "delta", "reasoning_content",
                          # the pooling APIs' content: rerank's query and documents, score's text pairs
                          "query", "documents", "text_1", "text_2"})
# ctx.evidence entries lifted to top-level fields of the record.
_LIFTED = ("decision", "budget", "candidates", "route", "predicted_ttft_ms", "predicted_cached_tokens", "cost",
           "session", "unit_cost")
_LIFTED_SET = frozenset(_LIFTED)
_REDACTED = "[redacted: zero retention]"
# exact types that are never containers (no content key can be inside one); subclasses take the isinstance path
_LEAF_TYPES = frozenset({str, int, float, bool, type(None)})
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})  # the leaves that are not strings
# exact types _plain hands back as they are
_PLAIN_TYPES = frozenset({str, int, float, bool, list, dict, tuple, type(None)})
# Record fields filled from stage-owned evidence (anything else in the record is built from typed values).
_STAGE_FIELDS = ("budget", "candidates", "route", "attempts", "cost", "unit_cost", "evidence")


_ECHO_KEYS = frozenset({"text", "arguments", "image_url", "url"})  # walked for content strings besides CONTENT_KEYS


def _content_strings(body: Any, out: list[str]) -> None:
    """Every text string inside the request body's content fields (used to redact echoes)."""
    t = type(body)
    if t is str or (t is not dict and t is not list and isinstance(body, str)):
        if len(body) >= 4:
            out.append(body)
    elif t is dict or (t is not list and isinstance(body, dict)):
        for k, v in body.items():
            if k in CONTENT_KEYS or k in _ECHO_KEYS:
                _content_strings(v, out)
            elif type(v) not in _LEAF_TYPES and isinstance(v, (dict, list)):  # identity first: see _strip_content
                _content_strings(v, out)
    elif t is list or isinstance(body, list):
        for v in body:
            _content_strings(v, out)


def _scrub(value: Any, secrets: list[str]) -> Any:
    """Drop content keys and redact strings that quote any of `secrets`: a string holding a secret, or the
    first 64 characters of a longer one (a long prompt may be echoed partially: truncated error messages)."""
    # a string holds s or, for s over 64 characters, s[:64] iff it holds the needle below (s holds s[:64])
    needles = tuple(dict.fromkeys(s[:64] if len(s) > 64 else s for s in secrets))
    return _scrub_in(value, needles, min(map(len, needles)) if needles else sys.maxsize)


def _scrub_in(value: Any, needles: tuple[str, ...], shortest: int) -> Any:
    """_scrub's walk. Exact types are tested first (isinstance misses look up `__class__`), and leaves that
    cannot hold a needle (numbers, None, a string shorter than every needle) are copied without a call: this walk
    was most of a zero-retention record's cost (docs/benchmarks.md, "Hot path choices")."""
    t = type(value)
    if t is str:
        if needles and len(value) >= shortest:
            for n in needles:
                if n in value:
                    return _REDACTED
        return value
    if t in _SCALAR_TYPES:
        return value
    if t is dict or (t is not list and t is not tuple and isinstance(value, dict)):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if k in CONTENT_KEYS:
                continue
            tv = type(v)
            out[k] = v if tv in _SCALAR_TYPES or (tv is str and len(v) < shortest) else _scrub_in(v, needles, shortest)
        return out
    if t is list or t is tuple or isinstance(value, (list, tuple)):
        return [v if (tv := type(v)) in _SCALAR_TYPES or (tv is str and len(v) < shortest)
                else _scrub_in(v, needles, shortest) for v in value]
    if isinstance(value, str) and needles:  # a str subclass
        for n in needles:
            if n in value:
                return _REDACTED
    return value


def _strip_content(value: Any) -> Any:
    """`_scrub` without secrets: `value` itself when no dict inside it has a content key (the common case:
    stage evidence is built from typed values), else a copy without those keys. Checking first costs far less per
    request than rebuilding every dict and list.
    Types are tested by identity before any isinstance: an isinstance miss looks up `__class__` on the value,
    and most values are leaves (str, numbers, None), and the walk runs on every request (docs/benchmarks.md,
    "Hot path choices")."""
    t = type(value)
    if t in _LEAF_TYPES:
        return value
    if t is dict or (t is not list and t is not tuple and isinstance(value, dict)):
        if not CONTENT_KEYS.isdisjoint(value):
            return _scrub(value, [])
        out = value
        for k, v in value.items():
            if type(v) in _LEAF_TYPES:
                continue
            w = _strip_content(v)  # v itself unless it is a dict, list or tuple holding a content key
            if w is not v:
                if out is value:
                    out = dict(value)
                out[k] = w
        return out
    if t is list or t is tuple or isinstance(value, (list, tuple)):
        out_l: list[Any] | None = None
        for i, v in enumerate(value):
            if type(v) in _LEAF_TYPES:
                continue
            w = _strip_content(v)
            if w is not v:
                if out_l is None:
                    out_l = list(value)
                out_l[i] = w
        return value if out_l is None else out_l
    return value


def _plain(v: Any) -> Any:
    """JSON-able form of stage-owned objects (dataclasses, structs) for the record."""
    if type(v) in _PLAIN_TYPES:  # the common case, without isinstance's misses (each looks up __class__)
        return v
    if v is None or isinstance(v, (str, int, float, bool, list, dict, tuple)):
        return v
    to_ev = getattr(v, "to_evidence", None)
    if callable(to_ev):
        return to_ev()
    slots = getattr(v, "__slots__", None)
    if slots:
        return {k: getattr(v, k, None) for k in slots}
    return getattr(v, "__dict__", None) or str(v)


def _iso_utc(ts: float) -> str:
    """`datetime.fromtimestamp(ts, timezone.utc).isoformat()`, written by orjson (RFC 3339, the same text for
    an aware UTC datetime, microseconds omitted when zero as isoformat does), cheaper than `isoformat`."""
    return orjson.dumps(datetime.fromtimestamp(ts, timezone.utc))[1:-1].decode()


def build_record(ctx: RequestContext, *, capture_content: bool = False,
                 backend_lookup: _BackendLookup | None = None) -> _Record:
    """The audit record for one finished request. Pure; never includes content for zero-retention requests,
    nor for requests whose retention is unknown (refused before the policy decision)."""
    d = ctx.decision
    ev = ctx.evidence
    usage = ctx.usage
    zero = ctx.zero_retention
    location = _backend_location(ctx, backend_lookup)
    rec: _Record = {
        "request_id": ctx.request_id,
        "client_request_id": ctx.client_request_id,
        "batch": _plain(ctx.batch),
        "ts": _iso_utc(ctx.received_wall),
        "endpoint": ctx.endpoint,
        "model": ctx.model,
        "model_chain": list(ctx.model_chain),
        "stream": ctx.stream,
        "principal": ctx.principal.to_evidence() if ctx.principal is not None else None,
        # the partner's trace/session id (routing.affinity_headers): an id, recorded even under zero retention
        "session": _plain(ev.get("session")),
        "matched_rules": list(d.matched_rules) if d is not None else [],
        "decision": ev.get("decision") or (d.to_evidence() if d is not None else None),
        "zero_retention": zero,
        "budget": _plain(ev.get("budget")),
        "candidates": _plain(ev.get("candidates")),
        "route": _plain(ev.get("route")),
        "backend": ctx.backend,
        "backend_model": ctx.backend_model,
        "backend_location": location,
        "attempts": [_plain(a) for a in ctx.attempts],
        "ttft_ms": {"predicted": ev.get("predicted_ttft_ms"),
                    "actual": round(ctx.ttft_s * 1000, 3) if ctx.ttft_s is not None else None},
        "cached_tokens": {"predicted": ev.get("predicted_cached_tokens"),
                          "actual": usage.cached_tokens if usage is not None else None},
        "usage": ({"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                   "cached_tokens": usage.cached_tokens} if usage is not None else None),
        "delivered_completion_tokens": ctx.delivered_completion_tokens,
        "response_id": ctx.response_id,
        "finish_reasons": list(ctx.finish_reasons),
        "cut_by_budget": ctx.cut_by_budget,
        "cost": _plain(ev.get("cost")),  # the price charged (budgets)
        # what serving it cost (gateway/cost, docs/cost.md): engine time apportioned from the engine's steps,
        # its price, the margin against `cost`, the category and the GPU-seconds saved or wasted
        "unit_cost": _plain(ev.get("unit_cost")),
        "status": ctx.status,
        "error": ctx.error,
        "total_ms": round(ctx.total_s * 1000, 3) if ctx.total_s is not None else None,
        "stage_timings_us": {k: round(v, 1) for k, v in ctx.stage_timings_us.items()},
        "evidence": {k: v if type(v) in _PLAIN_TYPES else _plain(v) for k, v in ev.items() if k not in _LIFTED_SET},
    }
    return _retained(rec, ctx, capture_content)


def _backend_location(ctx: RequestContext, backend_lookup: _BackendLookup | None) -> _Record | None:
    """Where the serving backend is and what it keeps (its location, retention and operator)."""
    location = None
    if ctx.backend and backend_lookup is not None:
        b = backend_lookup(ctx.backend)
        if b is not None:
            loc = b.location
            location = {"country": loc.country, "storage_country": loc.storage, "region": loc.region} \
                if loc is not None else {}
            location = {**location, "retention": b.retention, "operator": b.operator}
    return location


def _retained(rec: _Record, ctx: RequestContext, capture_content: bool) -> _Record:
    """The record as it may be kept: content captured only where retention allows; under zero (or unknown)
    retention every string is checked for echoes of the content, else only the stage-provided structures."""
    ev = ctx.evidence
    # unknown retention (no decision, no principal: refused early) is treated as zero: never captured, scrubbed
    keep = ctx.content_retainable
    want_content = capture_content and keep
    content: dict[str, Any] | None = None
    if want_content:
        body = ctx.body or {}
        content = {k: body[k] for k in ("messages", "prompt", "input") if k in body}
        for k in ("completion", "completion_text"):
            if k in ev:
                content["completion"] = ev[k]
    secrets: list[str] = []
    if not keep:
        _content_strings(ctx.body or {}, secrets)
        for k in ("completion", "completion_text"):
            if isinstance(ev.get(k), str):
                secrets.append(ev[k])
    if secrets:  # zero retention: every string in the record is checked for echoes of the content
        rec = _scrub(rec, secrets)
    else:  # otherwise only stage-provided structures can carry content keys; the rest is built here, typed
        for k in _STAGE_FIELDS:
            rec[k] = _strip_content(rec[k])  # the value itself unless a content key is inside it
    if content is not None:
        rec["content"] = content
    return rec


def _dumps(rec: Any) -> bytes:
    """The record as JSON; keys that are not str (a stage's int-keyed map) are written as orjson writes them
    with OPT_NON_STR_KEYS. That option costs on every dict (docs/benchmarks.md, "Hot path choices"), and
    records have str keys only unless a stage put others in: the plain encoding is
    tried first and refuses any other key (TypeError), which is then retried with the option."""
    try:
        return orjson.dumps(rec, default=str)
    except TypeError:
        return orjson.dumps(rec, default=str, option=orjson.OPT_NON_STR_KEYS)


class EvidenceRecorder:
    """Queue records on the request path; write JSON lines (and optional sinks) in a background task."""

    def __init__(self, path: str | Path | None, *, capture_content: bool = False, max_queue: int = 10000,
                 recent: int = 4096, sink: Any = None, backend_lookup: _BackendLookup | None = None,
                 batch: int = 256, sink_backlog: int = 100000, linger_s: float = 0.05, max_bytes: int = 0,
                 backups: int = 5) -> None:
        self.stdout = path == "-"  # JSON lines on fd 1 (then /admin/decisions reads memory and the sink only)
        self.path = Path(path) if path is not None and not self.stdout else None
        self.max_bytes = max_bytes  # rotate the file before a write would pass this size; 0 = never
        self.backups = max(1, backups)
        self.rotations = 0
        self._lock_fd: int | None = None  # .<name>.lock, held while a batch is appended (see _append)
        self.capture_content = capture_content
        self.sink = sink  # e.g. PostgresSink: async start(), write_many(records), get(request_id), close()
        self.backend_lookup = backend_lookup
        # (the record's JSON line, the record itself only when a sink takes dicts)
        self._queue: asyncio.Queue[tuple[bytes, dict[str, Any] | None] | None] = asyncio.Queue(maxsize=max_queue)
        # recent records as their JSON lines, serialised once on the request path (the writer appends the same
        # bytes): one untracked object each instead of ~15 dicts and lists the garbage collector would walk
        # in every full collection (thousands of records would be most of the gateway's tracked objects)
        self._recent: OrderedDict[str, bytes] = OrderedDict()
        self._recent_client: OrderedDict[str, bytes] = OrderedDict()  # client x-request-id -> newest
        self._recent_max = recent
        self._batch = batch
        # after the first record of a batch, wait this long for more: under load one file append (a thread
        # hand-off and a file open) per batch instead of one per record
        self._linger_s = linger_s
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.written = 0
        # records the sink could not take yet (database down); retried on every later write, oldest first
        self._sink_backlog: deque[dict[str, Any]] = deque(maxlen=sink_backlog)
        self._sink_started = False
        self.sink_dropped = 0

    def check_config(self, config: Config) -> None:
        """A reload (gateway.app.Reloadable): nothing to check."""

    def swap_config(self, config: Config) -> None:
        """Nothing to swap: the audit path, its rotation and its sink are read once, at startup."""

    async def start(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.sink is not None:
            await self._start_sink()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="evidence-writer")

    def record(self, ctx: RequestContext) -> bool:
        """Build and enqueue the record; never blocks. False when the queue is full (counted in `dropped`)."""
        try:
            rec = build_record(ctx, capture_content=self.capture_content, backend_lookup=self.backend_lookup)
        except Exception:  # evidence must never break a request
            log.exception("building evidence for %s failed", ctx.request_id)
            return False
        try:
            # a copy of exact size: orjson's buffer keeps kilobytes of slack per record after its shrink, and the
            # ring keeps thousands of them
            line = memoryview(_dumps(rec)).tobytes()
        except Exception:  # a value orjson cannot encode even as str(): evidence must never break a request
            log.exception("encoding evidence for %s failed", ctx.request_id)
            return False
        self._remember(rec["request_id"], rec.get("client_request_id"), line)
        try:
            self._queue.put_nowait((line, rec if self.sink is not None else None))
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    def _remember(self, rid: str, cid: str | None, line: bytes) -> None:
        self._recent[rid] = line
        self._recent.move_to_end(rid)
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)
        if cid is not None:
            self._recent_client[cid] = line
            self._recent_client.move_to_end(cid)
            while len(self._recent_client) > self._recent_max:
                self._recent_client.popitem(last=False)

    async def _run(self) -> None:
        stop = False
        while not stop:
            if self._sink_backlog:  # the database was down: retry the backlog every second even without traffic
                try:
                    item = await asyncio.wait_for(self._queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    await self._write_sink([])
                    continue
            else:
                item = await self._queue.get()
            if item is not None and self._linger_s > 0 and self._queue.qsize() < self._batch - 1:
                await asyncio.sleep(self._linger_s)
            items = [item]
            while len(items) < self._batch and not self._queue.empty():
                items.append(self._queue.get_nowait())
            recs = [r for r in items if r is not None]
            stop = any(r is None for r in items)
            if recs:
                await self._write(recs)

    async def _write(self, recs: list[tuple[bytes, dict[str, Any] | None]]) -> None:
        if self.path is not None or self.stdout:
            data = b"".join(line + b"\n" for line, _ in recs)
            try:
                await asyncio.to_thread(self._append, data)
            except OSError:
                log.exception("writing %d audit records to %s failed", len(recs), self.path or "stdout")
        if self.sink is not None:
            await self._write_sink([r if r is not None else orjson.loads(line) for line, r in recs])
        self.written += len(recs)

    async def _start_sink(self) -> bool:
        """Open the sink; a database that is down at start is retried on later writes, never fatal."""
        try:
            await self.sink.start()
        except Exception as e:
            log.warning("audit sink not available (%s); records are kept and retried", type(e).__name__)
            return False
        self._sink_started = True
        return True

    async def _write_sink(self, recs: list[dict[str, Any]]) -> None:
        backlog = self._sink_backlog
        if len(backlog) + len(recs) > (backlog.maxlen or 0):
            self.sink_dropped += len(backlog) + len(recs) - (backlog.maxlen or 0)
        backlog.extend(recs)
        if not self._sink_started and not await self._start_sink():
            return
        while backlog:
            batch = [backlog[i] for i in range(min(self._batch, len(backlog)))]
            try:
                await self.sink.write_many(batch)
            except Exception as e:
                log.warning("writing %d audit records to the sink failed (%s); kept for retry", len(batch),
                            type(e).__name__)
                return
            for _ in batch:
                backlog.popleft()

    def _append(self, data: bytes) -> None:
        """Append one batch (in a worker thread, one at a time per process). With max_bytes, a file that would
        pass it is rotated first: the batch starts the new file whole. Under an exclusive lock on `.<name>.lock` beside it:
        the workers of `gateway serve --workers N` write one file, so the size check, the rotation and the
        write must not interleave with another process's (a batch is never split, a file never rotated twice)."""
        if self.stdout:
            _write_all(1, data)
            return
        assert self.path is not None
        if self._lock_fd is None:
            self._lock_fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o640)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            if self.max_bytes:
                try:
                    size = self.path.stat().st_size
                except FileNotFoundError:
                    size = 0
                if size and size + len(data) > self.max_bytes:
                    self._rotate()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _rotated(self, i: int) -> Path:
        assert self.path is not None
        return self.path.with_name(f"{self.path.name}.{i}")

    def _rotate(self) -> None:
        """<path> -> <path>.1 -> ... -> <path>.<backups>; the oldest beyond that is removed (renames only: a
        record is in exactly one file at every moment)."""
        assert self.path is not None
        self._rotated(self.backups).unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            src = self._rotated(i)
            if src.exists():
                os.replace(src, self._rotated(i + 1))
        os.replace(self.path, self._rotated(1))
        self.rotations += 1

    async def close(self) -> None:
        """Flush everything queued, then stop the writer and the sink."""
        if self._task is not None:
            await self._queue.put(None)
            await self._task
            self._task = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.sink is not None:
            if self._sink_backlog:
                await self._write_sink([])
                if self._sink_backlog:
                    log.warning("audit sink: %d records not written at close (they are in the JSON-lines log)",
                                len(self._sink_backlog))
            await self.sink.close()

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """A record by the gateway's request id or, failing that, the newest one with that client x-request-id:
        recent memory first, then the sink, then a scan of the JSON-lines file."""
        line = self._recent.get(request_id) or self._recent_client.get(request_id)
        if line is not None:
            return orjson.loads(line)
        if self.sink is not None:
            try:
                rec = await self.sink.get(request_id)
            except Exception as e:  # database down: fall back to the JSON-lines log
                log.warning("audit sink lookup failed (%s)", type(e).__name__)
                rec = None
            if rec is not None:
                return rec
        if self.path is None:
            return None
        return await asyncio.to_thread(self._scan, request_id)

    def _scan(self, request_id: str) -> dict[str, Any] | None:
        """The current file, then the rotated ones newest first (a gateway id in any wins over a client id)."""
        assert self.path is not None
        quoted = orjson.dumps(request_id)
        needle, client_needle = b'"request_id":' + quoted, b'"client_request_id":' + quoted
        by_client = None
        for p in [self.path, *(self._rotated(i) for i in range(1, self.backups + 1))]:
            found = newest_client = None
            try:
                with open(p, "rb") as f:
                    for line in f:
                        if needle in line:
                            found = line  # the gateway's own id (unique; the last line wins if rewritten)
                        elif client_needle in line:
                            newest_client = line  # the newest with that client x-request-id in this file
            except FileNotFoundError:
                continue
            if found:
                return orjson.loads(found)
            by_client = by_client or newest_client
        return orjson.loads(by_client) if by_client else None


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a pipe such as stdout may take a large batch in parts)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
