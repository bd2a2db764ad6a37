"""`gateway engine vllm ...` starts a real engine and prints a backend entry the gateway's config accepts."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from gateway.config import parse_config
from tests.vllm.stack import MODEL_DIR, ROOT, engine_ports

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.slow]


def test_gateway_engine_vllm_prints_backend_config(vllm_env):
    port, kv, rp = engine_ports(3)
    r = subprocess.run([sys.executable, "-m", "gateway", "engine", "vllm", "--model", str(MODEL_DIR),
                        "--port", str(port), "--kv-port", str(kv), "--replay-port", str(rp), "--name", "cli-engine",
                        "--priority", "--block-size", "32", "--num-gpu-blocks-override", "80", "--exit-when-ready",
                        "--log", str(vllm_env / "cli-engine.log")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr + (vllm_env / "cli-engine.log").read_text(errors="replace")[-3000:]
    assert "# vLLM ready in" in r.stdout
    entry = yaml.safe_load(r.stdout)
    cfg = parse_config(yaml.safe_dump({"backends": entry}))
    b = cfg.backend("cli-engine")
    assert (b.kind, b.url, b.kv_events, b.replay) == ("vllm", f"http://127.0.0.1:{port}/v1", f"tcp://127.0.0.1:{kv}",
                                                      f"tcp://127.0.0.1:{rp}")
    assert b.priority_scheduling and b.models == ["tiny-llama"]
    started = r.stderr.splitlines()[0]
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config",
                 "replay_endpoint", "--scheduling-policy priority"):
        assert flag in started, started
