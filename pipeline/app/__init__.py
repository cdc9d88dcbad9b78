"""The composition root and the programs: the service that wires stages, stores and sockets,
the CLI, the demo, the engine simulator, status, metrics, logs and the sidecar launcher."""
