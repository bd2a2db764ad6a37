"""The flow gate (gateway/routing/gate.py) on a scripted fleet: it releases waiting requests in fair order,
one at a time, only to an engine that is open for them; a request whose slack runs out gets QueueTimeout; a
full flow queue refuses at once; a cancelled waiter leaves the queue; the prefill guard holds a long prompt
until a slot frees, and the wait estimate includes that."""
from __future__ import annotations

import asyncio

import pytest

from gateway.routing.config import FlowControlConfig
from gateway.routing.flow import LongFlight, Waiter
from gateway.routing.gate import FlowGate, FlowQueueFull, QueueTimeout
from gateway.routing.view import Drain

DRAIN = Drain(step_s=0.02, s_per_token=1 / 6000, budget=2048)


class Fleet:
    """Engines whose queued prefill tokens the test sets; long prompts prefilling per engine."""

    def __init__(self, names: list[str]) -> None:
        self.ahead = dict.fromkeys(names, 0.0)
        self.longs: dict[str, list[LongFlight]] = {}
        self.t = 0.0

    def state(self, name: str, now: float) -> tuple[float, float, float, Drain]:
        return self.ahead[name], self.ahead[name], 0.0, DRAIN

    def long_flights(self, now: float, limits) -> dict[str, list[LongFlight]]:
        return {e: [f for f in fl if f.ends_at > now] for e, fl in self.longs.items()}


def gate(fleet: Fleet, **kw) -> FlowGate:
    cfg = FlowControlConfig(**{"tick_ms": 1.0, **kw})
    return FlowGate(lambda: cfg, lambda: fleet.t, fleet.state, fleet.long_flights, lambda name: (2048, "learned"))


def w(flow: str, engines=("e1",), cost: int = 300, deadline: float = 10.0) -> Waiter:
    return Waiter(flow, "standard", float(cost), False, frozenset(engines), 0.0, deadline,
                  uncached=dict.fromkeys(engines, cost))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0.005)


async def test_waiters_are_released_in_fair_order_one_at_a_time_when_an_engine_opens():
    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 10_000  # closed
    g = gate(fleet)
    g.queue.charge("b", prefill_tokens=5_000)  # b was served more than a
    got: list[str] = []

    async def one(x: Waiter) -> None:
        await g.wait(x, 1.0)
        got.append(x.flow)

    tasks = [asyncio.create_task(one(w("b"))), asyncio.create_task(one(w("b")))]
    await _settle()
    tasks.append(asyncio.create_task(one(w("a"))))
    await _settle()
    assert got == [] and len(g.queue) == 3
    fleet.ahead["e1"] = 0.0  # opens
    await _settle()
    assert got == ["a"]  # the flow under its share first, and only one: the released one has not dispatched yet
    assert g.releasing is not None
    g.started("a", 1.0, 300.0, g.releasing, 0.0, "standard")
    await _settle()
    assert got == ["a", "b"]
    g.started("b", 1.0, 300.0, g.releasing, 0.0, "standard")
    await asyncio.gather(*tasks)
    assert got == ["a", "b", "b"] and g.stats["released"] == 3


async def test_a_waiter_whose_slack_runs_out_gets_queue_timeout_and_leaves_the_queue():
    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 10_000
    g = gate(fleet)
    loop = asyncio.get_running_loop()
    g.clock = loop.time
    with pytest.raises(QueueTimeout):
        await g.wait(w("a", deadline=loop.time() + 0.05), 1.0)
    assert len(g.queue) == 0 and g.stats["timeouts"] == 1


async def test_a_full_flow_queue_refuses_at_once_other_flows_still_queue():
    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 10_000
    g = gate(fleet, max_queue_per_flow=2)
    tasks = [asyncio.create_task(g.wait(w("a"), 1.0)) for _ in range(2)]
    await _settle()
    with pytest.raises(FlowQueueFull):
        await g.wait(w("a"), 1.0)
    t_b = asyncio.create_task(g.wait(w("b"), 1.0))
    await _settle()
    assert g.queue.depth() == {("standard", "a"): 2, ("standard", "b"): 1}
    for t in [*tasks, t_b]:
        t.cancel()
    await asyncio.gather(*tasks, t_b, return_exceptions=True)
    assert len(g.queue) == 0  # cancelled waiters (clients that left) are taken out


