"""What the two sides tell each other: each step's loads and saves, and saves done.

vLLM carries a ``StepPlan`` from the engine-core process to every worker inside its
``SchedulerOutput``, and each worker's ``SavesDone`` back inside its
``KVConnectorOutput`` (both pickled by vLLM's executor), so they hold only plain data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["LoadPlan", "SavePlan", "SavesDone", "StepPlan"]


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
    save_id: int
    """Its blocks are held out of vLLM's free pool until every worker has reported this
    id in ``SavesDone``."""


@dataclasses.dataclass(slots=True)
class StepPlan(KVConnectorMetadata):
    loads: list[LoadPlan] = dataclasses.field(default_factory=list)
    saves: list[SavePlan] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class SavesDone(KVConnectorWorkerMetadata):
    """Saves over since a worker last reported: the sidecar no longer reads their blocks
    (answered, cancelled and confirmed, or proven gone), whatever their outcome."""

    reports: dict[int, int]
    """``save_id`` -> how many workers report it (vLLM sums the workers' reports)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> SavesDone:
        assert isinstance(other, SavesDone)
        reports = dict(self.reports)
        for save_id, count in other.reports.items():
            reports[save_id] = reports.get(save_id, 0) + count
        return SavesDone(reports)
