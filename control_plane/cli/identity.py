"""`meshfn token | certs | ca`: tokens from the local issuer, the certificates proxies hold, and
the mesh CA's roots."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from meshfn.common.cli import fail, out

from .shared import (
    DEFAULT_POLICIES,
    DEFAULT_STATE,
    AdminOpt,
    ClientStateOpt,
    PoliciesOpt,
    StateOpt,
    admin_url,
    get_json,
    load_model,
)

if TYPE_CHECKING:
    from ..identity.ca import CertificateAuthority

token_app = typer.Typer(help="JWTs from the local issuer the example policies trust.")
certs_app = typer.Typer(help="Workload certificates (SPIFFE X.509).")
ca_app = typer.Typer(help="The mesh CA: rotate with an overlap, then retire the old root.")


@token_app.command("issue")
def token_issue(
    sub: Annotated[str, typer.Option("--sub", help="subject")],
    aud: Annotated[list[str], typer.Option("--aud", help="audience (repeatable)")],
    claim: Annotated[
        list[str] | None, typer.Option("--claim", help="k=v; repeat a key for a list")
    ] = None,
    ttl: Annotated[str, typer.Option(help='lifetime, e.g. "1h", "15m"')] = "1h",
    state_dir: StateOpt = DEFAULT_STATE,
) -> None:
    """Sign a token with the local issuer (ES256); prints the token."""
    from meshfn.contracts.durations import parse_duration

    from ..identity.issuer import LocalIssuer

    try:
        lifetime = parse_duration(ttl)
    except ValueError as exc:
        fail(exc)
    claims: dict[str, Any] = {}
    for item in claim or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--claim {item!r}: use key=value")
        if key in ("iss", "sub", "aud", "exp", "nbf", "iat"):
            fail(f"--claim {key}: set it with its own option")
        if key in claims:
            previous = claims[key]
            claims[key] = [*previous, value] if isinstance(previous, list) else [previous, value]
        else:
            claims[key] = value
    issuer = LocalIssuer(state_dir / "issuer")
    out.print(issuer.issue(sub, aud, claims, lifetime), markup=False, highlight=False)


@certs_app.command("show")
def certs_show(
    node: Annotated[str, typer.Argument(help="node id or workload")],
    admin: AdminOpt = None,
    pem: Annotated[bool, typer.Option(help="also print the PEM chain")] = False,
    state_dir: ClientStateOpt = DEFAULT_STATE,
) -> None:
    """Chain, SANs and expiry of the certificate a proxy holds (never its key)."""
    from cryptography import x509

    query = urllib.parse.urlencode({"node": node})
    document = get_json(f"{admin_url(admin, state_dir)}/debug/certs?{query}", state_dir)
    leaf = x509.load_pem_x509_certificate(document["certificate_pem"].encode())
    roots = x509.load_pem_x509_certificates(document["trust_bundle_pem"].encode())
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    out.print(f"workload   {document['workload']}")
    out.print(f"SPIFFE ID  {document['spiffe_id']}")
    out.print(f"URI SANs   {', '.join(uris) or '-'}")
    out.print(f"serial     {document['serial']}")
    out.print(f"valid      {document['not_before']} .. {document['not_after']}")
    out.print(f"renews at  {document['renew_at']}")
    out.print(f"issuer     {leaf.issuer.rfc4514_string()} (root {document['issuer_root']})")
    for root in roots:
        out.print(
            f"trusts     {root.subject.rfc4514_string()} until {root.not_valid_after_utc.isoformat()}"
        )
    if document.get("rolling_out"):
        out.print(
            f"rollout    a CA root change is rolling out (signing: {document['signing_root']})"
        )
    if pem:
        out.print(document["certificate_pem"] + document["trust_bundle_pem"], markup=False)


def _ca(policies: Path, state_dir: Path) -> CertificateAuthority:
    from ..identity.ca import CertificateAuthority

    model = load_model(policies)
    return CertificateAuthority(state_dir / "ca" / model.trust_domain, model.trust_domain)


@ca_app.command("rotate")
def ca_rotate(
    policies: PoliciesOpt = DEFAULT_POLICIES, state_dir: StateOpt = DEFAULT_STATE
) -> None:
    """Add a new root. A running control plane puts it in every trust bundle, and once every
    proxy has ACKed that bundle, re-issues every workload certificate from it; both roots stay
    trusted until `retire`."""
    ca = _ca(policies, state_dir)
    new = ca.rotate()
    out.print(f"new root {new}; trusted: {', '.join(ca.root_fingerprints())}")


@ca_app.command("retire")
def ca_retire(
    policies: PoliciesOpt = DEFAULT_POLICIES, state_dir: StateOpt = DEFAULT_STATE
) -> None:
    """Stop trusting every root but the newest. A running control plane keeps a retired root
    in the trust bundles until every proxy has ACKed a certificate from the newest (at most
    60 s), so no live certificate is distrusted by a peer."""
    ca = _ca(policies, state_dir)
    retired = ca.retire()
    out.print(
        f"retired {', '.join(retired) or 'nothing'}; trusted: {', '.join(ca.root_fingerprints())}"
    )
