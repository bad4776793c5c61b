"""`function.toml`: what a function is (name, version, kind, sources, KServe signature).

The manifest is the single source of the function's metadata: the build embeds it into the
guest (whose `metadata()` returns it) and into the signed metadata, so the two cannot drift.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshfn.contracts.function import NAME_RE, VERSION_RE

from .errors import ManifestError

DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
)
Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
MANIFEST = "function.toml"
# The field naming each kind's entry point.
ENTRY = {"python": "module", "core": "source", "onnx": "model"}


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    datatype: Datatype
    shape: list[int] = Field(min_length=1, max_length=8)

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        if any(d < -1 or d == 0 for d in shape):
            raise ValueError("dimensions are positive sizes or -1 (variable)")
        return shape


class FunctionManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    version: str
    kind: Literal["python", "core", "onnx"]
    description: str = ""
    module: str | None = None  # python: the module defining MODEL
    source: str | None = None  # core: the C file
    model: str | None = None  # onnx: the ONNX file (external data beside it is read too)
    # onnx: the largest batch the build checks the memory for, and the linear memory it may
    # need there (the Function's limits.memoryMiB should be at least this)
    max_batch: int = Field(default=64, ge=1, le=65536)
    memory_mib: int = Field(default=64, ge=1, le=4096)
    prepare: str | None = None  # host-side script run at build time with the staging dir
    # core: the module reads base64 `raw` input data (meshfn_core.h's mf_read_f32 does); else the
    # host converts every input to JSON `data` first. Python functions always read it (the SDK).
    raw_inputs: bool = False
    inputs: list[TensorSpec] = Field(min_length=1)
    outputs: list[TensorSpec] = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not NAME_RE.match(name):
            raise ValueError("lowercase letters, digits, '.', '_' or '-', at most 63 characters")
        return name

    @field_validator("version")
    @classmethod
    def _version(cls, version: str) -> str:
        if not VERSION_RE.match(version):
            raise ValueError("letters, digits, '.', '_' or '-', at most 63 characters")
        return version

    @field_validator("model")
    @classmethod
    def _model(cls, model: str | None) -> str | None:
        if model is not None and (
            not model or model.startswith("/") or ".." in model.replace("\\", "/").split("/")
        ):
            raise ValueError("a path inside the function directory")
        return model

    def platform(self) -> str:
        return f"meshfn-wasm-{self.kind}"

    def metadata(self) -> dict[str, Any]:
        """KServe v2 model metadata, plus how the guest takes input data (`raw_inputs`, read
        by the host only)."""
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform(),
            "inputs": [t.model_dump() for t in self.inputs],
            "outputs": [t.model_dump() for t in self.outputs],
            "raw_inputs": self.kind != "core" or self.raw_inputs,
        }


def load_manifest(directory: Path) -> FunctionManifest:
    path = directory / MANIFEST
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{directory}: no {MANIFEST} (is this a function directory?)") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ManifestError(f"{path}: {exc}") from None
    try:
        manifest = FunctionManifest.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise ManifestError(f"{path}: {problems}") from None
    field = ENTRY[manifest.kind]
    if not getattr(manifest, field):
        raise ManifestError(f"{path}: kind {manifest.kind!r} needs `{field}`")
    for other in set(ENTRY.values()) - {field}:
        if getattr(manifest, other):
            raise ManifestError(f"{path}: `{other}` is not for kind {manifest.kind!r}")
    names = [t.name for t in manifest.inputs]
    if len(set(names)) != len(names):
        raise ManifestError(f"{path}: duplicate input names")
    for rel in filter(None, [manifest.source, manifest.prepare]):
        if not (directory / rel).is_file():
            raise ManifestError(f"{path}: {rel} does not exist")
    # a model the prepare script writes at build time need not be there yet
    if manifest.model and not manifest.prepare and not (directory / manifest.model).is_file():
        raise ManifestError(f"{path}: model {manifest.model} does not exist")
    if manifest.module and not (directory / f"{manifest.module}.py").is_file():
        raise ManifestError(f"{path}: module {manifest.module}.py does not exist")
    return manifest
