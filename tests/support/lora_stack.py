"""One end-to-end stack for the adapter tests: a simulated fleet whose engines load LoRA adapters at run time
(`--enable-lora --max-loras N --lora-load-ms X`) and a real gateway declaring each engine
`lora: {dynamic: true, max_loras: N}` for the base model `base` (the engines' `sim-model`)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import yaml

from backends.sim.fleet import FleetProcess
from tests.support.procs import free_port, start_gateway


def dynamic_backends(manifest: dict[str, Any], max_loras: int) -> list[dict[str, Any]]:
    """The fleet's engines as backends e1, e2, ... serving `base`, loading adapters at run time (re-read from
    /v1/models only on first contact and after a 404: refresh_s is long)."""
    lora = {"dynamic": True, "max_loras": max_loras, "refresh_s": 3600.0}
    return [{"name": f"e{i + 1}", "url": e["url"], "kind": "sim", "models": ["base"],
             "model_map": {"base": "sim-model"}, "health": {"enabled": False}, "lora": lora}
            for i, e in enumerate(manifest["engines"])]


def engine_roots(manifest: dict[str, Any]) -> dict[str, str]:
    """Backend name -> the engine's server root (for its /v1/models, load and unload routes)."""
    return {f"e{i + 1}": e["url"].rstrip("/").removesuffix("/v1") for i, e in enumerate(manifest["engines"])}


@contextlib.contextmanager
def lora_stack(tmp: Path, admin_key: str, *, engines: int = 2, profile: str = "tiny", max_loras: int = 2,
               load_ms: float = 20, config: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Start the fleet and one gateway (`config` adds top-level sections); yields base, engines (roots), tmp."""
    fleet = FleetProcess(["--engines", str(engines), "--profile", profile, "--base-port", "0", "--enable-lora",
                          "--max-loras", str(max_loras), "--lora-load-ms", str(load_ms)], tmp / "fleet.json")
    man = fleet.start()
    try:
        port = free_port()
        cfg = {"server": {"host": "127.0.0.1", "port": port, "workers": 1},
               "backends": dynamic_backends(man, max_loras),
               "admin": {"key": admin_key},
               "policy": {"audit_path": str(tmp / "audit.jsonl")},
               "identity": {"sqlite_path": str(tmp / "id.db")},
               "data_dir": str(tmp / "var"), **(config or {})}
        path = tmp / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw, _ = start_gateway(path)
        try:
            yield {"base": f"http://127.0.0.1:{port}", "engines": engine_roots(man), "tmp": tmp}
        finally:
            gw.stop()
    finally:
        fleet.stop()
