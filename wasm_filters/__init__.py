"""Building and finding the proxy-wasm filter modules (the C sources beside this file, built
with clang + lld).

Building is a step of its own: `./dev.sh setup`, `meshfn filters build`, and the start of
`meshfn up` / `meshfn serve` (a command, before anything serves). The control plane's reload
path only reads what was built: `locate()` finds the build of the current sources without
compiling anything, and `artifacts()` checks it against its manifest. A missing or altered build
is a clear error, never a compiler run inside a reload.

Builds are content-addressed: `<cache>/wasm_filters/<source key>/` holds every module and a
`manifest.json` with their SHA-256 (what an Istio WasmPlugin pins). `$MESHFN_WASM_DIR` points at
prebuilt modules instead (checked for presence only: they are the operator's).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

from meshfn.common import env
from meshfn.common.progress import NULL, Reporter
from meshfn.contracts.plugins import BUILDS

MANIFEST = "manifest.json"
_SOURCE_SUFFIXES = (".c", ".h", ".sh")


class BuildError(RuntimeError):
    """The filters are not built, or could not be built (the message says why and what to do)."""


def source_dir() -> Path:
    return env.WASM_SRC.path() or Path(__file__).resolve().parent


def cache_dir() -> Path:
    return (env.CACHE.path() or Path.home() / ".cache" / "meshfn") / "wasm_filters"


def source_key(source: Path | None = None) -> str:
    """SHA-256 (16 hex digits) over the filter sources' relative paths and contents."""
    root = source or source_dir()
    digest = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in _SOURCE_SUFFIXES)
    if not files:
        raise BuildError(f"no filter sources under {root}: set MESHFN_WASM_DIR to prebuilt filters")
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _prebuilt() -> Path | None:
    prebuilt = env.WASM_DIR.get()
    if not prebuilt:
        return None
    path = Path(prebuilt)
    for name in BUILDS:
        if not (path / f"{name}.wasm").is_file():
            raise BuildError(f"MESHFN_WASM_DIR={prebuilt} has no {name}.wasm")
    return path


def build(native: bool = False, progress: Reporter = NULL, timeout: float = 300) -> Path:
    """Build every module (and with `native` the test-harness shared objects) unless the cache
    already has them; returns the build directory. Takes about a second, once per source change.
    `progress` hears one item per module file, finished as built or cached."""
    if not native and (prebuilt := _prebuilt()) is not None:
        return prebuilt
    source = source_dir()
    script = source / "build.sh"
    if not script.is_file():
        raise BuildError(f"{script} not found: set MESHFN_WASM_DIR to prebuilt filters")
    out = cache_dir() / source_key(source)
    argv = ["bash", str(script), "--out", str(out), *(["--native"] if native else [])]
    modules = [f"{name}{suffix}" for name in BUILDS for suffix in (".wasm", "_native.so")]
    for module in modules if native else modules[::2]:
        progress.begin(module, 1)
    with tempfile.TemporaryFile("w+", errors="replace") as errors:
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True)
        except OSError as exc:
            raise BuildError(f"building the wasm filters failed: {exc}") from None
        timer = threading.Timer(timeout, proc.kill)  # a hung compiler must not hang `meshfn up`
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # "built NAME" / "cached NAME", then the directory
                state, _, module = line.strip().partition(" ")
                if state in ("built", "cached") and module:
                    progress.finish(module, cached=state == "cached")
            code = proc.wait()
        finally:
            timer.cancel()
        errors.seek(0)
        stderr = errors.read()
    if code != 0:
        reason = "timed out" if code == -9 else "failed"
        raise BuildError(f"building the wasm filters {reason}:\n{stderr.strip()}")
    manifest = {name: _sha256(out / f"{name}.wasm") for name in BUILDS}
    tmp = out / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / MANIFEST)
    return out


def locate() -> Path | None:
    """The build of the current sources (or $MESHFN_WASM_DIR), or None if it was never built.
    Never compiles."""
    if (prebuilt := _prebuilt()) is not None:
        return prebuilt
    try:
        out = cache_dir() / source_key()
    except BuildError:
        return None
    return out if (out / MANIFEST).is_file() else None


def artifacts(directory: Path) -> dict[str, str]:
    """Build name -> SHA-256 of its module, checked against the build's manifest (a prebuilt
    directory without one is hashed as it is)."""
    manifest_path = directory / MANIFEST
    try:
        recorded = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    except (OSError, ValueError) as exc:
        raise BuildError(
            f"{manifest_path}: unreadable ({exc}); run `meshfn filters build`"
        ) from None
    out = {}
    for name in BUILDS:
        path = directory / f"{name}.wasm"
        try:
            digest = _sha256(path)
        except OSError:
            raise BuildError(f"{path} is missing: run `meshfn filters build`") from None
        if recorded is not None and recorded.get(name) != digest:
            raise BuildError(
                f"{path} does not match its build manifest (changed after the build):"
                " run `meshfn filters build`"
            )
        out[name] = digest
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(progress: Reporter = NULL) -> tuple[Path | None, str]:
    """For a command that is about to serve: the build directory (built now if needed), or None
    and the reason it could not be built. The control plane refuses policies that need the
    filters while it has none, naming that reason."""
    try:
        return build(progress=progress), ""
    except BuildError as exc:
        return locate(), str(exc)
