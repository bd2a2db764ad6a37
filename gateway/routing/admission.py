"""Admission control: admit, spill to a partner, queue (batch) or refuse now, from predicted TTFTs.

`decide` is pure: it reads the TTFT target and the calibrated upper predictions of the allowed engines and
says what to do. `BatchQueue` is the bounded wait for sheddable traffic: batch requests wait there while the
fleet is hot and are shed (queue full or waited too long) before any realtime request is refused, because
batch is held to a stricter headroom than the realtime target.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal, Sequence

Action = Literal["admit", "spill", "queue", "reject"]


@dataclass(frozen=True, slots=True)
class Admission:
    action: Action
    slo_ms: float | None
    best_ms: float | None  # best mean prediction among own engines
    best_upper_ms: float | None
    retry_after_s: float = 0.0
    reason: str = ""


# the answer without a target or without predictions to hold to it (frozen: one instance serves every request)
_ADMIT_UNJUDGED = Admission("admit", None, None, None)


def slo_ms(header: str | None, decision_slo: float | None, default: float | None) -> float | None:
    """The TTFT target: the request's x-ttft-slo-ms, else the policy decision's, else the route default."""
    if header:
        try:
            v = float(header)
            if v > 0:
                return v
        except ValueError:
            pass
    if decision_slo is not None and decision_slo > 0:
        return decision_slo
    return default


def decide(slo: float | None, uppers_ms: Sequence[float], means_ms: Sequence[float], *, priority: str,
           can_spill: bool, batch_headroom: float = 0.5, batch_target_ms: float | None = None) -> Admission:
    """What to do with a request whose own engines are predicted at `uppers_ms` (calibrated upper quantile).

    - no target: admit (nothing to promise);
    - some engine's upper bound meets the target: admit (batch only below `batch_headroom` x target);
    - none: spill when policy allows a partner, else batch queues and others are refused now, with a
      Retry-After of how long the best engine needs to drain back under the target.
    """
    best_u = min(uppers_ms) if uppers_ms else None
    best_m = min(means_ms) if means_ms else None
    target = slo
    if priority == "batch":
        target = batch_target_ms if batch_target_ms is not None else (slo * batch_headroom if slo else None)
    if target is None or best_u is None:
        if slo is None and best_m is None and best_u is None:
            return _ADMIT_UNJUDGED
        return Admission("admit", slo, best_m, best_u)
    if best_u <= target:
        return Admission("admit", slo, best_m, best_u)
    retry = max(0.05, min(30.0, (best_u - target) / 1000.0))
    if priority == "batch":
        return Admission("queue", slo, best_m, best_u, retry, "fleet above batch headroom")
    if can_spill:
        return Admission("spill", slo, best_m, best_u, retry, "no own engine meets the target")
    return Admission("reject", slo, best_m, best_u, retry,
                     f"no allowed engine is predicted to meet the {slo:g} ms TTFT target")


class QueueFull(Exception):
    pass


class BatchQueue:
    """Bounded FIFO of waiting batch requests; `wake` after each finished request lets the head re-check."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._waiters: list[asyncio.Future[None]] = []
        self.shed = 0
        self.admitted = 0

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for a wake-up; False on timeout. Raises QueueFull at once when the queue is full."""
        if len(self._waiters) >= self.capacity:
            self.shed += 1
            raise QueueFull()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def wake(self, n: int = 1) -> None:
        """Wake the n oldest waiters (each re-checks its prediction and may wait again)."""
        for fut in self._waiters[:n]:
            if not fut.done():
                fut.set_result(None)
