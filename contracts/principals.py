"""Istio's request principal: "<iss>/<sub>" of a verified JWT. Shared by the policies
(AuthorizationPolicy, Mesh.spec.drill) and a Function's repository callers, which the
inference backend's configuration carries too."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# "<iss>/<sub>" splits at the last "/": issuers are URLs, subjects have no "/"; "<iss>/*" is any
# subject of that issuer and "*" any verified token.
REQUEST_PRINCIPAL = r"^(\*|[^\s*]+/[^\s/*]+|[^\s*]+/\*)$"
RequestPrincipal = Annotated[str, Field(pattern=REQUEST_PRINCIPAL, max_length=1024)]
