"""clang + wasm-ld, with a content-addressed cache (~/.cache/meshfn/compiler/): the same C
and flags give the same module, so rebuilding a model (or the conformance suite) is free."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from meshfn.common import env

from .errors import ToolchainError

RUNTIME_DIR = Path(__file__).parent / "c"
CFLAGS = (
    "--target=wasm32", "-nostdlib", "-ffreestanding", "-O3", "-fno-math-errno", "-fwrapv",
    "-msimd128", "-fno-slp-vectorize", "-mbulk-memory", "-mnontrapping-fptoint", "-msign-ext", "-mmutable-globals",
    "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
)  # fmt: skip
LDFLAGS = (
    "-Wl,--no-entry", "-Wl,--strip-all", "-Wl,-z,stack-size=65536", "-Wl,--export=__heap_base",
)  # fmt: skip
TIMEOUT_S = 600


def cache_dir() -> Path:
    root = env.CACHE.path() or env.cache_home() / "meshfn"
    return root / "compiler"


@functools.cache
def clang_version() -> str:
    clang = shutil.which("clang")
    if clang is None:
        raise ToolchainError(
            "clang not found: install Debian's clang and lld (apt-get install clang lld)"
        )
    if shutil.which("wasm-ld") is None:
        raise ToolchainError("wasm-ld not found: install Debian's lld (apt-get install lld)")
    out = subprocess.run([clang, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "clang ?"


def _runtime_text() -> str:
    return (RUNTIME_DIR / "mf_rt.h").read_text()


def key(source: str) -> str:
    h = hashlib.sha256()
    for part in (clang_version(), " ".join(CFLAGS + LDFLAGS), _runtime_text(), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def build(source: str, use_cache: bool = True) -> bytes:
    """The wasm module for C `source` (which includes mf_rt.h)."""
    k = key(source)
    cached = cache_dir() / f"{k}.wasm"
    if use_cache and cached.is_file():
        return cached.read_bytes()
    with tempfile.TemporaryDirectory(prefix="meshfn-compiler-") as tmp:
        c_file = Path(tmp) / "model.c"
        out = Path(tmp) / "model.wasm"
        c_file.write_text(source)
        cmd = ["clang", *CFLAGS, *LDFLAGS, f"-I{RUNTIME_DIR}", "-o", str(out), str(c_file)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise ToolchainError(f"clang took more than {TIMEOUT_S} s") from None
        if proc.returncode != 0:
            keep = cache_dir() / "failed" / f"{k}.c"
            keep.parent.mkdir(parents=True, exist_ok=True)
            keep.write_text(source)
            raise ToolchainError(
                f"clang failed (a compiler bug; source kept in {keep}):\n{proc.stderr[-4000:]}"
            )
        wasm = out.read_bytes()
    if use_cache:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp_path.write_bytes(wasm)
        tmp_path.replace(cached)
    return wasm


RUNTIME_HEADER = '#include "mf_rt.h"\n'
