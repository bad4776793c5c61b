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
    kind: Literal["python", "core"]
    description: str = ""
    module: str | None = None  # python: the module defining MODEL
    source: str | None = None  # core: the C file
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
            "raw_inputs": self.kind == "python" or self.raw_inputs,
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
    entry = manifest.module if manifest.kind == "python" else manifest.source
    if not entry:
        field = "module" if manifest.kind == "python" else "source"
        raise ManifestError(f"{path}: kind {manifest.kind!r} needs `{field}`")
    names = [t.name for t in manifest.inputs]
    if len(set(names)) != len(names):
        raise ManifestError(f"{path}: duplicate input names")
    for rel in filter(None, [manifest.source, manifest.prepare]):
        if not (directory / rel).is_file():
            raise ManifestError(f"{path}: {rel} does not exist")
    if manifest.module and not (directory / f"{manifest.module}.py").is_file():
        raise ManifestError(f"{path}: module {manifest.module}.py does not exist")
    return manifest
