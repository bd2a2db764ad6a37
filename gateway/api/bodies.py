"""The request body of every endpoint, declared once as msgspec Structs: field names, types, enums, ranges and
required fields. They are the validator (`gateway.api.validate.validate`, called by the parsers) and the
request-body schemas of `/openapi.json` (`gateway.api.openapi`, through `msgspec.json.schema_components`).

A Struct validates; the client's dict is what goes upstream. msgspec ignores fields a Struct does not declare,
so every other field passes through to the engine unchanged (vLLM takes many). Each endpoint's parser
(`parse*.py`) adds only what a type cannot state, as rules keyed to the field after which they run: a field
requiring another, mutual exclusions, and the content rules of message parts, blocks and items whose shape
depends on their `type`.

Field metadata:
- `Meta(extra=...)` words a field's faults where the derived wording is not the gateway's: see
  gateway/api/validate.py (`expected`, `invalid`, `code`, `all`, `missing`, `flat`).
- `Annotated[Any, Meta(extra_json_schema=schema)]` declares a field the gateway passes to the engine without
  checking it (the engine does): any value is accepted, and it is documented as `schema`.
- `Meta(extra_json_schema=...)` on a checked field documents what the engine further requires of a value the
  gateway accepts (a chat `role`'s values), or the items of an array a rule checks (`list[Any]`: a completions
  `prompt`'s strings or token ids, whose kinds a msgspec union cannot tell apart; content blocks). msgspec's
  generated keys win over these, so they refine only what it leaves open (`items` of a `list[Any]`).

Unions that a rule dispatches by `type` (Anthropic content blocks, Responses input items and content parts) are
declared as Structs too: the rule converts a block with the Struct its `type` names (`by_type`), and the field's
documentation lists them (`doc_any_of`).

Form bodies (`TranscriptionRequest`) declare each field with the type it stands for (a number, a boolean); the
parser turns a form's text into that type first (gateway/api/parse_audio.py).
"""
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType
from msgspec import inspect as mi

from gateway.api.validate import core, struct_fields

REF = "#/components/schemas/{name}"
DOC_STRUCTS: list[type[Struct]] = []  # Structs the documentation refers to beyond the request bodies' own fields


def doc_any_of(*structs: type[Struct]) -> dict[str, Any]:
    """The JSON schema of one of `structs` (by reference), for a field whose items a rule converts by type."""
    DOC_STRUCTS.extend(s for s in structs if s not in DOC_STRUCTS)
    return {"anyOf": [{"$ref": REF.format(name=s.__name__)} for s in structs]}


def by_type(*structs: type[Struct]) -> dict[str, type[Struct]]:
    """Each `type` value to the Struct that declares it (its `type` field is a Literal of the values)."""
    out: dict[str, type[Struct]] = {}
    for s in structs:
        t = core(next(f.type for f in struct_fields(s) if f.name == "type"))
        assert isinstance(t, mi.LiteralType), s
        out.update((v, s) for v in t.values if isinstance(v, str))
    return out


# --- shared fields --------------------------------------------------------------------------------------------

Model = Annotated[str, Meta(min_length=1, max_length=256, description="a model or alias from GET /v1/models",
                            extra={"invalid": "'model' must be a non-empty string of at most 256 characters."})]
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(ge=0, le=1)]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
Count = Annotated[int, Meta(ge=1)]  # n, max_tokens and the like: an integer >= 1
Stop = Annotated[str | Annotated[list[Any], Meta(extra_json_schema={"items": {"type": "string"}})] | None,
                 Meta(extra={"expected": "a string or an array of strings"})]
AnyString = Annotated[Any, Meta(extra_json_schema={"type": "string"})]  # a string for the engine, passed unchecked
User = AnyString
Seed = Annotated[Any, Meta(extra_json_schema={"type": ["integer", "null"]})]
PROVIDER_NAMES = {"type": "array", "minItems": 1, "maxItems": 64, "uniqueItems": True,
                  "items": {"type": "string", "minLength": 1, "maxLength": 256}}
