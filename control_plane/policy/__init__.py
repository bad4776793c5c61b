"""Policy model v1alpha1: YAML documents -> validated objects -> MeshModel."""

from .errors import PolicyError, PolicyErrors
from .loader import PolicyLoader, load_policies

__all__ = ["PolicyError", "PolicyErrors", "PolicyLoader", "load_policies"]
