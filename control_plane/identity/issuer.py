"""The local JWT issuer behind `meshfn token issue`, so a new user can call the mesh at once.

ES256 keys; the public keys are served as a JWKS on the control plane's admin port
(/.well-known/jwks.json), which the example RequestAuthentication fetches through an Envoy
cluster. Rotation keeps old keys in the JWKS so tokens already issued stay valid until expiry.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from meshfn.common.files import read_private, write_private

DEFAULT_ISSUER = "https://issuer.meshfn.local"


class LocalIssuer:
    def __init__(self, directory: Path, issuer: str = DEFAULT_ISSUER) -> None:
        self.directory = directory
        self.issuer = issuer
        index = directory / "keys.json"
        if index.exists():
            self._kids: list[str] = json.loads(index.read_text())["keys"]
        else:
            self._kids = []
            self.rotate()

    def _key(self, kid: str) -> ec.EllipticCurvePrivateKey:
        key = serialization.load_pem_private_key(read_private(self.directory / f"{kid}.key"), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{kid}.key is not an EC key")
        return key

    def rotate(self) -> str:
        kid = secrets.token_hex(8)
        key = ec.generate_private_key(ec.SECP256R1())
        write_private(
            self.directory / f"{kid}.key",
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        self._kids.append(kid)
        write_private(self.directory / "keys.json", json.dumps({"keys": self._kids}).encode())
        return kid

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid in self._kids:
            jwk: dict[str, Any] = json.loads(ECAlgorithm.to_jwk(self._key(kid).public_key()))
            jwk.update({"kid": kid, "use": "sig", "alg": "ES256"})
            keys.append(jwk)
        return {"keys": keys}

    def issue(
        self,
        subject: str,
        audiences: list[str],
        claims: dict[str, Any] | None = None,
        ttl: dt.timedelta = dt.timedelta(hours=1),
        now: dt.datetime | None = None,
    ) -> str:
        issued = now or dt.datetime.now(dt.UTC)
        payload: dict[str, Any] = {
            **(claims or {}),
            "iss": self.issuer,
            "sub": subject,
            "aud": audiences[0] if len(audiences) == 1 else audiences,
            "iat": int(issued.timestamp()),
            "nbf": int(issued.timestamp()),
            "exp": int((issued + ttl).timestamp()),
        }
        kid = self._kids[-1]
        return jwt.encode(payload, self._key(kid), algorithm="ES256", headers={"kid": kid})
