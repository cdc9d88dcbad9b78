"""The declared stage graph: which paths run in the receive loop, and how far."""

from __future__ import annotations

import msgspec

from pipeline.app.graph import paths
from pipeline.core.config import Config


def _with_batching_deadline(deadline_ms: float) -> Config:
    config = Config()
    stages = config.stages
    return msgspec.structs.replace(config, stages=msgspec.structs.replace(
        stages, batching=msgspec.structs.replace(stages.batching, deadline_ms=deadline_ms)))


def test_saves_and_loads_run_in_the_receive_loop_up_to_their_copy() -> None:
    by_name = {path.name: path for path in paths(Config())}
    assert (by_name["save"].inline, by_name["save"].inline_until) == (True, "transfer")
    assert (by_name["load"].inline, by_name["load"].inline_until) == (True, "scatter")


def test_saves_wait_in_the_queue_while_batches_wait_for_more() -> None:
    """With a batching deadline a save is batched with the saves after it: it is never
    run ahead in the receive loop. A load still is."""
    by_name = {path.name: path for path in paths(_with_batching_deadline(5.0))}
    assert not by_name["save"].inline
    assert by_name["load"].inline
