"""`min_score`: lowest total first, ties by load; a session's engine leads when within the affinity slack."""
from gateway.routing.registry import build_plugin
from tests.routing.plugins.helpers import item, names


def _totals(totals, **kw):
    out = []
    for i, t in enumerate(totals):
        s = item(f"e{i}", inflight=kw.get("loads", [0] * len(totals))[i], affinity=kw.get("aff") == i)
        s.total = t
        out.append(s)
    return out


def test_min_score_orders_by_total_then_load():
    p = build_plugin({"type": "min_score"})
    assert names(p.order(_totals([30.0, 10.0, 20.0]))) == ["e1", "e2", "e0"]
    assert names(p.order(_totals([10.0, 10.0], loads=[3, 1]))) == ["e1", "e0"]


def test_min_score_affinity_only_with_a_slack():
    assert names(build_plugin({"type": "min_score"}).order(_totals([10.0, 20.0], aff=1))) == ["e0", "e1"]
    p = build_plugin({"type": "min_score", "params": {"affinity_slack_ms": 15}})
    assert names(p.order(_totals([10.0, 20.0], aff=1))) == ["e1", "e0"]  # within 15 of the best
    assert names(p.order(_totals([10.0, 40.0], aff=1))) == ["e0", "e1"]  # not within
    rel = build_plugin({"type": "min_score", "params": {"affinity_rel": 0.5}})
    assert names(rel.order(_totals([100.0, 140.0], aff=1))) == ["e1", "e0"]  # within 50% of |best|
