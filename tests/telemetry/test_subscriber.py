"""Subscriber against the simulator's vLLM-format publisher over real ZMQ: order, gaps+replay, unrecoverable
gaps, restarts, clears, floods."""
import asyncio

import pytest

from backends.sim.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored
from backends.sim.publisher import KVEventPublisher
from gateway.telemetry.index import KVIndex
from gateway.telemetry.subscriber import KVEventSubscriber
from tests.support.wait import async_wait_until

BS = 16


def chain(i: int, parent=None):
    toks = [i * 100 + t for t in range(BS)]
    return BlockStored([1000 + i], parent, toks, BS, None, "GPU", None), toks


async def settle(sub: KVEventSubscriber, seq: int, timeout: float = 5.0) -> None:
    async def wait():
        while sub.last_seq is None or sub.last_seq < seq:
            sub.applied.clear()
            await sub.applied.wait()
    await asyncio.wait_for(wait(), timeout)


@pytest.fixture
async def pub():
    p = KVEventPublisher(topic="kv", buffer_steps=50)
    p.start()
    yield p
    await p.close()


async def connect(pub, idx, **kw):
    sub = KVEventSubscriber("e", pub.endpoint, pub.replay_endpoint, "kv", idx, replay_timeout_s=1.0, **kw)
    await sub.start()
    await asyncio.sleep(0.3)  # PUB/SUB slow joiner
    return sub


async def test_in_order_apply_and_evict(pub):
    idx = KVIndex()
    sub = await connect(pub, idx)
    try:
        toks = []
        parent = None
        for i in range(5):
            ev, t = chain(i, parent)
            parent = 1000 + i
            toks += t
            s = pub.publish([ev])
        await settle(sub, s)
        assert idx.lookup(["e"], toks + [1])["e"].tokens == 80
        s = pub.publish([BlockRemoved([1002], "GPU")])
        await settle(sub, s)
        assert idx.lookup(["e"], toks + [1])["e"].tokens == 32
        assert sub.counters["gaps"] == 0 and not sub.stale
    finally:
        await sub.close()


async def test_gap_is_replayed(pub):
    idx = KVIndex()
    sub = await connect(pub, idx, drop_filter=lambda seq: seq in (1, 2))
    try:
        toks, parent = [], None
        for i in range(4):
            ev, t = chain(i, parent)
            parent = 1000 + i
            toks += t
            s = pub.publish([ev])
        await settle(sub, s)
        assert sub.counters["gaps"] == 1 and sub.counters["replays_ok"] == 1 and not sub.stale
        assert idx.lookup(["e"], toks + [1])["e"].tokens == 64
    finally:
        await sub.close()


async def test_unrecoverable_gap_marks_stale_and_resets(pub):
    idx = KVIndex()
    sub = await connect(pub, idx, drop_filter=lambda seq: 1 <= seq <= 60)
    try:
        ev, t0 = chain(0)
        pub.publish([ev])
        for i in range(1, 62):  # buffer_steps=50: seq 1..11 fall out of the replay buffer
            s = pub.publish([chain(i)[0]])
        await settle(sub, s)
        assert sub.stale and "gap 1..60" in sub.stale_reason
        assert sub.counters["unrecoverable_gaps"] == 1
        assert idx.lookup(["e"], t0 + [1])["e"].tokens == 0  # view rebuilt from scratch
        assert idx.lookup(["e"], chain(61)[1] + [1])["e"].tokens == 16
        s = pub.publish([AllBlocksCleared()])
        await settle(sub, s)
        assert not sub.stale  # an engine-side reset makes the rebuilt view exact again
    finally:
        await sub.close()


async def _restart(p1: KVEventPublisher) -> KVEventPublisher:
    """The engine process restarts: a new publisher on the same ports, counting from seq 0; returns once the
    subscriber has had time to reconnect."""
    await p1.close()
    await asyncio.sleep(0.2)
    p2 = KVEventPublisher(topic="kv", port=p1.port, replay_port=p1.replay_port)
    p2.start()
    await asyncio.sleep(0.5)
    return p2


async def test_restart_resets_engine():
    idx = KVIndex()
    p1 = KVEventPublisher(topic="kv")
    p1.start()
    sub = await connect(p1, idx)
    try:
        for i in range(5):
            s = p1.publish([chain(i)[0]])
        await settle(sub, s)
        assert idx.lookup(["e"], chain(3)[1] + [1])["e"].tokens == 16
        p2 = await _restart(p1)
        s = p2.publish([chain(7)[0]])
        await async_wait_until(lambda: sub.counters["restarts"] == 1, 5)
        assert idx.lookup(["e"], chain(3)[1] + [1])["e"].tokens == 0
        assert idx.lookup(["e"], chain(7)[1] + [1])["e"].tokens == 16
        await p2.close()
    finally:
        await sub.close()


async def test_restart_is_detected_when_the_new_engines_seq_0_is_lost():
    """ZMQ drops what a new publisher sends before the subscription is re-made: the restarted engine's first
    batches (seq 0, 1) never arrive, so seq 2 looks like an old duplicate of the previous engine's seq 2. Its
    batch is newer than anything applied, so it is a restart: the view is reset and rebuilt from replay."""
    idx = KVIndex()
    p1 = KVEventPublisher(topic="kv")
    p1.start()
    restarted = False
    sub = await connect(p1, idx, drop_filter=lambda seq: restarted and seq < 2)
    try:
        for i in range(6):
            s = p1.publish([chain(i)[0]])
        await settle(sub, s)
        assert idx.lookup(["e"], chain(3)[1] + [1])["e"].tokens == 16
        restarted = True
        p2 = await _restart(p1)
        for i in (10, 11, 12):  # seq 0 and 1 are "lost", seq 2 arrives
            p2.publish([chain(i)[0]])
        await async_wait_until(lambda: sub.counters["restarts"] == 1, 5)
        await async_wait_until(lambda: sub.last_seq == 2, 5)
        assert idx.lookup(["e"], chain(3)[1] + [1])["e"].tokens == 0  # the old engine's blocks are gone
        for i in (10, 11, 12):  # and the new engine's, the lost ones included (replayed), are known
            assert idx.lookup(["e"], chain(i)[1] + [1])["e"].tokens == 16
        assert sub.counters["duplicates"] == 0
        await p2.close()
    finally:
        await sub.close()


async def test_flood_is_bounded_and_recovered(pub):
    idx = KVIndex()
    sub = await connect(pub, idx, max_pending=4)
    try:
        for i in range(40):  # published faster than applied: the queue overflows
            s = pub.publish([chain(i)[0]])
        await settle(sub, s)
        await asyncio.sleep(0.2)
        assert sub._queue.qsize() <= 4
        assert sub.counters["dropped_overflow"] > 0 or sub.counters["gaps"] == 0
        assert not sub.stale  # everything dropped came back through replay (buffer 50)
        assert idx.stats()["engines"]["e"]["entries"] == 40
    finally:
        await sub.close()
