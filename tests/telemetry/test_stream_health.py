"""Issue 17: the gateway takes vLLM's default KV-event topic and says loudly when an engine's stream is silent.

The decision is a pure function (silence_reason) over evidence a StreamWatch collects; the subscriber is driven
over real ZMQ (a PUB socket on localhost sending vLLM's frames, or the simulator's publisher), and the service
and the /metrics collector are the real ones."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest
import yaml
import zmq
import zmq.asyncio

from backends.sim.kv_wire import BlockStored
from backends.sim.publisher import KVEventPublisher
from gateway.config import ConfigError, parse_config
from gateway.observability.collect import GatewayStateCollector
from gateway.proxy.health import Health
from gateway.telemetry.config import TelemetryConfig
from gateway.telemetry.index import KVIndex
from gateway.telemetry.kv_events import KVEventBatch, encode_batch
from gateway.telemetry.kv_events import BlockStored as GwBlockStored
from gateway.telemetry.scraper import EngineLoad
from gateway.telemetry.service import TelemetryService
from gateway.telemetry.stream_health import StreamWatch, silence_reason
from gateway.telemetry.subscriber import KVEventSubscriber
from tests.support.procs import free_port
from tests.support.wait import async_wait_until

BS = 16


# ------------------------------------------------------------------------------------------------ pure decision
def test_silence_reason_needs_pending_work_older_than_the_grace_period():
    assert silence_reason(100.0, 10.0, None, 0, 0) is None  # idle engine: never stale
    assert silence_reason(100.0, 10.0, 95.0, 3, 2) is None  # within grace
    assert silence_reason(100.0, 10.0, 90.0, 0, 0) == "no_events"
    assert silence_reason(100.0, 10.0, 90.0, 5, 0) == "wrong_topic"
    assert silence_reason(100.0, 10.0, 90.0, 5, 1) == "decode"  # frames on our topic that fail win


def test_watch_changes_state_once_per_change_and_a_batch_makes_it_fresh():
    w = StreamWatch(grace_s=1.0, topic="kv")
    assert not w.evaluate(0.0) and w.reason is None
    w.on_activity(0.0, "served_request")
    w.on_activity(0.5, "engine_metrics")  # the earliest pending work counts
    assert not w.evaluate(0.9)
    assert w.evaluate(1.0) and w.reason == "no_events"
    assert not w.evaluate(5.0)  # still stale: no second change
    w.on_other_topic(5.0, b"")
    assert w.evaluate(5.1) and w.reason == "wrong_topic"
    w.on_batch(6.0)
    assert w.evaluate(6.0) and w.reason is None
    assert not w.evaluate(100.0)  # idle after a batch: fresh


def test_other_topics_prove_activity_only_until_our_topic_carried_a_batch_and_are_bounded():
    w = StreamWatch(grace_s=1.0, topic="kv")
    for i in range(20):
        w.on_other_topic(0.0, f"t{i}".encode())
    assert w.activity_at == 0.0 and w.other_topic_frames == 20 and len(w.other_topics) == 8
    w.on_batch(1.0)
    w.on_other_topic(2.0, b"t0")  # another publisher on the same endpoint, ours works: no alarm
    assert w.activity_at is None and not w.evaluate(10.0)


def test_defaults_match_vllm():
    # vllm/config/kv_events.py KVEventsConfig.topic = "" (and ZmqEventPublisher(topic="")): take every topic
    assert TelemetryConfig().kv_topic == ""
    assert TelemetryConfig().kv_silence_grace_s == 10.0
    assert KVEventPublisher().topic == ""  # the simulator publishes as vLLM does by default


def test_bad_grace_is_a_clear_config_error():
    with pytest.raises(ConfigError, match="telemetry.kv_silence_grace_s: must be > 0"):
        parse_config(yaml.safe_dump({"telemetry": {"kv_silence_grace_s": 0}}))


def test_a_backend_kv_topic_overrides_the_telemetry_one():
    cfg = parse_config(yaml.safe_dump({"telemetry": {"kv_topic": "kv"}, "backends": [
        {"name": "a", "kind": "vllm", "url": "http://127.0.0.1:9/v1", "models": ["m"], "kv_events": "tcp://x:1"},
        {"name": "b", "kind": "vllm", "url": "http://127.0.0.1:9/v1", "models": ["m"], "kv_events": "tcp://x:2",
         "kv_topic": ""}]}))
    svc = TelemetryService(cfg)
    assert [svc.topic_for(b) for b in cfg.backends] == ["kv", ""]


# ------------------------------------------------------------------------------------------------ real ZMQ
def _payload(i: int) -> bytes:
    toks = [i * 100 + t for t in range(BS)]
    return encode_batch(KVEventBatch(time.time(), [GwBlockStored([1000 + i], None, toks, BS, None, None, None)]))


class RawPub:
    """A bare ZMQ PUB on localhost sending (topic, seq, payload) exactly as ZmqEventPublisher does."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.seq = 0

    def send(self, topic: bytes, payload: bytes, frames: int = 3) -> None:
        msg = [topic, self.seq.to_bytes(8, "big"), payload][:frames]
        self.sock.send_multipart(msg)
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


