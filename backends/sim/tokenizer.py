"""A deterministic, cheap tokenizer and a ChatML chat template shared by /tokenize and generation.

Text is cut into word-ish pieces that keep their leading space (like byte-level BPE), so joining the pieces
gives the text back; each piece maps to an id by a stable hash modulo the vocabulary. Special ChatML tokens
have fixed low ids. Ids seen are remembered (bounded) so /detokenize can invert them.
"""
from __future__ import annotations

import re
from typing import Any

import xxhash

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL = {IM_START: 1, IM_END: 2, "<|endoftext|>": 3}
SPECIAL_BY_ID = {v: k for k, v in SPECIAL.items()}
N_RESERVED = 16

_PIECE = re.compile(r"<\|im_start\|>|<\|im_end\|>|<\|endoftext\|>| ?[A-Za-z0-9_\u00c0-\uffff]+| ?[^\sA-Za-z0-9_]+|\s+")

# Words the sim "generates"; every entry is one token.
_WORDS = (" the of and to in is that for it as with was on be by this are from at or an which not have but "
          "one all their has more can were been its also two other into than only some time new such these "
          "first may after most used over many where then between would through model cache token engine "
          "block prefix route budget policy request latency stream batch").split(" ")
OUTPUT_PIECES = tuple(" " + w for w in _WORDS if w)


class Tokenizer:
    """Stable piece -> id mapping; `vocab_size` bounds ids like a real vocabulary."""

    def __init__(self, vocab_size: int = 32000, remember: int = 200_000) -> None:
        self.vocab_size = vocab_size
        self._span = vocab_size - N_RESERVED
        self._seen: dict[int, str] = dict(SPECIAL_BY_ID)
        self._remember = remember
        self._cache: dict[str, int] = {}
        self.output_ids = [self.piece_id(p) for p in OUTPUT_PIECES]

    def piece_id(self, piece: str) -> int:
        tid = self._cache.get(piece)
        if tid is None:
            tid = SPECIAL.get(piece)
            if tid is None:
                tid = N_RESERVED + xxhash.xxh32_intdigest(piece.encode("utf-8")) % self._span
            if len(self._cache) < self._remember:
                self._cache[piece] = tid
                self._seen.setdefault(tid, piece)
        return tid

    def pieces(self, text: str) -> list[str]:
        return _PIECE.findall(text)

    def encode(self, text: str) -> list[int]:
        return [self.piece_id(p) for p in _PIECE.findall(text)]

    def encode_with_pieces(self, text: str) -> tuple[list[int], list[str]]:
        ps = _PIECE.findall(text)
        return [self.piece_id(p) for p in ps], ps

    def id_to_piece(self, tid: int) -> str:
        return self._seen.get(tid, f"<|tok{tid}|>")

    def decode(self, ids: list[int]) -> str:
        seen = self._seen
        return "".join(seen.get(t) or f"<|tok{t}|>" for t in ids)


def _content_text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts ({type: text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError("message content must be a string or a list of content parts")


def render_chat(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """ChatML: <|im_start|>role\\ncontent<|im_end|>\\n ... then <|im_start|>assistant\\n."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError("each message needs a role")
        text = _content_text(m.get("content"))
        last = i == len(messages) - 1
        if continue_final_message and last:
            parts.append(f"{IM_START}{m['role']}\n{text}")
        else:
            parts.append(f"{IM_START}{m['role']}\n{text}{IM_END}\n")
    if add_generation_prompt and not continue_final_message:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)
