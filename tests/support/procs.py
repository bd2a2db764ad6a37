"""Start real processes (gateway, upstreams, simulators) on free ports for end-to-end tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready:\n{out[-4000:]}")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code in ok:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last})")


class Proc:
    """A child process whose output goes to a log file; stopped (and reaped) by `stop()`."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                  cwd=str(cwd or ROOT), start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig: int) -> None:
        self.p.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        self._log.close()
        return self.p.returncode

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(5)


def start_upstream(tmp: Path, key: str | None = None) -> tuple[Proc, int]:
    port = free_port()
    args = [sys.executable, "-m", "tests.support.upstream", "--port", str(port)]
    if key:
        args += ["--key", key]
    p = Proc(args, tmp / f"upstream-{port}.log")
    wait_http(f"http://127.0.0.1:{port}/health", proc=p.p)
    return p, port


def start_gateway(config_path: Path, env: dict[str, str] | None = None, ready_path: str = "/healthz",
                  timeout: float = 30.0) -> tuple[Proc, int]:
    import yaml

    cfg = yaml.safe_load(config_path.read_text())
    port = cfg["server"]["port"]
    p = Proc([sys.executable, "-m", "gateway", "serve", "--config", str(config_path)],
             config_path.parent / f"gateway-{port}.log", env=env)
    wait_http(f"http://127.0.0.1:{port}{ready_path}", timeout=timeout, proc=p.p)
    return p, port


def audit_record(base: str, request_id: str, admin_key: str, tries: int = 60) -> dict:
    """The audit record of a request (by the gateway's or the client's x-request-id) from
    /admin/decisions/{id}, polled while the recorder writes it."""
    r = None
    for _ in range(tries):
        r = httpx.get(f"{base}/admin/decisions/{request_id}", headers={"authorization": f"Bearer {admin_key}"})
        if r.status_code == 200:
            return r.json()
        time.sleep(0.1)
    raise AssertionError(f"no audit record for {request_id}: {r.status_code if r else '-'} {r.text if r else ''}")
