"""The peer bus's pure parts: encoding, remote flights in the view and their expiry, learner and affinity
sharing, transport choice; and the Unix-datagram transport between two buses in one loop."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
import pytest

from gateway.config import ConfigError, parse_config
from gateway.pipeline import RequestContext
from gateway.routing.affinity import Affinity
from gateway.routing.inflight import Flight, InFlight, RemoteFlight
from gateway.routing.peers import (Batch, Dispatch, Finish, FirstToken, PeerBus, PeerState, Remember,
                                   RedisTransport, Sample, UnixTransport, decode, encode, resolve_transport)
from gateway.routing.predictor import Features, Predictor
from gateway.routing.view import Drain, engine_view, queue_view
from tests.support.wait import async_wait_until


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def state(clock: Clock, **kw) -> tuple[PeerState, InFlight]:
    inf = InFlight()
    return PeerState(inf, clock, wall=lambda: clock.t, **kw), inf


def mk(rid: str, stream: bool = True) -> RequestContext:
    ctx = RequestContext(request_id=rid, endpoint="chat", headers={}, body={})
    ctx.stream = stream
    return ctx


def view(inf: InFlight, engine: str, now: float, drain: Drain | None = None):
    return engine_view(((f.started, f.uncached, f.prefilling(now)) for f in inf.on(engine)), now, drain)


async def arrived_and_closed(a: PeerBus, b: PeerBus, inf_b: InFlight) -> tuple[InFlight, dict]:
    """Wait (2 s at most) for A's dispatch on engine e1 to reach B, then B's snapshot; both buses closed."""
    for _ in range(200):
        await asyncio.sleep(0.01)
        if inf_b.on("e1"):
            break
    snap = b.snapshot()
    await a.close()
    await b.close()
    return inf_b, snap


def test_a_batch_round_trips_and_garbage_is_refused():
    b = Batch("host/w0/abc", 12.5, [Dispatch(1, "e1", 3000, 3500, 12.0, 0.25, True), FirstToken(1, 0.3),
                                    Finish(1), Sample("e1", 100.0, 3000.0, 2.0, 0.21), Remember("t|x|s", "e1")])
    data = encode(b)
    assert decode(data) == b
    assert len(encode(Batch("r", 1.0, [Dispatch(123456, "engine-1", 3000, 3500, 1.7e9, 0.25, True)]))) < 64
    for bad in (b"", b"\x93\x01", msgspec.msgpack.encode(["r", 1.0, [["zz", 1]]])):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decode(bad)


def test_remote_dispatch_counts_as_work_ahead_until_its_first_token_then_as_running():
    clock = Clock()
    st, inf = state(clock)
    assert view(inf, "e1", clock.t).prefilling_tokens == 0
    st.apply(Batch("B", clock.t, [Dispatch(7, "e1", 4000, 4200, clock.t - 0.01, 0.5, True)]))
    v = view(inf, "e1", clock.t)
    assert (v.inflight, v.prefilling_tokens, v.running) == (1, 4000, 0.0)
    assert inf.by_engine == {} and inf.by_rid == {}  # local-only logic (flow control, feedback) sees nothing
    st.apply(Batch("B", clock.t, [FirstToken(7, 0.2)]))
    v = view(inf, "e1", clock.t)
    assert (v.prefilling_tokens, v.running) == (0, 1.0)
    st.apply(Batch("B", clock.t, [Finish(7)]))
    assert view(inf, "e1", clock.t).inflight == 0 and inf.remote == {}


def test_remote_and_own_flights_drain_in_dispatch_order():
    clock = Clock()
    st, inf = state(clock)
    ctx = mk("own-1")
    inf.add(Flight(ctx, "e1", 2000, clock.t - 0.05, 0.3))
    st.apply(Batch("B", clock.t, [Dispatch(1, "e1", 2000, 2000, clock.t - 0.10, 0.3, True)]))
    starts = [f.started for f in inf.on("e1")]
    assert starts == sorted(starts) and len(starts) == 2
    d = Drain(step_s=0.01, s_per_token=1e-4, budget=2048)
    both = view(inf, "e1", clock.t, d).ahead_tokens
    inf.pop_remote("B/1")
    assert both > view(inf, "e1", clock.t, d).ahead_tokens > 0


def test_a_non_streamed_remote_flight_prefills_for_its_predicted_time():
    clock = Clock()
    st, inf = state(clock)
    st.apply(Batch("B", clock.t, [Dispatch(1, "e1", 1000, 1000, clock.t, 0.2, False)]))
    assert view(inf, "e1", clock.t).prefilling_tokens == 1000
    clock.t += 0.25
    assert view(inf, "e1", clock.t).prefilling_tokens == 0 and view(inf, "e1", clock.t).running == 1.0


def test_a_silent_peers_flights_lapse_and_a_lost_finish_by_ttl():
    clock = Clock()
    st, inf = state(clock, peer_timeout_s=3.0, flight_ttl_s=60.0)
    st.apply(Batch("crashed", clock.t, [Dispatch(1, "e1", 1000, 1000, clock.t, 0.2, True)]))
    st.apply(Batch("alive", clock.t, [Dispatch(1, "e1", 500, 500, clock.t, 0.2, True)]))
    clock.t += 2.0
    st.apply(Batch("alive", clock.t, []))  # a heartbeat
    assert st.expire() == 0 and len(inf.on("e1")) == 2
    clock.t += 1.5
    st.apply(Batch("alive", clock.t, []))
    assert st.expire() == 1 and [f.replica for f in inf.on("e1")] == ["alive"]
    assert "crashed" not in st.snapshot()["peers"]
    for _ in range(30):  # alive keeps beating, but its flight's finish was lost
        clock.t += 2.0
        st.apply(Batch("alive", clock.t, []))
        st.expire()
    assert inf.on("e1") == [] and st.counts["expired"] == 2


def test_a_dispatch_from_a_skewed_clock_is_bounded():
    clock = Clock()
    st, inf = state(clock, flight_ttl_s=60.0)
    st.apply(Batch("B", clock.t, [Dispatch(1, "e1", 1000, 1000, clock.t + 5.0, 0.2, True),  # from the future
                                  Dispatch(2, "e1", 1000, 1000, clock.t - 1e6, 0.2, True)]))  # ancient
    starts = sorted(f.started for f in inf.on("e1"))
    assert starts == [clock.t - 60.0, clock.t]


def test_the_peers_learner_samples_and_affinity_are_taken():
    clock = Clock()
    pred = Predictor()
    aff = Affinity()
    st, _ = state(clock, predictor=pred, affinity=aff)
    before = pred.learner("e1").samples
    st.apply(Batch("B", clock.t, [Sample("e1", 0.0, 2000.0, 1.0, 0.2)] * 3 + [Remember("t|x-session-id|s1", "e2")]))
    assert pred.learner("e1").samples == before + 3
    assert aff["t|x-session-id|s1"] == "e2" and st.counts["samples_in"] == 3


class FakeTransport:
    name = "fake"
    max_events = 64

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def start(self, on_data) -> None:
        self.on_data = on_data

    async def send(self, data: bytes) -> bool:
        self.sent.append(data)
        return True

    async def close(self) -> None:
        pass

    def status(self) -> dict:
        return {}


def test_the_bus_batches_events_off_the_request_path_and_reports_first_tokens():
    async def run() -> list[Batch]:
        clock = Clock()
        tr = FakeTransport()
        st, _ = state(clock)
        bus = PeerBus(tr, st, "A", flush_ms=5, heartbeat_s=10)
        await bus.start()
        ctxs = []
        for i in range(3):
            ctx = mk(f"r{i}")
            ctxs.append(ctx)
            bus.dispatched(Flight(ctx, "e1", 1000 + i, clock.t, 0.2))  # no await: appended
        await async_wait_until(lambda: len(tr.sent) == 1, what="the first flush")
        ctxs[0].ttft_s = 0.12
        await async_wait_until(lambda: len(tr.sent) == 2, what="the first token's flush")
        bus.finished("r0", ("e1", Features(10.0, 1000.0, 1.0), 0.11))
        bus.finished("never-dispatched", None)
        await async_wait_until(lambda: len(tr.sent) == 3, what="the finish's flush")
        bus.on_data(tr.sent[0])  # its own echo (Redis) is ignored
        bus.on_data(b"garbage")
        await bus.close()
        assert st.counts["bad_in"] == 1 and st.counts["batches_in"] == 0
        return [decode(d) for d in tr.sent]

    batches = asyncio.run(run())
    assert [type(e).__name__ for e in batches[0].events] == ["Dispatch"] * 3  # one send for the three
    assert batches[1].events == [FirstToken(0, 0.12)]
    assert batches[2].events == [Finish(0), Sample("e1", 10.0, 1000.0, 1.0, 0.11)]


def test_two_buses_on_unix_datagram_sockets(tmp_path):
    async def run() -> tuple[InFlight, dict]:
        clock = Clock()
        sa, _ = state(clock)
        sb, inf_b = state(clock)
        a = PeerBus(UnixTransport(tmp_path, "0"), sa, "A", flush_ms=1, heartbeat_s=0.05)
        b = PeerBus(UnixTransport(tmp_path, "1"), sb, "B", flush_ms=1, heartbeat_s=0.05)
        await a.start()
        await b.start()
        ctx = mk("r1")
        a.dispatched(Flight(ctx, "e1", 3000, clock.t, 0.2))
        return await arrived_and_closed(a, b, inf_b)

    inf_b, snap = asyncio.run(run())
    assert [f.uncached for f in inf_b.on("e1")] == [3000]
    assert snap["transport"] == "unix" and "A" in snap["peers"]
    assert snap["remote_flights"]["e1"]["prefilling_tokens"] == 3000
    assert not list(tmp_path.glob("*.sock"))  # closed buses remove their sockets


def test_a_unix_send_to_a_vanished_peer_is_dropped_quietly(tmp_path):
    async def run() -> int:
        t = UnixTransport(tmp_path, "0")
        await t.start(lambda d: None)
        (tmp_path / "w9.sock").write_text("")  # a stale name, not a socket
        ok = await t.send(b"x")
        await t.close()
        return t.dropped if not ok else -1

    assert asyncio.run(run()) == 1


def cfg(tmp_path, routing=None, budgets=None):
    import yaml

    return parse_config(yaml.safe_dump({"routing": routing or {}, "budgets": budgets or {},
                                        "data_dir": str(tmp_path)}), "t.yaml", base_dir=tmp_path)


def test_transport_choice(tmp_path):
    assert resolve_transport(cfg(tmp_path), env={}) is None  # no store, no supervisor: today's behaviour
    t = resolve_transport(cfg(tmp_path, budgets={"store": "redis", "redis_url": "redis://h:1/0"}), env={})
    assert isinstance(t, RedisTransport) and t.url == "redis://h:1/0" and t.channel == "gwb:peers"
    t = resolve_transport(cfg(tmp_path, {"peers": {"redis_url": "redis://x:2/0", "channel": "c"}}), env={})
    assert isinstance(t, RedisTransport) and (t.url, t.channel) == ("redis://x:2/0", "c")
    env = {"GATEWAY_PEER_DIR": str(tmp_path / "p"), "GATEWAY_WORKER_ID": "3"}
    t = resolve_transport(cfg(tmp_path), env=env)
    assert isinstance(t, UnixTransport) and t.path.name == "w3.sock"
    t = resolve_transport(cfg(tmp_path, budgets={"store": "redis"}), env=env)
    assert isinstance(t, RedisTransport)  # Redis carries it for workers and replicas alike
    assert resolve_transport(cfg(tmp_path, {"peers": {"mode": "off"}}, {"store": "redis"}), env=env) is None
    assert isinstance(resolve_transport(cfg(tmp_path, {"peers": {"mode": "local"}}, {"store": "redis"}), env=env),
                      UnixTransport)
    with pytest.raises(ConfigError, match="peers.mode"):
        cfg(tmp_path, {"peers": {"mode": "gossip"}})


def test_the_stage_publishes_what_it_dispatches_and_counts_the_peers(tmp_path):
    from gateway.routing.stage import PredictiveRouteStage

    c = cfg(tmp_path)
    st = PredictiveRouteStage(lambda: c, SimpleNamespace())
    tr = FakeTransport()
    st.peers = PeerBus(tr, PeerState(st.inflight, st.clock), "A")
    ctx = mk("r1")
    fl = Flight(ctx, "e1", 1500, st.clock(), 0.1)
    st.inflight.add(fl)
    st.peers.dispatched(fl)
    assert isinstance(st.peers._out[0], Dispatch) and st.peers._out[0].uncached == 1500
    asyncio.run(st.finish(ctx))
    assert isinstance(st.peers._out[-1], Finish)


def test_the_metrics_collector_shows_the_bus():
    from gateway.observability.collect import GatewayStateCollector

    clock = Clock()
    st, _ = state(clock)
    st.apply(Batch("B", clock.t, [Dispatch(1, "e1", 700, 700, clock.t, 0.2, True)]))
    bus = PeerBus(FakeTransport(), st, "A")
    gw = SimpleNamespace(router=SimpleNamespace(peers=bus))
    got = {(m.name, tuple(s.labels.values())): s.value for m in GatewayStateCollector(gw)._peers() for s in m.samples}
    assert got[("gateway_peers_heard", ())] == 1.0
    assert got[("gateway_peers_remote_prefilling_tokens", ("e1",))] == 700.0
    assert got[("gateway_peers_events", ("in",))] == 1.0


def test_a_stuck_transport_bounds_what_waits_for_it(monkeypatch):
    import gateway.routing.peers as peers

    monkeypatch.setattr(peers, "MAX_QUEUED", 5)
    clock = Clock()
    st, _ = state(clock)
    bus = PeerBus(FakeTransport(), st, "A")
    for i in range(8):
        bus.remembered(f"s{i}", "e1")
    assert len(bus._out) == 5 and bus.counts["dropped_out"] == 3


def test_redis_away_costs_the_bus_its_events_not_the_gateway():
    from tests.support.procs import free_port

    async def run() -> dict:
        clock = Clock()
        st, _ = state(clock)
        bus = PeerBus(RedisTransport(f"redis://127.0.0.1:{free_port()}/0", "c"), st, "A", flush_ms=1,
                      heartbeat_s=0.05)
        await bus.start()  # no Redis: starts anyway, the subscription retries in the background
        bus.dispatched(Flight(mk("r1"), "e1", 100, clock.t, 0.1))
        await asyncio.sleep(0.3)
        snap = bus.snapshot()
        await bus.close()
        return snap

    snap = asyncio.run(run())
    assert snap["dropped_out"] >= 1 and snap["connected"] is False


def test_the_prefill_guard_counts_the_peers_long_prompts(tmp_path):
    from gateway.routing.stage import PredictiveRouteStage

    c = cfg(tmp_path, {"flow_control": {"long_prompt_tokens": 4000}})
    st = PredictiveRouteStage(lambda: c, SimpleNamespace())
    ps = PeerState(st.inflight, st.clock)
    now = st.clock()
    ps.apply(Batch("B", time.time(), [Dispatch(1, "e1", 6000, 6000, time.time(), 1.0, True),
                                                    Dispatch(2, "e1", 500, 500, time.time(), 0.1, True)]))
    longs = st._long_flights(now, st.flow.limits)
    assert [lf.uncached for lf in longs["e1"]] == [6000]  # the short one is no long prompt
    ps.apply(Batch("B", 0.0, [FirstToken(1, 0.5)]))
    assert st._long_flights(st.clock(), st.flow.limits) == {}  # prefilled: no longer held against the engine
    ps.apply(Batch("B", 0.0, [Finish(1), Finish(2)]))
    assert st.inflight.remote_long == {} and st.inflight.remote == {}


def test_postgres_is_the_bus_when_identity_is_on_postgres_and_there_is_no_redis(tmp_path):
    from gateway.routing.peers import PostgresTransport

    ident = {"store": "postgres", "postgres_dsn_env": "PG_FOR_TEST"}
    import yaml

    c = parse_config(yaml.safe_dump({"identity": ident, "data_dir": str(tmp_path)}), "t.yaml", base_dir=tmp_path)
    t = resolve_transport(c, env={"PG_FOR_TEST": "postgresql://h/db"})
    assert isinstance(t, PostgresTransport) and (t.dsn, t.channel) == ("postgresql://h/db", "gwb_peers")
    assert resolve_transport(c, env={}) is None  # no DSN: no bus
    c = parse_config(yaml.safe_dump({"identity": ident, "budgets": {"store": "redis"}, "data_dir": str(tmp_path)}),
                     "t.yaml", base_dir=tmp_path)
    assert isinstance(resolve_transport(c, env={"PG_FOR_TEST": "x"}), RedisTransport)  # Redis first


def test_two_buses_on_postgres_listen_notify():
    import os
    import socket

    from gateway.routing.peers import PostgresTransport
    from tests.conftest import require_service

    dsn = os.environ.get("GATEWAY_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    try:
        socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
        up = True
    except OSError:
        up = False
    require_service(up, "PostgreSQL at 127.0.0.1:5432")
    channel = f"peers_test_{os.getpid()}_{int(time.time() * 1000) % 100000}"

    async def run() -> tuple[InFlight, dict]:
        clock = Clock()
        sa, _ = state(clock)
        sb, inf_b = state(clock)
        a = PeerBus(PostgresTransport(dsn, channel), sa, "A", flush_ms=1, heartbeat_s=0.05)
        b = PeerBus(PostgresTransport(dsn, channel), sb, "B", flush_ms=1, heartbeat_s=0.05)
        await a.start()
        await b.start()
        for _ in range(100):
            if a.transport.connected and b.transport.connected:
                break
            await asyncio.sleep(0.05)
        for i in range(30):  # more than one NOTIFY's worth, with long session keys
            a.remembered("t|x-session-id|" + "s" * 250 + str(i), "e1")
        a.dispatched(Flight(mk("r1"), "e1", 3000, clock.t, 0.2))
        return await arrived_and_closed(a, b, inf_b)

    inf_b, snap = asyncio.run(run())
    assert [f.uncached for f in inf_b.on("e1")] == [3000]
    assert snap["transport"] == "postgres" and "A" in snap["peers"] and snap["bad_in"] == 0
    assert snap["events_in"] == 31


def test_the_queue_the_view_drains_is_the_flights_prefilling_now():
    """InFlight.queue (Flight.prefilling written out for own flights) gives the view what engine_view gets from
    each flight's prefilling(): own only, own with remote ones, streamed, non-streamed and first-token flights."""
    clock = Clock()
    ps, inf = state(clock)
    d = Drain(0.01, 1e-4, 512)
    for i in range(12):
        ctx = mk(f"r{i}", stream=i % 3 == 0)
        if i % 4 == 1:
            ctx.ttft_s = 0.1
        inf.add(Flight(ctx, "e", 100 * (i + 1), clock.t + 0.01 * i, 0.02 + 0.005 * i))
    for remote in (False, True):
        if remote:
            for i in range(5):
                inf.add_remote(RemoteFlight(f"x/{i}", "x", "e", 700, clock.t + 0.013 * i, 0.03, i % 2 == 0,
                                            clock.t + 60, first_token=i == 3))
        for now in (clock.t, clock.t + 0.03, clock.t + 0.2):
            n, q, raw = inf.queue("e", now)
            ref = [(f.started, f.uncached) for f in inf.on("e") if f.prefilling(now)]
            assert (n, q) == (12 + 5 * remote, ref) and raw == sum(u for _, u in ref)
            assert queue_view(n, q, raw, now, d) == view(inf, "e", now, d)
    assert inf.queue("none", clock.t) == (0, [], 0.0)
