"""The simulator presenting itself as SGLang (`--present-as sglang`, `SimEngine.present_as == "sglang"`).

Where the gateway reads an engine, an engine presenting as SGLang answers as SGLang 0.5.23 does (shapes read in
sglang/srt/entrypoints/http_server.py, entrypoints/openai/protocol.py, serving_base.py, serving_tokenize.py and
usage_processor.py; no code taken from them):
- errors: the legacy top-level `ErrorResponse` `{"object": "error", "message", "type", "param", "code": <status>}`;
- `priority`: never refused (ignored without priority scheduling; with it, higher values run first: the engine
  stores the value negated, backends/sim/engine.py `submit`);
- LoRA: an adapter is selected as `model: "<base>:<adapter>"`; a name without a colon is the base model (SGLang
  checks no model name), an unknown adapter is a 400;
- /tokenize and /v1/tokenize: exactly one of `prompt` / `messages`; messages are rendered as for a chat
  completion unless `add_generation_prompt` is given; the answer is `{tokens, count, max_model_len}`;
- usage: `{prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details, reasoning_tokens}` with
  `prompt_tokens_details: {cached_tokens}` only under --enable-cache-report (the sim's
  enable_prompt_tokens_details), else null;
- /flush_cache resets the prefix cache; /metrics and the KV events in SGLang's names and wire
  (backends/sim/metrics.py, backends/sim/kv_wire.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from backends.sim.tokenizer import render_chat

if TYPE_CHECKING:
    from backends.sim.scheduler import SimRequest
    from backends.sim.server import EngineServer

_ERR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError", 503: "ServiceUnavailable"}


class SGLangError(Exception):
    """An error answered in SGLang's shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> Response:
    body = {"object": "error", "message": message, "type": _ERR_TYPES.get(status, "BadRequestError"),
            "param": param, "code": status}
    return Response(orjson.dumps(body), status, media_type="application/json")


def resolve_model(server: "EngineServer", model: Any) -> str | None:
    """The adapter `<base>:<adapter>` selects (serving_base `_parse_model_parameter`), else None (the base)."""
    base = server.engine.model
    if not isinstance(model, str) or ":" not in model or model == base:
        return None
    adapter = (model[len(base) + 1:] if model.startswith(base + ":") else model.split(":", 1)[1]).strip()
    if adapter and server.lora.has(adapter):
        return adapter
    raise SGLangError(400, f"LoRA adapter '{adapter}' was not found.", "model")


def usage(server: "EngineServer", req: "SimRequest") -> dict[str, Any]:
    return {"prompt_tokens": req.prompt_len, "total_tokens": req.prompt_len + req.num_output,
            "completion_tokens": req.num_output,
            "prompt_tokens_details": ({"cached_tokens": max(req.num_cached_tokens, 0)}
                                      if server.enable_prompt_tokens_details else None),
            "reasoning_tokens": 0}


def tokenize(server: "EngineServer", body: dict[str, Any]) -> Response:
    eng = server.engine
    resolve_model(server, body.get("model"))
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise SGLangError(400, "Exactly one of 'prompt' or 'messages' must be provided.")
    if body.get("messages") is not None:
        agp = body.get("add_generation_prompt")
        try:
            text = render_chat(body["messages"], True if agp is None else bool(agp),
                               bool(body.get("continue_final_message", False)))
        except ValueError as e:
            raise SGLangError(400, str(e), "messages") from None
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise SGLangError(400, "the simulator tokenizes one prompt (a string)", "prompt")
    ids = eng.tokenizer.encode(text)
    return Response(orjson.dumps({"tokens": ids, "count": len(ids), "max_model_len": eng.profile.max_model_len}),
                    200, media_type="application/json")


async def flush_cache(server: "EngineServer", request: Request) -> Response:
    """SGLang's /flush_cache: 200 when the cache was flushed, 400 while requests hold it."""
    ok = server.engine.reset_prefix_cache()
    if ok:
        return Response(b"Cache flushed.\n", 200)
    return Response(b"Cache not flushed. Please check if there are pending requests.\n", 400)