async def _sub(endpoint: str, topic: str, idx: KVIndex, grace: float = 0.3) -> KVEventSubscriber:
    s = KVEventSubscriber("e", endpoint, None, topic, idx, silence_grace_s=grace)
    await s.start()
    await asyncio.sleep(0.3)  # PUB/SUB slow joiner
    return s


async def test_empty_topic_takes_every_topic_vllms_default_included():
    pub = RawPub()
    idx = KVIndex()
    sub = await _sub(pub.endpoint, "", idx)
    try:
        pub.send(b"", _payload(0))  # vLLM's default topic
        pub.send(b"kv", _payload(1))
        await async_wait_until(lambda: sub.counters["batches"] == 2)
        assert sub.watch.other_topic_frames == 0
        assert idx.lookup(["e"], [100 + t for t in range(BS)] + [0])["e"].tokens == BS
    finally:
        await sub.close()
        pub.close()


async def test_named_topic_is_exact_and_other_topics_are_counted_then_reported_wrong_topic(caplog):
    pub = RawPub()
    idx = KVIndex()
    sub = await _sub(pub.endpoint, "kv", idx)
    caplog.set_level(logging.WARNING, logger="gateway.telemetry.subscriber")
    try:
        pub.send(b"", _payload(0))  # the engine kept vLLM's default topic
        pub.send(b"kvx", _payload(1))  # a prefix of ours is not ours (ZMQ prefix matching would take it)
        await async_wait_until(lambda: sub.watch.other_topic_frames == 2)
        assert sub.counters["batches"] == 0 and sub.watch.other_topics == {"": 1, "kvx": 1}
        assert not sub.evaluate_stream()  # within grace
        await asyncio.sleep(0.35)
        assert sub.evaluate_stream() and sub.watch.reason == "wrong_topic" and sub.stream_stale
        assert not sub.evaluate_stream()  # one warning per change
        snap = sub.snapshot()
        assert snap["stream_reason"] == "wrong_topic" and snap["other_topic_frames"] == 2
        assert "telemetry.kv_topic" in snap["stream_detail"]
        pub.send(b"kv", _payload(2))
        await async_wait_until(lambda: sub.counters["batches"] == 1)
        assert sub.evaluate_stream() and sub.watch.reason is None
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "KV " in r.getMessage()]
        assert len(warnings) == 2, warnings
        assert "stale (wrong_topic)" in warnings[0] and "fresh again (was wrong_topic)" in warnings[1]
    finally:
        await sub.close()
        pub.close()


