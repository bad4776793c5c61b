"""`meshfn fn build`: a function directory -> `<name>-<version>.wasm` + `<name>-<version>.json`.

Python functions: the optional `prepare` script runs on the host (e.g. trains and writes
weights.py), then componentize-py bundles the sources, the guest SDK and generated glue into a
component of the `meshfn:model` world. Core functions: `prepare`, then clang/wasm-ld to a core
module without imports. Builds are content-addressed under the cache directory: identical
sources, SDK, WIT and tool versions skip the ~10 CPU-s componentize step.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshfn.common import env
from meshfn.common.progress import NULL, Reporter

from .abi import check_core_module
from .errors import BuildError
from .manifest import FunctionManifest, load_manifest
from .signing import sha256_file

BUILD_FORMAT = "meshfn-build-7"  # bump when the build recipe changes
FUNCTIONS_DIR = Path(__file__).resolve().parents[1] / "functions"
WIT_DIR = FUNCTIONS_DIR / "wit"
SDK_FILE = FUNCTIONS_DIR / "sdk" / "meshfn_sdk.py"
CORE_INCLUDE = FUNCTIONS_DIR / "core"
# How the example ONNX functions' models are made (their train.py calls it): part of the build
# key of an onnx function with a prepare script, so a changed recipe rebuilds them.
EXAMPLE_RECIPES = FUNCTIONS_DIR.parent / "testing" / "onnx_models.py"


def cache_root() -> Path:
    """$MESHFN_CACHE, else $XDG_CACHE_HOME/meshfn, else ~/.cache/meshfn."""
    return env.CACHE.path() or env.cache_home() / "meshfn"


@dataclass(frozen=True)
class BuildResult:
    manifest: FunctionManifest
    wasm: Path
    meta: Path
    cached: bool

    @property
    def report(self) -> dict[str, Any]:
        """The build's full report (the prepare step's accuracy and held-out rows; for an onnx
        function the compiler's figures too), from the build cache."""
        path = self.meta.with_name(self.meta.name.removesuffix(".json") + ".report.json")
        data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        return data

    def info(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.meta.read_text())
        return data


def _tool_versions(kind: str) -> str:
    if kind == "python":
        return "componentize-py " + importlib.metadata.version("componentize-py")
    if kind == "onnx":  # the compiler, and what example prepare scripts export with
        from .onnxfn import compiler_digest

        versions = [
            f"{p} {importlib.metadata.version(p)}" for p in ("onnx", "skl2onnx", "scikit-learn")
        ]
        return f"{_clang_version()}; meshfn.compiler {compiler_digest()}; {', '.join(versions)}"
    return _clang_version()


def _clang_version() -> str:
    clang = shutil.which("clang")
    if clang is None:
        raise BuildError(
            "clang not found: install Debian's clang and lld (apt-get install clang lld)"
        )
    out = subprocess.run([clang, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "clang ?"


def _source_files(directory: Path) -> list[Path]:
    skip = {"__pycache__", ".pytest_cache"}
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(directory).parts)
    )


def build_key(directory: Path, manifest: FunctionManifest) -> str:
    digest = hashlib.sha256()
    digest.update(f"{BUILD_FORMAT}\n{_tool_versions(manifest.kind)}\n{sys.version}\n".encode())
    extra = [SDK_FILE, *sorted(WIT_DIR.glob("*.wit"))] if manifest.kind == "python" else []
    if manifest.kind == "core":
        extra = sorted(CORE_INCLUDE.glob("*.h"))
    if manifest.kind == "onnx" and manifest.prepare:
        extra = [EXAMPLE_RECIPES]  # the examples' prepare scripts make their models with it
    for path in [*_source_files(directory), *extra]:
        rel = path.name if path in extra else str(path.relative_to(directory))
        digest.update(f"{rel}\0{len(path.read_bytes())}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _run(argv: list[str], cwd: Path, what: str, timeout: float = 600) -> str:
    child_env = {k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "PYTHONPATH"}}
    child_env["PYTHONSAFEPATH"] = "1"
    try:
        out = subprocess.run(
            argv,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=child_env,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{what} failed: {exc}") from None
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-25:])
        raise BuildError(f"{what} failed (exit {out.returncode}):\n{tail}")
    return out.stdout


def _prepare(manifest: FunctionManifest, stage: Path) -> dict[str, Any]:
    if manifest.prepare:
        _run([sys.executable, "-P", manifest.prepare, str(stage)], stage, f"{manifest.prepare}")
    report = stage / "build-report.json"
    if report.exists():
        loaded: dict[str, Any] = json.loads(report.read_text())
        return loaded
    return {}


def _componentize(manifest: FunctionManifest, stage: Path, out: Path) -> None:
    metadata = json.dumps(manifest.metadata(), separators=(",", ":"))
    (stage / "_meshfn_app.py").write_text(
        '"""Generated by meshfn fn build: binds the model to the meshfn:model world."""\n'
        "import meshfn_sdk\n"
        f"import {manifest.module} as _model\n"
        f"WitWorld = meshfn_sdk.component(_model.MODEL, {metadata!r})\n"
        f"meshfn_sdk.warm_up(_model.MODEL, {metadata!r})\n"
    )
    tool = Path(sys.executable).parent / "componentize-py"
    if not tool.exists():
        found = shutil.which("componentize-py")
        if found is None:
            raise BuildError("componentize-py not found: pip install componentize-py==0.25.1")
        tool = Path(found)
    _run(
        [
            *(str(tool), "-q", "-d", str(WIT_DIR), "-w", "model"),
            # --stub-wasi: the component imports nothing, so a guest cannot block a worker in a
            # host call (sleep, poll) where epoch interruption cannot reach it, and has no
            # files, clocks, environment or console at all.
            *("componentize", "--stub-wasi", "_meshfn_app", "-p", str(stage), "-o", str(out)),
        ],
        stage,
        "componentize-py",
    )


