"""The stores and the decorators around them.

- ``embedded`` (with ``arena``): the in-process store, one preallocated arena;
- ``mooncake``: the Mooncake client, its embedded master and the start-up checks;
- ``wrapper``, ``breaker``, ``beside``: decorators over any store (a circuit breaker,
  checksums kept beside vLLM-format values).

A store implements ``pipeline.core.store.Store``; the composition root chooses and wraps
it (``pipeline.app.backends``).
"""
