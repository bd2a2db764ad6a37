"""gateway/routing/prediction.py: the predicted TTFT of a candidate counts what the engine must do before it can
start the request (a LoRA adapter's load where it is not resident), in the mean and the upper bound, and the
evidence says how much of it was the load."""
from __future__ import annotations

from gateway.config import parse_config
from gateway.routing.approx import ApproxPrefixIndex
from gateway.routing.plan import Candidate
from gateway.routing.plugin import EngineView
from gateway.routing.prediction import predict_candidates
from gateway.routing.predictor import Predictor

CFG = parse_config("""
backends:
  - {name: a, url: "http://a/v1", kind: sim, models: [m]}
  - {name: b, url: "http://b/v1", kind: sim, models: [m]}
""")


def _predict(setup):
    cands = [Candidate(CFG.backend("a"), "m"), Candidate(CFG.backend("b"), "m")]
    predict_candidates(cands, 100, {}, [], None, 0.0, None, [EngineView(), EngineView()], Predictor(),
                       ApproxPrefixIndex(), setup)
    return cands


def test_an_engine_that_must_load_the_adapter_first_is_predicted_later_by_the_load():
    plain = _predict(None)
    loaded = _predict({"b": 0.75})
    assert loaded[0].predicted_ttft_ms == plain[0].predicted_ttft_ms
    assert "adapter_load_ms" not in loaded[0].info
    assert abs(loaded[1].predicted_ttft_ms - plain[1].predicted_ttft_ms - 750.0) < 1e-6
    assert abs(loaded[1].predicted_ttft_upper_ms - plain[1].predicted_ttft_upper_ms - 750.0) < 1e-6
    assert loaded[1].info["adapter_load_ms"] == 750.0
    assert loaded[1].to_evidence()["adapter_load_ms"] == 750.0
