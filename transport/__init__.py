"""kvsidecar transport: ZMQ server and client, shared tensors, store backends."""
