"""The pure placement decisions (gateway/adapters/placement.py): resident preferred, load cost in the choice, a
free slot before an unload, the LRU unload never of an adapter with requests in flight, a full engine skipped;
and which engines a registered adapter becomes a candidate on."""
from __future__ import annotations

import pytest

from gateway.adapters.placement import (DEFAULT_LOAD_S, Slots, Step, adapter_backends, adapter_ids, choose,
                                        learn_load, lru_idle, mean_load, not_loaded_answer, step)
from gateway.config import ConfigError, parse_config
from gateway.pipeline import AdapterUse, RequestContext
from gateway.routing.plan import Candidate
from gateway.routing.prompt import lora_name


def test_a_resident_engine_is_kept_while_its_wait_is_shorter_than_a_load_elsewhere():
    """A cold adapter stays on one engine: its engine is slower, but not by a load."""
    slots = {"a": Slots(2, {"x": 1.0}), "b": Slots(2)}
    assert choose("x", [("a", 0.4), ("b", 0.01)], slots) == [("a", Step(False)), ("b", Step(True))]


def test_a_hot_adapter_spreads_when_loading_elsewhere_beats_waiting():
    """The resident engine's predicted wait (0.9 s) is longer than the other's TTFT plus the load (0.01 + 0.5 s)."""
    slots = {"a": Slots(2, {"x": 1.0}), "b": Slots(2)}
    assert choose("x", [("a", 0.9), ("b", 0.01)], slots) == [("b", Step(True)), ("a", Step(False))]
    # learned: a slow loader does not win it
    slots["b"].load_s = 2.0
    assert choose("x", [("a", 0.9), ("b", 0.01)], slots)[0] == ("a", Step(False))


def test_without_predictions_the_resident_engine_comes_first():
    """Pass-through (not modelled) engines have no TTFT: residency decides, then a free slot, then an unload."""
    slots = {"full": Slots(1, {"y": 1.0}), "free": Slots(1), "res": Slots(2, {"x": 1.0})}
    got = choose("x", [("full", None), ("free", None), ("res", None)], slots)
    assert got == [("res", Step(False)), ("free", Step(True)), ("full", Step(True, "y"))]


def test_the_ablation_routes_as_if_every_adapter_were_resident():
    """lora.choice: ignore_load (bench/adapters.py's load-on-miss): the lowest TTFT wins, residency only breaks ties."""
    slots = {"a": Slots(2, {"x": 1.0}), "b": Slots(2, load_s=3.0)}
    assert [n for n, _ in choose("x", [("a", 0.2), ("b", 0.1)], slots, load_aware=False)] == ["b", "a"]
    assert [n for n, _ in choose("x", [("a", 0.1), ("b", 0.1)], slots, load_aware=False)] == ["a", "b"]


def test_the_load_time_is_part_of_the_choice():
    slots = {"fast": Slots(2, load_s=2.0), "slow": Slots(2, load_s=0.1)}
    # fast engine, slow load: 0.2 + 2.0 > 0.5 + 0.1
    assert [n for n, _ in choose("x", [("fast", 0.2), ("slow", 0.5)], slots)] == ["slow", "fast"]
    # never measured: the prior
    slots = {"p": Slots(2), "q": Slots(2, load_s=0.1)}
    assert [n for n, _ in choose("x", [("p", 0.0), ("q", 0.3)], slots, prior_s=0.5)] == ["q", "p"]
    assert [n for n, _ in choose("x", [("p", 0.0), ("q", 0.5)], slots, prior_s=0.5)] == ["p", "q"]


def test_a_free_slot_is_taken_before_anything_is_unloaded():
    """An unload costs one more load (whoever needs the unloaded adapter loads it again): with equal engines the
    free slot wins; an engine that loads 30x faster may still be worth an unload."""
    slots = {"full": Slots(1, {"y": 1.0}, load_s=0.5), "free": Slots(1, load_s=0.5)}
    assert choose("x", [("full", 0.0), ("free", 0.0)], slots) == [("free", Step(True)), ("full", Step(True, "y"))]
    slots = {"full": Slots(1, {"y": 1.0}, load_s=0.1), "free": Slots(1, load_s=3.0)}
    assert choose("x", [("full", 0.0), ("free", 0.0)], slots) == [("full", Step(True, "y")), ("free", Step(True))]


