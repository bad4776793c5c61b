"""The local function registry: signed modules plus their precompiled `.cwasm`, per engine.

Layout (one directory per published version, replaced atomically on republish):

    REGISTRY/<name>/<version>/module.wasm           the signed module (component or core)
    REGISTRY/<name>/<version>/module.sig.json       detached signature: digest + metadata
    REGISTRY/<name>/<version>/compiled/<engine_key>.cwasm   native code for one engine
    REGISTRY/<name>/<version>/compiled/<engine_key>.json    signed record binding the two digests
    REGISTRY/<name>/<version>/model/model.onnx      (kind onnx) the ONNX file it was compiled
                                                    from, and its external data: signed with
                                                    the module (payload `model`), checked at
                                                    publish and at every verification

Verification hashes both files (tens of MB for a Python function, ~20-40 ms) and remembers the
files' identity (device, inode, size, mtime, ctime). A load re-checks only the identity (a
`stat`, microseconds) and re-hashes if anything changed, so cold starts stay in milliseconds
without trusting a file that was swapped or rewritten after verification.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshfn.contracts.function import NAME_RE, VERSION_RE

from . import signing
from .abi import check_core_module
from .engine import engine_key, engine_settings, new_engine
from .errors import BuildError, RegistryError, SignatureError
from .host import KINDS, Kind, compile_module, component_imports, load_precompiled, metadata_of
from .manifest import module_metadata

MODULE_SIG = "module.sig.json"


def signature_path(wasm: Path) -> Path:
    """`iris-1.wasm` -> `iris-1.sig.json` (what `meshfn fn sign` writes)."""
    return wasm.with_name(wasm.name.removesuffix(".wasm") + ".sig.json")


def sign_module(wasm: Path, key: Ed25519PrivateKey) -> Path:
    """Detached signature over the module digest and its metadata (from the build's .json)."""
    meta_path = wasm.with_name(wasm.name.removesuffix(".wasm") + ".json")
    try:
        info = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise SignatureError(f"{meta_path}: cannot read the build metadata ({exc})") from None
    digest = signing.sha256_file(wasm)
    if info.get("module_sha256") != digest:
        raise SignatureError(f"{wasm} does not match the digest in {meta_path}: rebuild it")
    payload = {
        "name": info["name"],
        "version": info["version"],
        "kind": info["kind"],
        "module_sha256": digest,
        "module_size": wasm.stat().st_size,
        "metadata": info["metadata"],
        "build": info.get("build", {}),
    }
    if "model" in info:  # kind onnx: the model file(s) it was compiled from, by digest
        payload["model"] = info["model"]
        check_model_files(model_files(model_dir(wasm), info["model"]))
    out = signature_path(wasm)
    out.write_text(json.dumps(signing.sign(key, "module", payload), indent=1))
    return out


@dataclass(frozen=True, slots=True)
class FileIdentity:
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        st = os.stat(path)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class VerifiedArtifact:
    """A registry entry whose signatures and digests checked out, and the files' identities."""

    name: str
    version: str
    kind: Kind
    metadata: dict[str, Any]
    build: dict[str, Any]
    key_id: str
    cwasm: Path
    identities: tuple[tuple[Path, FileIdentity], ...]

    @property
    def code_key(self) -> tuple[Kind, Path, FileIdentity]:
        """What the process-wide code cache keys this artifact's code by (codecache.py)."""
        return self.kind, self.cwasm, next(i for p, i in self.identities if p == self.cwasm)

    def intact(self) -> bool:
        """Cheap re-check before a load: True if no verified file changed since verification."""
        try:
            return all(FileIdentity.of(p) == ident for p, ident in self.identities)
        except OSError:
            return False


class Registry:
    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, name: str, version: str) -> Path:
        if not NAME_RE.match(name) or not VERSION_RE.match(version):
            raise RegistryError(f"invalid function reference {name}@{version}")
        return self.root / name / version

    def versions(self, name: str) -> list[str]:
        base = self.root / name
        if not NAME_RE.match(name) or not base.is_dir():
            return []
        return sorted(
            (p.name for p in base.iterdir() if (p / "module.wasm").exists()), key=_version_key
        )

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and self.versions(p.name))

    def published_digest(self, name: str, version: str) -> str | None:
        """The module digest an entry claims (unverified: only to skip identical republishes)."""
        entry = self.entry(name, version)
        if not (entry / "compiled" / f"{engine_key()}.json").exists():
            return None
        try:
            digest = json.loads((entry / MODULE_SIG).read_text())["payload"]["module_sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return str(digest)

    # ------------------------------------------------------------------ publish

    def publish(
        self,
        wasm: Path,
        key: Ed25519PrivateKey,
        trusted: signing.TrustedKeys | None = None,
        compile_cache: Path | None = None,
    ) -> Path:
        """Verify the module's signature, precompile it for this engine and install both.

        The module is instantiated once (here, not in the server) to check that its own
        `metadata()` is the signed metadata. The compile record is signed with `key`.
        `compile_cache` keeps native code by (module digest, engine key) so publishing the same
        module into another registry skips the ~6 CPU-s Cranelift compile of a Python guest.
        """
        trusted = trusted or signing.TrustedKeys([key.public_key()])
        sig_path = signature_path(wasm)
        payload, digest = _signed_payload(wasm, sig_path, trusted)
        name, version, kind = str(payload["name"]), str(payload["version"]), payload["kind"]
        if kind not in KINDS:
            raise RegistryError(f"{sig_path}: unknown function kind {kind!r}")
        models = None
        if kind == "onnx":  # the ONNX file(s) as signed, or nothing is published
            models = (model_dir(wasm), model_files(model_dir(wasm), payload.get("model")))
            check_model_files(models[1])
        key_name = engine_key()
        cached = compile_cache / f"{digest}-{key_name}.cwasm" if compile_cache else None
        native = _precompiled(wasm, cast(Kind, kind), payload["metadata"], cached)
        target = self.entry(name, version)
        record = {"name": name, "version": version, "module_sha256": digest}
        _install(target, wasm, sig_path, native, record, key, models)
        return target

    # ------------------------------------------------------------------ verify

    def verify(self, name: str, version: str, trusted: signing.TrustedKeys) -> VerifiedArtifact:
        """Full check (signatures and digests) of one entry for this engine."""
        entry = self.entry(name, version)
        module, sig = entry / "module.wasm", entry / MODULE_SIG
        key_name = engine_key()
        cwasm, record_path = (
            entry / "compiled" / f"{key_name}.cwasm",
            entry / "compiled" / f"{key_name}.json",
        )
        if not module.exists():
            raise RegistryError(f"{name}@{version} is not in the registry {self.root}")
        if not sig.exists():
            raise SignatureError(f"{name}@{version} is unsigned")
        if not cwasm.exists() or not record_path.exists():
            raise RegistryError(
                f"{name}@{version} has no precompiled artifact for {key_name}: publish it again"
            )
        identities = tuple((p, FileIdentity.of(p)) for p in (module, sig, cwasm, record_path))
        try:
            payload = signing.verify(json.loads(sig.read_text()), "module", trusted)
            envelope = json.loads(record_path.read_text())
        except ValueError:
            raise SignatureError(f"{name}@{version}: signature file is not JSON") from None
        identities += _verified_models(entry, payload)
        record = signing.verify(envelope, "compiled", trusted)
        if (payload.get("name"), payload.get("version")) != (name, version):
            raise SignatureError(f"{name}@{version}: signature is for another function")
        if signing.sha256_file(module) != payload.get("module_sha256"):
            raise SignatureError(f"{name}@{version}: module digest mismatch (tampered)")
        if record.get("module_sha256") != payload.get("module_sha256"):
            raise SignatureError(f"{name}@{version}: compiled artifact is for another module")
        if record.get("engine_key") != key_name:
            raise SignatureError(f"{name}@{version}: compile record is for another engine")
        if signing.sha256_file(cwasm) != record.get("cwasm_sha256"):
            raise SignatureError(
                f"{name}@{version}: precompiled artifact digest mismatch (tampered)"
            )
        if identities != tuple((p, FileIdentity.of(p)) for p, _ in identities):
            raise SignatureError(f"{name}@{version}: files changed during verification")
        kind = payload.get("kind")
        if kind not in KINDS:
            raise SignatureError(f"{name}@{version}: unknown kind {kind!r}")
        return VerifiedArtifact(
            name=name,
            version=version,
            kind=cast(Kind, kind),
            metadata=dict(payload["metadata"]),
            build=dict(payload.get("build") or {}),
            key_id=str(envelope["key_id"]),
            cwasm=cwasm,
            identities=identities,
        )


def model_dir(wasm: Path) -> Path:
    """`iris-1.wasm` -> `iris-1.model/`: the ONNX file(s) `fn build` compiled it from."""
    return wasm.with_name(wasm.name.removesuffix(".wasm") + ".model")


def model_files(directory: Path, model: Any) -> list[tuple[Path, str]]:
    """The files a signed model record names, under `directory`, with their digests."""
    files = model.get("files") if isinstance(model, dict) else None
    if not isinstance(files, dict) or not files:
        raise SignatureError(f"{directory}: the signature names no model file (kind onnx)")
    found = []
    for name, digest in files.items():
        rel = PurePosixPath(str(name))
        if not rel.parts or rel.is_absolute() or ".." in rel.parts:
            raise SignatureError(f"{directory}: the signature names model file {name!r}")
        found.append((directory.joinpath(*rel.parts), str(digest)))
    return found


def check_model_files(files: list[tuple[Path, str]]) -> None:
    """Each model file has the digest it was signed with (SignatureError names the file)."""
    for path, digest in files:
        try:
            actual = signing.sha256_file(path)
        except OSError:
            raise SignatureError(
                f"{path}: missing (the model file signed with the module)"
            ) from None
        if actual != digest:
            raise SignatureError(
                f"{path}: the model file does not match its signature (changed after signing?)"
            )


def _verified_models(entry: Path, payload: dict[str, Any]) -> tuple[tuple[Path, FileIdentity], ...]:
    """A compiled model's ONNX file(s) in its registry entry, checked against the signature
    (their identities taken first, as for the entry's other files)."""
    if payload.get("kind") != "onnx":
        return ()
    models = model_files(entry / "model", payload.get("model"))
    identities = tuple((p, _identity(p)) for p, _ in models)
    check_model_files(models)
    return identities


def _identity(path: Path) -> FileIdentity:
    try:
        return FileIdentity.of(path)
    except OSError:
        raise SignatureError(f"{path}: missing (the model file signed with the module)") from None


def _signed_payload(
    wasm: Path, sig_path: Path, trusted: signing.TrustedKeys
) -> tuple[dict[str, Any], str]:
    """The module's signed payload, checked against its signature and its digest."""
    try:
        envelope = json.loads(sig_path.read_text())
    except FileNotFoundError:
        raise SignatureError(f"{wasm} is not signed ({sig_path} missing): run fn sign") from None
    except (OSError, ValueError) as exc:
        raise SignatureError(f"{sig_path}: {exc}") from None
    payload = signing.verify(envelope, "module", trusted)
    digest = signing.sha256_file(wasm)
    if payload.get("module_sha256") != digest:
        raise SignatureError(f"{wasm}: digest does not match its signature (tampered?)")
    return payload, digest


def _precompiled(wasm: Path, kind: Kind, signed_metadata: Any, cached: Path | None) -> bytes:
    """The module compiled for this engine (from `cached` when it is there, kept there when it
    is given), instantiated once to check that it imports nothing and that its own
    `metadata()` is the signed metadata."""
    if kind != "python":
        try:
            check_core_module(wasm.read_bytes(), str(wasm), 2 if kind == "onnx" else 1)
        except BuildError as exc:
            raise RegistryError(str(exc)) from None
    engine = new_engine()
    try:
        if cached is not None and cached.exists():
            artifact = load_precompiled(engine, kind, cached)
            native = cached.read_bytes()
        else:
            artifact, native = compile_module(engine, kind, wasm)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(native)
                tmp.replace(cached)
        imports = component_imports(artifact)
        if imports:
            raise RegistryError(
                f"{wasm}: component imports {', '.join(imports)}; model functions get no host "
                "capabilities (build with `meshfn fn build`, i.e. componentize-py --stub-wasi)"
            )
        actual = metadata_of(artifact)
    except RegistryError:
        raise
    except Exception as exc:  # wasmtime raises several types for a bad module
        raise RegistryError(f"{wasm}: cannot compile or instantiate: {exc}") from None
    if not isinstance(signed_metadata, dict) or actual != module_metadata(kind, signed_metadata):
        raise RegistryError(f"{wasm}: metadata() differs from the signed metadata")
    return native


def _install(
    target: Path, wasm: Path, sig_path: Path, native: bytes, module: dict[str, str],
    key: Ed25519PrivateKey, models: tuple[Path, list[tuple[Path, str]]] | None = None,
) -> None:  # fmt: skip
    """The entry, staged beside `target` and renamed into place (a reader sees the old entry
    or the new one, never a part): the module, its signature, the native code and its compile
    record (`module`: name, version, module_sha256; signed with `key`), and a compiled
    model's ONNX file(s) (`models`, checked against the signature; copied, then checked
    again where they lie)."""
    key_name = engine_key()
    version = module["version"]
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{version}.", dir=target.parent))
    try:
        shutil.copyfile(wasm, stage / "module.wasm")
        shutil.copyfile(sig_path, stage / MODULE_SIG)
        if models is not None:
            base, files = models
            copies = []
            for path, digest in files:
                copy = stage / "model" / path.relative_to(base)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, copy)
                copies.append((copy, digest))
            check_model_files(copies)
        (stage / "compiled").mkdir()
        cwasm = stage / "compiled" / f"{key_name}.cwasm"
        cwasm.write_bytes(native)
        record = {
            **module,
            "cwasm_sha256": signing.sha256_file(cwasm),
            "cwasm_size": cwasm.stat().st_size,
            "engine_key": key_name,
            "engine": engine_settings(),
        }
        (stage / "compiled" / f"{key_name}.json").write_text(
            json.dumps(signing.sign(key, "compiled", record), indent=1)
        )
        for path in [stage, *stage.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{version}.old.", dir=target.parent))
            target.rename(trash / "entry")
            stage.rename(target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            stage.rename(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """Natural order: 2 < 10, numbers before words."""
    parts: list[tuple[int, int | str]] = []
    for piece in version.replace("-", ".").replace("_", ".").split("."):
        parts.append((0, int(piece)) if piece.isdigit() else (1, piece))
    return tuple(parts)


def latest(versions: list[str]) -> str:
    return max(versions, key=_version_key)