async def test_a_waiter_is_released_only_to_its_own_engines():
    fleet = Fleet(["e1", "e2"])
    fleet.ahead["e1"] = 10_000
    g = gate(fleet)
    t = asyncio.create_task(g.wait(w("a", engines=("e1",)), 1.0))
    await _settle()
    assert not t.done()  # e2 is open, but not allowed for it
    fleet.ahead["e1"] = 0.0
    assert await t == frozenset({"e1"})


async def test_a_long_prompt_waits_for_a_guard_slot_and_the_estimate_says_how_long():
    fleet = Fleet(["e1", "e2"])
    fleet.t = 100.0
    fleet.longs = {"e1": [LongFlight(12_000, 103.0)]}  # one long prefill on e1 until t=103
    g = gate(fleet, long_engine_share=0.5)
    unc = {"e1": 12_000, "e2": 12_000}
    assert g.long_on(unc) == {"e1": True, "e2": True}  # 2 x the 2048-token chunk budget
    assert g.may_start(unc, fleet.t) == frozenset()  # half of two engines already prefill a long prompt
    wait_s, _ = g.predicted_wait("standard", "a", 1.0, unc, fleet.t)
    assert wait_s == pytest.approx(3.0)
    # short prompts still go, to the engine without a long prefill in progress
    assert g.may_start({"e1": 300, "e2": 300}, fleet.t) == frozenset({"e2"})
    assert g.predicted_wait("standard", "a", 1.0, {"e1": 300}, fleet.t)[0] == pytest.approx(3.0)
    fleet.t = 103.5
    assert g.may_start(unc, fleet.t) == frozenset({"e1", "e2"})


def test_per_engine_limits_override_the_defaults():
    from gateway.routing.config import LongPrefillLimits

    fleet = Fleet(["e1", "e2"])
    g = gate(fleet, long_prompt_tokens=8000, engines={"e2": LongPrefillLimits(long_prompt_tokens=20_000,
                                                                                 max_long_prefills=2)})
    assert g.long_on({"e1": 12_000, "e2": 12_000}) == {"e1": True, "e2": False}
    assert g.limits("e2").max_long_prefills == 2 and g.limits("e1").max_long_prefills == 1


def test_the_gate_is_strict_only_while_more_than_one_flow_is_served():
    fleet = Fleet(["e1"])
    g = gate(fleet)
    assert not g.contended(fleet.t)
    g.started("a", 1.0, 300.0, None, 0.0, "standard")
    assert not g.contended(fleet.t)  # one flow alone: its prompts may fill a step
    g.started("b", 1.0, 300.0, None, 0.0, "standard")
    assert g.contended(fleet.t)
    fleet.t += 5.0
    assert not g.contended(fleet.t)  # both idle for longer than CONTENTION_S


def test_an_open_engine_much_slower_than_the_best_is_not_taken():
    """e_slow is open (nothing queued) but under many decodes; e_fast is closed behind 900 queued tokens.
    Waiting the moment until e_fast opens is the shorter way, so e_slow is no option; with both open (or both
    idle) the strategy orders them."""
    fleet = Fleet(["e_fast", "e_slow"])
    running = {"e_fast": 2.0, "e_slow": 40.0}
    fleet.state = lambda name, now: (fleet.ahead[name], fleet.ahead[name], running[name], DRAIN)

    def predict(name: str, ahead: float, uncached: float, run: float) -> float:
        speed = 2.0 if name == "e_fast" else 0.5
        return (0.02 + (ahead + uncached) / 6000 + 0.005 * run) / speed

    cfg = FlowControlConfig(tick_ms=1.0)
    g = FlowGate(lambda: cfg, lambda: fleet.t, fleet.state, fleet.long_flights, lambda name: (2048, "learned"),
                 predict)
    unc = {"e_fast": 300, "e_slow": 300}
    fleet.ahead["e_fast"] = 300.0
    assert g.may_start(unc, fleet.t) == frozenset({"e_fast", "e_slow"})  # both open: the strategy orders them
    fleet.ahead["e_fast"] = 900.0  # now closed
    assert g.may_start(unc, fleet.t) == frozenset()  # and e_slow (predicted 0.74 s vs 0.11 s) is no option
    running["e_slow"] = 0.0  # idle, e_slow is predicted 0.14 s against e_fast's 0.04 s: within 100 ms
    fleet.ahead["e_fast"] = 0.0
    assert g.may_start(unc, fleet.t) == frozenset({"e_fast", "e_slow"})


