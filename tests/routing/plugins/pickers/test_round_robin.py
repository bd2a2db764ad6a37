"""`round_robin`: every candidate, starting one further each call, scores ignored."""
from gateway.routing.registry import build_plugin
from tests.routing.plugins.helpers import item, names


def test_round_robin_rotates_and_keeps_every_candidate():
    p = build_plugin({"type": "round_robin"})
    items = [item("a"), item("b"), item("c")]
    assert [names(p.order(items)) for _ in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                        ["a", "b", "c"]]
    assert p.order([]) == []
