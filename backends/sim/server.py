"""vLLM's OpenAI-compatible HTTP surface for one simulated engine (Starlette app + in-process uvicorn).

Shapes follow vLLM's `vllm/entrypoints/openai` (chat/completions with streaming and include_usage,
prompt_tokens_details.cached_tokens, cache_salt, priority, /tokenize, /detokenize, /v1/models, /health,
/metrics, /reset_prefix_cache) and errors are vLLM's `{"error": {message, type, param, code}}`. Extra
`/sim/*` admin routes inject faults. The first streamed chunk is written the moment the first token exists;
later tokens go out in coarse chunks every `stream_interval_s`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import socket
import time
import uuid
from typing import Any, AsyncIterator, Iterator

import orjson
import uvicorn
import xxhash
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from backends.sim import anthropic_api, audio_api, extra_api, sglang_api
from backends.sim.engine import EngineDead, SimEngine
from backends.sim.http import ApiError, json_response, read_body
from backends.sim.lora import LoraConfig, LoraError, LoraState
from backends.sim.metrics import make_registry, render
from backends.sim.scheduler import SimRequest
from backends.sim.tokenizer import render_chat

log = logging.getLogger(__name__)

_SALT_BAD = set("@/\\\x00")
SYSTEM_FINGERPRINT = "vllm-0.32.0-sim"


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _Server(uvicorn.Server):
    """uvicorn without signal capture: several run in one loop and the CLI owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class EngineServer:
    """One engine and its HTTP server; crash/restart take both down and up like a process would."""

    def __init__(self, engine: SimEngine, host: str = "127.0.0.1", port: int = 0, *,
                 lora_modules: list[str] | None = None, enable_prompt_tokens_details: bool = True,
                 log_level: str = "warning", location: dict[str, Any] | None = None,
                 lora: LoraConfig | None = None) -> None:
        self.engine = engine
        self.host = host
        self.port = port
        self.lora = LoraState(engine.model, list(lora_modules or []), lora)  # backends/sim/lora.py
        engine.set_max_loras(lora.max_loras if lora is not None else None, lora.cache_size if lora is not None else None,
                             lora.load_s if lora is not None else 0.0)
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.log_level = log_level
        self.location = location
        self.registry = make_registry(engine)
        self.app = self._build_app()
        self._server: _Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._rng = random.Random(hash(engine.name) & 0xFFFF)
        self._restart_task: asyncio.Task[None] | None = None
        self.crashed = False

    # ------------------------------------------------------------------ addresses
    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        await self.engine.start()
        await self._start_http()
        self.crashed = False

    async def _start_http(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(self.app, lifespan="off", log_level=self.log_level, access_log=False,
                             timeout_graceful_shutdown=1, timeout_keep_alive=30)
        self._server = _Server(cfg)
        self._serve_task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.005)

    async def _stop_http(self, abrupt: bool) -> None:
        srv, task = self._server, self._serve_task
        self._server = self._serve_task = None
        if srv is None or task is None:
            return
        srv.should_exit = True
        if abrupt:
            srv.force_exit = True
            for conn in list(srv.server_state.connections):
                transport = getattr(conn, "transport", None)
                if transport is not None:
                    transport.abort()  # peers see a reset, as when a process dies
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task

    async def stop(self) -> None:
        if self._restart_task is not None:
            self._restart_task.cancel()
        await self.engine.stop()
        await self._stop_http(abrupt=True)

    async def crash(self, restart_after_s: float | None = None) -> None:
        """Die now (connections reset, sockets closed, state lost); come back after restart_after_s if given."""
        self.crashed = True
        await self._stop_http(abrupt=True)
        await self.engine.stop()
        if restart_after_s is not None:
            async def later() -> None:
                await asyncio.sleep(restart_after_s)
                await self.restart()
            self._restart_task = asyncio.get_running_loop().create_task(later())

    async def restart(self) -> None:
        """A fresh process on the same ports: empty cache, seq from 0."""
        await self.engine.restart()
        self.lora.clear()
        if self._server is None:
            await self._start_http()
        self.crashed = False

    # ------------------------------------------------------------------ app
    def _build_app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self._wrap(self.chat), methods=["POST"]),
            Route("/v1/completions", self._wrap(self.completions), methods=["POST"]),
            Route("/v1/embeddings", self._wrap(self.embeddings), methods=["POST"]),
            Route("/v1/messages", self._wrap(lambda r: anthropic_api.messages(self, r)), methods=["POST"]),
            Route("/v1/responses", self._wrap(lambda r: extra_api.responses(self, r)), methods=["POST"]),
            Route("/v1/rerank", self._wrap(lambda r: extra_api.rerank(self, r)), methods=["POST"]),
            Route("/v1/score", self._wrap(lambda r: extra_api.score(self, r)), methods=["POST"]),
            Route("/v1/audio/transcriptions", self._wrap(lambda r: audio_api.transcriptions(self, r)),
                  methods=["POST"]),
            Route("/v1/models", self._wrap(self.models), methods=["GET"]),
            Route("/v1/load_lora_adapter", self._wrap(self.load_lora), methods=["POST"]),
            Route("/v1/unload_lora_adapter", self._wrap(self.unload_lora), methods=["POST"]),
            Route("/tokenize", self._wrap(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._wrap(self.detokenize), methods=["POST"]),
            Route("/health", self._wrap(self.health), methods=["GET"]),
            Route("/metrics", self._wrap(self.metrics), methods=["GET"]),
            Route("/version", self._wrap(self.version), methods=["GET"]),
            Route("/reset_prefix_cache", self._wrap(self.reset_prefix_cache), methods=["POST"]),
            Route("/sim/faults", self._wrap(self.faults), methods=["GET", "POST"]),
            Route("/sim/restart", self._wrap(self.restart_route), methods=["POST"]),
            Route("/sim/state", self._wrap(self.state), methods=["GET"]),
            Route("/sim/costs", self._wrap(self.costs), methods=["GET"]),
        ]
        if self.engine.present_as == "sglang":  # SGLang's own routes (backends/sim/sglang_api.py)
            routes += [Route("/v1/tokenize", self._wrap(self.tokenize), methods=["POST"]),
                       Route("/flush_cache", self._wrap(lambda r: sglang_api.flush_cache(self, r)),
                             methods=["GET", "POST"])]
        return Starlette(routes=routes)

    def _wrap(self, fn: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            sgl = self.engine.present_as == "sglang"
            try:
                return await fn(request)
            except (ApiError, sglang_api.SGLangError) as e:
                return sglang_api.error_response(e.status, e.message, e.param) if sgl else \
                    ApiError(e.status, e.message, e.param).response()
            except EngineDead:
                msg = "engine died while handling the request"
                return sglang_api.error_response(500, msg) if sgl else ApiError(500, msg).response()
        return endpoint

    # ------------------------------------------------------------------ request parsing
    def _resolve_model(self, model: Any) -> str | None:
        """The LoRA adapter a model name selects (None for the base model); 404 for unknown names."""
        e = self.engine
        if e.present_as == "sglang":
            return sglang_api.resolve_model(self, model)
        if model is None or model == e.model:
            return None
        if isinstance(model, str) and self.lora.has(model):
            return model
        raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {e.model}.", "model")  # vLLM 0.32

    def _common(self, body: dict[str, Any]) -> dict[str, Any]:
        salt = body.get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str) or not salt or len(salt) > 128 or any(c in _SALT_BAD for c in salt):
                raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
                                    "without '@', '/', '\\' or NUL.", "cache_salt")
        prio = body.get("priority", 0)
        if not isinstance(prio, int) or isinstance(prio, bool):
            raise ApiError(400, "priority must be an integer", "priority")
        if prio != 0 and not self.engine.priority_policy and self.engine.present_as != "sglang":
            raise ApiError(400, f"Got priority {prio} != 0 but Priority scheduling is not enabled.", "priority")
        n = body.get("n", 1)
        if n != 1:
            raise ApiError(400, "the simulator supports n=1 only", "n")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object", "stream_options")
        return {"cache_salt": salt, "priority": prio, "stream": bool(body.get("stream", False)),
                "include_usage": bool(so.get("include_usage", False)), "lora": self._resolve_model(body.get("model"))}

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, seed: int) -> tuple[int, str]:
        mml = self.engine.profile.max_model_len
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if prompt_len >= mml:
            raise ApiError(400, f"This model's maximum context length is {mml} tokens. However, your request has "
                                f"{prompt_len} input tokens. Please reduce the length of the input messages.")
        if mt is None:
            # No EOS in a simulator: pick a deterministic "natural" length and finish with "stop".
            return max(1, min(16 + seed % 113, mml - prompt_len)), "stop"
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise ApiError(400, "max_tokens must be an integer >= 1", "max_tokens")
        if prompt_len + mt > mml:
            raise ApiError(400, f"This model's maximum context length is {mml} tokens. However, you requested "
                                f"{prompt_len + mt} tokens ({prompt_len} in the messages, {mt} in the completion). "
                                f"Please reduce the length of the messages or completion.", "max_tokens")
        return mt, "length"

    async def _gate(self) -> None:
        """HTTP-level faults: hang, then random 500s."""
        await self.engine.wait_unhung()
        rate = self.engine.faults.error_rate
        if rate > 0 and self._rng.random() < rate:
            raise ApiError(500, "simulated engine error (fault injection)")

    def _submit(self, ids: list[int], body: dict[str, Any], c: dict[str, Any]) -> SimRequest:
        seed = body.get("seed")
        if not isinstance(seed, int):
            seed = xxhash.xxh32_intdigest(repr(ids[-64:]).encode())
        mt, reason = self._max_tokens(body, len(ids), seed)
        return self.engine.submit(ids, mt, stop_reason=reason, cache_salt=c["cache_salt"], lora_name=c["lora"],
                                  priority=c["priority"], seed=seed)

    def _usage(self, req: SimRequest, stream: bool = False) -> dict[str, Any]:
        """vLLM 0.32's usage; in streams fields that are None are left out (as captured). SGLang's UsageInfo."""
        if self.engine.present_as == "sglang":
            return sglang_api.usage(self, req)
        u: dict[str, Any] = {"prompt_tokens": req.prompt_len, "total_tokens": req.prompt_len + req.num_output,
                             "completion_tokens": req.num_output}
        if self.enable_prompt_tokens_details:
            cached = max(req.num_cached_tokens, 0)
            bs = self.engine.profile.block_size
            created = max(0, (req.prompt_len // bs) * bs - cached) if self.engine.enable_prefix_caching else 0
            d: dict[str, Any] = {"cached_tokens": cached, "created_cache_tokens": created}
            if not stream:
                d["multimodal_tokens"] = None
            u["prompt_tokens_details"] = d
        if not stream:
            u["completion_tokens_details"] = None
        return u

    def _text(self, req: SimRequest, start: int, end: int) -> str:
        p = req.prompt_len
        return self.engine.tokenizer.decode(req.tokens[p + start:p + end])

    # ------------------------------------------------------------------ generation routes
    async def chat(self, request: Request) -> Response:
        body = await read_body(request)
        c = self._common(body)
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            raise ApiError(400, "messages must be a list of messages", "messages")
        try:
            text = render_chat(msgs, bool(body.get("add_generation_prompt", True)),
                               bool(body.get("continue_final_message", False)))
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = self.engine.tokenizer.encode(text)
        await self._gate()
        req = self._submit(ids, body, c)
        req.external_id = request.headers.get("x-request-id")
        model = body.get("model") or self.engine.model
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if c["stream"]:
            return StreamingResponse(self._stream(req, rid, created, model, c["include_usage"], chat=True),
                                     media_type="text/event-stream")
        await self._await(req, req.listener.done)
        return json_response({"id": rid, "object": "chat.completion", "created": created, "model": model,
                              "choices": [{"index": 0, "message": {"role": "assistant",
                                                                   "content": self._text(req, 0, req.num_output),
                                                                   "refusal": None, "annotations": None, "audio": None,
                                                                   "function_call": None, "reasoning": None},
                                           "logprobs": None, "finish_reason": req.finish_reason, "stop_reason": None,
                                           "token_ids": None, "routed_experts": None}],
                              "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
                              "usage": self._usage(req), "prompt_logprobs": None, "prompt_token_ids": None,
                              "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
                              "metrics": None})

    async def completions(self, request: Request) -> Response:
        body = await read_body(request)
        c = self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
        if not ids:
            raise ApiError(400, "prompt must not be empty", "prompt")
        await self._gate()
        req = self._submit(ids, body, c)
        req.external_id = request.headers.get("x-request-id")
        model = body.get("model") or self.engine.model
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if c["stream"]:
            return StreamingResponse(self._stream(req, rid, created, model, c["include_usage"], chat=False),
                                     media_type="text/event-stream")
        await self._await(req, req.listener.done)
        return json_response({"id": rid, "object": "text_completion", "created": created, "model": model,
                              "choices": [{"index": 0, "text": self._text(req, 0, req.num_output), "logprobs": None,
                                           "finish_reason": req.finish_reason, "stop_reason": None,
                                           "prompt_logprobs": None, "token_ids": None}],
                              "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
                              "usage": self._usage(req), "kv_transfer_params": None})

    async def _await(self, req: SimRequest, fut: asyncio.Future[None]) -> None:
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            self.engine.abort(req)
            raise

    async def _stream(self, req: SimRequest, rid: str, created: int, model: str, include_usage: bool,
                      chat: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        interval = self.engine.profile.stream_interval_s

        def chunk(text: str, finish: str | None, first: bool = False) -> bytes:
            if chat:
                delta: dict[str, Any] = {"content": text} if text or finish is None else {}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
                out = _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})
                if first:  # vLLM sends the role in its own chunk right before the first content
                    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}
                    out = _sse({"id": rid, "object": obj, "created": created, "model": model,
                                "choices": [role], "prompt_token_ids": None, "prompt_text": None}) + out
                return out
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

        w = req.listener
        finished = False
        try:
            await w.first
            sent = req.num_output
            if w.done.done():  # done at the first token: the token and finish_reason share one chunk
                w.done.result()
                finished = True
                yield chunk(self._text(req, 0, sent), req.finish_reason, first=True)
            else:
                yield chunk(self._text(req, 0, sent), None, first=True)
                while not w.done.done():
                    await asyncio.wait((w.done,), timeout=interval)
                    n = req.num_output
                    if w.done.done():
                        break
                    if n > sent:
                        yield chunk(self._text(req, sent, n), None)
                        sent = n
                w.done.result()  # raises EngineDead if the engine died: the connection drops
                finished = True
                yield chunk(self._text(req, sent, req.num_output), req.finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": self._usage(req, stream=True), "system_fingerprint": SYSTEM_FINGERPRINT})
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.engine.abort(req)

    async def embeddings(self, request: Request) -> Response:
        body = await read_body(request)
        c = self._common(body)
        inp = body.get("input")
        tok = self.engine.tokenizer
        if isinstance(inp, str):
            inputs = [tok.encode(inp)]
        elif isinstance(inp, list) and inp and all(isinstance(x, str) for x in inp):
            inputs = [tok.encode(x) for x in inp]
        elif isinstance(inp, list) and inp and all(isinstance(x, int) for x in inp):
            inputs = [list(inp)]
        elif isinstance(inp, list) and inp and all(isinstance(x, list) for x in inp):
            inputs = [list(x) for x in inp]
        else:
            raise ApiError(400, "input must be a string, a list of strings or token ids", "input")
        if any(not ids for ids in inputs):
            raise ApiError(400, "input must not be empty", "input")
        dims = body.get("dimensions") or 64
        if not isinstance(dims, int) or dims < 1 or dims > 4096:
            raise ApiError(400, "dimensions must be an integer in [1, 4096]", "dimensions")
        await self._gate()
        reqs = [self.engine.submit(ids, 1, cache_salt=c["cache_salt"], lora_name=c["lora"], priority=c["priority"])
                for ids in inputs]
        for r in reqs:
            await self._await(r, r.listener.done)
        data = []
        for i, ids in enumerate(inputs):
            rng = random.Random(xxhash.xxh64_intdigest(repr(ids).encode()))
            v = [rng.gauss(0.0, 1.0) for _ in range(dims)]
            norm = math.sqrt(sum(x * x for x in v)) or 1.0
            data.append({"object": "embedding", "index": i, "embedding": [x / norm for x in v]})
        n = sum(len(x) for x in inputs)
        return json_response({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": body.get("model") or self.engine.model, "data": data,
                              "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                        "prompt_tokens_details": None}})

    # ------------------------------------------------------------------ other vLLM routes
    async def models(self, request: Request) -> Response:
        e = self.engine
        created = int(e.started_at)

        def card(mid: str, parent: str | None) -> dict[str, Any]:
            return {"id": mid, "object": "model", "created": created, "owned_by": "vllm", "root": mid,
                    "parent": parent, "max_model_len": e.profile.max_model_len,
                    "permission": [{"id": f"modelperm-{mid}", "object": "model_permission", "created": created,
                                    "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                    "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                    "organization": "*", "group": None, "is_blocking": False}]}
        cards = [card(e.model, None)]
        for name, root in self.lora.names():
            cards.append({**card(name, e.model), "root": root})
        return json_response({"object": "list", "data": cards})

    async def load_lora(self, request: Request) -> Response:
        """vLLM's runtime LoRA loading (backends/sim/lora.py); without runtime updating the route is absent."""
        if not self.lora.runtime:
            raise ApiError(404, "Not Found")
        try:
            body = await read_body(request)
            msg = await self.lora.load(body)
        except LoraError as e:
            return json_response(e.body(), e.status)
        self.engine.sched.lora_warm(body["lora_name"])  # read into memory by the load
        return Response(msg, 200)  # vLLM answers the bare success line

    async def unload_lora(self, request: Request) -> Response:
        if not self.lora.runtime:
            raise ApiError(404, "Not Found")
        try:
            body = await read_body(request)
            msg = self.lora.unload(body)
        except LoraError as e:
            return json_response(e.body(), e.status)
        self.engine.sched.lora_cache.pop(body["lora_name"], None)
        return Response(msg, 200)  # vLLM answers the bare success line

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request)
        if self.engine.present_as == "sglang":
            return sglang_api.tokenize(self, body)
        self._resolve_model(body.get("model"))
        tok = self.engine.tokenizer
        if "messages" in body:
            try:
                text = render_chat(body["messages"], bool(body.get("add_generation_prompt", True)),
                                   bool(body.get("continue_final_message", False)))
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "either prompt (a string) or messages is required", "prompt")
        ids, pieces = tok.encode_with_pieces(text)
        return json_response({"count": len(ids), "max_model_len": self.engine.profile.max_model_len, "tokens": ids,
                              "token_strs": pieces if body.get("return_token_strs") else None})

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request)
        self._resolve_model(body.get("model"))
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise ApiError(400, "tokens must be a list of integers", "tokens")
        return json_response({"prompt": self.engine.tokenizer.decode(toks)})

    async def health(self, request: Request) -> Response:
        await self.engine.wait_unhung()
        if not self.engine.alive:
            raise ApiError(503, "engine is not running")
        return Response(b"", 200)

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(self, request: Request) -> Response:
        return json_response({"version": "0.32.0+sim"})

    async def reset_prefix_cache(self, request: Request) -> Response:
        e = self.engine
        if request.query_params.get("reset_running_requests", "").lower() == "true":
            for r in list(e.sched.running):
                e.sched._preempt(r)
        ok = e.reset_prefix_cache()
        return Response(b"", 200, headers={"x-sim-reset": "ok" if ok else "refused-blocks-in-use"})

    # ------------------------------------------------------------------ admin
    async def state(self, request: Request) -> Response:
        snap = self.engine.snapshot()
        snap.update({"url": self.url, "crashed": self.crashed, "location": self.location})
        return json_response(snap)

    async def costs(self, request: Request) -> Response:
        """Sim only: each finished or aborted request's true engine seconds (its share of every step it was
        in), keyed by the x-request-id it was sent with (else the engine's own id); what per-request
        apportioning is checked against (bench/cost_apportion.py)."""
        return json_response({"engine": self.engine.name, "costs": dict(self.engine.costs)})

    async def faults(self, request: Request) -> Response:
        e = self.engine
        if request.method == "POST":
            body = await read_body(request)
            f = e.faults
            for key, typ in (("event_delay_ms", float), ("event_loss", float), ("slow_factor", float),
                             ("error_rate", float), ("hang", bool)):
                if key in body:
                    try:
                        setattr(f, key, typ(body[key]))
                    except (TypeError, ValueError):
                        raise ApiError(400, f"{key} must be a {typ.__name__}", key) from None
            if not 0.0 <= f.event_loss <= 1.0 or not 0.0 <= f.error_rate <= 1.0 or f.slow_factor <= 0:
                raise ApiError(400, "event_loss and error_rate must be in [0, 1], slow_factor > 0")
            e.apply_faults()
            if body.get("crash"):
                delay = body.get("restart_after_s", 3.0)
                loop = asyncio.get_running_loop()
                loop.call_later(0.05, lambda: loop.create_task(self.crash(None if delay is None else float(delay))))
        return json_response(e.faults.as_dict())

    async def restart_route(self, request: Request) -> Response:
        asyncio.get_running_loop().call_later(0.01, lambda: asyncio.get_running_loop().create_task(self.restart()))
        return json_response({"restarting": True, "generation": self.engine.generation + 1})
