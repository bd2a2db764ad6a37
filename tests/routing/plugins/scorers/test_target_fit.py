"""`target_fit`: with a target, the engine meeting fill x target with least slack; without, the mean."""
from gateway.routing.registry import build_plugin
from gateway.routing.scorers.target_fit import target_fit_score
from tests.routing.plugins.helpers import item


def test_target_fit_scores_slack_under_the_line_and_upper_over_it():
    s = build_plugin({"type": "target_fit"})
    assert s.fill == 0.6  # the scorer's default (the pure function's is 0.8)
    out = s.score([item(pred=80, upper=100, target=1000), item(pred=500, upper=550, target=1000),
                   item(pred=700, upper=900, target=1000), item(pred=80, upper=100, target=None)])
    assert out == [600 - 100, 600 - 550, 1e6 + 900, 80]
    assert min(range(3), key=out.__getitem__) == 1  # least slack under 0.6 x 1000
    loose = build_plugin({"type": "target_fit", "params": {"fill": 1.0}})
    assert loose.score([item(pred=700, upper=900, target=1000)]) == [100]
    assert target_fit_score(None, None, 100) == 1e12
