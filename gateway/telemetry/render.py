"""A chat's messages as one stable ChatML-like text: what the approximate token source hashes, the last-resort
template when no tokenizer is at hand, and each endpoint's prompt text (the router's approximate prefix tree).
Pure, so the endpoint table and parsers (gateway/api) use it without importing the token sources
(gateway/telemetry/tokens.py, which reach the engines)."""
from __future__ import annotations

from typing import Any


def render_messages_plain(messages: list[dict[str, Any]]) -> str:
    """A stable ChatML-like text rendering (for the approximate source and as a last-resort template)."""
    parts = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role', 'user')}\n{c or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"