def test_lru_unload_never_takes_an_adapter_with_requests_in_flight():
    s = Slots(3, {"old": 1.0, "mid": 2.0, "new": 3.0})
    assert step("x", s) == Step(True, "old")
    s.inflight["old"] = 1
    assert step("x", s) == Step(True, "mid")
    assert lru_idle(s.resident, {"old": 1, "mid": 2}) == "new"
    s.inflight.update(mid=1, new=4)
    assert step("x", s) is None  # every slot busy
    s.inflight["mid"] = 0
    assert step("x", s) == Step(True, "mid")


def test_an_engine_whose_slots_are_all_in_flight_is_not_a_candidate():
    slots = {"busy": Slots(1, {"y": 1.0}, {"y": 1}), "ok": Slots(1, {"z": 1.0})}
    assert choose("x", [("busy", 0.0), ("ok", 5.0)], slots) == [("ok", Step(True, "z"))]
    slots["ok"].inflight["z"] = 2
    assert choose("x", [("busy", 0.0), ("ok", 5.0)], slots) == []
    # resident but full: still served there (holding it takes no slot more)
    assert choose("x", [("busy", 0.0)], {"busy": Slots(1, {"x": 0.5}, {"x": 3})}) == [("busy", Step(False))]


def test_load_time_is_learned_and_the_prior_is_the_mean_of_observed():
    assert learn_load(None, 2.0) == 2.0
    assert abs(learn_load(2.0, 1.0) - 1.7) < 1e-9
    assert mean_load([Slots(1), Slots(1)]) == DEFAULT_LOAD_S
    assert mean_load([Slots(1, load_s=1.0), Slots(1, load_s=3.0), Slots(1)]) == 2.0


def test_resident_set_and_not_loaded_answers_are_read_from_the_engine():
    body = {"data": [{"id": "sim-model", "parent": None}, {"id": "x", "parent": "sim-model", "root": "/w/x"}]}
    assert adapter_ids(body, ["sim-model"]) == {"x"}
    assert adapter_ids({"error": "no"}, ["sim-model"]) == set()
    assert not_loaded_answer(404, "The model `x` does not exist. Valid aliases: sim-model.", "x")
    assert not not_loaded_answer(400, "The model `x` does not exist.", "x")


CFG = """
backends:
  - {name: dyn, url: "http://e1/v1", kind: sim, models: [base], lora: {dynamic: true, max_loras: 2}}
  - {name: fixed, url: "http://e2/v1", kind: sim, models: [base]}
  - {name: other, url: "http://e3/v1", kind: sim, models: [other], lora: {dynamic: true}}
"""


def test_a_registered_adapter_is_a_candidate_on_the_dynamic_engines_of_its_base_keyed_by_its_name():
    cfg = parse_config(CFG)
    ctx = RequestContext(request_id="r", endpoint="chat", headers={}, body={})
    assert adapter_backends(cfg, ctx, "ad") == []  # not let through by the adapters stage
    ctx.adapter = AdapterUse("ad", "base")  # what the adapters stage sets
    ctx.evidence["adapter"] = {"name": "ad", "base_model": "base"}
    bs = adapter_backends(cfg, ctx, "ad")
    assert [b.name for b in bs] == ["dyn"]
    assert lora_name(Candidate(backend=bs[0], model="ad")) == "ad"
    assert [b.name for b in adapter_backends(cfg, ctx, "base")] == ["dyn", "fixed"]  # the config's, as before


def test_lora_config_is_validated():
    with pytest.raises(ConfigError, match="max_loras"):
        parse_config(CFG.replace("max_loras: 2", "max_loras: 0"))
    with pytest.raises(ConfigError, match="refresh_s"):
        parse_config(CFG.replace("max_loras: 2", "max_loras: 2, refresh_s: 0"))
