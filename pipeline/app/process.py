"""The sidecar process's own settings, set once at start-up: how it shares the CPU with
the engines beside it, and how its garbage collector runs.

- ``before_imports``: idle OpenMP workers must not spin (``OMP_WAIT_POLICY=PASSIVE``),
  set before torch is first imported.
- ``for_serving``: torch runs single-threaded (the copy engine splits each batch across
  its own threads; an OpenMP team inside every copy call would only add wake-ups), and a
  thread waiting for the GIL gets it after ``SWITCH_INTERVAL_S``.
- ``after_start``: what start-up built is frozen out of the collector's sight, and the
  youngest generation is collected after ``YOUNG_COLLECTION_ALLOCATIONS``.
"""

from __future__ import annotations

import gc
import os
import sys

__all__ = ["SWITCH_INTERVAL_S", "YOUNG_COLLECTION_ALLOCATIONS", "after_start",
           "before_imports", "for_serving"]

SWITCH_INTERVAL_S = 0.0005
"""How long a thread holds the GIL while another waits for it (Python's default: 5 ms).
A copy thread takes the GIL back between calls; behind a busy event loop, each such
return would otherwise wait a whole default interval."""

YOUNG_COLLECTION_ALLOCATIONS = 50_000
"""How many more objects allocated than freed start a collection of the youngest ones
(Python's default: 700). Serving allocates and frees containers by the hundred thousand
a second, nearly all freed by their reference counts once a request is answered, and
each collection pauses every request in flight."""


def before_imports() -> None:
    """Idle OpenMP workers would spin on the cores engines need; set before torch is
    first imported (an operator's own setting wins)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def for_serving() -> None:
    """Torch single-threaded, and a short GIL switch interval."""
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def after_start() -> None:
    """Freeze what start-up built (imported modules, torch's among them: some 200k
    objects that live as long as the process), so that a full collection walks only what
    serving creates, and collect the youngest generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_ALLOCATIONS, *gc.get_threshold()[1:])
