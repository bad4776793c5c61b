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

# KServe v2's tensor datatypes that a signature may name.
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

# The text interface every generative function serves over KServe (Triton's generate extension
# and LLM backends name it so): a prompt in, text out. Settings travel as request parameters.
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
# A step function's tensors (core ABI v2), in the order of its I/O table.
STEP_INPUTS = ("tokens", "state")
STEP_OUTPUTS = ("logits", "state_out")


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


class GenerateSpec(BaseModel):
    """How a generative function produces text (function.toml `[generate]`).

    `step`: a compiled model (`kind = "onnx"`, core ABI v2) whose graph computes one decode
    step for a batch of streams ((tokens, state) -> (logits, state_out), `state` floats per
    stream); the backend tokenises
    (`tokenizer`), keeps each stream's state, samples, and batches the steps of concurrent
    streams into one call. `generator`: a Python guest whose `generate` method is a generator
    of text pieces (meshfn_sdk.Model.generate): it tokenises and samples itself and reports its
    own usage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: Literal["step", "generator"]
    tokenizer: Literal["bytes"] | None = Field(
        None, description="step: the model's tokens are bytes 0-255 (the host tokenises)"
    )
    vocab: int | None = Field(None, ge=2, le=1 << 20, description="step: logits per stream")
    state: int | None = Field(None, ge=1, le=1 << 20, description="step: floats of state")
    eos: int | None = Field(None, ge=0, description="step: the token that ends a text")
    bos: int | None = Field(
        None, ge=0, description="step: a token fed before the prompt (default: eos, if any)"
    )
    context: int = Field(
        1024, ge=8, le=1 << 20, description="most prompt + completion tokens of one stream"
    )
    chat_template: Literal["lines"] = Field(
        "lines", description="lines: each message's content on a line of its own"
    )

    def step_metadata(self) -> dict[str, Any]:
        """The step module's own metadata (core ABI v2), as the module returns it."""
        assert self.vocab is not None and self.state is not None
        return {
            "abi": 2,
            "batch": "dynamic",
            "inputs": [
                {"name": "tokens", "datatype": "INT32", "shape": [-1]},
                {"name": "state", "datatype": "FP32", "shape": [-1, self.state]},
            ],
            "outputs": [
                {"name": "logits", "datatype": "FP32", "shape": [-1, self.vocab]},
                {"name": "state_out", "datatype": "FP32", "shape": [-1, self.state]},
            ],
        }


