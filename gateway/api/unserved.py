"""OpenAI routes the gateway does not serve, each answered with what the gateway does not keep.

The gateway is stateless: it stores no chat completions (`store` is not supported), no responses (every
`POST /v1/responses` goes upstream with `store: false`) and no conversations. OpenAI's SDKs still have methods
for the routes that read or change stored state (`client.chat.completions.list()`, `client.responses.retrieve()`,
`client.conversations.create()`, ...); without this table they got a bare 405 (the path of a POST endpoint) or
"No route" 404, which says nothing about why. Each route here answers 404 in OpenAI's error shape,
`{"error": {"message", "type": "invalid_request_error", "param": null, "code"}}`, naming what is not kept.

Authenticated first, as OpenAI does for its own routes: a request without a valid key gets the 401 (or the
auth-failure 429) it would get on any served route, so only a caller with a key learns more, and a wrong key is
reported as such rather than as a missing feature. Paths that are no OpenAI route at all keep the unauthenticated
"No route" 404 (OpenAI's "Invalid URL" is unauthenticated too). A method OpenAI does not have at one of these
paths is a 405 naming the methods it has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.routing import Route

from gateway.api.endpoints import BY_PATH
from gateway.api.reply import request_id, send_error
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext, RequestHeaders

_CHAT = "This gateway keeps no stored chat completions (store is not supported)"
_RESP = "This gateway keeps no stored responses (store is not supported: every response is created with store: false)"
_CONV = ("This gateway keeps no conversations (the Conversations API stores state): send the whole conversation in "
         "each request's input instead")
_CHAT_CODE = "stored_completions_not_supported"
_RESP_CODE = "stored_responses_not_supported"
_CONV_CODE = "conversations_not_supported"
_ENDPOINT_CODE = "endpoint_not_supported"


@dataclass(frozen=True, slots=True)
class UnservedRoute:
    path: str  # a Starlette path template ({name} matches one path segment)
    methods: dict[str, tuple[str, str]]  # OpenAI's methods at this path -> (message, code) of the 404

    def error(self, method: str) -> GatewayError:
        """The answer to `method` here: a 404 naming what is not kept, or a 405 for a method OpenAI lacks here."""
        hit = self.methods.get(method)
        if hit is None:
            allowed = ", ".join(sorted(self.methods))
            return GatewayError(405, f"Method not allowed; OpenAI's route {self.path} has {allowed}, and this gateway "
                                     "serves none of them.", code="method_not_allowed", headers={"allow": allowed})
        message, code = hit
        return GatewayError(404, message, code=code, type="invalid_request_error")


UNSERVED: tuple[UnservedRoute, ...] = (
    # stored chat completions (OpenAI: only completions created with store: true)
    UnservedRoute("/v1/chat/completions", {
        "GET": (f"{_CHAT}, so there are none to list.", _CHAT_CODE)}),
    UnservedRoute("/v1/chat/completions/{completion_id}", {
        "GET": (f"{_CHAT}, so none can be retrieved.", _CHAT_CODE),
        "POST": (f"{_CHAT}, so none can be updated.", _CHAT_CODE),
        "DELETE": (f"{_CHAT}, so there is none to delete.", _CHAT_CODE)}),
    UnservedRoute("/v1/chat/completions/{completion_id}/messages", {
        "GET": (f"{_CHAT}, so there are no stored messages to list.", _CHAT_CODE)}),
    # the Responses API's routes besides POST /v1/responses (the two fixed paths before /v1/responses/{id})
    UnservedRoute("/v1/responses/input_tokens", {
        "POST": ("This gateway does not serve input token counting for the Responses API "
                 "(POST /v1/responses/input_tokens).", _ENDPOINT_CODE)}),
    UnservedRoute("/v1/responses/compact", {
        "POST": ("This gateway does not serve response compaction (POST /v1/responses/compact).", _ENDPOINT_CODE)}),
    UnservedRoute("/v1/responses/{response_id}", {
        "GET": (f"{_RESP}, so none can be retrieved.", _RESP_CODE),
        "DELETE": (f"{_RESP}, so there is none to delete.", _RESP_CODE)}),
    UnservedRoute("/v1/responses/{response_id}/cancel", {
        "POST": (f"{_RESP} and runs no background responses, so there is none to cancel.", _RESP_CODE)}),
    UnservedRoute("/v1/responses/{response_id}/input_items", {
        "GET": (f"{_RESP}, so no response's input items can be listed.", _RESP_CODE)}),
    # the Conversations API (state the Responses API reads with `conversation`, refused there too)
    UnservedRoute("/v1/conversations", {
        "POST": (f"{_CONV}.", _CONV_CODE)}),
    UnservedRoute("/v1/conversations/{conversation_id}", {
        "GET": (f"{_CONV}.", _CONV_CODE), "POST": (f"{_CONV}.", _CONV_CODE), "DELETE": (f"{_CONV}.", _CONV_CODE)}),
    UnservedRoute("/v1/conversations/{conversation_id}/items", {
        "GET": (f"{_CONV}.", _CONV_CODE), "POST": (f"{_CONV}.", _CONV_CODE)}),
    UnservedRoute("/v1/conversations/{conversation_id}/items/{item_id}", {
        "GET": (f"{_CONV}.", _CONV_CODE), "DELETE": (f"{_CONV}.", _CONV_CODE)}),
)

# the routes at a path the gateway serves with POST (the data plane's endpoint answers its other methods)
ON_SERVED_PATHS: dict[str, UnservedRoute] = {r.path: r for r in UNSERVED if r.path in BY_PATH}


async def answer(gw: Any, route: UnservedRoute, scope: dict[str, Any], headers: RequestHeaders, rid: str
                 ) -> GatewayError:
    """What `route` answers this request: the authentication refusal when there is one (401, or the auth-failure
    429), else its 404 naming what is not kept; a method OpenAI lacks there is its 405 (unauthenticated, as the
    405 of a served path is)."""
    err = route.error(scope["method"])
    if err.status != 404:
        return err
    client = scope.get("client")
    ctx = RequestContext(request_id=rid, endpoint="unserved", headers=headers, body={},
                         client_addr=client[0] if client else "")
    try:
        await gw.auth.run(ctx)
    except GatewayError as refused:
        return refused
    return err


class UnservedEndpoint:
    """The ASGI endpoint of one unserved route (a path the gateway serves no method of)."""

    def __init__(self, gw: Any, route: UnservedRoute) -> None:
        self.gw = gw
        self.route = route

    async def __call__(self, scope, receive, send) -> None:
        headers = RequestHeaders.from_scope(scope)
        rid = request_id(headers)
        await send_error(send, await answer(self.gw, self.route, scope, headers, rid), rid)


def routes(gw: Any) -> list[Route]:
    """Starlette routes for the unserved paths the data plane does not own."""
    return [Route(r.path, UnservedEndpoint(gw, r), methods=None) for r in UNSERVED if r.path not in ON_SERVED_PATHS]
