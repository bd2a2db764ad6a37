"""Dependencies are pinned by requirements.lock and checked for known vulnerabilities with pip-audit (PyPI's
advisory data, queried over the network: the check fails, naming the cause, when it cannot be reached)."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*(\[[^\]]*\])?==[^\s=]+", line), f"not pinned: {line!r}"
        name, version = line.split("==")
        out[_norm(name.split("[")[0])] = version
    return out


def test_every_declared_dependency_is_pinned_in_the_lock():
    locked = _locked()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    missing = [d for d in declared if _norm(re.split(r"[\[<>=!~; ]", d, 1)[0]) not in locked]
    assert not missing, f"declared but not in requirements.lock: {missing}"


def test_the_environment_holds_exactly_the_locked_versions():
    """scripts/bootstrap.sh installs with `-c requirements.lock`, so what the suite runs on is what pip-audit
    checks: every locked package is installed at its locked version (extra tools in .venv are allowed)."""
    from importlib import metadata

    installed = {_norm(d.metadata["Name"]): d.version for d in metadata.distributions()}
    wrong = {n: (v, installed.get(n)) for n, v in _locked().items() if installed.get(n) != v}
    assert not wrong, f"locked vs installed (re-run scripts/bootstrap.sh): {wrong}"


def test_pip_audit_finds_no_known_vulnerability_in_the_lock():
    exe = shutil.which("pip-audit", path=str(Path(sys.executable).parent)) or shutil.which("pip-audit")
    assert exe, "pip-audit is not installed (it is a dev extra: pip install -e '.[dev]')"
    r = subprocess.run([exe, "-r", str(LOCK), "--no-deps", "--disable-pip", "--progress-spinner", "off"],
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    if r.returncode != 0 and "Found" not in out and "vulnerab" not in out.lower():
        raise AssertionError(f"pip-audit could not run (is PyPI's vulnerability service reachable?):\n{out[-3000:]}")
    assert r.returncode == 0, f"known vulnerabilities in requirements.lock:\n{out[-5000:]}"
