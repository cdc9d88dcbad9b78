"""The disk tier's reads: records read back on threads of their own, checked, and
copied out (``io.read_records``), spread over the readers."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from pipeline.backends.stores.disk.io import DiskRecord, read_records
from pipeline.backends.stores.disk.segments import AlignedBuffers
from pipeline.backends.threads import WorkerThreads

__all__ = ["DiskReads"]


class DiskReads:
    """``readers`` threads reading records of a tier whose secret is ``secret``."""

    def __init__(self, readers: int, secret: bytes) -> None:
        self._readers = readers
        self._secret = secret
        self._threads = WorkerThreads(readers, name="kvsidecar-disk-read")
        self._buffers = AlignedBuffers()

    async def read(self, wanted: Sequence[tuple[str, DiskRecord, torch.Tensor]], *,
                   failing: bool = False) -> list[str | None]:
        """Read each record into its tensor, checked first: None, or why it failed, in
        order. Raises ``OSError`` when the file system fails (``failing``: as injected).
        Waits for every read it started, even when cancelled."""
        count = min(self._readers, len(wanted))
        chunks = [list(wanted[i::count]) for i in range(count)]
        results = await self._threads.run_each([functools.partial(
            read_records, chunk, self._buffers, self._secret, failing) for chunk in chunks])
        problems: list[str | None] = [None] * len(wanted)
        for index, chunk_results in enumerate(results):
            problems[index::count] = chunk_results
        return problems

    def close(self) -> None:
        self._threads.close()
