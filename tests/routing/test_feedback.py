"""gateway/routing/feedback.py: the engine learner is fit on the engine's own part of the TTFT: after the
prediction, and less the time the dispatcher spent making the engine ready (a LoRA adapter's load, which the
prediction counts apart from the learned load time), so a load does not teach the engine's model that its
prefill is slow."""
from __future__ import annotations

import pytest

from gateway.pipeline import RequestContext
from gateway.routing.approx import ApproxPrefixIndex
from gateway.routing.feedback import feed_back
from gateway.routing.inflight import Flight
from gateway.routing.predictor import Features, Predictor


def _observed(setup_s: float) -> float:
    """The TTFT the learner was fed for a request of 0.6 s TTFT, 0.05 s from arrival to the prediction."""
    ctx = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    ctx.backend, ctx.status, ctx.ttft_s, ctx.setup_s = "e", 200, 0.6, setup_s
    f = Features(ahead_tokens=0.0, uncached_tokens=500.0, running=0.0)
    fl = Flight(ctx=ctx, engine="e", uncached=500, started=0.0, predicted_s=0.1, features={"e": f}, elapsed_s=0.05)
    p = Predictor()
    pred = p.learner("e").predict(f)
    feed_back(ctx, fl, predictor=p, approx=ApproxPrefixIndex(), avg_uncached={}, telemetry=None,
              has_telemetry_name=lambda n: False)
    return (p.learner("e").residuals[-1] + 1.0) * pred  # r = ttft / pred - 1


def test_the_learner_is_fed_the_ttft_after_the_prediction_less_the_engines_set_up():
    assert _observed(0.0) == pytest.approx(0.55)
    assert _observed(0.5) == pytest.approx(0.05)  # a 0.5 s adapter load is not the engine's prefill
