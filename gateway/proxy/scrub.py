"""What of an upstream's error text may reach a client (issue 35, finding 5).

An upstream's error message is the upstream's own text: it can quote the gateway's credential for that
upstream (an echoed Authorization header, a key in a query string, a basic-auth blob), internal URLs, host
names and addresses, and tracebacks. Every upstream error the gateway relays goes through one function,
`Scrubber.client_text`, whatever carries it: an upstream 4xx in the endpoint's error shape (OpenAI's,
Anthropic's on /v1/messages, the Responses API's), an error event in a relayed or translated stream, an error
object inside a 200 body, and therefore batch error files too (the batch lane records the GatewayError or
the JsonResult body the dispatcher produced, gateway/batch/service.py `execute`). An upstream 5xx is never
relayed at all: the dispatcher answers with its own message (gateway/proxy/forward.py `_upstream_status`).

`client_text`:
- masks every configured backend secret (the `api_key_env` / `api_key_file` values, as read, which is what
  is sent), as it is, percent-encoded (either hex case, any of its characters encoded, `+` for a space) and
  base64-encoded (standard and URL-safe alphabets, at each of the three byte alignments, so the secret is also
  found inside a longer encoded blob such as `Basic base64(user:secret)` or `base64("Bearer " + secret)`), and
  anything shaped like a credential (`Bearer ...`, `Basic ...`, gateway keys, JWTs, `sk-...` keys,
  `key=...` / `token: ...` pairs);
- cuts a Python traceback and its frames;
- replaces every URL (any scheme), every configured backend host (url, proxy, kv_events, replay, metrics,
  discovery name; name or IP), every IPv4 address, bracketed IPv6 address, `host:port` and internal DNS name
  (`*.local`, `*.internal`, `*.svc`, ...);
- bounds the result (500 characters, after scrubbing, so a secret cut in half by the bound is already gone).

`secrets` masks only the credentials: the operator's copy of an upstream message in the audit record
(`attempts[].upstream_message`), where internal URLs are useful and no client reads it.
"""
from __future__ import annotations

import base64
import re
from typing import TYPE_CHECKING, Any, Iterable
from urllib.parse import urlsplit

import orjson

from gateway.proxy import sse

if TYPE_CHECKING:
    from gateway.config import BackendConfig

MASK = "[redacted]"
MAX_MESSAGE = 500
MAX_FIELD = 64  # type, code, param of an upstream error object
_MIN_B64 = 8  # shorter base64 fragments of a secret would match ordinary words
PARTIAL = 12  # a run of at least this many characters of a secret (a cut or partial echo) is masked too
_URLSAFE = str.maketrans("+/", "-_")

# credential shapes, whoever's they are (the gateway's log redaction has the same first three)
_TOKENISH = re.compile(
    r"(?i:\bbearer\s+)(?=[A-Za-z._\-~]*[0-9+/=])[A-Za-z0-9._\-~+/=]{8,}"  # a digit or +/=: not a word
    r"|\bgw_[A-Za-z0-9]+_[A-Za-z0-9_\-]{8,}"
    r"|\beyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*"
    r"|\b(?:sk|pk|rk)-[A-Za-z0-9_\-]{16,}")
_BASIC = re.compile(r"(?i:\bbasic\s+)([A-Za-z0-9+/]{6,}={0,2})(?![\w+/=])")  # masked when it decodes to user:password
_CRED_NAMES = r"api[_-]?key|access[_-]?token|auth[_-]?token|secret|password|passwd|authorization"
_KEY_VALUE = re.compile(  # `name=value` for these names and key/token, `name: value` for these names only
    rf"(?i)\b((?:x-)?(?:{_CRED_NAMES}|key|token))(\s*=\s*)(?!\[redacted\])[^\s,;&\"'<>)\]}}]+"
    rf"|(?i:\b((?:x-)?(?:{_CRED_NAMES}))(\s*:\s*))(?!\[redacted\])[^\s,;&\"'<>)\]}}]+")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*", re.S)
