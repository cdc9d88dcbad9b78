"""What the scheduler side tells the workers each step: the loads and saves to issue.

vLLM carries it from the engine-core process to every worker inside its
``SchedulerOutput`` (pickled by vLLM's executor), so it holds only plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadPlan", "SavePlan", "StepPlan"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Blocks:
    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    """vLLM's own fine block hashes of ``token_ids`` (``request.block_hashes``)."""
    block_ids: tuple[list[int], ...]
    """One list per kv-cache group, block j of the request at index j (0: leave it)."""
    keys: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan(_Blocks):
    num_tokens: int
    """Load up to here (the lookup's hit)."""
    computed_tokens: int
    """The engine's own prefix-cache hit: blocks ending before it stay as they are."""


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan(_Blocks):
    fence: bool
    """Some of the blocks belong to a group whose blocks vLLM frees while the request
    runs (sliding window, chunked local, Mamba): the worker saves those from a snapshot,
    or else the next step's forward waits for this save, since it may write into them."""


@dataclasses.dataclass(slots=True)
class StepPlan(KVConnectorMetadata):
    loads: list[LoadPlan] = dataclasses.field(default_factory=list)
    saves: list[SavePlan] = dataclasses.field(default_factory=list)
    preempted: list[str] = dataclasses.field(default_factory=list)
    """Requests preempted since the last step: vLLM freed their blocks, so their saves
    in flight must finish before this step's forward may overwrite them."""
