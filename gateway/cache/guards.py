"""Guards against near-miss intents: a semantic match is served only when these features of the two
conversations are equal, whatever the similarity. Numbers, named entities and negations flip an answer while
barely moving an embedding ("refund order 1234" vs "refund order 1243", "can I" vs "can't I")."""
from __future__ import annotations

import re
from typing import Any

_NUM = re.compile(r"\d+(?:[.,:/-]\d+)*")
_NUM_WORDS = frozenset("zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty "
                       "fifty hundred thousand million billion first second third half double triple".split())
_NEG = frozenset("not no never none nobody nothing neither nor without cannot cant dont doesnt didnt isnt arent "
                 "wasnt werent wont wouldnt shouldnt couldnt hasnt havent except unless".split())
_NEG_STEMS = frozenset("do does did is are was were wo would should could has have ca must need".split())
_NOT_ENTITY = frozenset("I I'm I'd I've I'll OK Ok Thanks Thank Please Hi Hello Hey Sorry Yes No".split())
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_'\-]*")
_QUOTED = re.compile(r"[\"“`']([^\"”`']{1,80})[\"”`']")
_SENT_START = re.compile(r"(?:^|[.!?:\n]\s*)([A-Za-z][\w'\-]*)")


def conversation(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) of every non-system turn; the prompt of /v1/completions as one user turn."""
    if "messages" not in body:
        p = body.get("prompt")
        return [("user", p if isinstance(p, str) else repr(p))]
    out = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict) or m.get("role") in ("system", "developer"):
            continue
        c = m.get("content")
        if isinstance(c, list):
            c = " ".join(str(x.get("text", "")) if isinstance(x, dict) else str(x) for x in c)
        text = c if isinstance(c, str) else repr(c)
        if m.get("tool_calls"):
            text += " " + repr(m.get("tool_calls"))
        out.append((str(m.get("role")), text))
    return out


def features(turns: list[tuple[str, str]]) -> dict[str, Any]:
    """The guard features of a conversation: turn roles, numbers, named entities, negations (per turn)."""
    nums: list[list[str]] = []
    ents: list[list[str]] = []
    negs: list[int] = []
    vocab: list[list[str]] = []
    for _, text in turns:
        words = [w.lower().replace("'", "") for w in _WORD.findall(text)]
        nums.append(sorted(_NUM.findall(text) + [w for w in words if w in _NUM_WORDS]))
        negs.append(sum(1 for w in words if w in _NEG or w.endswith("nt") and w[:-2] in _NEG_STEMS))
        starts = {m.group(1) for m in _SENT_START.finditer(text)}
        caps = {w for w in _WORD.findall(text) if w not in _NOT_ENTITY and (w[0].isupper() and w not in starts) or
                (len(w) > 1 and w.isupper()) or any(ch.isdigit() for ch in w)}
        caps |= {q.strip().lower() for q in _QUOTED.findall(text)}
        ents.append(sorted(c.lower() for c in caps))
        vocab.append(sorted(set(words) | {q.strip().lower() for q in _QUOTED.findall(text)}))
    return {"roles": [r for r, _ in turns], "numbers": nums, "entities": ents, "negations": negs, "words": vocab}


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, list[str], str | None]:
    """(all passed, guards passed, the first that failed)."""
    passed: list[str] = []
    for g in ("roles", "numbers", "negations"):
        if a.get(g) != b.get(g):
            return False, passed, g
        passed.append(g)
    # every entity named on one side appears (any case, any position) on the other, turn by turn: a swapped
    # name fails, a lower-cased or moved one passes
    ea, eb, wa, wb = a.get("entities") or [], b.get("entities") or [], a.get("words") or [], b.get("words") or []
    if len(ea) != len(eb) or len(wa) != len(ea) or len(wb) != len(eb):
        return False, passed, "entities"
    for i in range(len(ea)):
        sa, sb = set(wa[i]), set(wb[i])
        if any(_bare(e) not in sb for e in ea[i]) or any(_bare(e) not in sa for e in eb[i]):
            return False, passed, "entities"
    passed.append("entities")
    return True, passed, None


def _bare(entity: str) -> str:
    return entity.replace("'", "")
