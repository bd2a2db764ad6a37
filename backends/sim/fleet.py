"""Start N simulated engines in one process (or as a subprocess) and describe them in a manifest.

Ports: engine i listens for HTTP on base_port + 3i, publishes KV events on base_port + 3i + 1 and serves
replay on base_port + 3i + 2 (base_port 0: every port is picked by the OS, which tests use). The manifest
is JSON {"engines": [{name, url, kv_events, replay, metrics, location, profile, model, present_as, kind}]},
whose url, kv_events and replay keys a gateway backend takes as they are; `kind` is the backend kind that reads
the engine (`sim` for an engine presenting as vLLM, `sglang` for one presenting as SGLang).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from backends.sim.engine import Faults, SimEngine
from backends.sim.kv_wire import Wire, WireForm
from backends.sim.lora import LoraConfig
from backends.sim.profiles import EngineProfile, get_profile
from backends.sim.server import EngineServer


GATEWAY_KIND = {"vllm": "sim", "sglang": "sglang"}  # the gateway backend kind that reads each presentation


def parse_location(loc: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """"DE" or "DE:eu-central" or a dict -> {"country", "region"?} (the gateway's Location shape)."""
    if loc is None or isinstance(loc, dict):
        return loc
    country, _, region = loc.partition(":")
    out: dict[str, Any] = {"country": country.strip().upper()}
    if region:
        out["region"] = region.strip()
    return out


class Fleet:
    """N EngineServers sharing one event loop; `async with start_fleet(...) as fleet:`."""

    def __init__(self, servers: list[EngineServer]) -> None:
        self.servers = servers

    @property
    def engines(self) -> list[EngineServer]:
        return self.servers

    def __getitem__(self, i: int) -> EngineServer:
        return self.servers[i]

    def __len__(self) -> int:
        return len(self.servers)

    async def start(self) -> "Fleet":
        try:
            for s in self.servers:
                await s.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        for s in self.servers:
            try:
                await s.stop()
            except Exception:  # keep stopping the others
                pass

    async def __aenter__(self) -> "Fleet":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def manifest(self) -> dict[str, Any]:
        engines = []
        for s in self.servers:
            e = s.engine
            pub = e.publisher
            engines.append({
                "name": e.name, "url": s.url,
                "kv_events": pub.endpoint if pub else None,
                "replay": pub.replay_endpoint if pub else None,
                "metrics": s.root + "/metrics", "location": s.location, "profile": e.profile.name,
                "model": e.model, "topic": e.topic, "block_size": e.profile.block_size,
                "present_as": e.present_as, "kind": GATEWAY_KIND[e.present_as],
            })
        return {"engines": engines}

    def write_manifest(self, path: str | Path) -> None:
        """Atomically (write + rename), so a reader never sees half a file."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.manifest(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, p)


def build_fleet(n: int, base_port: int = 0, *, profiles: Sequence[str | EngineProfile] = ("tiny",),
                locations: Sequence[str | dict[str, Any] | None] = (None,), host: str = "127.0.0.1",
                model: str = "sim-model", name_prefix: str = "sim", lora_modules: Sequence[str] = (),
                priority_policy: bool = False, enable_prefix_caching: bool = True,
                enable_prompt_tokens_details: bool = True, faults: Faults | None = None, topic: str = "",
                batch_form: WireForm = "array", event_form: WireForm = "map",
                log_level: str = "warning", overrides: dict[str, Any] | None = None,
                lora: LoraConfig | None = None, present_as: Wire = "vllm") -> Fleet:
    """A Fleet that is not started yet; profiles and locations cycle over the engines. `present_as` "sglang":
    the engines answer as SGLang does (KV-event wire, metrics, errors, priority, tokenize, LoRA naming)."""
    servers = []
    for i in range(n):
        prof = profiles[i % len(profiles)]
        prof = get_profile(prof) if isinstance(prof, str) else prof
        if overrides:
            prof = prof.with_overrides(**overrides)
        port = 0 if base_port == 0 else base_port + 3 * i
        eng = SimEngine(prof, name=f"{name_prefix}-{i}", model=model, engine_index=0, host=host,
                        zmq_port=0 if base_port == 0 else port + 1, replay_port=0 if base_port == 0 else port + 2,
                        topic=topic, enable_prefix_caching=enable_prefix_caching, priority_policy=priority_policy,
                        batch_form=batch_form, event_form=event_form, present_as=present_as,
                        faults=Faults(**faults.as_dict()) if faults else None)  # type: ignore[arg-type]
        servers.append(EngineServer(eng, host, port, lora_modules=list(lora_modules),
                                    enable_prompt_tokens_details=enable_prompt_tokens_details, log_level=log_level,
                                    location=parse_location(locations[i % len(locations)] if locations else None),
                                    lora=lora))
    return Fleet(servers)


def start_fleet(n: int, base_port: int = 0, **kw: Any) -> Fleet:
    """In-process fleet for pytest: `async with start_fleet(2, profiles=["tiny"]) as fleet: ...`."""
    return build_fleet(n, base_port, **kw)


class FleetProcess:
    """The CLI fleet as a child process (for e2e tests): starts it, waits for its manifest, stops it."""

    def __init__(self, args: Sequence[str], manifest: str | Path, timeout_s: float = 20.0,
                 cwd: str | Path | None = None) -> None:
        self.args = list(args)
        self.manifest_path = Path(manifest)
        self.timeout_s = timeout_s
        self.cwd = cwd or Path(__file__).resolve().parents[2]
        self.proc: subprocess.Popen[bytes] | None = None
        self.manifest: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        if self.manifest_path.exists():
            self.manifest_path.unlink()
        cmd = [sys.executable, "-m", "backends.sim", *self.args, "--manifest", str(self.manifest_path)]
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"sim fleet exited with {self.proc.returncode}: {err[-2000:]}")
            if self.manifest_path.exists():
                self.manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
                return self.manifest
            time.sleep(0.05)
        self.stop()
        raise TimeoutError("sim fleet did not write its manifest in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()

    def __enter__(self) -> dict[str, Any]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()



def manifest_backends(manifest: dict[str, Any], kind: str | None = "vllm") -> list[dict[str, Any]]:
    """The manifest's engines as gateway `backends:` entries (url, kv_events, replay, metrics taken as they are);
    kind None: each engine's own (`sim` or `sglang`, as it presents itself)."""
    out = []
    for e in manifest["engines"]:
        b: dict[str, Any] = {"name": e["name"], "url": e["url"], "kind": kind or e.get("kind", "sim"), "models": [e.get("model", "sim-model")],
                             "kv_events": e["kv_events"], "replay": e["replay"], "metrics": e["metrics"]}
        if e.get("location"):
            b["location"] = e["location"]
        out.append(b)
    return out
