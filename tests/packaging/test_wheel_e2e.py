"""The wheel is what a platform team deploys: build it from a clean export of the tracked files, install it
non-editable into a fresh venv with only the runtime lock, and run it from a directory with no repository in
sight (`--version`, `config check`, `policy check`, `serve` + a chat completion + /admin/ui, `demo`).

Catches package data left out of the wheel (budget.lua, dashboard.html, the policy schema), run-time paths
into a source checkout, and a requirements.lock that is not exactly the runtime closure. ~60 s (the venv install
takes most of it; pip's cache and find-links serve the wheels).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.support.procs import ROOT, Proc, free_port, start_upstream, wait_http

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GW_KEY, ADMIN_KEY, UP_KEY = "gw-pkg-key-0123456789", "gw-pkg-admin-0123456789", "up-pkg-key"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args} exited {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}"
    return r.stdout


def _export_tracked(dest: Path) -> None:
    """The tracked files as they are in the work tree (a clean clone's content; untracked files stay out)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to export")
    names = _run(["git", "ls-files", "-z"], ROOT).split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin dir, clean env, a work dir outside the repository) with the wheel installed."""
    tmp = tmp_path_factory.mktemp("pkg")
    src, dist, venv, work = tmp / "src", tmp / "dist", tmp / "venv", tmp / "work"
    for d in (src, dist, work):
        d.mkdir()
    _export_tracked(src)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], tmp)
    wheels = list(dist.glob("policy_gateway-*.whl"))
    assert len(wheels) == 1, wheels
    _run([sys.executable, "-m", "venv", str(venv)], tmp)
    py = venv / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", str(wheels[0]), "-c", str(src / "requirements.lock")], tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    return {"bin": venv / "bin", "env": env, "work": work, "src": src}


def test_the_wheel_imports_from_site_packages_not_the_checkout(installed):
    out = _run([str(installed["bin"] / "python"), "-c",
                "import gateway, backends; print(gateway.__file__); print(backends.__file__)"],
               installed["work"], installed["env"])
    for line in out.split():
        assert "site-packages" in line and str(ROOT) not in line, out


def test_the_runtime_lock_is_exactly_what_the_wheel_installs(installed):
    """requirements.lock is what an image installs: every package the wheel pulled in is pinned there at that
    version, and nothing in it is left over (dev tooling lives in requirements-dev.lock)."""
    freeze = _run([str(installed["bin"] / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                  installed["work"], installed["env"])
    got = {_norm(n): v for n, v in (ln.split("==", 1) for ln in freeze.split() if "==" in ln)}
    got.pop("policy-gateway", None)
    lock = {}
    for line in (installed["src"] / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            n, v = line.split("==", 1)
            lock[_norm(n)] = v
    assert got == lock, {"installed, not as locked": {n: v for n, v in got.items() if lock.get(n) != v},
                         "locked, not installed": sorted(set(lock) - set(got))}


def test_version(installed):
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _run([str(installed["bin"] / "gateway"), "--version"], installed["work"], installed["env"])
    assert out.strip() == f"gateway {want}"


def test_the_installed_metadata_carries_the_license_and_readme(installed):
    """What a platform team's licence scanner and package index read: the SPDX expression (PEP 639), the
    LICENSE text inside the wheel, and the README as the long description."""
    out = _run([str(installed["bin"] / "python"), "-c",
                "import json; from importlib import metadata as m; d = m.distribution('policy-gateway'); "
                "print(json.dumps({'license': d.metadata['License-Expression'], "
                "'type': d.metadata['Description-Content-Type'], 'description': d.metadata.get_payload(), "
                "'license_files': [f.read_text() for f in d.files if f.name == 'LICENSE']}))"],
               installed["work"], installed["env"])
    meta = json.loads(out)
    assert meta["license"] == "Apache-2.0"
    assert meta["type"] == "text/markdown"
    assert meta["description"].strip() == (ROOT / "README.md").read_text().strip()
    assert meta["license_files"] == [(ROOT / "LICENSE").read_text()]


def test_config_check_policy_check_serve_chat_and_dashboard(installed, tmp_path):
    work, env, gw_bin = installed["work"], dict(installed["env"]), str(installed["bin"] / "gateway")
    up, up_port = start_upstream(tmp_path, key=UP_KEY)  # the test's mock upstream (dev venv), not the wheel
    port = free_port()
    (work / "policies").mkdir(exist_ok=True)
    (work / "policies" / "eea.yaml").write_text("""
