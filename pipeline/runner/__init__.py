"""The stage runner: bounded typed edges, workers, the batcher, and the declared graph."""

from pipeline.runner.edges import Edge, create_edge
from pipeline.runner.graph import BatchSpec, Graph, GraphRow, PathSpec, StageSpec
from pipeline.runner.stages import Batching, Sink, Stage, run_batcher, start_stage

__all__ = [
    "BatchSpec",
    "Batching",
    "Edge",
    "Graph",
    "GraphRow",
    "PathSpec",
    "Sink",
    "Stage",
    "StageSpec",
    "create_edge",
    "run_batcher",
    "start_stage",
]
