"""`prefix_hash`: the longest approximate prefix match wins once the best covers `threshold` of the prompt."""
from gateway.routing.registry import build_plugin
from tests.routing.plugins.helpers import item


def test_prefix_hash_prefers_the_match_above_the_threshold_else_least_load():
    s = build_plugin({"type": "prefix_hash"})
    assert s.threshold == 0.5
    hit = s.score([item(approx=0.9, inflight=3), item(approx=0.1)])
    assert hit[0] < hit[1] and hit == [-900 + 3, -100]
    assert s.score([item(approx=0.4, inflight=3), item(approx=0.1)]) == [3, 0]  # under threshold: load only
    strict = build_plugin({"type": "prefix_hash", "params": {"threshold": 0.95}})
    assert strict.score([item(approx=0.9, inflight=3), item(approx=0.1)]) == [3, 0]