def _c_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal of ASCII text is a valid C literal


def _clang(manifest: FunctionManifest, stage: Path, out: Path) -> None:
    metadata = json.dumps(manifest.metadata(), separators=(",", ":"), ensure_ascii=True)
    (stage / "meshfn_metadata.h").write_text(
        "/* Generated by meshfn fn build from function.toml. */\n"
        f"static const char MESHFN_METADATA[] = {_c_string(metadata)};\n"
        '__attribute__((export_name("meshfn_metadata"))) i64 meshfn_metadata(void) {\n'
        "  return mf_result(MF_OK, MESHFN_METADATA, sizeof(MESHFN_METADATA) - 1);\n}\n"
    )
    assert manifest.source is not None
    _run(
        [
            *("clang", "--target=wasm32", "-O2", "-nostdlib", "-ffreestanding", "-Wall", "-Werror"),
            *("-Wl,--no-entry", "-Wl,-z,stack-size=65536", "-Wl,--strip-all"),
            *(f"-I{stage}", f"-I{CORE_INCLUDE}", "-o", str(out), manifest.source),
        ],
        stage,
        "clang",
    )
    check_core_module(out.read_bytes(), str(out))


def _compile(
    manifest: FunctionManifest, directory: Path, stage: Path, wasm: Path, report: dict[str, Any]
) -> dict[str, Any]:
    """The kind's compile step into `wasm`; returns the build info's kind-specific fields
    (the metadata to sign, for an onnx function its model record) and fills `report`."""
    if manifest.kind == "python":
        _componentize(manifest, stage, wasm)
    elif manifest.kind == "core":
        _clang(manifest, stage, wasm)
    else:
        from .onnxfn import compile_into

        built = compile_into(manifest, stage, directory, wasm, report)
        report.update(built.report)
        return {"metadata": built.metadata, "model": built.model}
    return {"metadata": manifest.metadata()}


_STEP = {"python": "componentize-py", "core": "clang", "onnx": "compile (ONNX -> C -> wasm)"}


def _build_into(
    manifest: FunctionManifest, directory: Path, key: str, cached_dir: Path,
    progress: Reporter, item: str,
) -> None:  # fmt: skip
    stem = f"{manifest.name}-{manifest.version}"
    with tempfile.TemporaryDirectory(dir=cached_dir.parent, prefix=".stage-") as tmp:
        stage = Path(tmp) / "src"
        shutil.copytree(directory, stage, ignore=shutil.ignore_patterns("__pycache__"))
        if manifest.kind == "python":  # prepare scripts may import the model (and so the SDK)
            shutil.copy(SDK_FILE, stage / "meshfn_sdk.py")
        if manifest.prepare:
            progress.step(item, f"prepare ({manifest.prepare})")
        report = _prepare(manifest, stage)
        out = Path(tmp) / "out"
        out.mkdir()
        progress.step(item, _STEP[manifest.kind])
        wasm = out / f"{stem}.wasm"
        fields = _compile(manifest, directory, stage, wasm, report)
        info = {
            "name": manifest.name,
            "version": manifest.version,
            "kind": manifest.kind,
            "description": manifest.description,
            "module_sha256": sha256_file(wasm),
            "module_size": wasm.stat().st_size,
            **fields,
            "build": {
                "key": key,
                "tool": _tool_versions(manifest.kind),
                # held-out rows stay out of the signed metadata; they live in .report.json
                "report": {k: v for k, v in report.items() if k != "heldout"},
            },
        }
        (out / f"{stem}.json").write_text(json.dumps(info, indent=1))
        (out / f"{stem}.report.json").write_text(json.dumps(report))
        shutil.rmtree(cached_dir, ignore_errors=True)
        out.rename(cached_dir)


def build(
    directory: Path,
    out_dir: Path | None = None,
    force: bool = False,
    progress: Reporter = NULL,
    item: str | None = None,
) -> BuildResult:
    """Build (or find in the cache) one function; `progress` hears each step under `item`
    (default: the directory's name)."""
    item = item or directory.name
    directory = directory.resolve()
    manifest = load_manifest(directory)
    key = build_key(directory, manifest)
    stem = f"{manifest.name}-{manifest.version}"
    cached_dir = cache_root() / "functions" / "build" / f"{stem}-{key}"
    wasm, meta = cached_dir / f"{stem}.wasm", cached_dir / f"{stem}.json"
    cached = wasm.exists() and meta.exists() and not force
    if not cached:
        cached_dir.parent.mkdir(parents=True, exist_ok=True)
        _build_into(manifest, directory, key, cached_dir, progress, item)
    if out_dir is None:
        return BuildResult(manifest, wasm, meta, cached)
    out_dir.mkdir(parents=True, exist_ok=True)
    report_file = cached_dir / f"{stem}.report.json"
    for src in (wasm, meta, report_file):
        shutil.copyfile(src, out_dir / src.name)
    models = cached_dir / f"{stem}.model"
    if models.is_dir():  # kind onnx: the model file(s), signed with the module by digest
        shutil.rmtree(out_dir / models.name, ignore_errors=True)
        shutil.copytree(models, out_dir / models.name)
    return BuildResult(manifest, out_dir / wasm.name, out_dir / meta.name, cached)
