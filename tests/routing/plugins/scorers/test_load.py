"""`load`: own in flight + engine waiting + 0.1 x running, in requests."""
import pytest

from gateway.routing.registry import build_plugin
from tests.routing.plugins.helpers import item


def test_load_scores_inflight_plus_waiting_plus_a_tenth_of_running():
    s = build_plugin({"type": "load", "weight": 2.5})
    assert s.unit == "requests" and s.weight == 2.5
    assert s.score([item(inflight=2, waiting=1, running=10), item()]) == [pytest.approx(4.0), 0.0]
