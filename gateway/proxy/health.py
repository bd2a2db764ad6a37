"""Per-backend health: a circuit breaker fed by passive outcomes and active `/health` probes.

closed -> (failures_to_open consecutive failures) -> open -> (open_s elapsed) -> half_open (one trial request
or probe) -> closed on success, open again on failure. Decisions are pure over the state and a clock.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from gateway.config import BackendConfig, Config

log = logging.getLogger("gateway.health")


@dataclass(slots=True)
class BreakerState:
    state: str = "closed"  # closed | open | half_open
    consecutive_failures: int = 0
    opened_at: float = 0.0
    last_error: str | None = None
    half_open_in_flight: bool = False
    successes: int = 0
    failures: int = 0


class Health:
    """Circuit breakers for all backends. Thread-unsafe by design: used from the event loop only."""

    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._states: dict[str, BreakerState] = {}
        self._cfg: dict[str, BackendConfig] = {}
        self.swap_config(config)

    def swap_config(self, config: Config) -> None:
        self._cfg = {b.name: b for b in config.backends}
        for name in list(self._states):
            if name not in self._cfg:
                del self._states[name]
        for name in self._cfg:
            self._states.setdefault(name, BreakerState())

    def state(self, name: str) -> BreakerState:
        return self._states.setdefault(name, BreakerState())

    def available(self, name: str) -> bool:
        """May a request be sent to this backend now? An open breaker admits one trial after open_s."""
        st = self.state(name)
        if st.state == "closed":
            return True
        cfg = self._cfg.get(name)
        open_s = cfg.health.open_s if cfg else 5.0
        if st.state == "open" and self._clock() - st.opened_at >= open_s:
            st.state = "half_open"
            st.half_open_in_flight = False
        if st.state == "half_open" and not st.half_open_in_flight:
            return True
        return False

    def begin(self, name: str) -> None:
        st = self.state(name)
        if st.state == "half_open":
            st.half_open_in_flight = True

    def success(self, name: str) -> None:
        st = self.state(name)
        st.successes += 1
        st.consecutive_failures = 0
        st.last_error = None
        if st.state != "closed":
            log.info("backend %s recovered: circuit closed", name)
        st.state = "closed"
        st.half_open_in_flight = False

    def failure(self, name: str, reason: str) -> None:
        st = self.state(name)
        st.failures += 1
        st.consecutive_failures += 1
        st.last_error = reason
        cfg = self._cfg.get(name)
        threshold = cfg.health.failures_to_open if cfg else 3
        if st.state == "half_open" or st.consecutive_failures >= threshold:
            if st.state != "open":
                log.warning("backend %s circuit opened after %d failures (%s)", name, st.consecutive_failures, reason)
            st.state = "open"
            st.opened_at = self._clock()
            st.half_open_in_flight = False

    def snapshot(self) -> dict[str, dict]:
        return {n: {"state": s.state, "consecutive_failures": s.consecutive_failures, "last_error": s.last_error}
                for n, s in self._states.items()}


async def probe_loop(get_config: Callable[[], Config], health: Health, client: httpx.AsyncClient,
                     client_for: Callable[[BackendConfig], httpx.AsyncClient | None] | None = None) -> None:
    """Active checks: GET <server_root><health.path> per backend, every interval; feeds the breaker.
    `client_for` names a backend's own probe client (one behind an egress proxy), else `client` is used."""
    last: dict[str, float] = {}
    while True:
        cfg = get_config()
        now = time.monotonic()
        due = [b for b in cfg.backends if b.health.enabled and now - last.get(b.name, 0.0) >= b.health.interval_s]
        async def one(b: BackendConfig) -> None:
            last[b.name] = time.monotonic()
            try:
                c = (client_for(b) if client_for is not None else None) or client
                r = await c.get(b.server_root + b.health.path, timeout=min(2.0, b.health.interval_s))
                if r.status_code < 500:
                    st = health.state(b.name)
                    # an open circuit waits out open_s even when /health answers (passive errors opened it:
                    # an engine can answer /health and still fail every generation); then the probe is the
                    # half-open trial
                    if st.state == "open" and not health.available(b.name):
                        return
                    if st.state != "closed" or st.consecutive_failures:
                        health.success(b.name)
                else:
                    health.failure(b.name, f"health check HTTP {r.status_code}")
            except (httpx.HTTPError, OSError) as e:
                health.failure(b.name, f"health check {type(e).__name__}")
        if due:
            await asyncio.gather(*(one(b) for b in due))
        await asyncio.sleep(0.5)
