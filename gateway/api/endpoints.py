"""The endpoint table: every inference API the gateway serves, one `Endpoint` entry each.

An entry says everything the request path needs to know about one API: its path, its body's media type (JSON or
a multipart form: how the ingress reads it and the exchange writes it upstream, gateway/api/media.py) and size
limit, the parser that validates a body (gateway/api/parse.py: against its Struct in gateway/api/bodies.py,
which is also its schema in /openapi.json), the upstream path on an engine speaking it natively, the wire rules
of its responses and errors (gateway/api/wire/), the body field a max-tokens cap goes into and the engine's
default when the client sends none, whether it generates tokens at all, its OpenTelemetry operation name, the
parameter that carries the prompt (named in context errors) and the prompt as text for routing.

Adding an endpoint: one entry here, its body Struct and a parser, and its wire rules when its wire is new
(docs/architecture.md); a multipart one names `media=FORM` (/v1/audio/transcriptions: gateway/api/parse_audio.py,
wire/audio.py). Stages read `ctx.ep` (this entry); none compares endpoint names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from msgspec import Struct

from gateway.api import bodies, parse
from gateway.api.media import FORM, JSON, Media
from gateway.api.parse_audio import FORM_OVERHEAD_BYTES, MAX_FILE_BYTES, parse_transcription
from gateway.api.parse_messages import as_chat, parse_messages
from gateway.api.wire.anthropic import ANTHROPIC
from gateway.api.wire.audio import TRANSCRIPTION
from gateway.api.wire.base import ClientWire
from gateway.api.wire.openai import OPENAI
from gateway.api import parse_pooling, parse_responses
from gateway.api.wire.pooling import POOLING
from gateway.api.wire.responses import RESPONSES
from gateway.telemetry.render import render_messages_plain


def _messages_text(body: dict[str, Any]) -> str:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return ""
    return render_messages_plain([m for m in msgs if isinstance(m, dict)])


def _anthropic_text(body: dict[str, Any]) -> str:
    """An Anthropic Messages prompt as text: the chat an engine renders for it (`system` first)."""
    return _messages_text(as_chat(body))


def _field_text(name: str) -> Callable[[dict[str, Any]], str]:
    def text(body: dict[str, Any]) -> str:
        p = body.get(name, "")
        return p if isinstance(p, str) else "".join(map(str, p)) if isinstance(p, list) else str(p)

    return text


def _chat_max_tokens_key(body: dict[str, Any]) -> str:
    """Chat accepts either name: a cap goes into the one the client used."""
    return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"


@dataclass(frozen=True, slots=True)
class Doc:
    """What /openapi.json says of an endpoint (gateway/api/openapi.py builds its operation from this): its
    operationId, summary, the msgspec Struct its body is (gateway/api/bodies.py: the schema is generated from the
    declaration the parser validates with) and whether it answers with SSE when `stream` is true."""

    op_id: str
    summary: str
    body: type[Struct]
    streams: bool = False


@dataclass(frozen=True, slots=True)
class Endpoint:
    name: str  # ctx.endpoint: the name in metrics, audit records and batch lines
    path: str  # the client-facing path
    parse: Callable[[dict[str, Any]], parse.Parsed]
    # relative to a backend's base URL, for a backend serving this API natively; a leading '/' makes it relative to
    # the server root instead (the base URL without a trailing /v1: vLLM serves /tokenize there, not under /v1)
    upstream_path: str
    wire: ClientWire
    operation: str  # OpenTelemetry gen_ai.operation.name
    prompt_param: str  # the body parameter holding the prompt (named in context-length errors)
    prompt_text: Callable[[dict[str, Any]], str]  # the prompt as text (the router's approximate prefix tree)
    max_tokens_key: Callable[[dict[str, Any]], str] | None = None  # None: generates no tokens (embeddings, ...)
    default_max_tokens: int | None = None  # the engine's completion length when the client sends none
    cacheable: bool = False  # the response cache may answer it (gateway/cache)
    batchable: bool = False  # a batch line may target it (gateway/batch)
    # a backend serves it only when this is in its `capabilities` (pooling APIs need a pooling model); None: any
    capability: str | None = None
    # the body as the OpenAI chat body an engine renders for it, where this API is not chat's (routing tokenizes
    # it, keys its message prefixes and builds the approximate tree from it); None: the body as it is
    chat_view: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    media: Media = JSON  # the body's media type: read at the ingress, written upstream by the exchange
    max_body_bytes: int | None = None  # its own body limit (an audio upload's); None: server.max_body_bytes
    doc: Doc | None = None  # its operation in /openapi.json

    @property
    def generates(self) -> bool:
        return self.max_tokens_key is not None

    def implied_max_tokens(self, requested: int | None) -> int | None:
        """The completion length the engine will use: the request's, else this API's default (None: until a
        stop or the context ends it)."""
        return requested if requested is not None else self.default_max_tokens


def _const(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda body: key


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("chat", "/v1/chat/completions", parse.parse_chat, "chat/completions", OPENAI, "chat",
             "messages", _messages_text, _chat_max_tokens_key, cacheable=True, batchable=True,
             doc=Doc("createChatCompletion", "Chat completion (OpenAI-compatible)", bodies.ChatRequest, True)),
    # OpenAI's and vLLM's default completion length for /v1/completions is 16 tokens
    Endpoint("completions", "/v1/completions", parse.parse_completions, "completions", OPENAI, "text_completion",
             "prompt", _field_text("prompt"), _const("max_tokens"), default_max_tokens=16, cacheable=True,
             batchable=True,
             doc=Doc("createCompletion", "Text completion (OpenAI-compatible)", bodies.CompletionRequest, True)),
    Endpoint("embeddings", "/v1/embeddings", parse.parse_embeddings, "embeddings", OPENAI, "embeddings",
             "input", _field_text("input"), batchable=True, capability="embeddings",
             doc=Doc("createEmbedding", "Embeddings (OpenAI-compatible)", bodies.EmbeddingRequest)),
    # OpenAI's Responses API, stateless (store: true refused by the parser, store: false sent upstream)
    Endpoint("responses", "/v1/responses", parse_responses.parse_responses, "responses", RESPONSES, "chat",
             "input", parse_responses.prompt_text, _const("max_output_tokens"), chat_view=parse_responses.as_chat,
             doc=Doc("createResponse", "Responses API, stateless (OpenAI-compatible; store: true and "
                     "previous_response_id are refused with 400)", bodies.ResponsesRequest, True)),
    # vLLM's pooling APIs (a backend serves them when its capabilities say so) and its tokenizer, which vLLM
    # serves at the server root: budgets on the input tokens they count
    Endpoint("rerank", "/v1/rerank", parse_pooling.parse_rerank, "rerank", POOLING, "rerank", "documents",
             parse_pooling.rerank_text, capability="rerank",
             doc=Doc("rerank", "Rerank documents against a query (vLLM's API; backends with the rerank capability)",
                     bodies.RerankRequest)),
    Endpoint("score", "/v1/score", parse_pooling.parse_score, "score", POOLING, "score", "text_2",
             parse_pooling.score_text, capability="score",
             doc=Doc("score", "Score text pairs (vLLM's API; backends with the score capability)",
                     bodies.ScoreRequest)),
    Endpoint("tokenize", "/tokenize", parse_pooling.parse_tokenize, "/tokenize", POOLING, "tokenize", "prompt",
             parse_pooling.tokenize_text,
             doc=Doc("tokenize", "Tokenize a prompt or a chat (vLLM's API)", bodies.TokenizeRequest)),
    # Anthropic Messages: max_tokens is required by its parser, so there is no default
    Endpoint("messages", "/v1/messages", parse_messages, "messages", ANTHROPIC, "chat", "messages",
             _anthropic_text, _const("max_tokens"), chat_view=as_chat,
             doc=Doc("createMessage", "Anthropic Messages (x-api-key or Bearer; Anthropic-shaped errors)",
                     bodies.MessagesRequest, True)),
    # OpenAI's audio transcription, a multipart form, on backends whose model transcribes (vLLM's Whisper-class
    # models: the `transcription` capability). It generates text: a cap goes upstream as vLLM's
    # max_completion_tokens form field; the client sends none (OpenAI has none), the engine runs to a stop
    Endpoint("transcriptions", "/v1/audio/transcriptions", parse_transcription, "audio/transcriptions",
             TRANSCRIPTION, "transcription", "file", _field_text("prompt"), _const("max_completion_tokens"),
             capability="transcription", media=FORM, max_body_bytes=MAX_FILE_BYTES + FORM_OVERHEAD_BYTES,
             doc=Doc("createTranscription", "Transcribe audio (OpenAI-compatible; backends with the transcription "
                     "capability, vLLM's Whisper-class models); usage in tokens", bodies.TranscriptionRequest)),
)

BY_NAME: dict[str, Endpoint] = {e.name: e for e in ENDPOINTS}
BY_PATH: dict[str, Endpoint] = {e.path: e for e in ENDPOINTS}


def endpoint(name: str) -> Endpoint:
    return BY_NAME[name]


def prompt_token_bound(raw: bytes, body: dict, prompt_chars: int) -> int:
    """An upper bound on the prompt tokens an engine will count, for budget reservations.

    Byte-level BPE tokenizers never emit more tokens than the text has bytes; for ASCII bodies that is the
    content's characters, plus a chat template's special tokens (generously 16 per message, 16 for the
    generation prompt). For non-ASCII bodies the raw body size is used (it bounds content bytes + template).
    """
    if not raw.isascii():
        return len(raw)
    msgs = body.get("messages")
    n = len(msgs) if isinstance(msgs, list) else 1
    return prompt_chars + 16 * n + 16


def prepare(ctx: Any, parsed: parse.Parsed, raw: bytes, config: Any) -> None:
    """Fill a request context from its validated body (the same for HTTP requests and batch lines)."""
    ctx.model = parsed.model
    ctx.stream = parsed.stream
    ctx.client_wants_usage = parsed.include_usage
    ctx.max_tokens = parsed.max_tokens
    ctx.prompt_tokens_est = max(1, parsed.prompt_chars // 4)
    # the raw body bounds the prompt only where it is the prompt's text (JSON; not an audio upload's bytes)
    text = raw if ctx.ep is None or ctx.ep.media.bounds_prompt else b""
    ctx.prompt_tokens_max = prompt_token_bound(text, ctx.body, parsed.prompt_chars)
    ctx.model_chain = config.resolve_model(parsed.model)
