#!/usr/bin/env bash
# Builds the Kubernetes control plane the e2e tests run (kube-apiserver, kube-controller-manager
# v1.20.2) and fetches etcd, from Debian's archive only: bookworm's `kubernetes` source package,
# compiled with Debian's Go 1.19 in GOPATH mode. No registry, no container engine.
#
#   usage: e2e/kube/build.sh [OUT_DIR]     (default: ${MESHFN_KUBE_DIR:-~/.cache/meshfn/kube-1.20})
#   result: OUT_DIR/bin/{kube-apiserver,kube-controller-manager,etcd}
#
# ~5-10 min and ~2 GB of scratch on 2 cores the first time; once OUT_DIR/bin holds binaries that
# run, it returns in milliseconds. Concurrent callers serialise on a lock; an interrupted build
# leaves no half-written binary (each one is moved into place after it is built).
set -euo pipefail
OUT=${1:-${MESHFN_KUBE_DIR:-$HOME/.cache/meshfn/kube-1.20}}
BIN=$OUT/bin
VERSION=v1.20.2
log() { printf '[kube-build %s] %s\n' "$(date +%T)" "$*" >&2; }

built() {
  [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ] && [ -x "$BIN/etcd" ] \
    && [ "$(cat "$BIN/.version" 2>/dev/null)" = "$VERSION" ]
}
if built; then exit 0; fi

mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if built; then exit 0; fi   # another caller finished it while we waited

for tool in apt-get dpkg-deb flock tar; do
  command -v "$tool" >/dev/null || { log "needs $tool (Debian's apt tooling)"; exit 1; }
done

W=$OUT/work
rm -rf "$W"
mkdir -p "$W"/{apt/sources,apt/lists/partial,apt/cache/archives/partial,debs,root,gocache,gotmp,gopath/src/k8s.io} "$BIN"
trap 'rm -rf "$W"' EXIT
cd "$W"

# apt with a private state: the machine's own Debian mirrors, for binaries and sources, so
# nothing on the system (its lists, its cache) changes.
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  sed -E 's/^Types:.*$/Types: deb deb-src/' /etc/apt/sources.list.d/debian.sources >apt/sources/debian.sources
elif [ -f /etc/apt/sources.list ]; then
  sed -nE 's/^deb (.*)$/deb \1\ndeb-src \1/p' /etc/apt/sources.list >apt/sources/debian.list
else
  log "no Debian apt sources found (/etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list)"
  exit 1
fi
APT=(apt-get -q -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$W/apt/sources"
     -o "Dir::State::Lists=$W/apt/lists" -o "Dir::Cache=$W/apt/cache" -o "APT::Sandbox::User=root")
log "apt update (deb-src, private lists)"
"${APT[@]}" -qq update
log "downloading the kubernetes source package"
"${APT[@]}" -qq source --download-only kubernetes >/dev/null
log "downloading Go 1.19, reflect2 1.0.2 and etcd (unpacked here, not installed)"
(cd debs && "${APT[@]}" -qq download golang-1.19-go golang-1.19-src \
   golang-github-modern-go-reflect2-dev etcd-server)
for deb in debs/*.deb; do dpkg-deb -x "$deb" root; done

log "unpacking"
tar xzf kubernetes_*.orig.tar.gz
SRC=$(find "$W" -maxdepth 1 -type d -name 'kubernetes-1.*' | sed -n 1p)
[ -n "$SRC" ] || { log "the kubernetes source tarball has no kubernetes-1.* folder"; exit 1; }
ln -s "$SRC" gopath/src/k8s.io/kubernetes
# reflect2 1.0.1 (vendored) reads runtime internals that changed in Go 1.18 and crashes at start;
# Debian's 1.0.2 is API-compatible.
rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
cp -r root/usr/share/gocode/src/github.com/modern-go/reflect2 "$SRC/vendor/github.com/modern-go/"
rm -f "$SRC"/vendor/github.com/modern-go/reflect2/*_test.go

export GOROOT=$W/root/usr/lib/go-1.19 GOPATH=$W/gopath GOCACHE=$W/gocache GOTMPDIR=$W/gotmp \
       GOPROXY=off GOFLAGS= GO111MODULE=off CGO_ENABLED=0
export PATH=$GOROOT/bin:$PATH
cd "$GOPATH/src/k8s.io/kubernetes"

# The tarball lacks the generated OpenAPI definitions the apiserver links in: generate them
# from every package that asks for it (+k8s:openapi-gen=), as hack/ does in a git checkout.
log "generating pkg/generated/openapi"
go build -o "$W/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen
INPUTS=$(grep -R -l --include='*.go' '+k8s:openapi-gen=' pkg vendor/k8s.io 2>/dev/null \
  | grep -v -E '^vendor/k8s.io/(code-generator|sample-apiserver)/|testdata|_examples' \
  | xargs -n1 dirname | sort -u | sed 's#^#k8s.io/kubernetes/#' | paste -sd, -)
"$W/openapi-gen" -i "$INPUTS" -p k8s.io/kubernetes/pkg/generated/openapi -O zz_generated.openapi \
  -h hack/boilerplate/boilerplate.generatego.txt -r "$W/openapi-violations.report" >"$W/openapi-gen.log" 2>&1 \
  || { tail -n 20 "$W/openapi-gen.log" >&2; exit 1; }

V=k8s.io/kubernetes/vendor
LDFLAGS="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDFLAGS+=" -X $V/$pkg.gitVersion=$VERSION -X $V/$pkg.gitMajor=1 -X $V/$pkg.gitMinor=20"
done
for cmd in kube-apiserver kube-controller-manager; do
  log "go build $cmd"
  go build -p "$(nproc)" -ldflags "$LDFLAGS" -o "$W/$cmd" "./cmd/$cmd"
  mv "$W/$cmd" "$BIN/$cmd"
done
install -m 0755 "$W/root/usr/bin/etcd" "$BIN/etcd.new" && mv "$BIN/etcd.new" "$BIN/etcd"
"$BIN/kube-apiserver" --version >&2
# sed reads all of it: `head -n 1` would close the pipe early, and etcd, writing its next line,
# would die of SIGPIPE and fail the build under pipefail (exit 141) before .version is written
"$BIN/etcd" --version | sed -n 1p >&2
echo "$VERSION" >"$BIN/.version"
log "done: $BIN"
