"""Build, sign and publish the example functions in one call (for `./dev.sh` and `meshfn up`).

Everything slow is cached under the meshfn cache directory (~/.cache/meshfn): builds by source
hash, native code by module digest and engine, and the development signing key. A second run
with unchanged sources only re-checks digests (well under a second).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshfn.common.progress import NULL, Reporter

from . import signing
from .build import FUNCTIONS_DIR, build, cache_root
from .errors import SignatureError
from .registry import Registry, sign_module, signature_path

EXAMPLES = (
    "examples/iris", "examples/embedder", "examples/digits", "examples/digits28",
    "examples/cancer", "examples/digits-cnn", "examples/tiny-lm",
)  # fmt: skip
TESTING = ("testing/chaos", "testing/chaos-core", "testing/chaos-gen", "testing/iris-py")


@dataclass(frozen=True)
class Published:
    name: str
    version: str
    kind: str
    entry: Path
    skipped: bool  # registry already held this exact module for this engine
    report: dict[str, object]


def dev_key(key_dir: Path | None = None) -> tuple[Path, Path]:
    """The development signing key pair, created on first use (private key mode 0600)."""
    key_dir = key_dir or cache_root() / "keys"
    private, public = key_dir / "meshfn-dev.key", key_dir / "meshfn-dev.pub"
    if not private.exists():
        signing.generate_key(key_dir, "meshfn-dev")
    return private, public


def publish_dir(
    directory: Path,
    registry: Registry,
    key_path: Path,
    force: bool = False,
    progress: Reporter = NULL,
) -> Published:
    """build -> sign -> publish one function directory, skipping what is already done.
    `progress` hears the steps (prepare, compile, precompile) under the directory's name."""
    item = directory.name
    progress.begin(item, 3)
    key = signing.load_private_key(key_path)
    result = build(directory, force=force, progress=progress, item=item)
    info = result.info()
    name, version, digest = info["name"], info["version"], info["module_sha256"]
    if not force and registry.published_digest(name, version) == digest:
        progress.finish(item, cached=result.cached)
        return Published(
            name, version, info["kind"], registry.entry(name, version), True, result.report
        )
    sig = signature_path(result.wasm)
    if force or not sig.exists() or not _signed_by(sig, key, digest):
        sign_module(result.wasm, key)
    progress.step(item, "precompile (.cwasm)")
    entry = registry.publish(
        result.wasm, key, compile_cache=cache_root() / "functions" / "compiled"
    )
    progress.finish(item, cached=False)
    return Published(name, version, info["kind"], entry, False, result.report)


def _signed_by(sig: Path, key: Ed25519PrivateKey, digest: str) -> bool:
    try:
        envelope = json.loads(sig.read_text())
        payload = signing.verify(envelope, "module", signing.TrustedKeys([key.public_key()]))
    except (OSError, ValueError, SignatureError):
        return False
    return payload.get("module_sha256") == digest


def publish_examples(
    registry_dir: Path,
    key_dir: Path | None = None,
    include_testing: bool = False,
    force: bool = False,
    progress: Reporter = NULL,
) -> tuple[list[Published], Path]:
    """Publish the example functions (and optionally the test ones) into `registry_dir`.

    Returns what was published and the public key the backend must trust (`--trusted-key`).
    """
    private, public = dev_key(key_dir)
    registry = Registry(registry_dir)
    dirs = EXAMPLES + (TESTING if include_testing else ())
    published = [publish_dir(FUNCTIONS_DIR / d, registry, private, force, progress) for d in dirs]
    return published, public
