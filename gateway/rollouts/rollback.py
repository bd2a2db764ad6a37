"""Automatic rollback: per arm, a sliding window of outcomes, and the pure verdict that compares an arm with
the stable arm (error rate, TTFT p90) under the alias's thresholds."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from gateway.rollouts.config import RollbackConfig


@dataclass(frozen=True)
class ArmStats:
    requests: int
    errors: int
    ttft_p90_s: float | None  # over the successful requests with a TTFT

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def p90(values: list[float]) -> float | None:
    """The nearest-rank 90th percentile."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(0.9 * len(s)) - 1)]


class Window:
    """Outcomes of one arm within the last `window_s` seconds (times given by the caller)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: deque[tuple[float, bool, float | None]] = deque()

    def add(self, now: float, ok: bool, ttft_s: float | None) -> None:
        self.items.append((now, ok, ttft_s))
        self.trim(now)

    def trim(self, now: float) -> None:
        while self.items and self.items[0][0] < now - self.window_s:
            self.items.popleft()

    def stats(self, now: float) -> ArmStats:
        self.trim(now)
        errors = sum(1 for _, ok, _ in self.items if not ok)
        ttfts = [t for _, ok, t in self.items if ok and t is not None]
        return ArmStats(len(self.items), errors, p90(ttfts))


def verdict(arm: ArmStats, stable: ArmStats, cfg: RollbackConfig) -> str | None:
    """Why `arm` must be rolled back against `stable`, or None. Neither is judged before each has
    `min_requests` in the window."""
    if not cfg.enabled or arm.requests < cfg.min_requests or stable.requests < cfg.min_requests:
        return None
    er, base = arm.error_rate, stable.error_rate
    if er > base * cfg.error_rate_ratio and er > base + cfg.error_rate_margin:
        return f"error rate {er:.1%} vs stable {base:.1%}"
    a, b = arm.ttft_p90_s, stable.ttft_p90_s
    if a is not None and b is not None and a > b * cfg.ttft_p90_ratio and a > b + cfg.ttft_p90_margin_s:
        return f"TTFT p90 {a:.3f}s vs stable {b:.3f}s"
    return None
