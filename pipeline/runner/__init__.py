"""The stage runner: bounded typed edges, workers, the batcher, and the declared graph."""

from pipeline.runner.edges import Edge, EdgeReceiveStream, EdgeSendStream, create_edge
from pipeline.runner.graph import (
    ALWAYS,
    NEVER,
    BatchSpec,
    Entrance,
    Graph,
    GraphRow,
    PathSpec,
    StageSpec,
    WaitRule,
)
from pipeline.runner.stages import (
    Batching,
    OnDone,
    Outbox,
    Sink,
    Stage,
    run_batcher,
    start_stage,
    wrapped,
)

__all__ = [
    "ALWAYS",
    "NEVER",
    "BatchSpec",
    "Batching",
    "Edge",
    "EdgeReceiveStream",
    "EdgeSendStream",
    "Entrance",
    "Graph",
    "GraphRow",
    "OnDone",
    "Outbox",
    "PathSpec",
    "Sink",
    "Stage",
    "StageSpec",
    "WaitRule",
    "create_edge",
    "run_batcher",
    "start_stage",
    "wrapped",
]
