"""The ed25519 key that signs audit checkpoints.

The private key lives beside the store (mode 0600) and signs; `verify` needs only the public key,
which can be copied off the machine so a checkpoint can be checked by someone who does not trust
this host. Whoever holds the private key can forge history: keep it out of backups of the store.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey


class KeyError_(RuntimeError):
    """A key file is missing, unreadable or not an ed25519 key (message says which)."""


def public_path(private: Path) -> Path:
    return private.with_name(private.name + ".pub")


def load_or_create(private: Path) -> Ed25519PrivateKey:
    if private.exists():
        return load_private(private)
    private.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public_path(private).write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise KeyError_(f"{path}: cannot load the audit signing key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyError_(f"{path}: not an ed25519 private key")
    return key


def load_public(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except (OSError, ValueError, TypeError) as exc:
        raise KeyError_(f"{path}: cannot load the audit public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyError_(f"{path}: not an ed25519 public key")
    return key


def key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return raw.hex()[:16]


def valid(key: Ed25519PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True