async def test_undecodable_frames_on_our_topic_are_reported_decode():
    pub = RawPub()
    sub = await _sub(pub.endpoint, "kv", KVIndex())
    try:
        pub.send(b"kv", b"\xc1 not msgpack")
        pub.send(b"kv", b"", frames=2)  # not (topic, seq, payload)
        await async_wait_until(lambda: sub.counters["decode_errors"] == 2)
        await asyncio.sleep(0.35)
        assert sub.evaluate_stream() and sub.watch.reason == "decode"
        assert "failed to decode" in sub.snapshot()["stream_detail"]
    finally:
        await sub.close()
        pub.close()


async def test_sim_publisher_on_its_default_topic_reaches_a_default_gateway():
    pub = KVEventPublisher()
    pub.start()
    idx = KVIndex()
    sub = await _sub(pub.endpoint, TelemetryConfig().kv_topic, idx)
    try:
        s = pub.publish([BlockStored([7], None, list(range(BS)), BS, None, None, None)])  # medium None: GPU
        await async_wait_until(lambda: sub.last_seq == s)
        assert idx.lookup(["e"], list(range(BS)) + [1])["e"].tokens == BS
        assert idx.engine_blocks("e") == {"GPU": 1}
    finally:
        await sub.close()
        await pub.close()


# ------------------------------------------------------------------------------------------------ service
def _cfg(kv: str, topic: str | None = None, metrics: str | None = None, grace: float = 0.3, url: str | None = None):
    tel = {"kv_silence_grace_s": grace, "scrape_interval_s": 0.1}
    if topic is not None:
        tel["kv_topic"] = topic
    return parse_config(yaml.safe_dump({"telemetry": tel, "backends": [
        {"name": "e", "kind": "vllm", "url": url or f"http://127.0.0.1:{free_port()}/v1", "models": ["m"],
         "kv_events": kv, "metrics": metrics}]}))


def _gauges(svc: TelemetryService, cfg) -> dict[tuple[str, tuple[str, ...]], float]:
    gw = type("GW", (), {})()
    gw.health, gw.telemetry, gw.router = Health(cfg), svc, None
    out = {}
    for fam in GatewayStateCollector(gw).collect():
        for s in fam.samples:
            out[(s.name, tuple(s.labels.values()))] = s.value
    return out


async def test_served_work_without_events_is_no_events_in_fleet_and_metrics():
    cfg = _cfg(f"tcp://127.0.0.1:{free_port()}")  # nothing publishes there
    svc = TelemetryService(cfg)
    await svc.start()
    try:
        svc.index.set_block_size("e", BS)
        svc.observe_served("e", BS - 1, 0)  # less than a block: the engine needs to store nothing
        svc.observe_served("e", 10 * BS, None)  # cached unknown: may have been a full hit
        svc.observe_served("e", 10 * BS, 9 * BS + 1)
        now = time.monotonic() + 1
        svc.evaluate_streams(now)
        assert not svc.is_stale("e")
        svc.observe_served("e", 10 * BS, 8 * BS)  # two uncached blocks: a BlockStored must come
        assert not svc.is_stale("e")
        await async_wait_until(lambda: svc.is_stale("e"), 3)  # the watch loop re-judges on its own
        e = svc.fleet_snapshot()["engines"]["e"]
        assert e["stale"] and e["stale_reason"] == "no_events" and "no KV batch" in e["stale_detail"]
        assert e["kv_events"]["batches"] == 0 and e["kv_events"]["last_batch_age_s"] is None
        assert svc.kv_view("e")["reason"] == "no_events"
        g = _gauges(svc, cfg)
        assert g[("gateway_kv_stream_stale", ("e", "no_events"))] == 1.0
        assert g[("gateway_kv_stream_stale", ("e", "wrong_topic"))] == 0.0
        assert g[("gateway_kv_index_stale", ("e",))] == 1.0
        assert g[("gateway_kv_stream_batches", ("e",))] == 0.0
    finally:
        await svc.close()


