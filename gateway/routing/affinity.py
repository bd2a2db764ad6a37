"""Session affinity: the session id a request carries and the engine that session last used."""
from __future__ import annotations

from typing import Any

from gateway.pipeline import RequestContext
from gateway.routing.config import RoutingConfig

MAX_SESSIONS = 100_000


def session_id(headers: Any, names: list[str]) -> tuple[str, str] | None:
    """(header, value) of the first affinity header present with a usable id: 1-256 printable ASCII, so the
    affinity map and the audit record only ever hold bounded ids (a longer or binary value is ignored)."""
    if headers is None:
        return None
    for h in names:
        val = headers.get(h)
        if val:
            v = val.strip()
            if 0 < len(v) <= 256 and v.isascii() and v.isprintable():
                return h, v
    return None


def affinity_key(ctx: RequestContext, rc: RoutingConfig) -> str | None:
    """The request's affinity key (tenant|header|id), or None; records the session in the evidence (an id,
    never content). A partner's end user counts as a session: their turns share a prefix too."""
    sess = session_id(ctx.headers, rc.affinity_headers)
    if sess is None and ctx.principal is not None and ctx.principal.end_user:
        sess = ("end_user", ctx.principal.end_user)
    if sess is None:
        return None
    ctx.evidence["session"] = {"header": sess[0], "id": sess[1]}
    return f"{ctx.principal.tenant if ctx.principal else ''}|{sess[0]}|{sess[1]}"


class Affinity(dict[str, str]):
    """affinity key -> engine last used; bounded (the oldest session is forgotten past MAX_SESSIONS)."""

    def remember(self, key: str, engine: str) -> None:
        self[key] = engine
        if len(self) > MAX_SESSIONS:
            self.pop(next(iter(self)))
