"""Implementations chosen once at the root behind the core's protocols: batch memories
(staging pool, lent store memory), copy engines (CPU), store decorators (breaker, faults)."""
