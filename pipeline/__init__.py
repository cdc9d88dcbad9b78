"""kvsidecar core: layout model, hashing, keys, messages, config and the stage runner."""