_FRAME = re.compile(r"File \"[^\"]*\", line \d+(?:, in \S+)?")
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]{1,15}://[^\s\"'<>`]*")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?::\d{{1,5}})?(?!\.?\d)")
_IPV6 = re.compile(r"\[[0-9A-Fa-f:.%]+\](?::\d{1,5})?")
_HOST_PORT = re.compile(r"(?<![\w.\-])(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z][A-Za-z0-9\-]*"
                        r":\d{1,5}(?!\d)|(?i:\blocalhost\b)(?::\d{1,5})?")
_INTERNAL_NAME = re.compile(r"(?i)(?<![\w.\-])(?:[a-z0-9](?:[a-z0-9\-]*[a-z0-9])?\.)+"
                            r"(?:local|localdomain|internal|intranet|svc|lan|corp|home\.arpa)\b")


def _basic(m: re.Match[str]) -> str:
    v = m.group(1)
    try:
        creds = base64.b64decode(v + "=" * (-len(v) % 4), validate=True)
    except ValueError:
        return m.group(0)
    return MASK if b":" in creds else m.group(0)


def _pct(b: int) -> str:
    return "%" + "".join(f"[{h.lower()}{h}]" if h.isalpha() else h for h in f"{b:02X}")


def _char(c: str) -> str:
    """One character of a secret, as it is or percent-encoded (either hex case), `+` for a space."""
    alts = [re.escape(c), "".join(_pct(b) for b in c.encode())]
    if c == " ":
        alts.append(r"\+")
    return "(?:" + "|".join(alts) + ")"


def _base64_cores(raw: bytes) -> set[str]:
    """The base64 text any encoding of a string containing `raw` contains, at each of the three byte
    alignments: the characters carrying only the secret's bits (the ones shared with a neighbouring byte are
    left off), in both alphabets; and the whole encoding of the secret alone (padded or not)."""
    out: set[str] = set()
    for k in range(3):
        enc = base64.b64encode(b"\0" * k + raw).decode().rstrip("=")[(0, 2, 3)[k]:]
        if (k + len(raw)) % 3:
            enc = enc[:-1]
        if len(enc) >= _MIN_B64:
            out.add(enc)
            out.add(enc.translate(_URLSAFE))
    whole = base64.b64encode(raw).decode()
    out.update({whole, whole.rstrip("="), whole.translate(_URLSAFE), whole.rstrip("=").translate(_URLSAFE)})
    return out


def _hosts(url: str | None) -> set[str]:
    if not url:
        return set()
    try:
        u = urlsplit(url if "://" in url else "tcp://" + url)
        host = u.hostname
    except ValueError:
        return set()
    return {host} if host else set()


