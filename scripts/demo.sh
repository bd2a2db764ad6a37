#!/usr/bin/env bash
# The main job: the gateway with its embedded defaults (SQLite state, in-process policy engine) in front of a
# simulated vLLM fleet. Prints the URL, a demo API key and a curl line. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/gateway demo "$@"
