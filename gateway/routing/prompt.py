"""The request's prompt as routing sees it: its text and approximate blocks, its token count, and the tokens
each candidate engine already holds (KV index through the pending cache, else the approximate prefix tree)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from gateway.pipeline import RequestContext
from gateway.proxy.dialects import DIALECTS
from gateway.routing.approx import ApproxPrefixIndex, text_blocks
from gateway.routing.pending import PendingCache
from gateway.routing.plan import Candidate
from gateway.telemetry.index import RequestKeys
from gateway.telemetry.tokens import render_messages_plain

if TYPE_CHECKING:
    from gateway.telemetry.service import TelemetryService

APPROX_BLOCK_CHARS = 256
CHARS_PER_TOKEN = 4


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as plain text (for the approximate prefix tree)."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        return render_messages_plain([m for m in msgs if isinstance(m, dict)])
    p = body.get("prompt", body.get("input", ""))
    return p if isinstance(p, str) else "".join(map(str, p)) if isinstance(p, list) else str(p)


def routing_body(ctx: RequestContext) -> dict[str, Any]:
    """The body routing reads the prompt from: the endpoint's chat view when its API is not chat's (an Anthropic
    Messages body as the chat the engine renders, `system` first), else the body itself."""
    view = ctx.ep.chat_view if ctx.ep is not None else None
    return view(ctx.body) if view is not None else ctx.body


def lora_name(cand: Candidate) -> str | None:
    """The LoRA adapter a candidate serves the request with (the KV index's lora key: the name the kind's KV
    events give it, e.g. `adapter` of SGLang's `base:adapter`), or None for the base."""
    up = cand.backend.upstream_model(cand.model)
    if up not in cand.backend.lora_adapters:
        return None
    d = DIALECTS.get(cand.backend.kind)
    return d.lora_key(up) if d is not None else up


class PromptFacts(NamedTuple):
    """What the stage predicts from: prompt tokens, cached tokens per engine, where the token count came from
    (`engine` /tokenize, `cache`, `estimate`), the approximate blocks, and per engine (blocks its index holds,
    own keys of the prompt's full blocks): what a dispatch there will store, for the pending cache."""

    n_tokens: int
    cached: dict[str, int]
    source: str
    blocks: list[int]
    unstored: dict[str, tuple[int, list[int]]]


async def prompt_facts(ctx: RequestContext, cands: list[Candidate], salt: str | None, *,
                       telemetry: TelemetryService | None, has_telemetry: Callable[[Candidate], bool],
                       pending: PendingCache, approx: ApproxPrefixIndex,
                       clock: Callable[[], float], learn: Callable[[Candidate, list[int]], None]) -> PromptFacts:
    """Tokenize once (the first candidate with telemetry), look the tokens up in the KV index per LoRA key and
    extend through own pending prefill; candidates without telemetry get the approximate tree's estimate.
    `learn(cand, toks)` is called with engine-tokenized ids (the early refusal's prefix cache)."""
    body = routing_body(ctx)
    text = prompt_text(body)
    blocks = text_blocks((salt or "") + text, APPROX_BLOCK_CHARS)
    n_tokens = max(1, ctx.prompt_tokens_est)
    cached: dict[str, int] = {}
    unstored: dict[str, tuple[int, list[int]]] = {}
    source = "estimate"
    tel = [c for c in cands if has_telemetry(c)]
    if tel and telemetry is not None:
        try:
            toks, source = await telemetry.tokens_for(tel[0].backend.name, None, body,
                                                      retain=not ctx.zero_retention)
            n_tokens = max(1, len(toks))
            if source == "engine":
                learn(tel[0], toks)
            by_lora: dict[str | None, list[str]] = {}
            for c in tel:  # engines serving the model as a LoRA adapter key their blocks by its name
                by_lora.setdefault(lora_name(c), []).append(c.backend.name)
            index = telemetry.index
            for lora, names in by_lora.items():
                rk = RequestKeys(toks, salt, lora)
                found = telemetry.lookup(names, rk, salt=salt, lora=lora)
                for k, v in found.items():
                    cached[k] = int(v.tokens)
                    bs = index.block_size(k)
                    if bs:  # extend through blocks an earlier dispatch there is still prefilling
                        keys = rk.keys(bs)
                        limit = min(len(keys), (n_tokens - 1) // bs)
                        held = min(int(v.blocks), limit)
                        n = pending.extend(k, keys, held, limit, clock())
                        if n > held:
                            cached[k] = n * bs
                        unstored[k] = (held, keys)
        except Exception:  # telemetry trouble must never fail a request: fall back to the approx tree
            source = "estimate"
    for c in cands:
        name = c.backend.name
        if name not in cached:
            m = approx.match(name, blocks)
            cached[name] = min(n_tokens - 1, m * APPROX_BLOCK_CHARS // CHARS_PER_TOKEN) if m else 0
    return PromptFacts(n_tokens, cached, source, blocks, unstored)