async def test_a_model_that_holds_while_the_engine_has_room_is_overruled_and_says_so_once(caplog):
    """Issue 34: the harmful-hold check. The drain model calls e1 closed (10k tokens ahead) while the engine has
    fewer requests in flight than it served in the last minute without its TTFT rising: holding would be a
    defect, so e1 is open; the change of state is logged and counted once, and again when it ends."""
    import logging

    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 10_000  # the model: closed
    room = {"e1": (3, 8)}  # 3 in flight, healthy at 8
    cfg = FlowControlConfig(tick_ms=1.0)
    g = FlowGate(lambda: cfg, lambda: fleet.t, fleet.state, fleet.long_flights, lambda name: (2048, "learned"),
                 room=lambda name, now: room[name])
    with caplog.at_level(logging.INFO, logger="gateway.routing.flow"):
        assert g.may_start({"e1": 300}, 0.0) == frozenset({"e1"})
        assert g.may_start({"e1": 300}, 0.0) == frozenset({"e1"})
        assert g.stats["harmful_holds"] == 1 and g.holding_with_room == {"e1"}
        assert g.snapshot()["holding_with_room"] == ["e1"]
        room["e1"] = (8, 8)  # at its healthy peak: the model's hold stands
        assert g.may_start({"e1": 300}, 0.0) == frozenset()
        assert g.holding_with_room == set()
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "while it has room (3 in flight, 8 served" in msgs[0] and "no longer" in msgs[1]
    # a waiting request is released by the pump through the same check
    room["e1"] = (1, 8)
    x = w("a")
    assert await asyncio.wait_for(g.wait(x, 1.0), 1.0) == frozenset({"e1"})
    assert g.stats["harmful_holds"] == 2


def test_the_waits_upper_bound_adds_the_recent_waits_error():
    """Issue 34: the bound admission holds a queued request to counts how wrong the predicted waits were (the
    upper quantile of waited - predicted over the recent ones), so requests are refused on arrival rather than
    served late."""
    fleet = Fleet(["e1"])
    g = gate(fleet)
    assert g.wait_margin() == 0.0
    for i in range(9):
        g.observe_wait(Waiter("a", "standard", 1.0, False, frozenset({"e1"}), 0.0, 1.0, predicted_s=0.1),
                       0.1 + 0.05 * i)  # errors 0 .. 0.4 s
    assert 0.3 <= g.wait_margin() <= 0.4
    assert g.snapshot()["wait_margin_ms"] == round(g.wait_margin() * 1000, 3)
    for _ in range(64):  # waits shorter than predicted: never a negative margin
        g.observe_wait(Waiter("a", "standard", 1.0, False, frozenset({"e1"}), 0.0, 1.0, predicted_s=0.5), 0.1)
    assert g.wait_margin() == 0.0


def test_a_target_opens_an_engine_within_its_budget_while_one_flow_alone_is_served():
    """Issue 34 (burst goodput): a request with a TTFT target may wait in an engine's queue as long as its target
    allows, not only `engine_queue_ms`, while nobody else is being served (holding it in the gateway would only
    spend its target); with two flows served the engines' queues stay short and the fair queue decides."""
    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 3000  # ~0.5 s of prefill queued: closed for engine_queue_ms 100
    g = gate(fleet)
    unc = {"e1": 300}
    assert g.may_start(unc, 0.0) == frozenset()  # no target: held
    assert g.may_start(unc, 0.0, budget={"e1": 0.3}) == frozenset()  # its target leaves 0.3 s: held
    assert g.may_start(unc, 0.0, budget={"e1": 1.0}) == {"e1"}  # 1.0 s: it goes
    g.started("a", 1.0, 300.0, None, 0.0, "standard")
    g.started("b", 1.0, 300.0, None, 0.0, "standard")  # two flows served: strict
    assert g.contended(0.0)
    assert g.may_start(unc, 0.0, budget={"e1": 1.0}) == frozenset()


async def test_a_waiting_request_is_released_when_its_remaining_budget_covers_the_engine_queue():
    """The release side of the same rule: a queued request carries its due time and own prefill bound, so the
    gate releases it once the engine's queue drains within what is left of its target."""
    fleet = Fleet(["e1"])
    fleet.ahead["e1"] = 30_000  # ~5 s queued
    g = gate(fleet)
    x = w("a")
    x.first_token_by, x.own_upper_s = 2.5, {"e1": 0.2}  # due at t=2.5, 0.2 s of its own prefill: 2.3 s to wait
    t = asyncio.create_task(g.wait(x, 1.0))
    await _settle()
    assert not t.done()
    fleet.ahead["e1"] = 9000  # ~1.5 s queued: within its budget, not within engine_queue_ms
    await _settle()
    assert await t == {"e1"}
