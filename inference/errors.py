"""Errors a user can cause; the CLI prints them without a traceback, the server maps them to 4xx."""

from __future__ import annotations


class InferenceError(Exception):
    """Base for every error with a message meant for the person running meshfn."""


class ManifestError(InferenceError):
    pass


class BuildError(InferenceError):
    pass


class SignatureError(InferenceError):
    """Unsigned, untrusted, tampered: the artifact must not be loaded."""


class RegistryError(InferenceError):
    pass


class ConfigError(InferenceError):
    pass
