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

    def state(self, name: str, now: float) -> tuple[float, Drain]:
        return self.ahead[name], DRAIN

    def long_flights(self, now: float, limits) -> dict[str, list[LongFlight]]:
        return {e: [f for f in fl if f.ends_at > now] for e, fl in self.longs.items()}


def gate(fleet: Fleet, **kw) -> FlowGate:
    cfg = FlowControlConfig(**{"tick_ms": 1.0, **kw})
    return FlowGate(lambda: cfg, lambda: fleet.t, fleet.state, fleet.long_flights, lambda name: 2048)


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
    assert g.may_start({"e1": 300, "e2": 300}, fleet.t) == frozenset({"e1", "e2"})  # short prompts still go
    fleet.t = 103.5
    assert g.may_start(unc, fleet.t) == frozenset({"e1", "e2"})


def test_per_engine_limits_override_the_defaults():
    from gateway.routing.config import LongPrefillLimits

    fleet = Fleet(["e1", "e2"])
    g = gate(fleet, long_prompt_tokens=8000, engines={"e2": LongPrefillLimits(long_prompt_tokens=20_000,
                                                                                 max_long_prefills=2)})
    assert g.long_on({"e1": 12_000, "e2": 12_000}) == {"e1": True, "e2": False}
    assert g.limits("e2").max_long_prefills == 2 and g.limits("e1").max_long_prefills == 1
