"""The routing plugin registry: presets expand to today's plugin lists, lists build in order, and a bad
entry (unknown type, bad weight, bad or unknown param, two pickers) is a config error naming it."""
from __future__ import annotations

import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.routing.filters.capacity import ContextFilter
from gateway.routing.pickers.min_score import MinScorePicker
from gateway.routing.pickers.round_robin import RoundRobinPicker
from gateway.routing.plugin import Scorer
from gateway.routing.registry import (PRESETS, build_strategy, plugin_types, register, strategy_error,
                                      strategy_label)
from tests.routing.plugins.helpers import item, names


def _parse(strategy, **routing):
    return parse_config(yaml.safe_dump({"backends": [{"name": "a", "url": "http://a/v1", "models": ["m"]}],
                                        "routing": {"strategy": strategy, **routing}}))


def test_every_plugin_module_is_discovered_and_registered_by_type():
    kinds = {t: c.kind for t, c in plugin_types().items()}
    assert kinds == {"capacity": "filter", "predicted_ttft": "scorer", "load": "scorer", "prefix_hash": "scorer",
                     "target_fit": "scorer", "min_score": "picker", "round_robin": "picker"}


def test_presets_expand_to_todays_plugin_lists():
    assert PRESETS == ("predicted_ttft", "least_loaded", "round_robin", "prefix_hash", "target_fit")
    shape = {}
    for name in PRESETS:
        s = build_strategy(name, 15.0, 0.1)
        assert s.name == name and [type(f) for f in s.filters] == [ContextFilter]
        shape[name] = ([sc.name for sc in s.scorers], s.picker.name,
                       getattr(s.picker, "affinity_slack", None), getattr(s.picker, "affinity_rel", None))
    assert shape == {"predicted_ttft": (["predicted_ttft"], "min_score", 15.0, 0.1),
                     "least_loaded": (["load"], "min_score", 0.0, 0.0),
                     "round_robin": ([], "round_robin", None, None),
                     "prefix_hash": (["prefix_hash"], "min_score", 0.0, 0.0),
                     "target_fit": (["target_fit"], "min_score", 15.0, 0.1)}
    assert all(sc.weight == 1.0 for n in PRESETS for sc in build_strategy(n).scorers)
    with pytest.raises(ValueError, match="unknown routing strategy 'fastest'"):
        build_strategy("fastest")


def test_a_list_builds_its_plugins_in_order_with_weights_params_and_a_default_picker():
    s = build_strategy([{"type": "capacity"}, {"type": "predicted_ttft"},
                        {"type": "load", "weight": 20}, {"type": "prefix_hash", "weight": 0.5,
                                                         "params": {"threshold": 0.8}}])
    assert [(x.name, x.weight) for x in s.scorers] == [("predicted_ttft", 1.0), ("load", 20.0), ("prefix_hash", 0.5)]
    assert s.scorers[2].threshold == 0.8 and isinstance(s.picker, MinScorePicker)
    assert s.name == "capacity,predicted_ttft*1,load*20,prefix_hash*0.5"
    rr = build_strategy([{"type": "round_robin"}])
    assert isinstance(rr.picker, RoundRobinPicker) and rr.filters == [] and rr.scorers == []


def test_weights_combine_as_a_weighted_sum_lower_is_better():
    # e0: 100 ms, 3 in flight; e1: 130 ms, idle
    items = lambda: [item("e0", pred=100.0, inflight=3), item("e1", pred=130.0)]  # noqa: E731
    ttft_only = build_strategy([{"type": "predicted_ttft"}])
    assert names(ttft_only.run(items(), 10)[0]) == ["e0", "e1"]
    mixed = build_strategy([{"type": "predicted_ttft"}, {"type": "load", "weight": 20}])
    kept, _ = mixed.run(items(), 10)
    assert names(kept) == ["e1", "e0"]  # 3 requests x 20 = 60 ms-equivalents outweigh 30 ms
    assert kept[1].total == pytest.approx(160.0) and kept[1].scores == {"predicted_ttft": 100.0, "load": 3.0}
    assert kept[1].cand.score == pytest.approx(160.0)


@pytest.mark.parametrize("strategy,key,msg", [
    ("fastest", "routing.strategy", "must be a list of plugins or one of predicted_ttft, least_loaded"),
    ([], "routing.strategy", "an empty list routes nothing"),
    ([{"type": "capacity"}, {"type": "lod"}], "routing.strategy[1].type", "unknown plugin type 'lod'; known: "),
    ([{"type": "load", "weight": -1}], "routing.strategy[0].weight", "must be a finite number >= 0"),
    ([{"type": "load", "weight": "heavy"}], "routing.strategy[0].weight", "Expected `float | null`"),
    ([{"type": "capacity", "weight": 2}], "routing.strategy[0].weight", "only scorers take a weight"),
    ([{"type": "prefix_hash", "params": {"threshold": 2}}], "routing.strategy[0].params.threshold",
     "must be between 0 and 1 (got 2)"),
    ([{"type": "prefix_hash", "params": {"treshold": 0.5}}], "routing.strategy[0].params.treshold",
     "unknown param for 'prefix_hash' (it takes: threshold)"),
    ([{"type": "load", "params": {"x": 1}}], "routing.strategy[0].params.x", "(it takes: none)"),
    ([{"type": "target_fit", "params": {"fill": "most"}}], "routing.strategy[0].params.fill",
     "must be > 0 and <= 1 (got 'most')"),
    ([{"type": "min_score"}, {"type": "round_robin"}], "routing.strategy[1]", "a strategy has one picker"),
    ([{"type": "load", "wieght": 1}], "routing.strategy[0].wieght", "unknown key"),
])
def test_a_bad_strategy_is_a_config_error_naming_the_entry(strategy, key, msg):
    with pytest.raises(ConfigError) as e:
        _parse(strategy)
    assert f": {key}: " in str(e.value) and msg in str(e.value), str(e.value)
    assert str(e.value).startswith("<config>:")  # with the line of the entry


def test_target_fit_flag_applies_to_the_preset_only():
    assert _parse("predicted_ttft", target_fit=True).raw.routing.target_fit is True
    with pytest.raises(ConfigError, match="routing.target_fit: applies to the predicted_ttft preset only"):
        _parse([{"type": "predicted_ttft"}], target_fit=True)


def test_valid_strategies_parse_and_are_labelled():
    for name in PRESETS:
        assert strategy_error(name) is None and _parse(name).raw.routing.strategy == name
    cfg = _parse([{"type": "capacity"}, {"type": "load", "weight": 2}, {"type": "min_score",
                                                                       "params": {"affinity_slack_ms": 5}}])
    assert strategy_label(cfg.raw.routing.strategy) == "capacity,load*2,min_score"


def test_a_new_scorer_is_one_registered_class():
    from gateway.routing import registry

    @register("test_only_constant")
    class ConstantScorer(Scorer):
        unit = "points"

        def score(self, items):
            return [7.0 for _ in items]

    try:
        assert strategy_error([{"type": "test_only_constant", "weight": 2}]) is None
        s = build_strategy([{"type": "test_only_constant", "weight": 2}])
        kept, _ = s.run([item("e0")], 1)
        assert kept[0].total == 14.0
        with pytest.raises(ValueError, match="registered twice"):
            register("load")(ConstantScorer)
    finally:
        registry._REGISTRY.pop("test_only_constant", None)
