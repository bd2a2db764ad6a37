"""One end-to-end stack from a few arguments: a simulated fleet (`python -m backends.sim`, a child process), the
gateway's config written from the fleet's manifest, and a `python -m gateway serve` process in front of it.

    with make_stack(tmp, keys={KEY: "acme"}, admin=ADMIN, engines=2, policy={"version": 1, "rules": [...]}) as s:
        httpx.post(s.base + "/v1/chat/completions", ...)

What every e2e test wrote by hand is the default: the gateway on a free local port, the engines as backends
(their URL and telemetry endpoints taken from the manifest), the audit log, identity store and budget ledger
under `tmp`. Arguments change only what a test is about; any other top-level config section is a keyword
(`cost={...}`, `observability={...}`) and a dict is merged over the default of the same name."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import yaml

from backends.sim.fleet import FleetProcess, manifest_backends
from tests.support.procs import Proc, free_port, start_gateway


@dataclass
class Stack:
    tmp: Path
    base: str
    port: int
    config: Path
    manifest: dict[str, Any]
    gw: Proc

    @property
    def engines(self) -> list[dict[str, Any]]:
        """The fleet's engines as its manifest lists them (name, url, kv_events, replay, metrics...)."""
        return self.manifest["engines"]


def fleet_backends(manifest: dict[str, Any], kind: str = "sim", **fields: Any) -> list[dict[str, Any]]:
    """The manifest's engines as backends of `kind` (named as the engines are), each with `fields` added."""
    return [{**b, **fields} for b in manifest_backends(manifest, kind=kind)]


def key_entries(keys: Mapping[str, str | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`{secret: tenant}` or `{secret: {"tenant": ..., "team": ..., ...}}` as the config's `keys:` list."""
    return [{"key": k, **({"tenant": v} if isinstance(v, str) else dict(v))} for k, v in keys.items()]


def gateway_config(tmp: Path, port: int, backends: list[dict[str, Any]], *,
                   keys: Mapping[str, str | Mapping[str, Any]], admin: str | None = None,
                   policy: Mapping[str, Any] | None = None, **sections: Any) -> dict[str, Any]:
    """The config an e2e stack runs: `policy` (a policy document) is written to tmp/policy.yaml; each of
    `sections` replaces the default section of its name, or is merged over it when both are dicts."""
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port},
        "backends": backends,
        "keys": key_entries(keys),
        "policy": {"audit_path": str(tmp / "audit.jsonl")},
        "identity": {"sqlite_path": str(tmp / "id.db")},
        "budgets": {"sqlite_path": str(tmp / "budgets.db"), "spool_path": str(tmp / "spool.jsonl"),
                    "ledger_flush_s": 0.05}}
    if admin is not None:
        cfg["admin"] = {"key": admin}
    if policy is not None:
        (tmp / "policy.yaml").write_text(yaml.safe_dump(dict(policy)))
        cfg["policy"]["files"] = [str(tmp / "policy.yaml")]
    for name, v in sections.items():
        base = cfg.get(name)
        cfg[name] = {**base, **v} if isinstance(base, dict) and isinstance(v, Mapping) else v
    return cfg


@contextlib.contextmanager
def make_stack(tmp: Path, *, keys: Mapping[str, str | Mapping[str, Any]], engines: int = 1, profile: str = "tiny",
               fleet_args: Sequence[str] = (), kind: str = "sim", backend: Mapping[str, Any] | None = None,
               backends: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None,
               admin: str | None = None, policy: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None, **sections: Any) -> Iterator[Stack]:
    """Start `engines` simulated engines (`profile`, plus `fleet_args`) and one gateway in front of them, and stop
    both on exit. The backends are the engines as `kind` with the fields of `backend` added, unless
    `backends(manifest)` says otherwise; a section
    that names engines may be a function of the manifest too (`cost=lambda man: {...}`)."""
    fleet = FleetProcess(["--engines", str(engines), "--profile", profile, "--base-port", "0", *fleet_args],
                         tmp / "fleet.json")
    manifest = fleet.start()
    try:
        port = free_port()
        bs = backends(manifest) if backends is not None else fleet_backends(manifest, kind, **(backend or {}))
        secs = {k: v(manifest) if callable(v) else v for k, v in sections.items()}
        path = tmp / "gw.yaml"
        path.write_text(yaml.safe_dump(gateway_config(tmp, port, bs, keys=keys, admin=admin, policy=policy,
                                                      **secs)))
        gw, _ = start_gateway(path, env=dict(env) if env is not None else None)
        try:
            yield Stack(tmp=tmp, base=f"http://127.0.0.1:{port}", port=port, config=path, manifest=manifest, gw=gw)
        finally:
            gw.stop()
    finally:
        fleet.stop()
