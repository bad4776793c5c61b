"""How a proxy proves which workload identity it may receive (embedded mode).

The supervisor that starts an Envoy gives it, in its bootstrap, a bearer token bound to its
workload: base64url(HMAC-SHA256(key, "xds:" + node.cluster)). Envoy sends it as `authorization`
metadata on the ADS stream (GrpcService.initial_metadata); the ADS server refuses a stream whose
token does not match the node.cluster it claims, before it sends anything, private keys included.
The key lives in the state directory (0600) and never leaves the control plane host. In
Kubernetes the same check is done with the proxy's service-account token and TokenReview.

A gateway with a global rate limit gets a second token, for purpose "rls"
(HMAC(key, "rls:" + node.cluster)), inside its ratelimit filter's configuration (over ADS, to that
gateway only); it sends it with its node cluster on each call to the control plane's limit
service (xds/rls.py). A separate purpose, so the copy in the listener configuration (visible in
config dumps) opens no ADS stream, and an ADS token spends no limit-service tokens.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

from meshfn.common.files import secret_key

METADATA_KEY = "authorization"
LIMIT_SERVICE_PURPOSE = "rls"


class BootstrapTokens:
    def __init__(self, key_file: Path) -> None:
        self._key = secret_key(key_file)

    def token(self, node_cluster: str, purpose: str = "xds") -> str:
        message = f"{purpose}:{node_cluster}".encode()
        digest = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def header(self, node_cluster: str, purpose: str = "xds") -> str:
        return f"Bearer {self.token(node_cluster, purpose)}"

    def verify(self, node_cluster: str, header: str | None, purpose: str = "xds") -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer ") :], self.token(node_cluster, purpose))