async def test_engine_metrics_growth_is_evidence_and_a_batch_explains_it():
    cfg = _cfg(f"tcp://127.0.0.1:{free_port()}", grace=30)
    svc = TelemetryService(cfg)
    await svc.start()
    try:
        sub = svc.subscribers["e"]
        load = lambda q, h: EngineLoad(prefix_queries=q, prefix_hits=h, block_size=BS, healthy=True)  # noqa: E731
        svc._observe_load("e", load(1000, 0))  # the first scrape is the baseline
        svc._observe_load("e", load(1000 + BS, BS - 1))  # < one block of new uncached tokens
        assert sub.watch.activity_at is None
        sub.watch.on_batch(time.monotonic())
        svc._observe_load("e", load(1000 + 3 * BS, BS))  # a batch since: what was counted is explained
        assert sub.watch.activity_at is None
        svc._observe_load("e", load(1000 + 5 * BS, BS))
        assert sub.watch.activity_source == "engine_metrics"
        svc.evaluate_streams(time.monotonic() + 31)  # as if the grace period had passed
        assert sub.watch.reason == "no_events"
    finally:
        await svc.close()


async def test_wrong_topic_against_the_simulator_through_the_service():
    """The original failure: engines on vLLM's default topic, a gateway configured with `kv_topic: kv`."""
    from backends.sim.fleet import start_fleet

    import httpx

    async with start_fleet(1, profiles=["tiny"]) as fleet:
        m = fleet.manifest()["engines"][0]
        cfg = _cfg(m["kv_events"], topic="kv", metrics=m["metrics"])
        svc = TelemetryService(cfg)
        await svc.start()
        try:
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=10) as c:
                r = await c.post(m["url"] + "/completions", json={"prompt": "alpha " * 80, "max_tokens": 1})
                assert r.status_code == 200
            await async_wait_until(lambda: svc.kv_view("e")["stale"], 5)
            e = svc.fleet_snapshot()["engines"]["e"]
            assert e["stale_reason"] == "wrong_topic" and e["kv_events"]["other_topics"] == {"": 1}
            assert _gauges(svc, cfg)[("gateway_kv_stream_other_topic_frames", ("e",))] == 1.0
        finally:
            await svc.close()


# ------------------------------------------------------------------------------------------------ wire forms
@pytest.mark.parametrize("array_events", [False, True])
def test_bytes_block_hashes_and_medium_none_round_trip_through_the_index(array_events):
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends 32-byte hashes; `medium` None is the GPU pool; both in the
    map events of vLLM 0.32 and the array events of older versions."""
    from gateway.telemetry.kv_events import BlockRemoved as GwBlockRemoved
    from gateway.telemetry.kv_events import decode_batch

    h1, h2 = b"\x01" * 32, b"\xfe" * 32
    toks = list(range(2 * BS))
    idx = KVIndex()
    for ev in ([GwBlockStored([h1, h2], None, toks, BS, None, None, None)], [GwBlockRemoved([h2], None)]):
        b = decode_batch(encode_batch(KVEventBatch(1.0, ev, 0), array_events=array_events))
        assert b.events[0].block_hashes[-1] in (h2, h1) and b.events[0].medium is None
        idx.apply("e", b)
    assert idx.engine_blocks("e") == {"GPU": 1}
    assert idx.lookup(["e"], toks + [1])["e"].tokens == BS


async def test_hot_reload_retunes_topic_and_grace_on_the_same_subscription():
    pub = RawPub()
    url = f"http://127.0.0.1:{free_port()}/v1"
    cfg = _cfg(pub.endpoint, topic="kv", grace=5, url=url)
    svc = TelemetryService(cfg)
    await svc.start()
    try:
        sub = svc.subscribers["e"]
        await asyncio.sleep(0.3)
        pub.send(b"", _payload(0))
        await async_wait_until(lambda: sub.watch.other_topic_frames == 1)
        await svc.swap_config(_cfg(pub.endpoint, topic="", grace=2, url=url))
        assert svc.subscribers["e"] is sub and sub.topic == "" and sub.watch.grace_s == 2
        pub.send(b"", _payload(1))
        await async_wait_until(lambda: sub.counters["batches"] == 1)
    finally:
        await svc.close()
        pub.close()
