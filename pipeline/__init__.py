"""kvsidecar's core and composition root, in layers: ``core`` (pure contracts), ``state``,
``runner`` and ``backends`` over it, and ``app`` (the root and the programs) on top."""