Provider = Annotated[Any, Meta(extra_json_schema={
    "type": "object", "additionalProperties": False, "properties": {
        "zdr": {"type": "boolean"}, "data_collection": {"type": "string", "enum": ["allow", "deny"]},
        "allow_fallbacks": {"type": "boolean"}, "only": PROVIDER_NAMES, "ignore": PROVIDER_NAMES,
        "order": PROVIDER_NAMES}}, description=(
    "OpenRouter-style provider preferences, tighten only (checked by gateway/policy/provider_prefs.py); anything "
    "else is refused with 400"))]


class StreamOptions(Struct):
    include_usage: bool | None = None


# --- OpenAI chat, completions, embeddings (gateway/api/parse.py) --------------------------------------------

class ImageURL(Struct):
    url: Annotated[str, Meta(extra={"missing": "null"})]


class ChatPart(Struct):
    """A content part. `text` and `refusal` are strings where present (a part of type text or refusal needs its
    own); `image_url` a URL string or an object with one. Other part types (input_audio, file, video_url, ...)
    pass through to the engine."""

    type: str | None = None
    text: str | UnsetType = UNSET
    refusal: str | UnsetType = UNSET
    image_url: Annotated[str | ImageURL | UnsetType, Meta(extra={"expected": "a string URL"})] = UNSET


class ChatMessage(Struct):
    role: Annotated[str, Meta(extra={"all": ("Missing or invalid '{param}'.", "invalid_value")},
                              extra_json_schema={"enum": ["system", "developer", "user", "assistant", "tool"]})]
    content: Annotated[str | list[ChatPart] | None, Meta(extra={"expected": "a string or an array of content parts"})] = None
    name: AnyString = UNSET


class ChatRequest(Struct):
    """POST /v1/chat/completions."""

    model: Model
    messages: Annotated[list[ChatMessage], Meta(min_length=1, extra={
        "invalid": "'messages' must contain at least one message."})]
    stream: bool | None = None
    stream_options: StreamOptions | None = None  # only with stream: true
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Count | None = None
    stop: Stop = None
    max_completion_tokens: Count | None = None
    max_tokens: Count | None = None
    user: User = UNSET
    seed: Seed = UNSET
    provider: Provider = UNSET


TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
# strings, token ids or arrays of token ids (one kind per array)
TEXTS_OR_TOKENS = {"minItems": 1, "items": {"anyOf": [{"type": "string"}, TOKEN_ID,
                                                      {"type": "array", "minItems": 1, "items": TOKEN_ID}]}}


# A completions prompt or an embeddings input: a string, or a non-empty array of strings, of token ids or of arrays
# of token ids (the arrays' items checked by a rule: msgspec unions take one array type)
Prompt = Annotated[str | Annotated[list[Any], Meta(extra_json_schema=TEXTS_OR_TOKENS)], Meta(extra={
    "expected": "a string, an array of strings or an array of token ids (ints >= 0)"})]
EmbeddingInput = Annotated[str | Annotated[list[Any], Meta(extra_json_schema=TEXTS_OR_TOKENS)], Meta(extra={
    "expected": "a string or a non-empty array"})]


class CompletionRequest(Struct):
    """POST /v1/completions."""

    model: Model
    prompt: Prompt
    stream: bool | None = None
    stream_options: StreamOptions | None = None  # only with stream: true
    temperature: Temperature | None = None
    top_p: TopP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    n: Count | None = None
    stop: Stop = None
    max_tokens: Count | None = None
    user: User = UNSET
    seed: Seed = UNSET
    provider: Provider = UNSET


class EmbeddingRequest(Struct):
    """POST /v1/embeddings (no streaming)."""

    model: Model
    input: EmbeddingInput
    encoding_format: Annotated[Literal["float", "base64"] | None, Meta(extra={
        "all": ("'encoding_format' must be 'float' or 'base64'.", "invalid_value")})] = None
    user: User = UNSET
    provider: Provider = UNSET


# --- vLLM's pooling APIs and tokenizer (gateway/api/parse_pooling.py) ----------------------------------------

class RerankRequest(Struct):
    """POST /v1/rerank (no streaming; at most 4096 documents)."""

    model: Model
    query: str
    documents: Annotated[list[str], Meta(min_length=1, extra={
        "expected": "an array of strings", "invalid": "'documents' must contain at least one document."})]
    top_n: Annotated[int, Meta(ge=0)] | None = None
    return_documents: bool | None = None


