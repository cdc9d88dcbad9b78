"""The stage runner: bounded typed edges, workers, the batcher, and the declared graph."""

from pipeline.runner.edges import Edge, EdgeReceiveStream, EdgeSendStream, create_edge
from pipeline.runner.graph import BatchSpec, Graph, GraphRow, InlineFirst, PathSpec, StageSpec
from pipeline.runner.stages import (
    Batching,
    OnDone,
    Sink,
    Stage,
    run_batcher,
    start_stage,
    wrapped,
)

__all__ = [
    "BatchSpec",
    "Batching",
    "Edge",
    "EdgeReceiveStream",
    "EdgeSendStream",
    "Graph",
    "GraphRow",
    "InlineFirst",
    "OnDone",
    "PathSpec",
    "Sink",
    "Stage",
    "StageSpec",
    "create_edge",
    "run_batcher",
    "start_stage",
    "wrapped",
]
