"""What the router models about each engine: its view at routing time (own flights drained at the learned
rate, plus its last fresh scrape), its chunked-prefill budget and the facts /admin/routing shows."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from gateway.config import Config
from gateway.proxy.dialects import TELEMETRY_KINDS
from gateway.routing.inflight import InFlight
from gateway.routing.pending import PendingCache
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView
from gateway.routing.predictor import Predictor
from gateway.routing.view import Drain, Scrape, queue_view

if TYPE_CHECKING:
    from gateway.telemetry.service import TelemetryService

DEFAULT_UNCACHED = 512.0  # what one waiting request weighs until the engine's mean uncached prompt is observed
_ASK = object()  # "the telemetry service was not resolved by the caller: ask for it"


def publishes_telemetry(cand: Candidate) -> bool:
    """has_telemetry of a request that has a telemetry service: by the backend's kind."""
    return cand.backend.kind in TELEMETRY_KINDS


def no_telemetry(cand: Candidate) -> bool:
    """has_telemetry of a request without a telemetry service."""
    return False


class EngineModel:
    """Views, budgets and facts per engine over the stage's shared state (passed in, not owned)."""

    def __init__(self, config: Callable[[], Config], telemetry: Callable[[], TelemetryService | None],
                 predictor: Predictor,
                 inflight: InFlight, pending: PendingCache, avg_uncached: dict[str, float]) -> None:
        self._config = config
        self._telemetry = telemetry
        self.predictor = predictor
        self.inflight = inflight
        self.pending = pending
        self.avg_uncached = avg_uncached

    def has_telemetry(self, cand: Candidate) -> bool:
        return self._telemetry() is not None and cand.backend.kind in TELEMETRY_KINDS

    def has_telemetry_name(self, name: str, tel: Any = _ASK) -> bool:
        try:
            return (self._telemetry() if tel is _ASK else tel) is not None and \
                self._config().backend(name).kind in TELEMETRY_KINDS
        except KeyError:
            return False

    @staticmethod
    def telemetry_test(tel: Any) -> Callable[[Candidate], bool]:
        """`has_telemetry` for a request whose telemetry service (or None) the caller resolved once."""
        return publishes_telemetry if tel is not None else no_telemetry

    def drain(self, name: str, tel: Any = _ASK) -> Drain:
        """How fast the engine works off queued prefill (Predictor.drain at its chunk budget)."""
        return self.predictor.drain(name, self.chunk_budget(name, tel)[0])

    def view(self, name: str, now: float, has_tel: bool, drain: Drain | None = None, tel: Any = _ASK) -> EngineView:
        """`gateway.routing.view.engine_view` (shared with bench/routing_des.py; here `queue_view` of
        `InFlight.queue`) on this gateway's flights to the engine, drained at its learned rate, and its last
        scrape when fresh (other replicas' load).
        `drain` and `tel`: the engine's drain and the telemetry service where the caller has them already."""
        scrape = None
        if has_tel:
            t = self._telemetry() if tel is _ASK else tel
            load = t.load(name) if t is not None else None
            age = time.time() - load.scraped_at if load is not None else 1e9
            if load is not None and load.healthy and age < 5.0:
                scrape = Scrape(float(load.running), float(load.waiting), float(load.kv_usage), max(0.0, age))
        if drain is None:
            drain = self.drain(name, tel)
        n, queue, raw = self.inflight.queue(name, now)
        return queue_view(n, queue, raw, now, drain, scrape, self.avg_uncached.get(name, DEFAULT_UNCACHED))

    def chunk_budget(self, name: str, tel: Any = _ASK) -> tuple[int, str]:
        """The engine's chunked-prefill budget per step and where it comes from: `configured`
        (routing.prefill_token_budgets), `learned` (from its KV events, gateway/telemetry/chunk_budget.py), or
        `assumed` (routing.prefill_token_budget, until the engine showed one: shown as such in /admin/routing).
        `tel`: the telemetry service (or None) where the caller resolved it already."""
        rc = self._config().raw.routing
        b = rc.prefill_token_budgets.get(name)
        if b is not None:
            return b, "configured"
        if tel is _ASK:
            tel = self._telemetry()
        learned = tel.index.chunk_budget(name) if tel is not None else None
        if learned:
            return learned, "learned"
        return rc.prefill_token_budget, "assumed"

    def facts(self, name: str) -> dict[str, Any]:
        """What the router models about one engine, with the source of each fact (for /admin/routing)."""
        budget, src = self.chunk_budget(name)
        tel = self._telemetry()
        bs = tel.index.block_size(name) if tel is not None else None
        load = tel.load(name) if tel is not None else None
        cap = load.num_gpu_blocks if load is not None else None
        return {"chunk_budget": budget, "chunk_budget_source": src,
                "block_size": bs, "block_size_source": "kv events / metrics" if bs else "unknown",
                "kv_capacity_blocks": cap, "kv_capacity_source": "metrics (cache_config_info)" if cap else "unknown",
                "pending_blocks": self.pending.blocks(name),
                # what one request the engine's metrics count as waiting weighs in the view (view.engine_view)
                "mean_uncached_prompt": round(self.avg_uncached.get(name, DEFAULT_UNCACHED), 1),
                "mean_uncached_prompt_source": "observed" if name in self.avg_uncached else "assumed"}
