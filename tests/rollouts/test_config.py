"""Weighted alias targets in the config: accepted shapes and the errors that name the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.rollouts.service import rollouts_of


def _cfg(targets: list[Any], **alias: Any) -> Any:
    data = {"backends": [{"name": "b1", "url": "http://127.0.0.1:9/v1", "models": ["m1", "m2", "m3"]}],
            "aliases": [{"name": "a", "targets": targets, **alias}]}
    return parse_config(yaml.safe_dump(data), source="t.yaml", base_dir=Path("."))


def test_plain_strings_are_still_the_ordered_chain_and_no_rollout() -> None:
    c = _cfg(["m2", "m1"])
    assert c.resolve_model("a") == ("m2", "m1")
    assert rollouts_of(c) == {}


def test_weighted_targets_make_a_rollout_with_the_heaviest_as_stable() -> None:
    c = _cfg([{"model": "m2", "weight": 5}, {"model": "m1", "weight": 95}], sticky={"header": "X-Conv"},
             rollback={"min_requests": 10})
    assert c.resolve_model("a") == ("m2", "m1")  # the config-order chain before an arm is chosen
    r = rollouts_of(c)["a"]
    assert (r.arms, r.stable, r.sticky_header, r.rollback.min_requests) == (("m2", "m1"), "m1", "x-conv", 10)
    assert rollouts_of(_cfg([{"model": "m2", "weight": 5, "stable": True}, {"model": "m1", "weight": 95}])
                       )["a"].stable == "m2"


@pytest.mark.parametrize("targets,extra,where", [
    ([{"model": "m1", "weight": 5}, "m2"], {}, "aliases[0].targets[1]"),
    ([{"model": "m1", "weight": -1}], {}, "aliases[0].targets[0].weight"),
    ([{"model": "m1", "weight": 0}], {}, "aliases[0].targets"),
    ([{"model": "m1", "weight": 1, "stable": True}, {"model": "m2", "weight": 1, "stable": True}], {},
     "aliases[0].targets"),
    ([{"model": "m1", "weight": 1}, {"model": "m1", "weight": 2}], {}, "aliases[0].targets"),
    ([{"model": "nope", "weight": 1}], {}, "aliases[0].targets[0]"),
    ([{"model": "m1", "weight": 1}], {"rollback": {"window_s": 0}}, "aliases[0].rollback.window_s"),
    ([{"model": "m1", "weight": 1}], {"rollback": {"min_requests": 0}}, "aliases[0].rollback.min_requests"),
    ([{"model": "m1", "wieght": 1}], {}, "wieght"),
])
def test_a_bad_rollout_setting_names_its_key(targets: list[Any], extra: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError, match=r"t\.yaml.*" + where.replace("[", r"\[").replace("]", r"\]")):
        _cfg(targets, **extra)
