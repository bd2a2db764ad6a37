"""The batch lane's pacer reads the real router (PredictiveRouteStage and its Predictor) without dispatching:
concurrency rises while the predicted realtime TTFT has headroom and halves when it does not; lines start only
on engines with prefill room (engine_room: pure, no timing)."""
from __future__ import annotations

import yaml

from gateway.app import Gateway
from gateway.batch.scheduler import Pacer, realtime_prediction
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.pipeline import RequestContext
from gateway.types import Decision, Principal
from gateway.routing.stage import PredictiveRouteStage


def _gw(**batch) -> Gateway:
    cfg = parse_config(yaml.safe_dump({
        "backends": [{"name": f"e{i}", "kind": "openai", "url": f"http://127.0.0.1:{9900 + i}/v1",
                      "models": ["m"], "location": {"country": "DE"}} for i in range(2)],
        "routing": {"default_ttft_slo_ms": 1000},
        "batch": {"min_concurrency": 1, "max_concurrency": 8, "headroom": 0.5, "clear_engines": 0, **batch}}))
    gw = Gateway(cfg)
    gw.router = PredictiveRouteStage(lambda: gw.config, gw.health)
    return gw


def _realtime(i: int, prompt_tokens: int) -> RequestContext:
    c = RequestContext(request_id=f"rt-{i}", endpoint="chat", headers={},
                       body={"model": "m", "messages": [{"role": "user", "content": f"question {i} " + "x" * 64}]})
    c.model, c.model_chain, c.prompt_tokens_est = "m", ("m",), prompt_tokens
    c.principal = Principal(id="k", kind="api_key", tenant="acme")
    c.decision = Decision(allow=True, priority="realtime")
    return c


async def test_concurrency_rises_while_idle_and_halves_under_realtime_load():
    gw = _gw()
    p = Pacer(gw.config.raw.batch)
    assert p.allowance(gw, [], 0) == 1  # idle fleet: the cold-start prediction is far under 0.5 x 1000 ms
    grown = [p.allowance(gw, [], int(p.conc)) for _ in range(20)]  # every slot busy each tick: +1 per tick
    assert int(p.conc) == 8 and grown[-1] == 0 and p.room
    idle = realtime_prediction(gw)
    assert idle < 500
    # realtime load: requests routed (not dispatched) by the real route stage queue prefill on both engines
    ctxs = []
    for i in range(8):
        c = _realtime(i, 3000)
        try:
            await gw.router.run(c)
            ctxs.append(c)
        except GatewayError as e:  # admission refuses realtime once the fleet is full: it leaves no flight
            assert e.code == "ttft_slo_unattainable"
    assert len(ctxs) >= 2
    busy = realtime_prediction(gw)
    assert busy > 500 > idle
    assert p.allowance(gw, [], 8) == 0 and not p.room and int(p.conc) == 4  # halved, no new line
    assert p.allowance(gw, [], 8) == 0 and int(p.conc) == 4  # at most one halving per cooldown
    for c in ctxs:  # realtime finishes: room again, and concurrency climbs back
        await gw.router.finish(c)
    assert realtime_prediction(gw) < 500
    assert p.allowance(gw, [], 4) == 0 and p.room and int(p.conc) == 5  # 4 lines routing has not placed take
    assert p.allowance(gw, [], 1) == 1 and int(p.conc) == 5  # both engines' prefill room; with one, one is left


def test_only_max_concurrency_bounds_without_a_router():
    gw = _gw(max_concurrency=3)
    gw.router = None
    p = Pacer(gw.config.raw.batch)
    for _ in range(5):
        p.allowance(gw, [], int(p.conc))
    assert int(p.conc) == 3 and p.allowance(gw, [], 1) == 2


def test_unworkable_batch_settings_are_refused_naming_file_line_and_key():
    import pytest

    from gateway.config import ConfigError

    for text, key in (("batch:\n  lease_s: 0\n", "batch.lease_s"),
                      ("batch:\n  min_concurrency: 4\n  max_concurrency: 2\n", "batch.max_concurrency"),
                      ("batch:\n  headroom: -1\n", "batch.headroom")):
        with pytest.raises(ConfigError) as e:
            parse_config(text, source="g.yaml")
        assert str(e.value).startswith("g.yaml:") and key in str(e.value)


# ---------------------------------------------------------------- prefill room per engine (pure decisions)

def test_engine_room_no_line_while_realtime_prefills_or_batch_prefill_is_full():
    from gateway.batch.scheduler import engine_room

    assert engine_room(0, 0, None, 0.0, 1, 1.0)
    assert not engine_room(1, 0, None, 0.0, 1, 1.0)  # a realtime request before its first token there
    assert not engine_room(0, 1, 5.0, 0.1, 1, 1.0)  # the engine already has its batch line prefilling
    assert engine_room(0, 1, 5.0, 0.1, 2, 1.0)
    assert engine_room(0, 0, 0.0, 0.1, 1, 1.0)  # duty 1: the next line may start as soon as the last prefilled


