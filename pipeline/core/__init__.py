"""The pure core: contracts and rules every layer shares (layout, hashing, keys, hit rule,
integrity, messages, config, errors, the store and seam protocols). Imports no other layer."""
