"""The ed25519 key that signs audit checkpoints.

Only the signer (signer.py) loads the private key (mode 0600, in its own directory, never beside
the store: layout.key_path); `verify` needs only the public key, which can be copied off the
machine so a checkpoint can be checked by someone who does not trust this host. Whoever holds
the private key can sign a forged history (the witness still contradicts it): keep it out of
the store's backups and away from the store's writer.
"""

from __future__ import annotations

from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshfn.common import keys


class KeyError_(RuntimeError):
    """A key file is missing, unreadable or not an ed25519 key (message says which)."""


def public_path(private: Path) -> Path:
    return private.with_name(private.name + ".pub")


def load_or_create(private: Path) -> Ed25519PrivateKey:
    if private.exists():
        return load_private(private)
    private.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return keys.write_key_pair(private, public_path(private))


def load_private(path: Path) -> Ed25519PrivateKey:
    try:
        return keys.load_private_key(path)
    except keys.KeyFileError as exc:
        raise KeyError_(f"cannot load the audit signing key: {exc}") from None


def load_public(path: Path) -> Ed25519PublicKey:
    try:
        return keys.load_public_key(path)
    except keys.KeyFileError as exc:
        raise KeyError_(f"cannot load the audit public key: {exc}") from None