class Scrubber:
    """The scrub of one configuration's backends (built by gateway/proxy/upstream.py `Upstreams` from the same
    secret values it sends); `Scrubber()` knows no configured value and applies the generic patterns only."""

    __slots__ = ("_secret_re", "_host_re", "_windows", "_tail")

    def __init__(self, secrets: Iterable[str | None] = (), hosts: Iterable[str] = ()) -> None:
        pats: set[str] = set()
        # every PARTIAL-character window of every secret -> (the secret, where the window starts in it)
        self._windows: dict[str, tuple[str, int]] = {}
        self._tail = 0  # what `bound` drops after its cut: room for the longest secret in its longest encoding
        for s in secrets:
            if not s:
                continue
            self._tail = max(self._tail, 3 * len(s.encode()) + 16)
            for i in range(len(s) - PARTIAL + 1):
                self._windows.setdefault(s[i:i + PARTIAL], (s, i))
            pats.add("".join(_char(c) for c in s))
            pats.update(re.escape(v) for v in _base64_cores(s.encode()) if v)
        self._secret_re = re.compile("|".join(sorted(pats, key=len, reverse=True))) if pats else None
        hs = {h for h in hosts if h and len(h) >= 2}
        self._host_re = (re.compile(r"(?i)(?<![\w.\-])(?:" + "|".join(re.escape(h) for h in
                                                                       sorted(hs, key=len, reverse=True))
                                    + r")(?::\d{1,5})?(?![\w\-]|\.\w)") if hs else None)

    @classmethod
    def for_backends(cls, backends: Iterable[BackendConfig], secrets: Iterable[str | None]) -> "Scrubber":
        """Every secret given (the backends' credentials) and every host a backend's config names."""
        hosts: set[str] = set()
        for b in backends:
            for value in (b.url, b.proxy, b.kv_events, b.replay, b.metrics):
                hosts |= _hosts(value)
            if b.discovery is not None and b.discovery.dns:
                hosts.add(b.discovery.dns)
        return cls(secrets, hosts)

    # -- text
    def secrets(self, text: str) -> str:
        """`text` with every configured secret (in any of its encodings) and credential-shaped token masked."""
        if self._secret_re is not None:
            text = self._secret_re.sub(MASK, text)
        if self._windows:
            text = self._partials(text)
        text = _BASIC.sub(_basic, _TOKENISH.sub(MASK, text))
        return _KEY_VALUE.sub(lambda m: (m.group(1) or m.group(3)) + (m.group(2) or m.group(4)) + MASK, text)

    def _partials(self, text: str) -> str:
        """Mask every run of at least PARTIAL consecutive characters of a secret (a prefix cut by an upstream's
        own bound, a fragment): found by its first window, extended while it goes on matching the secret."""
        windows, start, k = self._windows, 0, 0
        out: list[str] = []
        while k <= len(text) - PARTIAL:
            hit = windows.get(text[k:k + PARTIAL])
            if hit is None:
                k += 1
                continue
            secret, i = hit
            end, j = k + PARTIAL, i + PARTIAL
            while end < len(text) and j < len(secret) and text[end] == secret[j]:
                end, j = end + 1, j + 1
            out += (text[start:k], MASK)
            start = k = end
        out.append(text[start:])
        return "".join(out)

    def bound(self, text: str, n: int) -> str:
        """`text` cut to about `n` characters before scrubbing (the scan is per character): when it is cut, the
        last stretch that could hold the start of a secret cut in two goes too, so no fragment survives it."""
        if len(text) <= n:
            return text
        return text[:max(0, n - self._tail)]

    def client_text(self, text: str, limit: int = MAX_MESSAGE, fallback: str = "The upstream refused the request."
                    ) -> str:
        """An upstream's error text as a client may see it (see the module docstring): no secret, traceback,
        URL, host or address of the upstream's; at most `limit` characters; `fallback` when nothing is left."""
        text = self.secrets(self.bound(text, max(4 * limit, 2048)))
        text = _TRACEBACK.sub("[traceback removed]", text)
        text = _FRAME.sub("[frame removed]", text)
        text = _URL.sub("[url]", text)
        if self._host_re is not None:
            text = self._host_re.sub("[host]", text)
        text = _IPV6.sub("[host]", _IPV4.sub("[host]", text))
        text = _INTERNAL_NAME.sub("[host]", _HOST_PORT.sub("[host]", text))
        text = text.strip()[:limit]
        return text or fallback

    def field(self, v: Any) -> str | None:
        """A short string field of an upstream error object (type, code, param), scrubbed; None otherwise."""
        if not isinstance(v, str) or not 0 < len(v) <= MAX_FIELD:
            return None
        out = self.client_text(v, MAX_FIELD, "")
        return out or None

    # -- error objects in bodies and stream events
    def error_object(self, err: dict[str, Any], server_message: str | None) -> dict[str, Any]:
        """An upstream error object with its message scrubbed (or replaced by `server_message` when the
        error says it is the upstream's own failure and a replacement is given), its short string fields
        scrubbed, anything else of the upstream's dropped."""
        out: dict[str, Any] = {}
        msg = err.get("message")
        if server_message is not None and _server_side(err):
            out["message"] = server_message
        else:
            out["message"] = self.client_text(msg if isinstance(msg, str) else "", fallback="upstream error")
        for k in ("type", "code", "param"):
            if k in err:
                v = err[k]
                out[k] = v if v is None or (isinstance(v, int) and not isinstance(v, bool)) else self.field(v)
        return out

    def scrub_errors(self, obj: Any, server_message: str | None, depth: int = 0) -> Any:
        """`obj` (a parsed body or event) with every error object in it scrubbed: the value of an `error` key
        (an object or a string), and an object whose `type` (the Responses API's error event) or `object`
        (vLLM's ErrorResponse) is `error`;
        at most 6 levels deep (errors sit near the top; no recursion on a deep body)."""
        if depth > 6:
            return obj
        if isinstance(obj, dict):
            out: dict[str, Any] = {}
            if (obj.get("type") == "error" or obj.get("object") == "error") and isinstance(obj.get("message"), str):
                obj = {**obj, **self.error_object(obj, server_message)}
            for k, v in obj.items():
                if k == "error" and isinstance(v, dict):
                    out[k] = self.error_object(v, server_message)
                elif k == "error" and isinstance(v, str):
                    out[k] = (server_message if server_message is not None else
                              self.client_text(v, fallback="upstream error"))
                elif isinstance(v, (dict, list)):
                    out[k] = self.scrub_errors(v, server_message, depth + 1)
                else:
                    out[k] = v
            return out
        if isinstance(obj, list):
            return [self.scrub_errors(v, server_message, depth + 1) for v in obj]
        return obj

    def json_body(self, body: bytes) -> bytes:
        """A 200 JSON body as the client gets it: unchanged unless it carries an error object (a Responses API
        `status: failed` response, a partner's error inside a 200), which is scrubbed."""
        if b'"error"' not in body:
            return body
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        new = self.scrub_errors(obj, UPSTREAM_FAILED)
        return body if new == obj else _dumps(new)

    def event(self, ev: bytes) -> bytes:
        """One SSE event (without its blank line) as the client gets it: unchanged unless it carries an error
        object, whose message is scrubbed (a client-side error: 4xx code or type) or replaced by the
        gateway's own (anything else: the upstream failed)."""
        if b'"error"' not in ev:
            return ev
        data = sse.event_data(ev)
        if data is None:
            return ev
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return ev if self._secret_re is None else self.secrets(ev.decode("utf-8", "replace")).encode()
        new = self.scrub_errors(obj, UPSTREAM_FAILED)
        if new == obj:
            return ev
        lines = [ln for ln in ev.split(b"\n") if not ln.startswith(b"data:")]
        return b"\n".join([*lines, b"data: " + _dumps(new)])


UPSTREAM_FAILED = "The upstream failed while serving this request."


def _dumps(obj: Any) -> bytes:
    """A scrubbed body or event; one nested deeper than orjson writes (255 levels) is replaced whole."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return orjson.dumps({"error": {"message": UPSTREAM_FAILED, "type": "upstream_error", "param": None,
                                       "code": "upstream_error"}})
# error types that say the request was refused as the client sent it (OpenAI's, vLLM's, Anthropic's)
_CLIENT_TYPES = frozenset({"invalid_request_error", "BadRequestError", "not_found_error", "NotFoundError",
                           "request_too_large", "UnprocessableEntityError", "context_length_exceeded"})


def _server_side(err: dict[str, Any]) -> bool:
    """Does this upstream error object say the upstream failed (5xx, or nothing that says it is the client's)?"""
    for k in ("code", "status", "status_code"):
        v = err.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return not 400 <= v < 500
    for k in ("type", "code"):
        v = err.get(k)
        if isinstance(v, str) and v in _CLIENT_TYPES:
            return False
    return True


GENERIC = Scrubber()
