"""Helpers every meshfn package may use: secret files, ed25519 key files, logging.

A leaf: it imports nothing else of meshfn, so the control plane and the inference backend can
share it without importing each other.
"""
