"""Fixtures for the Helm chart tests: a helm binary (scripts/get_helm.sh) and kubernetes-validate.

Without them the tests skip locally; under CI=true a missing tool is a failure, never a skip."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gateway"


def _missing(why: str) -> None:
    unavailable(f"{why} (chart tests)")


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "get_helm.sh")], capture_output=True, text=True,
                             timeout=300, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired) as e:
        _missing(f"scripts/get_helm.sh could not run: {e}")
    if out.returncode != 0:
        _missing(f"no helm binary: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def kval():
    try:
        import kubernetes_validate.utils as utils
    except ImportError:
        _missing("kubernetes-validate is not installed (pip install -e '.[dev]')")
    return utils
