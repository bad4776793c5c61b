"""Resources as plain data (for YAML golden files, `meshfn config-dump`, /debug endpoints)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from .names import EXTENSION, LISTENER, PUSH_ORDER, SECRET, SHORT_NAMES

REDACTED = "[redacted]"
# The audit filter's HMAC key travels inside its plugin configuration (a JSON string).
_SALT = re.compile(r'("subject_salt":\s*")[0-9a-fA-F]+(")')


def message_to_plain(message: Message) -> Any:
    # MessageToDict returns OrderedDicts for Any payloads; a JSON round trip yields plain types.
    # sort_keys: protobuf map fields (Struct, typed_extension_protocol_options) iterate in a
    # per-process order; sorting makes dumps and golden files stable.
    return json.loads(json_format.MessageToJson(message, indent=None, sort_keys=True))


def resources_to_plain(
    resources: Mapping[str, Mapping[str, Message]], redact: bool = True
) -> dict[str, Any]:
    """{listeners: [...], routes: [...], ...} in make-before-break order, resources by name.
    Private keys in secrets, the audit subject salt and limit-service tokens are replaced by
    "[redacted]" unless `redact` is False."""
    out: dict[str, Any] = {}
    for type_url in reversed(PUSH_ORDER):
        by_name = resources.get(type_url)
        if by_name:
            plain = [message_to_plain(by_name[n]) for n in sorted(by_name)]
            if redact and type_url in (LISTENER, EXTENSION):  # the audit filter, or the
                plain = [_redact_salt(resource) for resource in plain]  # combined plugin (ECDS)
            if type_url == SECRET and redact:
                for secret in plain:
                    certificate = secret.get("tlsCertificate")
                    if certificate and "privateKey" in certificate:
                        certificate["privateKey"] = {"inlineString": REDACTED}
            out[SHORT_NAMES[type_url]] = plain
    return out


def _redact_salt(value: Any) -> Any:
    """The audit salt, and the bearer token a gateway shows the limit service (its ratelimit
    filter's initialMetadata `authorization`)."""
    if isinstance(value, dict):
        if value.get("key") == "authorization" and "value" in value:
            return {**value, "value": REDACTED}
        return {k: _redact_salt(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_salt(v) for v in value]
    if isinstance(value, str) and "subject_salt" in value:
        return _SALT.sub(rf"\g<1>{REDACTED}\g<2>", value)
    return value


def to_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
