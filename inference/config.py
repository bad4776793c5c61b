"""Declarations the backend serves: which functions, from which registry, under which limits.

One `FunctionSpec` per served model version. Its fields are what a control-plane `Function`
policy needs to say, camelCase in files like every meshfn policy, so a
`kind: Function` document's `metadata.name` + `spec` maps onto it 1:1:

    registry: /var/lib/meshfn/functions      # where `meshfn fn publish` put the artifacts
    trustedKeys: [/etc/meshfn/keys/dev.pub]   # ed25519 public keys (files or directories)
    workers: 2                                # threads running wasm (the GIL is released)
    functions:
      - name: iris                            # served as /v2/models/iris
        version: "1"                          # default: the registry's latest
        artifact: iris@1                      # registry entry; default name@version
        isolation: reuse                      # or fresh-instance-per-request
        idleTtlSeconds: 300                   # unload after this long unused (scale to zero)
        codeTtlSeconds: 3600                  # optional: keep the loaded code this long unused
        pool: {minIdle: 1, maxIdle: 4}        # warm instances kept while loaded
        limits: {memoryMiB: 64, timeoutMs: 1000, maxConcurrency: 8, maxRequestBytes: 1048576}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from .errors import ConfigError
from .manifest import NAME_RE, VERSION_RE

Isolation = Literal["reuse", "fresh-instance-per-request"]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class Limits(_Model):
    memory_mib: int = Field(default=64, ge=1, le=4096, alias="memoryMiB")
    """Linear-memory cap per instance; a componentize-py guest needs at least 13 MiB."""
    timeout_ms: int = Field(default=1000, ge=1, le=600_000)
    """Wall-clock deadline per call, enforced by epoch interruption (5 ms granularity)."""
    max_concurrency: int = Field(default=8, ge=1, le=10_000)
    """In-flight requests for this function; more get 429 at once."""
    max_request_bytes: int = Field(default=1 << 20, ge=64, le=256 << 20)
    """Larger request bodies get 413 before they are read."""


class Pool(_Model):
    min_idle: int = Field(default=0, ge=0, le=256)
    """Pre-instantiated instances kept ready while the function is loaded."""
    max_idle: int = Field(default=4, ge=0, le=1024)
    """Upper bound of idle instances kept for reuse (the pool's max)."""


class FunctionSpec(_Model):
    name: str
    version: str | None = None
    artifact: str | None = None
    isolation: Isolation = "reuse"
    idle_ttl_seconds: float = Field(default=300.0, gt=0, le=86_400 * 30)
    """Unused this long: the instances go (scale to zero), and the code too unless codeTtl."""
    code_ttl_seconds: float | None = Field(default=None, gt=0, le=86_400 * 30)
    """Keep the loaded code (not the instances) until unused this long: a request after the
    idle TTL then only instantiates (iris, measured: p50 4.5 ms instead of 7.2 ms from the
    artifact), for ~1.6 MiB per Python function. None: the code goes with the instances."""
    pool: Pool = Pool()
    limits: Limits = Limits()

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not NAME_RE.match(name):
            raise ValueError("lowercase letters, digits, '.', '_' or '-', at most 63 characters")
        return name

    @field_validator("version")
    @classmethod
    def _version(cls, version: str | None) -> str | None:
        if version is not None and not VERSION_RE.match(version):
            raise ValueError("letters, digits, '.', '_' or '-', at most 63 characters")
        return version

    @field_validator("artifact")
    @classmethod
    def _artifact(cls, artifact: str | None) -> str | None:
        if artifact is None:
            return None
        name, sep, version = artifact.partition("@")
        if not sep or not NAME_RE.match(name) or not VERSION_RE.match(version):
            raise ValueError("expected NAME@VERSION of a published function")
        return artifact

    @property
    def code_ttl(self) -> float:
        return self.idle_ttl_seconds if self.code_ttl_seconds is None else self.code_ttl_seconds

    def check(self) -> None:
        if self.pool.min_idle > self.pool.max_idle and self.isolation == "reuse":
            raise ConfigError(f"{self.name}: pool.minIdle exceeds pool.maxIdle")
        if self.code_ttl < self.idle_ttl_seconds:
            raise ConfigError(f"{self.name}: codeTtlSeconds is shorter than idleTtlSeconds")


class BackendConfig(_Model):
    registry: Path
    trusted_keys: list[Path] = Field(default_factory=list)
    workers: int = Field(default=2, ge=1, le=64)
    functions: list[FunctionSpec] | None = None
    """None serves every function in the registry (each version) with default settings."""

    def with_overrides(self, **values: object) -> BackendConfig:
        data = self.model_dump()
        data.update({k: v for k, v in values.items() if v is not None})
        return BackendConfig.model_validate(data)


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
    )


def load_config(path: Path) -> BackendConfig:
    """A YAML or JSON config file; errors name the field."""
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    base = path.parent
    for key in ("registry",):
        if isinstance(raw.get(key), str):
            raw[key] = str(base / raw[key])
    if isinstance(raw.get("trustedKeys"), list):
        raw["trustedKeys"] = [
            str(base / k) if isinstance(k, str) else k for k in raw["trustedKeys"]
        ]
    return parse_config(raw, str(path))


def parse_config(raw: object, where: str = "config") -> BackendConfig:
    try:
        config = BackendConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_errors(exc)}") from None
    seen: set[tuple[str, str | None]] = set()
    for spec in config.functions or []:
        spec.check()
        if (spec.name, spec.version) in seen:
            raise ConfigError(f"{where}: {spec.name}@{spec.version} declared twice")
        seen.add((spec.name, spec.version))
    return config
