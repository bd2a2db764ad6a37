"""The `authenticate` pipeline stage: ties each request to a Principal and enforces key-level model limits."""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import Principal

if TYPE_CHECKING:
    from gateway.identity.service import IdentityService


def model_allowed(principal: Principal, model: str, chain: tuple[str, ...] = ()) -> bool:
    """True if the key has no model restriction, or the requested name (or every model it resolves to)
    matches one of its glob patterns. The one owner of a key's model list: the policy stage does not check it
    again (it used to, on the alias name only, and refused an alias whose every target the key allows)."""
    pats = principal.allowed_models
    if not pats or not model:
        return True
    if any(fnmatchcase(model, p) for p in pats):
        return True
    return bool(chain) and all(any(fnmatchcase(m, p) for p in pats) for m in chain)


class AuthStage:
    name = "authenticate"

    def __init__(self, service: IdentityService) -> None:
        self.service = service

    async def run(self, ctx: RequestContext) -> None:
        if ctx.batch is not None and ctx.principal is not None:
            # a batch line runs as its job's owner, re-checked now (a revoked key stops its batch). ctx.batch
            # is set only in-process by the batch lane (gateway/batch), never from a client's request.
            p = await self.service.recheck(ctx.principal, ctx.batch.get("principal_valid_until"))
        else:
            p = await self.service.authenticate(ctx.headers, ctx.client_addr)
        ctx.principal = p
        ctx.evidence["principal"] = p.to_evidence()
        if not model_allowed(p, ctx.model, ctx.model_chain):
            raise GatewayError(403, f"This key may not use model {ctx.model!r}.", code="model_not_allowed",
                               param="model")

