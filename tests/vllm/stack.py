"""Real vLLM engines + a real gateway process in front of them, for the real-engine suite and bench/gpu_check.

No pytest here (bench/gpu_check.py imports it on a GPU machine): `ensure_env` makes .venv-vllm, `ensure_model`
the tiny offline model, `start_stack` N engines (in parallel, each on its own ports and, on CPU, its own core)
plus one gateway configured with them as `kind: vllm` backends. `VllmStack.close()` stops everything.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from backends.vllm import launcher
from tests.support.procs import Proc, free_port, wait_http

ROOT = Path(__file__).resolve().parents[2]
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_DIR = ROOT / "var" / "tiny-llama"
API_KEY = "vllm-e2e-key-0123456789"
ADMIN_KEY = "vllm-e2e-admin-0123456789"


class SetupError(RuntimeError):
    """The vLLM environment, the model or an engine could not be brought up (the reason is in the message)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def engine_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """n distinct ports for an engine's HTTP, KV-event and replay sockets, taken *below* the kernel's ephemeral
    range and bindable on every interface (vLLM binds its ZMQ sockets on tcp://*). A port from free_port() lies
    in the ephemeral range, so between choosing it and vLLM's bind any outgoing connection (the suite makes
    thousands) or another engine's own get_open_port() can take it, and the engine core dies at start with
    "Address already in use"; ports below that range are only ever taken by an explicit bind."""
    rng = rng or random.Random()
    low = max(_ephemeral_low(), 12000)
    out: list[int] = []
    while len(out) < n:
        port = rng.randrange(10000, low)
        if port in out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        out.append(port)
    return out


_CAUSE = re.compile(r"\b[A-Za-z_.]*(Error|Exception)\b: ")


def failure_excerpt(log: str, tail: int = 2500) -> str:
    """What a failed engine start printed that says why: every distinct exception line (vLLM's root cause,
    e.g. the engine core's ZMQError, sits far above the API server's generic "Engine core initialization
    failed" traceback that fills the end of the log), then the log's last `tail` characters."""
    causes: list[str] = []
    for line in log.splitlines():
        if _CAUSE.search(line):
            msg = line[_CAUSE.search(line).start():].strip()
            if msg not in causes:
                causes.append(msg)
    head = "exceptions in the log:\n  " + "\n  ".join(causes[:12]) + "\n" if causes else ""
    return f"{head}--- last {tail} characters:\n{log[-tail:]}"


