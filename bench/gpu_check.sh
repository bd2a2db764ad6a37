#!/usr/bin/env bash
# One command on a machine with an NVIDIA GPU and vLLM installed:
#   bash bench/gpu_check.sh /path/to/model [--engines 2] [--gpu-memory-utilization 0.35] [--num-blocks N] ...
# Starts vLLM engine(s) on the local model (launcher --device cuda), the gateway in front of them, runs the
# real-engine e2e checks (tests/vllm/checks.py) and the routing benchmark, and prints one table.
# vLLM's interpreter: --vllm-python PY, else .venv-vllm/bin/python, else python3 on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    [[ -x .venv/bin/python ]] && exec .venv/bin/python -m bench.gpu_check --help
    sed -n '2,7p' "$0"; exit 2
fi
boot_log="$(mktemp)"                          # the gateway's own .venv (idempotent); quiet unless it fails
if ! bash scripts/bootstrap.sh >"$boot_log" 2>&1; then cat "$boot_log" >&2; exit 1; fi
rm -f "$boot_log"
if [[ " $* " != *" --device cpu "* ]] && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: nvidia-smi not found; this check needs an NVIDIA GPU (or pass --device cpu)" >&2
    exit 2
fi
exec .venv/bin/python -m bench.gpu_check "$@"