def test_engine_room_duty_spaces_line_starts_by_predicted_prefill_over_duty():
    from gateway.batch.scheduler import engine_room

    assert not engine_room(0, 0, 0.39, 0.1, 1, 0.25)  # 0.1 s prefill at duty 0.25: one start per 0.4 s
    assert engine_room(0, 0, 0.40, 0.1, 1, 0.25)
    assert engine_room(0, 0, None, 0.1, 1, 0.25)  # nothing started there yet


class _Fl:
    """A flight as the pacer reads it (gateway/batch/scheduler.py FlightView)."""

    def __init__(self, batch: bool, started: float, prefilling: bool, predicted_s: float = 0.1):
        self.is_batch = batch
        self.started, self.predicted_s, self._p = started, predicted_s, prefilling

    def prefilling(self, now: float) -> bool:
        return self._p


def test_engine_loads_splits_realtime_and_batch_before_first_token():
    from types import SimpleNamespace

    from gateway.batch.scheduler import engine_loads

    router = SimpleNamespace(flights={
        "e0": {"a": _Fl(False, 1.0, True), "b": _Fl(True, 2.0, False, 0.2), "c": _Fl(True, 3.0, True, 0.3)},
        "e1": {"d": _Fl(False, 1.0, False)}})
    loads = engine_loads(router, 10.0)
    assert loads["e0"] == (1, 1, 3.0, 0.3)  # newest batch start and its predicted prefill
    assert loads["e1"] == (0, 0, None, 0.0)


def test_rooms_count_engines_with_room_less_lines_not_yet_routed():
    from types import SimpleNamespace

    gw = _gw(max_prefilling_per_engine=1, prefill_duty=1.0)
    p = Pacer(gw.config.raw.batch)
    gw.router = SimpleNamespace(clock=lambda: 10.0, flights={})
    assert p.rooms(gw, 0) == 2  # two idle engines
    assert p.rooms(gw, 1) == 1  # one line started, routing has not placed it yet: it takes a room
    gw.router.flights = {"e0": {"x": _Fl(True, 9.9, True)}}
    assert p.rooms(gw, 1) == 1  # placed on e0 (prefilling there): e1 is left
    gw.router.flights = {"e0": {"x": _Fl(True, 9.9, True)}, "e1": {"r": _Fl(False, 9.9, True)}}
    assert p.rooms(gw, 1) == 0  # e1 has realtime before its first token


def test_rooms_duty_remembers_the_last_start_after_the_line_is_gone():
    from types import SimpleNamespace

    gw = _gw(prefill_duty=0.25)
    p = Pacer(gw.config.raw.batch)
    now = [10.0]
    gw.router = SimpleNamespace(clock=lambda: now[0], flights={"e0": {"x": _Fl(True, 10.0, False, 0.1)}})
    assert p.rooms(gw, 1) == 1  # e0 waits 0.4 s after that start, e1 is free
    gw.router.flights = {}  # the line finished
    now[0] = 10.3
    assert p.rooms(gw, 0) == 1
    now[0] = 10.41
    assert p.rooms(gw, 0) == 2


def test_fleet_room_keeps_engines_clear_for_arriving_realtime():
    from gateway.batch.scheduler import fleet_room

    assert fleet_room(rooms=2, clear=2, engines=2, keep_clear=1, unplaced=0) == 1  # one engine stays clear
    assert fleet_room(rooms=1, clear=1, engines=2, keep_clear=1, unplaced=0) == 0  # the other one is busy
    assert fleet_room(rooms=2, clear=2, engines=2, keep_clear=0, unplaced=0) == 2
    assert fleet_room(rooms=2, clear=2, engines=2, keep_clear=1, unplaced=1) == 0  # a started line takes one
    assert fleet_room(rooms=1, clear=1, engines=1, keep_clear=1, unplaced=0) == 1  # one engine: cannot keep any
    assert fleet_room(rooms=3, clear=4, engines=4, keep_clear=1, unplaced=0) == 3


def test_rooms_with_clear_engines_leave_one_engine_without_prefill():
    from types import SimpleNamespace

    gw = _gw(clear_engines=1)
    p = Pacer(gw.config.raw.batch)
    gw.router = SimpleNamespace(clock=lambda: 10.0, flights={})
    assert p.rooms(gw, 0) == 1
    gw.router.flights = {"e1": {"r": _Fl(False, 9.9, True)}}  # realtime prefilling on e1: e0 is the clear one
    assert p.rooms(gw, 0) == 0
    gw.router.flights = {"e1": {"r": _Fl(False, 9.0, False)}}  # its first token came: decodes leave e1 clear
    assert p.rooms(gw, 0) == 1


def test_prefill_duty_out_of_range_is_refused():
    import pytest

    from gateway.config import ConfigError

    for text in ("batch:\n  prefill_duty: 0\n", "batch:\n  prefill_duty: 1.5\n",
                 "batch:\n  max_prefilling_per_engine: 0\n", "batch:\n  clear_engines: -1\n"):
        with pytest.raises(ConfigError) as e:
            parse_config(text, source="g.yaml")
        assert str(e.value).startswith("g.yaml:")