# a string, or a non-empty array of strings
Texts = Annotated[str | Annotated[list[str], Meta(min_length=1)], Meta(extra={
    "expected": "a string or a non-empty array of strings", "flat": True})]


class ScoreRequest(Struct):
    """POST /v1/score: `text_1` against each of `text_2` (1:N), or pairwise (N:N; no streaming)."""

    model: Model
    text_1: Texts
    text_2: Texts


class TokenizeRequest(Struct):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model: Model
    prompt: Annotated[str, Meta(description="a string; or `messages` instead (a chat)")] | UnsetType = UNSET
    messages: Annotated[list[ChatMessage], Meta(min_length=1, extra={
        "expected": "a non-empty array", "invalid": "Invalid type for '{param}': expected a non-empty array, got list.",
        "code": "invalid_type"})] | UnsetType = UNSET
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None
    continue_final_message: bool | None = None


# --- Anthropic Messages (gateway/api/parse_messages.py) --------------------------------------------------------

class TextBlock(Struct):
    type: Annotated[Literal["text"], Meta(extra={"all": ("'{param}' must be 'text'.", "invalid_value")})]
    text: Annotated[str, Meta(extra={"missing": "null"})]


class ImageBlock(Struct):
    type: Literal["image"]
    source: Annotated[dict[str, Any], Meta(extra={"missing": "null"})]


class DocumentBlock(Struct):
    type: Literal["document"]
    source: Annotated[dict[str, Any], Meta(extra={"missing": "null"})]


class ToolUseBlock(Struct):
    type: Literal["tool_use"]
    id: Annotated[str, Meta(extra={"missing": "null"})]
    name: Annotated[str, Meta(extra={"missing": "null"})]
    input: Annotated[dict[str, Any], Meta(extra={"missing": "null"})]


class ThinkingBlock(Struct):
    type: Literal["thinking"]
    thinking: Annotated[str, Meta(extra={"missing": "null"})]


class ToolResultBlock(Struct):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Meta(extra={"missing": "null"})]
    content: Annotated[str | Annotated[list[Any], Meta(extra_json_schema={"items": doc_any_of(TextBlock, ImageBlock)})]
                       | None, Meta(extra={"expected": "a string or an array of content blocks"})] = None


# The content blocks a rule checks by their `type` (others pass through to the engine)
ANTHROPIC_BLOCKS = (TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, DocumentBlock)


class AnthropicMessage(Struct):
    role: Annotated[Literal["user", "assistant"], Meta(extra={
        "all": ("'{param}' must be 'user' or 'assistant'.", "invalid_value")})]
    content: Annotated[str | Annotated[list[Any], Meta(extra_json_schema={"items": doc_any_of(*ANTHROPIC_BLOCKS)})],
                       Meta(extra={"expected": "a string or an array of content blocks"})]


class AnthropicTool(Struct):
    name: Annotated[str, Meta(min_length=1, extra={"all": ("'{param}' must be a non-empty string.", "invalid_value")})]
    description: AnyString = UNSET
    input_schema: Annotated[Any, Meta(extra_json_schema={"type": "object"})] = UNSET


class ToolChoice(Struct):
    type: Annotated[Literal["auto", "any", "tool", "none"], Meta(extra={
        "all": ("'{param}' must be one of 'auto', 'any', 'tool', 'none'.", "invalid_value")})]
    name: Annotated[AnyString, Meta(description="with type: tool")] = UNSET


class AnthropicMetadata(Struct):
    user_id: AnyString = UNSET


class MessagesRequest(Struct):
    """POST /v1/messages (Anthropic's Messages API)."""

    model: Model
    max_tokens: Annotated[int, Meta(ge=1)]
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1, extra={
        "invalid": "'messages' must contain at least one message."})]
    system: Annotated[str | list[TextBlock] | None, Meta(extra={"expected": "a string or an array of text blocks"})] = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: Annotated[list[str] | None, Meta(extra={"expected": "an array of strings", "flat": True})] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: AnthropicMetadata | None = None


# --- OpenAI Responses, stateless (gateway/api/parse_responses.py) --------------------------------------------

class ResponsesTextPart(Struct):
    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: Annotated[str, Meta(extra={"missing": "null"})]


class ResponsesRefusalPart(Struct):
    type: Literal["refusal"]
    refusal: Annotated[str, Meta(extra={"missing": "null"})]


