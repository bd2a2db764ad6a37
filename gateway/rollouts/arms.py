"""Choosing an arm: pure functions over (alias, sticky key, live weights). Deterministic hashing, so every
replica and worker picks the same arm for the same key with no shared state."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

SCALE = float(1 << 64)


def unit(alias: str, key: str) -> float:
    """A uniform number in [0, 1) fixed by (alias, key): sha256, the first 8 bytes."""
    d = hashlib.sha256(f"{alias}\x00{key}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(d[:8], "big") / SCALE


def choose(arms: Sequence[str], weights: Mapping[str, float], u: float) -> int:
    """The index of the arm whose cumulative-weight slice holds u (arms in config order); weights <= 0 never
    chosen. -1 when no arm has weight."""
    total = sum(max(0.0, weights.get(a, 0.0)) for a in arms)
    if total <= 0:
        return -1
    x = u * total
    acc = 0.0
    last = -1
    for i, a in enumerate(arms):
        w = max(0.0, weights.get(a, 0.0))
        if w <= 0:
            continue
        acc += w
        last = i
        if x < acc:
            return i
    return last  # float rounding at the very top


def chain(arms: Sequence[str], weights: Mapping[str, float], u: float) -> tuple[str, ...]:
    """The models to try: the chosen arm first, then the others in config order (the fallback); arms rolled to
    weight 0 stay in the chain, last, as a fallback only."""
    i = choose(arms, weights, u)
    if i < 0:
        return tuple(arms)
    return (arms[i], *(a for j, a in enumerate(arms) if j != i))


def stable_arm(arms: Sequence[str], config_weights: Mapping[str, float], marked: str | None) -> str:
    """The arm others are judged against: the one marked stable, else the highest configured weight (the first
    on a tie)."""
    if marked is not None:
        return marked
    return max(arms, key=lambda a: (config_weights.get(a, 0.0), -arms.index(a)))


def sticky_key(header_value: str | None, end_user: str | None, user_field: Any, fallback: str) -> str:
    """What the arm is hashed by, first present wins: conversation header, partner end user, OpenAI `user`."""
    if header_value:
        return "conv:" + header_value
    if end_user:
        return "eu:" + end_user
    if isinstance(user_field, str) and user_field:
        return "user:" + user_field
    return "key:" + fallback
