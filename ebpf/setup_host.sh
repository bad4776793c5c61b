#!/usr/bin/env bash
# Host setup for meshfn.ebpf; idempotent, safe to call from ./dev.sh on every run.
#   ebpf/setup_host.sh [VENV]     (VENV defaults to .venv next to this repository's root)
# 1. apt: python3-bpfcc (Debian's bcc 0.26 and libbcc; PyPI's `bcc` is an unrelated library).
# 2. Kernel headers for bcc's compiler when /lib/modules/$(uname -r)/build is absent: a MERGED tree
#    of Debian's linux-headers-<abi>-common and -amd64 (either alone fails to compile), built once
#    from the .debs (extracted, not installed: installing pulls gcc and kbuild) and cached under
#    ${XDG_CACHE_HOME:-~/.cache}/meshfn/kernel-headers/<abi>, with `current` pointing at it.
# 3. Only the `bcc` package (not the rest of Debian's dist-packages) is exposed to the venv: a
#    symlink in VENV/meshfn-system-bcc/ plus a .pth naming that directory.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-${MESHFN_VENV:-.venv}}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/meshfn
HEADERS=$CACHE/kernel-headers
SYSTEM_BCC=/usr/lib/python3/dist-packages/bcc

if [ -t 2 ] && [ -z "${NO_COLOR:-}" ] && [ "${TERM:-}" != dumb ]; then
  log() { printf '\033[1m[meshfn ebpf]\033[0m %s\n' "$*" >&2; }
else  # piped into a log file: plain text
  log() { printf '[meshfn ebpf] %s\n' "$*" >&2; }
fi
die() { log "$*"; exit 1; }

# Other processes on a shared machine may hold the dpkg lock: wait for it instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=600 -qq)

need_root() {
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "needs root and apt-get to $1; do it by hand and run again"
}

ensure_bcc() {
  if dpkg-query -W -f='${Status}' python3-bpfcc 2>/dev/null | grep -q 'install ok installed'; then
    return
  fi
  need_root "install python3-bpfcc"
  log "installing python3-bpfcc"
  "${APT[@]}" update
  DEBIAN_FRONTEND=noninteractive "${APT[@]}" install -y --no-install-recommends python3-bpfcc >/dev/null
}

ensure_headers() {
  if [ -d "/lib/modules/$(uname -r)/build/include" ]; then
    return # the kernel's own headers: the loader prefers them
  fi
  if [ -e "$HEADERS/current/.complete" ]; then
    return
  fi
  need_root "download kernel headers"
  local amd64 abi
  amd64=$(apt-cache depends linux-headers-amd64 2>/dev/null | awk '/Depends: linux-headers-/ {print $2; exit}')
  if [ -z "$amd64" ]; then
    "${APT[@]}" update
    amd64=$(apt-cache depends linux-headers-amd64 | awk '/Depends: linux-headers-/ {print $2; exit}')
  fi
  [ -n "$amd64" ] || die "apt knows no linux-headers-amd64 package; cannot build a header tree"
  abi=${amd64#linux-headers-}
  abi=${abi%-amd64}
  log "building merged kernel header tree $abi under $HEADERS"
  (
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cd "$work"
    "${APT[@]}" -o APT::Sandbox::User=root download \
      "linux-headers-$abi-common" "linux-headers-$abi-amd64" \
      || die "downloading linux-headers-$abi-{common,amd64} failed"
    for deb in ./*.deb; do dpkg-deb -x "$deb" x; done
    dest=$HEADERS/$abi
    rm -rf "$dest.tmp"
    mkdir -p "$dest.tmp"
    # Top-level scripts/tools symlinks point into a kbuild package we do not install (bcc does
    # not need it); -amd64 adds the generated headers and .config on top of -common.
    find x/usr/src -mindepth 2 -maxdepth 2 -type l -delete
    cp -a "x/usr/src/linux-headers-$abi-common/." "$dest.tmp/"
    cp -a --remove-destination "x/usr/src/linux-headers-$abi-amd64/." "$dest.tmp/"
    touch "$dest.tmp/.complete"
    rm -rf "$dest"
    mv "$dest.tmp" "$dest"
  )
  ln -sfn "$abi" "$HEADERS/current"
}

ensure_venv_link() {
  [ -d "$SYSTEM_BCC" ] || die "$SYSTEM_BCC missing although python3-bpfcc is installed"
  [ -x "$VENV/bin/python" ] || die "no venv at $VENV (run ./dev.sh setup first)"
  local site
  site=$("$VENV/bin/python" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$VENV/meshfn-system-bcc"
  ln -sfn "$SYSTEM_BCC" "$VENV/meshfn-system-bcc/bcc"
  local pth=$site/meshfn-system-bcc.pth
  local want
  want=$(cd "$VENV/meshfn-system-bcc" && pwd -P)
  [ "$(cat "$pth" 2>/dev/null)" = "$want" ] || echo "$want" >"$pth"
  "$VENV/bin/python" -P -c 'import bcc' || die "the venv cannot import bcc"
}

ensure_bcc
ensure_headers
ensure_venv_link
log "ready"
