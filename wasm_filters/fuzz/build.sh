#!/usr/bin/env bash
# Builds the libFuzzer targets for the proxy-wasm filters: the filters' C code (the same sources
# as the .wasm modules) + the fake host + fuzz_filter.c, with AddressSanitizer and
# UndefinedBehaviorSanitizer, the allocator on malloc (MF_SYSTEM_MALLOC) so ASan sees every
# block. Needs Debian's clang and libclang-rt-14-dev (the sanitizer and libFuzzer runtimes).
#   wasm_filters/fuzz/build.sh   -> <dir>/{audit,degrade,meshfn}_fuzz; prints <dir>
# Cached under ${MESHFN_CACHE:-~/.cache/meshfn}/wasm_filters/fuzz-<source hash>/.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
CLANG=${CLANG:-clang}
command -v "$CLANG" >/dev/null || { echo "fuzz/build.sh: $CLANG not found (apt-get install clang)" >&2; exit 1; }
key=$(cd "$here" && { "$CLANG" --version | head -1;
  cat fuzz/build.sh fuzz/*.c common/*.h common/*.c audit/*.c degrade/*.c route/*.[ch] meshfn/*.c harness/*.c; } | sha256sum | cut -c1-16)
out=${MESHFN_CACHE:-$HOME/.cache/meshfn}/wasm_filters/fuzz-$key
mkdir -p "$out"
CFLAGS=(-g -O1 -fno-omit-frame-pointer -fsanitize=fuzzer,address,undefined
  -fno-sanitize-recover=undefined -DMF_SYSTEM_MALLOC -Wall -Wextra -Werror
  -Wno-unused-parameter -Wno-unused-function -Wno-unused-variable)
common=(common/mf.c common/json.c common/sha256.c common/filter_base.c harness/fake_host.c)

build() { # name: audit | degrade | meshfn (the full builds: per-request contexts, body hashing)
  local name=$1 target=$out/${1}_fuzz tmp
  [ -x "$target" ] && return 0
  tmp=$(mktemp "$out/.${name}.XXXXXX")
  local -a srcs defs
  case "$name" in
    audit) srcs=(audit/audit.c); defs=(-DFILTER_WANTS_BODY) ;;
    degrade) srcs=(degrade/degrade.c); defs=() ;;
    meshfn) srcs=(meshfn/meshfn.c); defs=(-DFILTER_WANTS_BODY) ;;
  esac
  local objdir; objdir=$(mktemp -d "$out/.obj.XXXXXX")
  (
    cd "$here"
    if [ "$name" = meshfn ]; then
      "$CLANG" "${CFLAGS[@]}" -c -DFILTER_NS=audit -DFILTER_WANTS_BODY -o "$objdir/audit.o" audit/audit.c
      "$CLANG" "${CFLAGS[@]}" -c -DFILTER_NS=degrade -o "$objdir/degrade.o" degrade/degrade.c
      "$CLANG" "${CFLAGS[@]}" -c -DFILTER_NS=route -o "$objdir/route.o" route/route.c
    fi
    for f in "${srcs[@]}" "${common[@]}" fuzz/fuzz_filter.c; do
      "$CLANG" "${CFLAGS[@]}" "${defs[@]}" -c -o "$objdir/$(basename "$f" .c).o" "$f"
    done
    "$CLANG" "${CFLAGS[@]}" -o "$tmp" "$objdir"/*.o
  )
  rm -rf "$objdir"
  mv "$tmp" "$target"
}

for name in audit degrade meshfn; do build "$name"; done
echo "$out"
