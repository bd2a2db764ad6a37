"""`predicted_ttft`: the mean prediction in ms, 1e12 when there is none."""
from gateway.routing.registry import build_plugin
from tests.routing.plugins.helpers import item


def test_predicted_ttft_scores_the_mean_prediction_and_puts_unpredicted_last():
    s = build_plugin({"type": "predicted_ttft"})
    assert s.kind == "scorer" and s.unit == "ms" and s.weight == 1.0
    assert s.score([item(pred=120.5), item(pred=None), item(pred=80.0)]) == [120.5, 1e12, 80.0]
