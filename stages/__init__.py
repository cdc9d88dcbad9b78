"""kvsidecar pipeline stages: one small async stage per module."""
