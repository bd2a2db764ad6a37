"""Structured JSON logs with request ids. Secrets are never passed to the logger by the code; as a second
line of defence, anything that looks like a bearer token or gateway key is masked before a line is written."""
from __future__ import annotations

import contextvars
import logging
import re
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

import orjson

if TYPE_CHECKING:
    from gateway.pipeline import RequestContext

_SECRET = re.compile(r"(gw_[A-Za-z0-9]+_[A-Za-z0-9_\-]{8,}|Bearer\s+[A-Za-z0-9._\-~+/=]{8,}|eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*)")


# Secrets the config names (static client keys, the admin key, upstream credentials): their literal values
# are masked too, whatever their shape (a static key like "acme-prod-7f3a..." matches no pattern above).
_KNOWN: set[str] = set()
_KNOWN_RE: re.Pattern[str] | None = None
_MIN_KNOWN = 8  # shorter values would mask ordinary words; config validation asks for longer keys anyway


def register_secret(value: str | None) -> None:
    """Mask this exact value in every log line from now on (called where credentials are read)."""
    global _KNOWN_RE
    if not value or len(value) < _MIN_KNOWN or value in _KNOWN:
        return
    _KNOWN.add(value)
    _KNOWN_RE = re.compile("|".join(re.escape(v) for v in sorted(_KNOWN, key=len, reverse=True)))


def redact(text: str) -> str:
    text = _SECRET.sub("[REDACTED]", text)
    return _KNOWN_RE.sub("[REDACTED]", text) if _KNOWN_RE is not None else text


def redact_value(v: Any) -> Any:
    """`redact` applied to every string inside a JSON-like value (log `fields` may nest)."""
    if isinstance(v, str):
        return redact(v)
    if isinstance(v, dict):
        return {k: redact_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [redact_value(x) for x in v]
    return v


# The request being served by the current task (set by ObserveStage.run: one ContextVar.set per request).
current_request: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("gateway_request",
                                                                                       default=None)
_ZR_REDACTED = "[redacted: zero retention]"


def _content_strings(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        if len(value) >= 4:
            out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _content_strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _content_strings(v, out)


def zero_retention_content(ctx: RequestContext | None) -> list[str]:
    """The text a request whose content may not be kept carried (messages/prompt/input, rerank/score texts): zero
    retention, or retention not known yet (no decision: refused or still before the policy stage); [] for others."""
    if ctx is None or ctx.content_retainable:
        return []
    body = ctx.body or {}
    out: list[str] = []
    for k in ("messages", "prompt", "input", "suffix", "instructions", "tools", "query", "documents", "text_1",
              "text_2"):
        if k in body:
            _content_strings(body[k], out)
    return out


class RequestContextFilter(logging.Filter):
    """Adds the current request id to every record and, during a zero-retention request, replaces any
    record whose text quotes the request's content (a second line of defence: the code never logs content)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = current_request.get()
        if ctx is None:
            return True
        if getattr(record, "request_id", None) is None:
            record.request_id = ctx.request_id
        secrets = zero_retention_content(ctx)
        if secrets:
            text = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            exc = record.exc_text or ""
            fields = orjson.dumps(getattr(record, "fields", None), default=str).decode()
            if any(s in text or s in exc or s in fields or (len(s) > 64 and s[:64] in text) for s in secrets):
                record.msg, record.args = _ZR_REDACTED, None
                record.exc_info, record.exc_text, record.fields = None, None, None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                out.setdefault(k, redact_value(v))
        if record.exc_text:
            out["exc"] = redact(record.exc_text)
        elif record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        return orjson.dumps(out).decode()


class PlainRedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


# Paths load balancers, kubelets and Prometheus poll: their access lines are DEBUG, not one INFO line per probe.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Loggers of the HTTP clients the gateway polls engines and partners with (health probes, /metrics scrapes,
# /tokenize, JWKS): httpx logs every request at INFO ("HTTP Request: GET ... 200 OK").
CLIENT_LOGGERS = ("httpx", "httpcore", "aiohttp.client")


def _demote(record: logging.LogRecord) -> bool:
    """Turn an INFO record into a DEBUG one; keep it only when DEBUG is on for its logger."""
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class ProbeAccessFilter(logging.Filter):
    """On uvicorn.access: a probe's or scrape's line (PROBE_PATHS, query string ignored) is DEBUG; every other
    request keeps its INFO line. uvicorn's args are (client, method, path, http version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.levelno == logging.INFO and isinstance(args, tuple) and len(args) >= 3:
            path = str(args[2]).split("?", 1)[0]
            if path in PROBE_PATHS:
                return _demote(record)
        return True


class ClientRequestFilter(logging.Filter):
    """On the HTTP client loggers: their per-request INFO lines (the gateway's own polling of engines' /metrics,
    health, /tokenize) are DEBUG; warnings and errors pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _demote(record) if record.levelno == logging.INFO else True


def configure_logging(level: str = "info", json_logs: bool = True, stream: TextIO | None = None) -> logging.Handler:
    """One handler on the root logger: JSON (or plain) lines, request ids, secrets masked."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    h = logging.StreamHandler(stream or sys.stderr)
    h.addFilter(RequestContextFilter())
    h.setFormatter(JsonFormatter() if json_logs else PlainRedactingFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root.addHandler(h)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers = []
        lg.propagate = True
        lg.setLevel(logging.NOTSET)  # the configured level, not one a uvicorn log_config left behind
    _install(logging.getLogger("uvicorn.access"), ProbeAccessFilter)
    for name in CLIENT_LOGGERS:
        _install(logging.getLogger(name), ClientRequestFilter)
    return h


def _install(logger: logging.Logger, kind: type[logging.Filter]) -> None:
    """Add one filter of this kind to the logger (configure_logging may run more than once)."""
    if not any(isinstance(f, kind) for f in logger.filters):
        logger.addFilter(kind())
