#!/usr/bin/env bash
# The lint and type gate (issue #19): ruff over every Python tree, then mypy over the package code; settings live in
# pyproject.toml ([tool.ruff.lint], [tool.mypy]). Exits non-zero on any finding. Needs .venv (scripts/bootstrap.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rc=0
.venv/bin/ruff check gateway backends bench scripts tests || rc=1
.venv/bin/mypy gateway backends || rc=1
exit "$rc"