def ensure_env(timeout: float = 900.0) -> float:
    """Run scripts/setup_vllm_env.sh (idempotent: 0 s when the stamp matches); returns seconds spent."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup_vllm_env.sh")], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode != 0 or not VENV_PY.exists():
        raise SetupError(f"scripts/setup_vllm_env.sh failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return time.monotonic() - t0


def ensure_model(outdir: Path = MODEL_DIR, python: Path = VENV_PY) -> Path:
    """Generate the tiny Llama + tokenizer (backends/vllm/model.py) unless a complete one is already there."""
    if (outdir / "tiny_model.json").is_file() and (outdir / "model.safetensors").is_file():
        return outdir
    r = subprocess.run([str(python), "-m", "backends.vllm.model", str(outdir)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise SetupError(f"model generation failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return outdir


@dataclass
class Engine:
    """One running vLLM OpenAI server with its KV-event ports."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    proc: subprocess.Popen[bytes]
    log: Path
    startup_s: float = 0.0
    priority: bool = False  # started with --scheduling-policy priority (and configured so in the gateway)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    @property
    def kv(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


@dataclass
class VllmStack:
    """What the checks need: the engines, the gateway's base URL and credentials, the served model name."""

    model: str
    engines: list[Engine]
    gateway: Proc | None = None
    gw_port: int = 0
    workdir: Path = Path(".")
    block_size: int | None = None
    num_blocks: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    startup_failures: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gw_port}"

    def engine(self, name: str) -> Engine:
        return next(e for e in self.engines if e.name == name)

    def admin_get(self, path: str) -> Any:
        r = httpx.get(self.base + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        for e in self.engines:
            launcher.stop(e.proc)

    def logs_tail(self, n: int = 3000) -> str:
        out = []
        for e in self.engines:
            try:
                out.append(f"--- {e.name} ({e.log})\n" + e.log.read_text(errors="replace")[-n:])
            except OSError:
                pass
        if self.gateway is not None:
            out.append(f"--- gateway\n{self.gateway.log()[-n:]}")
        return "\n".join(out)


def gateway_config(stack: VllmStack, gw_port: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Both engines as kind: vllm backends (url, kv_events, replay, metrics), no policies, memory budgets."""
    backends = []
    for e in stack.engines:
        b = launcher.backend_config(e.name, e.port, e.kv_port, e.replay_port, stack.model, country="SE",
                                    priority_scheduling=e.priority)
        b["health"] = {"interval_s": 1.0}
        b["timeouts"] = {"first_token_s": 120, "total_s": 300}
        backends.append(b)
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": gw_port},
        "backends": backends,
        "keys": [{"key_env": "VLLM_E2E_KEY", "tenant": "e2e"}],
        "admin": {"key_env": "VLLM_E2E_ADMIN_KEY"},
        "policy": {"files": [], "default_allow": True, "audit_path": str(stack.workdir / "audit.jsonl")},
        "budgets": {"store": "memory", "sqlite_path": str(stack.workdir / "budgets.db")},
        "telemetry": {"scrape_interval_s": 0.5},
        "data_dir": str(stack.workdir),
    }
    for k, v in (extra or {}).items():
        cfg[k] = v
    return cfg


def start_stack(workdir: Path, model_dir: Path = MODEL_DIR, *, engines: int = 2, device: str = "cpu",
                block_size: int | None = 32, num_blocks: int | None = 96, python: str | None = None,
                ready_timeout: float = 600.0, extra_args: tuple[str, ...] = (),
                priority_engines: tuple[int, ...] = ()) -> VllmStack:
    """Start `engines` vLLM servers in parallel, wait until all answer /health, then start the gateway.
    Engines whose index is in `priority_engines` run vLLM's priority scheduler (the gateway then forwards the
    policy's priority to them, and only to them)."""
    workdir.mkdir(parents=True, exist_ok=True)
    served = launcher.served_name_for(model_dir)
    stack = VllmStack(model=served, engines=[], workdir=workdir, block_size=block_size, num_blocks=num_blocks)
    t0 = time.monotonic()
    cores = os.cpu_count() or 1

    def launch_engine(i: int, attempt: int) -> Engine:
        port, kv, rp = engine_ports(3)
        prio = i in priority_engines
        cmd = launcher.build_command(model_dir, port, kv, rp, python=python, served_model_name=served,
                                     block_size=block_size, num_gpu_blocks_override=num_blocks,
                                     priority_scheduling=prio, device=device, extra_args=extra_args)
        bind = str(i % cores) if device == "cpu" and engines > 1 else None
        env = launcher.build_env(omp_threads_bind=bind, device=device)
        log = workdir / f"engine-{i}{'' if attempt == 0 else f'-retry{attempt}'}.log"
        return Engine(f"vllm-{chr(ord('a') + i)}", port, kv, rp, launcher.launch(cmd, env, log_path=log), log,
                      priority=prio)

    try:
        for i in range(engines):
            stack.engines.append(launch_engine(i, 0))
        for i in range(engines):
            # An engine that *exits* during start-up is relaunched once on fresh ports; the first failure's
            # cause is kept in stack.startup_failures (printed by the fixture). A timeout is not retried.
            for attempt in range(2):
                e = stack.engines[i]
                try:
                    launcher.wait_ready(e.url, ready_timeout, e.proc)
                    break
                except RuntimeError as exc:
                    why = f"engine {e.name}: {exc}\n{failure_excerpt(e.log.read_text(errors='replace'))}"
                    launcher.stop(e.proc)
                    if attempt == 1:
                        raise SetupError("\n".join([*stack.startup_failures, why])) from None
                    stack.startup_failures.append(why)
                    stack.engines[i] = launch_engine(i, attempt + 1)
                except TimeoutError as exc:
                    why = failure_excerpt(e.log.read_text(errors="replace"))
                    raise SetupError(f"engine {e.name}: {exc}\n{why}") from None
            stack.engines[i].startup_s = time.monotonic() - t0
        stack.timings["engines_ready_s"] = time.monotonic() - t0
        gw_port = free_port()
        cfg_path = workdir / "gateway.yaml"
        cfg_path.write_text(yaml.safe_dump(gateway_config(stack, gw_port), sort_keys=False))
        t1 = time.monotonic()
        env = {"VLLM_E2E_KEY": API_KEY, "VLLM_E2E_ADMIN_KEY": ADMIN_KEY}
        stack.gateway = Proc([sys.executable, "-m", "gateway", "serve", "--config", str(cfg_path)],
                             workdir / "gateway.log", env=env)
        stack.gw_port = gw_port
        wait_http(f"{stack.base}/healthz", timeout=60, proc=stack.gateway.p)
        stack.timings["gateway_ready_s"] = time.monotonic() - t1
        return stack
    except BaseException:
        stack.close()
        raise
