"""ed25519 signatures over artifact digests.

An envelope is `{"kind", "payload", "key_id", "signature"}`; the signed bytes are a domain tag,
the kind and the canonical JSON of the payload, so a module signature can never be replayed as a
compile record or the other way round. Keys are PEM files (PKCS#8 private, SubjectPublicKeyInfo
public); a key id is the first 16 hex digits of the SHA-256 of the raw public key.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshfn.common import keys

from .errors import SignatureError

DOMAIN = b"meshfn-signature-v1\n"


def canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_key(directory: Path, name: str = "meshfn-signing") -> tuple[Path, Path]:
    """A new key pair as `<name>.key` (mode 0600) and `<name>.pub`; refuses to overwrite."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / f"{name}.key", directory / f"{name}.pub"
    if private_path.exists() or public_path.exists():
        raise SignatureError(f"{private_path} or {public_path} already exists; not overwriting")
    keys.write_key_pair(private_path, public_path)
    return private_path, public_path


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        return keys.load_private_key(path)
    except keys.KeyFileError as exc:
        raise SignatureError(str(exc)) from None


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        return keys.load_public_key(path)
    except keys.KeyFileError as exc:
        raise SignatureError(str(exc)) from None


class TrustedKeys:
    """The public keys whose signatures the backend accepts, by key id."""

    def __init__(self, keys: list[Ed25519PublicKey]) -> None:
        self.by_id = {key_id(k): k for k in keys}

    @classmethod
    def from_paths(cls, paths: list[Path]) -> TrustedKeys:
        files: list[Path] = []
        for path in paths:
            if path.is_dir():
                files.extend(sorted(path.glob("*.pub")))
            else:
                files.append(path)
        return cls([load_public_key(p) for p in files])

    def __len__(self) -> int:
        return len(self.by_id)


def sign(key: Ed25519PrivateKey, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    signature = key.sign(DOMAIN + kind.encode() + b"\n" + canonical(payload))
    return {
        "kind": kind,
        "payload": payload,
        "key_id": key_id(key.public_key()),
        "signature": base64.b64encode(signature).decode(),
    }


def verify(envelope: Any, kind: str, trusted: TrustedKeys) -> dict[str, Any]:
    """The payload of a valid envelope of `kind` signed by a trusted key, else SignatureError."""
    if not isinstance(envelope, dict) or not {"kind", "payload", "key_id", "signature"} <= set(
        envelope
    ):
        raise SignatureError("not a meshfn signature envelope")
    if envelope["kind"] != kind:
        raise SignatureError(f"signature is for a {envelope['kind']!r}, expected {kind!r}")
    payload = envelope["payload"]
    if not isinstance(payload, dict):
        raise SignatureError("signature payload is not an object")
    public = trusted.by_id.get(str(envelope["key_id"]))
    if public is None:
        raise SignatureError(f"signed by untrusted key {envelope['key_id']!r}")
    try:
        signature = base64.b64decode(str(envelope["signature"]), validate=True)
        public.verify(signature, DOMAIN + kind.encode() + b"\n" + canonical(payload))
    except (InvalidSignature, ValueError):
        raise SignatureError("bad signature (content changed after signing?)") from None
    return payload


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