class EmbeddingsSpec(BaseModel):
    """Which tensors serve OpenAI's /v1/embeddings: a BYTES input of texts, an FP32 output of
    one vector per text, and optionally an integer output of each text's token count."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: str
    output: str
    tokens: str | None = None


class OpenAISpec(BaseModel):
    """The OpenAI operations a non-generative function serves (function.toml `[openai]`);
    generative functions serve chat and text completions by being generative."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    embeddings: EmbeddingsSpec | None = None


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
    generate: GenerateSpec | None = None
    openai: OpenAISpec | None = None

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
        by the host only), and for a generative function its `generate` section (with a step
        function's own metadata under `step`) or the OpenAI operations it serves."""
        out: dict[str, Any] = {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform(),
            "inputs": [t.model_dump() for t in self.inputs],
            "outputs": [t.model_dump() for t in self.outputs],
            "raw_inputs": self.kind != "core" or self.raw_inputs,
        }
        if self.generate is not None:
            section = self.generate.model_dump(exclude_none=True)
            if self.generate.engine == "step":
                section["step"] = self.generate.step_metadata()
            out["generate"] = section
        if self.openai is not None:
            out["openai"] = self.openai.model_dump(exclude_none=True)
        return out

    def problems(self) -> list[str]:
        """What contradicts itself across fields (load_manifest reports them)."""
        field = ENTRY[self.kind]
        if not getattr(self, field):
            return [f"kind {self.kind!r} needs `{field}`"]
        out = [
            f"`{other}` is not for kind {self.kind!r}"
            for other in sorted(set(ENTRY.values()) - {field})
            if getattr(self, other)
        ]
        names = [t.name for t in self.inputs]
        if len(set(names)) != len(names):
            out.append("duplicate input names")
        generate = self.generate
        if generate is not None:
            out += _generate_problems(self, generate)
        if self.openai is not None and self.openai.embeddings is not None:
            out += _embeddings_problems(self, self.openai.embeddings)
        return out


def module_metadata(kind: str, signed: dict[str, Any]) -> dict[str, Any]:
    """What the module's own `metadata()` must return for a function of `kind` with this
    signed metadata: the signed metadata itself (core ABI v1, Python components); for a
    compiled model (ABI v2), which knows its tensors and batch only, the signed tensors and
    batch, or a generative step function's step tensors (`generate.step`), whose signed
    inputs and outputs are its text interface."""
    if kind != "onnx":
        return signed
    generate = signed.get("generate")
    if isinstance(generate, dict) and isinstance(generate.get("step"), dict):
        return dict(generate["step"])
    return {
        "abi": 2,
        "batch": signed.get("batch"),
        "inputs": signed.get("inputs"),
        "outputs": signed.get("outputs"),
    }


def _generate_problems(manifest: FunctionManifest, generate: GenerateSpec) -> list[str]:
    out = []
    text_in = [t for t in manifest.inputs if t.name == TEXT_INPUT and t.datatype == "BYTES"]
    text_out = [t for t in manifest.outputs if t.name == TEXT_OUTPUT and t.datatype == "BYTES"]
    if len(manifest.inputs) != 1 or not text_in or len(manifest.outputs) != 1 or not text_out:
        out.append(
            f"a generative function's one input is {TEXT_INPUT} (BYTES) and its one "
            f"output {TEXT_OUTPUT} (BYTES)"
        )
    if generate.engine == "generator" and manifest.kind != "python":
        out.append('[generate] engine "generator" is for Python functions')
    if generate.engine == "step":
        if manifest.kind != "onnx":
            out.append('[generate] engine "step" needs kind "onnx" (a compiled step graph)')
        missing = [k for k in ("tokenizer", "vocab", "state") if getattr(generate, k) is None]
        if missing:
            out.append(f'[generate] engine "step" needs {", ".join(missing)}')
        if generate.tokenizer == "bytes" and generate.vocab is not None and generate.vocab < 256:
            out.append("[generate] a bytes tokenizer needs vocab >= 256")
        for key in ("eos", "bos"):
            value = getattr(generate, key)
            if value is not None and generate.vocab is not None and value >= generate.vocab:
                out.append(f"[generate] {key} must be below vocab")
    return out


def _embeddings_problems(manifest: FunctionManifest, spec: EmbeddingsSpec) -> list[str]:
    inputs = {t.name: t for t in manifest.inputs}
    outputs = {t.name: t for t in manifest.outputs}
    out = []
    if spec.input not in inputs or inputs[spec.input].datatype != "BYTES":
        out.append(f"[openai.embeddings] input {spec.input!r} must be a BYTES input")
    if spec.output not in outputs or outputs[spec.output].datatype not in ("FP32", "FP64"):
        out.append(f"[openai.embeddings] output {spec.output!r} must be an FP32 or FP64 output")
    if spec.tokens is not None and (
        spec.tokens not in outputs or not outputs[spec.tokens].datatype.startswith(("INT", "UINT"))
    ):
        out.append(f"[openai.embeddings] tokens {spec.tokens!r} must be an integer output")
    return out


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
    contradictions = manifest.problems()
    if contradictions:
        raise ManifestError(f"{path}: {'; '.join(contradictions)}")
    for rel in filter(None, [manifest.source, manifest.prepare]):
        if not (directory / rel).is_file():
            raise ManifestError(f"{path}: {rel} does not exist")
    # a model the prepare script writes at build time need not be there yet
    if manifest.model and not manifest.prepare and not (directory / manifest.model).is_file():
        raise ManifestError(f"{path}: model {manifest.model} does not exist")
    if manifest.module and not (directory / f"{manifest.module}.py").is_file():
        raise ManifestError(f"{path}: module {manifest.module}.py does not exist")
    return manifest
