"""Learner feedback on finish: what a served request teaches the router (the engine's TTFT learner, its step
time, the approximate prefix tree, the mean uncached prompt, the KV index's cached-token accuracy) and the
evidence of predicted vs actual."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol

from gateway.pipeline import RequestContext
from gateway.routing.approx import ApproxPrefixIndex
from gateway.routing.inflight import Flight
from gateway.routing.predictor import Predictor

if TYPE_CHECKING:
    from gateway.routing.engines import EngineModel
    from gateway.routing.peers import PeerBus
    from gateway.routing.room import Room
    from gateway.telemetry.service import TelemetryService


class LearningStage(Protocol):
    """What the learners read of the route stage (gateway/routing/stage.py PredictiveRouteStage)."""

    room: Room
    clock: Callable[[], float]
    predictor: Predictor
    approx: ApproxPrefixIndex
    avg_uncached: dict[str, float]
    engines: EngineModel
    peers: PeerBus | None

    @property
    def telemetry(self) -> TelemetryService | None: ...


def engine_part(ttft_s: float, elapsed_s: float) -> float:
    """What the engine learner is fit on: the TTFT after the prediction was made. The time from arrival to the
    prediction (parse, policy, the /tokenize round trip, this box's CPU contention) is known when predicting and
    is added to the prediction as measured; fitting it with engine features left it as noise, since it follows the
    gateway host's load rather than the engine's (docs/benchmarks.md, Routing)."""
    return max(1e-4, ttft_s - max(0.0, elapsed_s))


def feed_back(ctx: RequestContext, fl: Flight, *, predictor: Predictor, approx: ApproxPrefixIndex,
              avg_uncached: dict[str, float], telemetry: TelemetryService | None,
              has_telemetry_name: Callable[[str], bool]) -> None:
    """Evidence of predicted vs actual for a finished flight; when it was served (200), train the serving
    engine's learners on it (the sample is the request's `outcome.learned`). A request that failed over from another engine is not a sample (its TTFT holds
    the failed attempt)."""
    served = ctx.backend or fl.engine
    ev = ctx.evidence
    ev["actual_ttft_ms"] = round(ctx.ttft_s * 1000, 3) if ctx.ttft_s is not None else None
    ev["predicted_cached_tokens"] = fl.cached.get(served)
    actual_cached = ctx.usage.cached_tokens if ctx.usage is not None else None
    ev["actual_cached_tokens"] = actual_cached
    if ctx.backend is None or ctx.status not in (0, 200):
        return
    approx.insert(served, fl.blocks)
    usage = ctx.usage
    uncached = (usage.prompt_tokens - (actual_cached or 0)) if usage and usage.prompt_tokens else fl.uncached
    a = avg_uncached.get(served)
    avg_uncached[served] = uncached if a is None else 0.9 * a + 0.1 * uncached
    failed_before = any("error" in x for x in ctx.attempts)
    f = fl.features.get(served)
    if ctx.ttft_s is not None and f is not None and not failed_before:
        # the engine's part: after the prediction, less the engine's set-up (an adapter's load, predicted apart)
        part = engine_part(ctx.ttft_s, fl.elapsed_s + ctx.setup_s)
        rel = predictor.observe(served, f, part, fl.uppers.get(served) or None)
        ev["ttft_prediction_error"] = round(rel, 4)
        ctx.outcome.learned = (served, f, part)  # the same sample goes to the peers (gateway/routing/stage.py)
    done = ctx.usage.completion_tokens if ctx.usage is not None else 0
    if ctx.stream and ctx.ttft_s is not None and done and done > 1:  # mean inter-token time: the step
        total = ctx.total_s if ctx.total_s is not None else time.perf_counter() - ctx.received_at
        predictor.observe_step(served, (total - ctx.ttft_s) / (done - 1))
    if actual_cached is not None and telemetry is not None and served in fl.cached \
            and ctx.backend_model is not None and has_telemetry_name(served):
        try:
            telemetry.observe_cached(served, fl.cached[served], actual_cached)
        except Exception:
            pass


class Learn:
    """The route stage's learners as a response-complete plugin (gateway/routing/plugin.py ResponseComplete): the
    TTFT learner and the rest `feed_back` feeds, the room check's healthy-concurrency sample, and the learner's
    sample to the peers (replicas learn from each other's responses)."""

    name = "learn"

    def __init__(self, stage: LearningStage) -> None:
        self.stage = stage

    def response_complete(self, ctx: RequestContext, fl: Flight) -> None:
        st = self.stage
        if ctx.ttft_s is not None and ctx.status in (0, 200) and ctx.backend == fl.engine:  # the room check's sample
            st.room.observe(fl.engine, st.clock(), fl.concurrency, ctx.ttft_s)
        tel = st.telemetry
        feed_back(ctx, fl, predictor=st.predictor, approx=st.approx, avg_uncached=st.avg_uncached, telemetry=tel,
                  has_telemetry_name=lambda name: st.engines.has_telemetry_name(name, tel))
        if st.peers is not None:  # the learner's sample, where feed_back observed one, to the peers
            st.peers.finished(ctx.request_id, ctx.outcome.learned)
