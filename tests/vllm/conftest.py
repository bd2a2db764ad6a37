"""Session fixture for the real-vLLM suite: .venv-vllm, the tiny model, two CPU engines and a gateway.

Under CI=true any failure to set up or start the engines fails the tests; elsewhere the suite is skipped with
the reason when .venv-vllm is absent (RUN_VLLM=1 creates it) or cannot be created; RUN_VLLM=0 skips it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import IN_CI, unavailable
from tests.vllm.stack import MODEL_DIR, ROOT, VENV_PY, SetupError, ensure_env, ensure_model, start_stack

ENGINE_RAM_GB = 3  # ~2-3 GB RSS per CPU engine with a small KV cache (docs/vllm.md)


def _unavailable(why: str) -> None:
    unavailable(f"real vLLM suite could not start: {why}")


def _free_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return float("inf")


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory):
    """.venv-vllm set up and the tiny model generated; yields a work directory for logs and configs."""
    if os.environ.get("RUN_VLLM") == "0" and not IN_CI:
        pytest.skip("RUN_VLLM=0")
    if not IN_CI and os.environ.get("RUN_VLLM") != "1" and not VENV_PY.exists():
        pytest.skip(".venv-vllm not set up (run scripts/setup_vllm_env.sh, or set RUN_VLLM=1 to create it)")
    if shutil.which("bash") is None:
        _unavailable("bash not found")
    if _free_gb() < 2 * ENGINE_RAM_GB:
        _unavailable(f"only {_free_gb():.1f} GB RAM available; two CPU engines need ~{2 * ENGINE_RAM_GB} GB")
    t0 = time.monotonic()
    try:
        ensure_env()
        ensure_model(MODEL_DIR)
    except (SetupError, subprocess.TimeoutExpired, OSError) as e:
        _unavailable(f".venv-vllm / tiny model could not be created: {e}")
    work = tmp_path_factory.mktemp("vllm")
    (work / "setup_s").write_text(f"{time.monotonic() - t0:.1f}")
    return work


@pytest.fixture(scope="session")
def vllm_stack(vllm_env):
    work = vllm_env
    t0 = time.monotonic()
    setup_s = float((work / "setup_s").read_text())
    try:
        stack = start_stack(work, MODEL_DIR, engines=2, block_size=32, num_blocks=96, priority_engines=(1,))
    except (SetupError, TimeoutError, RuntimeError, OSError) as e:
        _unavailable(f"vLLM engines or gateway did not start: {e}")
    stack.timings["setup_env_s"] = setup_s
    stack.timings["fixture_s"] = time.monotonic() - t0
    print(f"\nvllm stack: {stack.timings}")
    for why in stack.startup_failures:  # an engine that exited at start and was relaunched once: say why
        print(f"vllm stack: relaunched after a failed start:\n{why}")
    yield stack
    stack.close()
    logs = ROOT / "var" / "vllm-e2e-last"
    try:  # keep the last run's logs for debugging CI failures
        shutil.rmtree(logs, ignore_errors=True)
        shutil.copytree(work, logs, ignore=shutil.ignore_patterns("*.db", "*.db-*"))
    except OSError:
        pass
