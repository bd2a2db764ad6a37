#!/usr/bin/env bash
# Create/refresh the project's virtual environment (.venv) when pyproject.toml or a lock file changed.
# Installs exactly the versions requirements.lock (runtime) and requirements-dev.lock (dev and chart tooling) pin
# (pip constraints), the set pip-audit checks.
# Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.stamp
want=$(cat pyproject.toml requirements.lock requirements-dev.lock | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e '.[dev]' -c requirements.lock -c requirements-dev.lock
  echo "$want" > "$stamp"
fi
# Headless Chromium for the dashboard test (tests/observability/test_dashboard.py); needs root for apt-get.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
