#!/usr/bin/env bash
# The whole test suite: sets up .venv on a fresh machine, then runs every test (unit + end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
