"""The web console."""
