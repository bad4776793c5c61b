"""Words that YAML 1.1 reads as something else. PyYAML (and kubectl's YAML) turn a bare `off`
into false, so `acceleration: off` reached the models as a boolean and was refused with
"should be 'ebpf', 'off' or 'auto'", naming the very word the user wrote."""

from __future__ import annotations

from pydantic import BeforeValidator


def yaml_off(value: object) -> object:
    """In a field whose words include "off", false can only mean that word."""
    return "off" if value is False else value


# Annotated[Literal["off", ...], OFF]: the field takes a bare `off` as written.
OFF = BeforeValidator(yaml_off)
