"""One gateway process in front of a simulated fleet, for the hardening tests and benches (bench/fuzz_api.py,
bench/concurrency.py, bench/soak.py): real processes, real sockets, the config written from the manifest."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backends.sim.fleet import FleetProcess
from tests.resilience.stack import ADMIN_KEY, EEA_KEY, GW_KEY, sim_backends, write_config
from tests.support.procs import Proc, start_gateway

__all__ = ["ADMIN_KEY", "EEA_KEY", "GW_KEY", "Stack", "start_stack", "proc_stats"]


@dataclass
class Stack:
    tmp: Path
    fleet: FleetProcess
    manifest: dict[str, Any]
    gw: Proc
    port: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.gw.stop()
        self.fleet.stop()


def start_stack(tmp: Path, engines: int = 2, profile: str = "tiny", locations: str = "DE,SE",
                server: dict[str, Any] | None = None, fleet_args: list[str] | None = None,
                env: dict[str, str] | None = None, **sections: Any) -> Stack:
    """Start `engines` simulated engines and one gateway in front of them (keys from tests.resilience.stack)."""
    fp = FleetProcess(["--engines", str(engines), "--profile", profile, "--base-port", "0", "--locations",
                       locations, *(fleet_args or [])], tmp / "manifest.json")
    manifest = fp.start()
    try:
        backends = sim_backends(manifest, capabilities=["chat", "completions", "embeddings", "rerank", "score",
                                                            "transcription"])
        srv = {"max_body_bytes": 1_000_000, **(server or {})}
        cfg = write_config(tmp, backends, server=srv, observability={"log_level": "warning"}, **sections)
        gw, port = start_gateway(cfg, env=env)
    except BaseException:
        fp.stop()
        raise
    return Stack(tmp=tmp, fleet=fp, manifest=manifest, gw=gw, port=port)


def proc_stats(pid: int) -> dict[str, float]:
    """Resident memory (MiB), open file descriptors and TCP sockets of a process, read from /proc."""
    rss_kb = 0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
        if line.startswith("VmHWM:"):
            hwm_kb = int(line.split()[1])
    fds = os.listdir(f"/proc/{pid}/fd")
    socks = 0
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                socks += 1
        except OSError:
            pass
    return {"rss_mib": rss_kb / 1024, "peak_rss_mib": hwm_kb / 1024, "fds": len(fds), "sockets": socks}


def wait_ready(base: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base}/readyz not ready")
