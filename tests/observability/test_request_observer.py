"""RequestObserver's prediction metrics: observed for a served request with a first token whose route picked
the backend that served it, and never for a JSON answer (no TTFT) or another backend's request."""
from __future__ import annotations

from gateway.metrics import Metrics
from gateway.observability.hooks import RequestObserver
from gateway.pipeline import RequestContext
from gateway.types import Usage


def _ctx(ttft_s: float | None, pick: str = "up", pred: object = 100.0) -> RequestContext:
    c = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    c.backend, c.backend_model, c.status, c.ttft_s = "up", "m", 200, ttft_s
    c.evidence.update(predicted_ttft_ms=pred, route={"pick": pick})
    c.usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=2)
    return c


def _counts(m: Metrics) -> tuple[float, float]:
    text = m.render().decode()
    get = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                           if line.startswith(f"{name}_count{{"))
    return get("gateway_ttft_prediction_error_ratio"), get("gateway_ttft_prediction_delta_seconds")


def test_prediction_metrics_only_for_a_first_token_on_the_picked_backend():
    m = Metrics()
    obs = RequestObserver(m, lambda: False)
    obs.observe(_ctx(None))  # a JSON answer
    obs.observe(_ctx(0.0))  # no first-token time either
    obs.observe(_ctx(0.12, pick="other"))
    obs.observe(_ctx(0.12, pred="120"))  # not a number
    assert _counts(m) == (0.0, 0.0)
    obs.observe(_ctx(0.12))
    obs.observe(_ctx(0.08))
    assert _counts(m) == (2.0, 2.0)
    text = m.render().decode()
    assert 'gateway_cached_prompt_tokens_total{backend="up",model="m"} 12.0' in text  # every served request
    assert list(obs.recent) == ["r"] * 6
