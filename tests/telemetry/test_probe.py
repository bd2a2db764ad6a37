"""`gateway config check --probe`: one decodable batch per KV-event stream within the timeout, or why not.
Real ZMQ on localhost: the simulator's publisher (PUB + replay ROUTER, vLLM 0.32 frames) or a bare PUB."""
from __future__ import annotations

import threading
import time

import yaml

from backends.sim.kv_wire import BlockStored
from backends.sim.publisher import KVEventPublisher
from gateway.cli import main
from gateway.telemetry.probe import probe_stream
from tests.support.procs import free_port
from tests.telemetry.test_stream_health import RawPub, _payload


def _ev(i: int) -> list:
    return [BlockStored([i], None, list(range(16)), 16, None, None, None)]


async def test_an_engine_that_published_before_is_judged_from_its_replay_buffer_at_once():
    pub = KVEventPublisher()  # vLLM's default topic ""
    pub.start()
    try:
        pub.publish(_ev(1))
        t0 = time.monotonic()
        ok = await probe_stream("e", pub.endpoint, pub.replay_endpoint, "", timeout_s=5)
        assert ok.ok and "replay buffer" in ok.message and time.monotonic() - t0 < 4
        wrong = await probe_stream("e", pub.endpoint, pub.replay_endpoint, "kv", timeout_s=5)
        assert wrong.status == "wrong_topic" and wrong.other_topics == {"": 1}
        assert "telemetry.kv_topic" in wrong.message and "1 buffered batch" in wrong.replay
    finally:
        await pub.close()


async def test_an_idle_engine_says_nothing_arrived_and_that_its_buffer_is_empty():
    pub = KVEventPublisher()
    pub.start()
    try:
        r = await probe_stream("e", pub.endpoint, pub.replay_endpoint, "", timeout_s=0.5)
        assert r.status == "no_events" and r.replay == "answered with an empty buffer"
        assert "published nothing yet" in r.message
    finally:
        await pub.close()
    r = await probe_stream("e", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", "", 0.3)
    assert r.status == "no_events" and r.replay == "did not answer" and "--kv-events-config" in r.message


def _keep_sending(pub: RawPub, topic: bytes, payload: bytes, stop: threading.Event) -> threading.Thread:
    def go():
        while not stop.is_set():
            pub.send(topic, payload)
            time.sleep(0.05)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _config(tmp_path, endpoint: str, topic: str | None) -> str:
    tel = {} if topic is None else {"kv_topic": topic}
    p = tmp_path / "gw.yaml"
    p.write_text(yaml.safe_dump({"telemetry": tel, "backends": [
        {"name": "e0", "kind": "vllm", "url": "http://127.0.0.1:9/v1", "models": ["m"], "kv_events": endpoint}]}))
    return str(p)


def test_cli_probe_live_stream(tmp_path, capsys):
    pub = RawPub()  # no replay socket: only the live stream can answer
    stop = threading.Event()
    t = _keep_sending(pub, b"", _payload(3), stop)
    try:
        assert main(["config", "check", "--probe", _config(tmp_path, pub.endpoint, None)]) == 0
        out = capsys.readouterr().out
        assert "probe e0 (" in out and "topic ''): ok: batch seq" in out and "live stream" in out
        assert main(["config", "check", "--probe", "--probe-timeout", "1",
                     _config(tmp_path, pub.endpoint, "kv")]) == 1
        out = capsys.readouterr().out
        assert "FAIL wrong_topic: frames arrive on topic(s) ''" in out
    finally:
        stop.set()
        t.join()
    stop.clear()
    t = _keep_sending(pub, b"kv", b"\xc1 not msgpack", stop)
    try:
        assert main(["config", "check", "--probe", "--probe-timeout", "1", _config(tmp_path, pub.endpoint, "kv")]) == 1
        assert "FAIL decode:" in capsys.readouterr().out
    finally:
        stop.set()
        t.join()
        pub.close()


def test_cli_probe_rejects_a_bad_timeout(tmp_path, capsys):
    assert main(["config", "check", "--probe", "--probe-timeout", "0",
                 _config(tmp_path, "tcp://127.0.0.1:1", None)]) == 2
    assert "--probe-timeout must be > 0" in capsys.readouterr().err
