"""Field types shared by the policy kinds: names, ports, addresses, durations, RE2 regexes."""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Annotated

import re2
from pydantic import AfterValidator, Field, WithJsonSchema

API_VERSION = "meshfn.io/v1alpha1"

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Name = Annotated[str, Field(pattern=DNS_LABEL, min_length=1, max_length=63)]

OBJECT_REF = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ObjectRef = Annotated[str, Field(pattern=OBJECT_REF, max_length=127)]

HTTP_PATH = r"^/"
HttpPath = Annotated[str, Field(pattern=HTTP_PATH, max_length=1024)]
Port = Annotated[int, Field(ge=1, le=65535)]


def _ip_address(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 or IPv6 address") from None


IPAddress = Annotated[
    str, AfterValidator(_ip_address), WithJsonSchema({"type": "string", "format": "ip-address"})
]

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False


def _re2_regex(value: str) -> str:
    """Reject what Envoy's RE2 would reject (lookarounds, backreferences, bad syntax) at load time.

    RE2's program-size ceiling is an Envoy runtime setting, so it is Envoy's to enforce: an
    oversized regex is NACKed and shows in `meshfn status`.
    """
    try:
        re2.compile(value, options=_RE2_OPTIONS)
    except re2.error as exc:
        detail = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"invalid RE2 regex {value!r}: {detail}") from None
    return value


Regex = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_re2_regex)]

HEADER_NAME = r"^:?[a-zA-Z0-9!#$%&'*+.^_`|~-]+$"
HeaderName = Annotated[str, Field(pattern=HEADER_NAME, min_length=1, max_length=256)]

HOST = r"^(\*|(\*\.)?[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*)$"
Host = Annotated[str, Field(pattern=HOST, max_length=253)]

TRUST_DOMAIN = r"^[a-z0-9]([-a-z0-9._]*[a-z0-9])?$"
TrustDomain = Annotated[str, Field(pattern=TRUST_DOMAIN, min_length=1, max_length=255)]

LocalityName = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", max_length=128)
]

# ---------------------------------------------------------------- zero trust

_ALLOWED_JWK_ALGS = {
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
}
_ALLOWED_KTY = {"RSA", "EC", "OKP"}


def _jwks(value: str) -> str:
    """An inline JWKS must be a JSON key set of public, asymmetric keys Envoy can use. A
    symmetric (oct) key or an unknown algorithm would either fail in Envoy or open the door."""
    try:
        document = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"jwks is not valid JSON: {exc}") from None
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list) or not keys:
        raise ValueError('jwks must be a JSON object with a non-empty "keys" list')
    for i, key in enumerate(keys):
        if not isinstance(key, dict):
            raise ValueError(f"jwks key {i} is not an object")
        kty = key.get("kty")
        if kty == "oct":
            raise ValueError(f"jwks key {i}: symmetric (oct) keys are not accepted")
        if kty not in _ALLOWED_KTY:
            raise ValueError(f"jwks key {i}: unknown key type {kty!r} (use RSA, EC or OKP)")
        alg = key.get("alg")
        if alg is not None and alg not in _ALLOWED_JWK_ALGS:
            raise ValueError(f"jwks key {i}: unsupported algorithm {alg!r}")
        if "d" in key or "p" in key:
            raise ValueError(f"jwks key {i} contains private key material")
    return value


Jwks = Annotated[str, Field(min_length=2, max_length=256 * 1024), AfterValidator(_jwks)]

_URI = re.compile(r"^(https?)://([A-Za-z0-9.-]+|\[[0-9a-fA-F:]+\])(?::(\d{1,5}))?(/[^\s]*)?$")


def _jwks_uri(value: str) -> str:
    match = _URI.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not an http(s) URL with a host")
    if match.group(3) is not None and not 1 <= int(match.group(3)) <= 65535:
        raise ValueError(f"{value!r} has an invalid port")
    return value


JwksUri = Annotated[str, Field(max_length=2048), AfterValidator(_jwks_uri)]

# Istio spellings. A principal is "<trust-domain>/ns/<namespace>/sa/<account>"; "*" matches any
# authenticated peer; a leading or trailing "*" makes a suffix or prefix match.
PRINCIPAL = r"^(\*|[a-z0-9._-]+/ns/[a-z0-9-]+/sa/[a-z0-9-]+|\*[^\s*]+|[^\s*]+\*)$"
Principal = Annotated[str, Field(pattern=PRINCIPAL, max_length=512)]
NAMESPACE_MATCH = r"^(\*|[a-z0-9]([-a-z0-9]*[a-z0-9])?\*?)$"
NamespaceMatch = Annotated[str, Field(pattern=NAMESPACE_MATCH, max_length=64)]
PATH_PATTERN = r"^(\*|/[^\s*]*\*?|\*[^\s*]+)$"
PathPattern = Annotated[str, Field(pattern=PATH_PATTERN, max_length=1024)]
CONDITION_KEY = (
    r"^(request\.auth\.claims\[[A-Za-z0-9_.:-]+\]|request\.auth\.principal|"
    r"request\.auth\.audiences|source\.principal|source\.namespace|request\.headers\[[A-Za-z0-9-]+\])$"
)
ConditionKey = Annotated[str, Field(pattern=CONDITION_KEY, max_length=256)]
