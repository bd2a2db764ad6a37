"""Live rollout state in the identity store: a PATCH or a rollback survives a restart, another replica sees it
after a refresh, the request chain follows the live weights, and reset returns to the config."""
from __future__ import annotations

from typing import Any, AsyncIterator

import pytest

from gateway.identity.service import IdentityService
from gateway.rollouts.service import RolloutService


class Replica:
    def __init__(self, config: Any) -> None:
        self.identity = IdentityService(config)
        self.rollouts = RolloutService(config, self.identity)

    async def start(self) -> "Replica":
        await self.identity.start()
        await self.rollouts.start()
        return self

    async def close(self) -> None:
        await self.rollouts.close()
        await self.identity.close()


@pytest.fixture
async def replicas(config_factory: Any) -> AsyncIterator[Any]:
    started: list[Replica] = []

    async def make(**alias: Any) -> Replica:
        r = await Replica(config_factory(**alias)).start()
        started.append(r)
        return r

    yield make
    for r in started:
        await r.close()


async def test_patched_weights_survive_a_restart_and_reach_another_replica(replicas: Any) -> None:
    a = await replicas()
    b = await replicas()
    assert a.rollouts.state("support").weights == {"support-v2": 5.0, "support-v1": 95.0}
    await a.rollouts.set_weights("support", {"support-v2": 100.0, "support-v1": 0.0})
    assert a.rollouts.order("support", "anyone") == ("support-v2", "support-v1")
    await b.rollouts.refresh()  # what b's poll does every REFRESH_S
    assert b.rollouts.state("support").weights == {"support-v2": 100.0, "support-v1": 0.0}
    await a.close()
    c = await replicas()  # a restart: the row wins over the config's weights
    assert c.rollouts.order("support", "anyone") == ("support-v2", "support-v1")
    await c.rollouts.reset("support")
    await b.rollouts.refresh()
    assert b.rollouts.state("support").weights == {"support-v2": 5.0, "support-v1": 95.0}


async def test_a_regressing_arm_is_rolled_back_persisted_and_seen_by_replicas(replicas: Any) -> None:
    a = await replicas(rollback={"min_requests": 10, "window_s": 30})
    b = await replicas(rollback={"min_requests": 10, "window_s": 30})
    for i in range(20):
        a.rollouts.observe("support", "support-v1", True, 0.1, now=float(i))
    whys = [a.rollouts.observe("support", "support-v2", i % 2 == 0, 0.1, now=20.0 + i) for i in range(10)]
    assert whys[:9] == [None] * 9 and whys[9] is not None and "error rate" in whys[9]
    st = a.rollouts.state("support")
    assert st.weights["support-v2"] == 0.0 and "support-v2" in st.rolled_back
    assert a.rollouts.alarms[-1]["arm"] == "support-v2"
    for t in list(a.rollouts._writes):
        await t
    await b.rollouts.refresh()
    assert all(b.rollouts.order("support", f"u{i}")[0] == "support-v1" for i in range(200))
    view = b.rollouts.view("support")
    assert view["arms"][0]["rolled_back"] and view["arms"][0]["weight"] == 0.0
    # an admin giving the arm a weight again clears its rollback
    await b.rollouts.set_weights("support", {"support-v2": 5.0})
    assert b.rollouts.state("support").rolled_back == {}


async def test_the_stable_arm_is_never_rolled_back(replicas: Any) -> None:
    a = await replicas(rollback={"min_requests": 5})
    for i in range(50):
        assert a.rollouts.observe("support", "support-v1", False, None, now=float(i)) is None
    assert a.rollouts.state("support").rolled_back == {}


async def test_live_weights_survive_a_reload_that_changes_the_config_weights(replicas: Any, config_factory: Any) -> None:
    a = await replicas()
    await a.rollouts.set_weights("support", {"support-v2": 40.0})
    a.rollouts.swap_config(config_factory(targets=[{"model": "support-v2", "weight": 1},
                                                   {"model": "support-v1", "weight": 99}]))
    assert a.rollouts.state("support").weights == {"support-v2": 40.0, "support-v1": 95.0}
    await a.rollouts.reset("support")
    assert a.rollouts.state("support").weights == {"support-v2": 1.0, "support-v1": 99.0}  # the new config's


async def test_two_replicas_rolling_one_arm_back_keep_the_first_reason(replicas: Any) -> None:
    """Each replica judges its own window, so two may roll the same arm back, with different reasons, before either
    reads the other's: the store keeps the first reason and the second replica takes it (a plain upsert let the
    later write replace the reason every replica had shown)."""
    a = await replicas(rollback={"min_requests": 10, "window_s": 30})
    b = await replicas(rollback={"min_requests": 10, "window_s": 30})
    for r, fail_every in ((a, 2), (b, 1)):  # a: 50% errors, b: 100%: two different reasons
        for i in range(20):
            r.rollouts.observe("support", "support-v1", True, 0.1, now=float(i))
        for i in range(10):
            r.rollouts.observe("support", "support-v2", i % fail_every != 0, 0.1, now=20.0 + i)
        if r is b:
            why_b = b.rollouts.state("support").rolled_back["support-v2"]  # b's own, before its write: b has
            # not read the store since a wrote
        for t in [*r.rollouts._writes]:
            await t
    why_a = a.rollouts.state("support").rolled_back["support-v2"]
    assert why_a != why_b
    assert b.rollouts.state("support").rolled_back == {"support-v2": why_a}
    await a.rollouts.refresh()
    await b.rollouts.refresh()
    assert a.rollouts.view("support")["arms"][0]["rolled_back"] == why_a
    assert b.rollouts.view("support")["arms"][0]["rolled_back"] == why_a
    assert b.rollouts.state("support").weights == {"support-v2": 0.0, "support-v1": 95.0}
