#!/usr/bin/env bash
# Builds the proxy-wasm filters with Debian's clang + lld, and with --native the same filter code
# as shared libraries linked against the fake ABI host for the test harness.
# Output goes to a content-addressed cache dir (or --out DIR: meshfn.wasm_filters passes
# the directory named by its own source key); the last line printed is that directory.
#   wasm_filters/build.sh            -> <dir>/{audit,degrade,meshfn}{,-lean}.wasm
#   wasm_filters/build.sh --native   -> also <dir>/{audit,degrade,meshfn}{,-lean}_native.so
# audit.wasm and degrade.wasm are the two filters; meshfn.wasm is both in one plugin, with the
# model router (route/, full build only: it reads request bodies) beside them (one
# per-request wasm overhead instead of two). The -lean builds keep no per-request context
# (cheaper per request; request headers only, so no body hashing; one configuration per VM:
# see common/filter_base.c). Needs: clang, lld (wasm-ld).
# Cached under ${MESHFN_CACHE:-~/.cache/meshfn}/wasm_filters/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
native=0
out=
while (($#)); do
  case "$1" in
    --native) native=1 ;;
    --out) out=$2; shift ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

CLANG=${CLANG:-clang}
command -v "$CLANG" >/dev/null || { echo "build.sh: $CLANG not found (apt-get install clang lld)" >&2; exit 1; }
command -v wasm-ld >/dev/null || { echo "build.sh: wasm-ld not found (apt-get install lld)" >&2; exit 1; }

common=(common/mf.c common/json.c common/sha256.c common/filter_base.c)
WASM_CFLAGS=(--target=wasm32 -nostdlib -O2 -mbulk-memory -fvisibility=hidden -ffreestanding
  -Wall -Wextra -Werror -Wno-unused-parameter)
WASM_LDFLAGS=(-Wl,--no-entry -Wl,--strip-all -Wl,--allow-undefined -Wl,-z,stack-size=65536
  -Wl,--initial-memory=262144)
NATIVE_CFLAGS=(-O1 -g -fPIC -fvisibility=hidden -Wall -Wextra -Werror -Wno-unused-parameter)
NATIVE_LDFLAGS=(-shared -Wl,-Bsymbolic)

# Which optional proxy-wasm callbacks each filter exports (each costs Envoy CPU per request).
declare -A WANTS=([audit]="-DFILTER_WANTS_BODY" [degrade]="" [meshfn]="-DFILTER_WANTS_BODY"
  [audit-lean]="-DFILTER_LEAN" [degrade-lean]="-DFILTER_LEAN" [meshfn-lean]="-DFILTER_LEAN")

if [ -z "$out" ]; then
  key=$(cd "$here" && { "$CLANG" --version | head -1;
    cat build.sh common/*.h common/*.c audit/*.c degrade/*.c route/*.[ch] meshfn/*.c harness/*.c; } | sha256sum | cut -c1-16)
  out=${MESHFN_CACHE:-$HOME/.cache/meshfn}/wasm_filters/$key
fi
mkdir -p "$out"

compile() { # kind(wasm|native) name -> prints the link inputs
  local kind=$1 name=$2 cflags ldflags src=${2%-lean}
  if [ "$kind" = wasm ]; then cflags=("${WASM_CFLAGS[@]}"); else cflags=("${NATIVE_CFLAGS[@]}"); fi
  local objdir; objdir=$(mktemp -d "$out/.obj.XXXXXX")
  # shellcheck disable=SC2086
  if [ "$src" = meshfn ]; then
    "$CLANG" "${cflags[@]}" -c -DFILTER_NS=audit ${WANTS[${name/meshfn/audit}]} -o "$objdir/audit.o" audit/audit.c
    "$CLANG" "${cflags[@]}" -c -DFILTER_NS=degrade -o "$objdir/degrade.o" degrade/degrade.c
    "$CLANG" "${cflags[@]}" -c -DFILTER_NS=route -o "$objdir/route.o" route/route.c
    "$CLANG" "${cflags[@]}" -c ${WANTS[$name]} -o "$objdir/meshfn.o" meshfn/meshfn.c
  else
    "$CLANG" "${cflags[@]}" -c ${WANTS[$name]} -o "$objdir/$src.o" "$src/$src.c"
  fi
  local file
  for file in "${common[@]}"; do
    # shellcheck disable=SC2086
    "$CLANG" "${cflags[@]}" -c ${WANTS[$name]} -o "$objdir/$(basename "$file" .c).o" "$file"
  done
  echo "$objdir"
}

build() { # kind name
  local kind=$1 name=$2 target objdir
  if [ "$kind" = wasm ]; then target=$out/$name.wasm; else target=$out/${name}_native.so; fi
  # One progress line per module on stdout (meshfn.wasm_filters reports it).
  [ -s "$target" ] && { echo "cached ${target##*/}"; return 0; }
  objdir=$(cd "$here" && compile "$kind" "$name")
  # concurrent builders (tests, a control plane) each link to their own file, then rename
  if [ "$kind" = wasm ]; then
    "$CLANG" "${WASM_CFLAGS[@]}" "${WASM_LDFLAGS[@]}" -o "$objdir/out" "$objdir"/*.o
  else
    "$CLANG" "${NATIVE_CFLAGS[@]}" -c -o "$objdir/fake_host.o" "$here/harness/fake_host.c"
    "$CLANG" "${NATIVE_LDFLAGS[@]}" -o "$objdir/out" "$objdir"/*.o
  fi
  mv "$objdir/out" "$target"
  rm -rf "$objdir"
  echo "built ${target##*/}"
}

for name in audit degrade meshfn audit-lean degrade-lean meshfn-lean; do
  build wasm "$name"
  [ "$native" = 1 ] && build native "$name"
done
echo "$out"