class ResponsesMediaPart(Struct):
    """An image, file or audio part, passed to the engine."""

    type: Literal["input_image", "input_file", "input_audio"]


# The content parts a rule checks by their `type` (any other type is refused)
RESPONSES_PARTS = (ResponsesTextPart, ResponsesRefusalPart, ResponsesMediaPart)
Parts = Annotated[list[Any], Meta(extra_json_schema={"items": doc_any_of(*RESPONSES_PARTS)})]
Content = Annotated[str | Parts, Meta(extra={"expected": "a string or an array of content parts"})]


class MessageItem(Struct):
    """A message (`type` may be left out when `role` is given)."""

    role: Annotated[Literal["user", "assistant", "system", "developer"], Meta(extra={"all": (
        "Invalid value for '{param}': expected one of user, assistant, system, developer.", "invalid_value")})]
    content: Content
    type: Literal["message"] = "message"


class FunctionCallItem(Struct):
    type: Literal["function_call"]
    call_id: Annotated[str, Meta(extra={"missing": "null"})]
    name: Annotated[str, Meta(extra={"missing": "null"})]
    arguments: Annotated[str, Meta(extra={"missing": "null"})]


class FunctionCallOutputItem(Struct):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(extra={"missing": "null"})]
    output: Annotated[Content, Meta(extra={"missing": "null"})]


class ReasoningItem(Struct):
    type: Literal["reasoning"]
    summary: Parts | None = None
    content: Parts | None = None


# The input items a rule checks by their `type` (item_reference is refused: it needs stored responses)
RESPONSES_ITEMS = (MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem)


class ResponsesTool(Struct):
    type: Annotated[str, Meta(extra={"missing": "null"})]


STATELESS = "stateless: an absent or false value only; true is refused with 400 (the gateway stores no responses)"


class ResponsesRequest(Struct, kw_only=True):
    """POST /v1/responses, stateless: `store: true`, `background: true`, `previous_response_id` and
    `conversation` are refused with 400 (they need stored responses); an absent `store` means false."""

    model: Model
    store: Annotated[bool | None, Meta(description=STATELESS, extra_json_schema={"enum": [False, None]})] = None
    background: Annotated[bool | None, Meta(description=STATELESS, extra_json_schema={"enum": [False, None]})] = None
    input: Annotated[
        Annotated[str, Meta(min_length=1, extra={"invalid": "'input' must not be empty."})]
        | Annotated[list[Any], Meta(min_length=1, extra={"invalid": "'input' must contain at least one item."},
                                    extra_json_schema={"items": doc_any_of(*RESPONSES_ITEMS)})],
        Meta(extra={"expected": "a string or an array of input items"})]
    instructions: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # only with stream: true
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: list[ResponsesTool] | None = None
    metadata: dict[str, Any] | None = None
    max_output_tokens: Count | None = None
    user: User = UNSET


# --- OpenAI audio transcription, a multipart form (gateway/api/parse_audio.py) --------------------------------

FormText = Meta(extra={"expected": "a text field"})  # a form field given as a file or more than once is no text


class TranscriptionRequest(Struct):
    """POST /v1/audio/transcriptions, a multipart form: each field's type is what its text stands for."""

    model: Model
    file: Annotated[Any, Meta(extra_json_schema={"type": "string", "format": "binary"}, description=(
        "the audio (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav or webm), at most 25 MiB"))]
    language: Annotated[str, FormText, Meta(max_length=32, description="ISO-639-1", extra={
        "invalid": "'{param}' must be at most 32 characters."})] | UnsetType = UNSET
    prompt: Annotated[str, FormText] | UnsetType = UNSET
    response_format: Annotated[Literal["json", "text", "verbose_json"], FormText, Meta(extra={
        "invalid": lambda param, v: f"'{param}' must be one of json, text, verbose_json, got {v[:32]!r}."})] | UnsetType = UNSET
    temperature: Annotated[float, FormText, Meta(ge=0, le=1)] | UnsetType = UNSET
    stream: Annotated[bool, FormText, Meta(description="streaming is refused", extra_json_schema={"enum": [False]})] | UnsetType = UNSET
    max_completion_tokens: Annotated[int, FormText, Meta(ge=1, description="vLLM's cap on the transcript's tokens")] | UnsetType = UNSET
