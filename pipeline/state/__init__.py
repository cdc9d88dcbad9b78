"""Mutable state of a running sidecar: engine sessions, their registry, jobs in flight."""
