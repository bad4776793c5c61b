"""Policy model v1alpha1: YAML documents -> validated objects -> MeshModel."""

from .errors import PolicyError, PolicyErrors
from .loader import PolicyLoader, Provenance, load_policies

__all__ = ["PolicyError", "PolicyErrors", "PolicyLoader", "Provenance", "load_policies"]