rules:
  - id: eea-stays-in-eea
    match: {tenant: demo}
    require: {jurisdiction: EEA}
tests:
  - given: {tenant: demo, model: mock-model}
    expect: {allow: true, jurisdiction: EEA}
""")
    (work / "gateway.yaml").write_text(f"""
server: {{host: 127.0.0.1, port: {port}}}
backends:
  - name: local
    kind: openai
    url: http://127.0.0.1:{up_port}/v1
    api_key_env: UPSTREAM_KEY
    models: [mock-model]
    location: {{country: DE}}
    retention: zero
keys:
  - key_env: GATEWAY_KEY
    tenant: demo
admin:
  key_env: GATEWAY_ADMIN_KEY
policy:
  files: [policies/eea.yaml]
  audit_path: audit.jsonl
identity: {{sqlite_path: gateway.db}}
budgets: {{sqlite_path: budgets.db}}
""")
    env.update(UPSTREAM_KEY=UP_KEY, GATEWAY_KEY=GW_KEY, GATEWAY_ADMIN_KEY=ADMIN_KEY)
    out = _run([gw_bin, "config", "check", "gateway.yaml"], work, env)
    assert "gateway.yaml: ok (1 backends, 1 models" in out
    _run([gw_bin, "policy", "check", "policies/"], work, env)  # the schema is package data
    _run([gw_bin, "policy", "test", "policies/"], work, env)
    gw = Proc([gw_bin, "serve", "--config", "gateway.yaml"], tmp_path / "gw.log", env=env, cwd=work)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/readyz", timeout=30, proc=gw.p)
        r = httpx.post(base + "/v1/chat/completions", headers={"authorization": f"Bearer {GW_KEY}"}, timeout=10,
                       json={"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        ui = httpx.get(base + "/admin/ui", timeout=5)
        assert ui.status_code == 200 and "<html" in ui.text.lower(), ui.text[:300]
        d = httpx.get(base + f"/admin/decisions/{r.headers['x-request-id']}", timeout=5,
                      headers={"authorization": f"Bearer {ADMIN_KEY}"})
        assert d.status_code == 200 and "eea-stays-in-eea" in d.text, d.text[:500]
    finally:
        rc = gw.stop()
        up.stop()
    # a clean drain: uvicorn re-raises the SIGTERM it handled once shutdown is complete
    assert rc in (0, -signal.SIGTERM), gw.log_path.read_text(errors="replace")[-3000:]
    assert (work / "audit.jsonl").exists() and (work / "gateway.db").exists()


def test_demo_runs_from_the_wheel(installed, tmp_path):
    """`gateway demo`: simulator + gateway + the packaged example policy, everything written under --dir."""
    port, sim_port = free_port(), free_port()
    env = {**installed["env"], "GATEWAY_DEMO_KEY": GW_KEY}
    demo = Proc([str(installed["bin"] / "gateway"), "demo", "--engines", "1", "--port", str(port),
                 "--sim-base-port", str(sim_port), "--dir", str(tmp_path / "demo")], tmp_path / "demo.log",
                env=env, cwd=installed["work"])
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60, proc=demo.p)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=20,
                       headers={"authorization": f"Bearer {GW_KEY}"},
                       json={"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        demo.signal(signal.SIGINT)  # Ctrl-C, and nothing else: the demo stops its fleet and gateway itself
        try:
            rc = demo.p.wait(30)
        except subprocess.TimeoutExpired:
            rc = None
        demo.stop(5)
    assert rc == 0, demo.log_path.read_text(errors="replace")[-3000:]
    # ... and they are gone when it returns (before, a signal during its start-up killed the demo and left the
    # simulator and the gateway running, orphaned)
    for p in (port, sim_port):
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{p}/", timeout=2)
    assert (tmp_path / "demo" / "policy.yaml").read_text() == (ROOT / "policies" / "tenants.yaml").read_text()
