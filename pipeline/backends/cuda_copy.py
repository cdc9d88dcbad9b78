"""The CUDA copy engine: engine KV blocks in GPU memory to and from stored values in host
memory, on dedicated CUDA streams.

A save waits on the engine's step event (recorded after its forward), gathers the
batch's blocks into one device matrix of values (every page in one kernel launch,
``cuda_pages``, where Triton is), seals each value's checksum there (``cuda_digests``)
and copies each run of adjacent values to host memory in one transfer. A load copies
the values to the device in one transfer per run, checks their checksums there and
scatters only the intact ones into the engine's blocks (the page kernel skips a value
whose check failed): the engine never receives a corrupted byte. The sidecar replies
only once the copy's event has completed, so the blocks are in place before the engine
hears of them. Without Triton (or for values the digest kernels do not take) checksums
are sealed on the host once a save's copy has completed and verified on the host before
a load's, in C without the GIL (``row_digests``), a large batch's shared by helpers.

Completion is seen through CUDA events awaited in worker threads (blocking-sync events:
the thread sleeps, nothing spins), never by synchronizing the device or a stream the
engine uses. Host memory the values live in is pinned (``pinned``) so that transfers
are asynchronous DMA. Geometries of CPU tensors go to the CPU engine this one wraps.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence

import anyio
import numpy
import structlog
import torch

from pipeline.backends.cpu_copy import page_table
from pipeline.backends.cuda_kernels import checksums_on_device, triton_kernels, word_bytes
from pipeline.backends.in_place_copy import HelperThreads, row_digests
from pipeline.core.errors import ConfigError
from pipeline.core.geometry import Segment, StoreGroupGeometry
from pipeline.core.integrity import CHECKSUM_BYTES
from pipeline.core.runs import Run
from pipeline.core.seams import CopyEngine

__all__ = [
    "CudaCopyEngine", "gather_blocks", "intact_runs", "pinned", "scatter_blocks", "seal_runs",
    "span_of",
]

log = structlog.get_logger("kvsidecar.copy")


def span_of(rows: torch.Tensor) -> torch.Tensor:
    """A run's rows with the padding after each (a direct store's own bytes) as one
    contiguous matrix, for copies that need one (to and from a GPU)."""
    count, stride = rows.shape[0], rows.stride(0)
    return torch.as_strided(rows, (count, stride), (stride, 1))


_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2))


def _words(blocks: torch.Tensor, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both byte matrices as the widest integer type whose view fits both (same bytes):
    the word must divide the page, both row strides and both start offsets."""
    sizes = (blocks.shape[1], blocks.stride(0), blocks.storage_offset(),
             columns.stride(0), columns.storage_offset())
    for dtype, width in _WORDS:
        if all(size % width == 0 for size in sizes):
            return blocks.view(dtype), columns.view(dtype)
    return blocks, columns


def gather_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """rows[i] = the pages of engine block block_ids[i] in these segments."""
    for segment in segments:
        blocks, out = _words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        torch.index_select(blocks, 0, block_ids, out=out)


def scatter_blocks(
    segments: Sequence[Segment], block_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Engine block block_ids[i] = rows[i] in these segments (the inverse of gather)."""
    for segment in segments:
        blocks, source = _words(
            segment.blocks, rows[:, segment.offset : segment.offset + segment.page_bytes]
        )
        blocks.index_copy_(0, block_ids, source)


@contextlib.contextmanager
def pinned(memory: torch.Tensor) -> Iterator[None]:
    """Page-lock a host tensor's memory for the duration (``cudaHostRegister``), so that
    copies between it and a device are asynchronous DMA."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    nbytes = memory.numel() * memory.element_size()
    result = cudart.cudaHostRegister(memory.data_ptr(), nbytes, 0)
    if result != cudart.cudaError.success:
        raise ConfigError(f"cannot pin {nbytes} bytes of host memory for CUDA copies: {result}")
    try:
        yield
    finally:
        cudart.cudaHostUnregister(memory.data_ptr())


def _row_stride(runs: Sequence[Run], stored: int) -> int:
    """How far apart a batch's values lie in device memory: as far as on the host (a
    direct store pads its values), so each run moves as one contiguous transfer."""
    return max((run.stride for run in runs), default=stored)


def _paired(host: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A host run and its device rows as matrices of one shape: whole contiguous spans
    where their strides agree (asynchronous DMA), else the values alone."""
    if host.stride(0) == rows.shape[1]:
        return span_of(host), rows
    return host, rows[:, : host.shape[1]]


def _trailers(runs: Sequence[Run], payload_bytes: int) -> list[numpy.ndarray]:
    """Each run's checksum bytes, where they lie after the payloads: ``[count, 8]``."""
    return [run.rows[:, payload_bytes : payload_bytes + CHECKSUM_BYTES].numpy()
            for run in runs]


def seal_runs(runs: Sequence[Run], payload_bytes: int, seed: int,
              helpers: HelperThreads | None) -> None:
    """Seal every value of the runs (host memory) after its payload, as ``seal_rows``."""
    digests = row_digests([run.rows for run in runs], payload_bytes, seed, helpers)
    sealed = digests.view(numpy.uint8).reshape(-1, CHECKSUM_BYTES)
    start = 0
    for trailer in _trailers(runs, payload_bytes):
        trailer[:] = sealed[start : start + len(trailer)]
        start += len(trailer)


def intact_runs(runs: Sequence[Run], payload_bytes: int, seed: int,
                helpers: HelperThreads | None) -> list[bool]:
    """Whether each value of the runs matches its sealed checksum, as ``verify_rows``."""
    if not runs:
        return []
    digests = row_digests([run.rows for run in runs], payload_bytes, seed, helpers)
    sealed = numpy.concatenate(_trailers(runs, payload_bytes)).view(numpy.uint64).reshape(-1)
    intact: list[bool] = (digests == sealed).tolist()
    return intact


def _kernel_table(geometry: StoreGroupGeometry, block_ids: Sequence[int],
                  rows_of: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """The page kernel's table (``cuda_pages``) on the device, copied from pinned memory
    on the current stream."""
    segments, count = len(geometry.segments), len(block_ids)
    host = torch.empty(2 * segments + count * (segments + 1), dtype=torch.int64,
                       pin_memory=True)
    table = host.numpy()
    table[: 2 * segments] = (geometry.segment_table[2:4] // width).ravel()
    table[2 * segments : 2 * segments + count * segments] = numpy.frombuffer(
        page_table(geometry, block_ids), dtype=numpy.int64)
    table[2 * segments + count * segments :] = rows_of
    return host.to(device, non_blocking=True)


def _move_pages(geometry: StoreGroupGeometry, block_ids: Sequence[int],
                rows_of: Sequence[int], rows: torch.Tensor, device: torch.device, *,
                to_rows: bool, ok: torch.Tensor | None = None) -> None:
    """Engine block ``block_ids[i]``'s pages to row ``rows_of[i]`` of ``rows`` (uint8,
    contiguous, on the device) or back, on the current stream: one kernel where Triton
    is, else a call per segment. ``ok`` (the kernel's only) holds back rows flagged 0."""
    kernels = triton_kernels()
    if kernels is not None:
        width = word_bytes(geometry, rows.stride(0))
        table = _kernel_table(geometry, block_ids, rows_of, width, device)
        kernels[0].copy_pages(table, rows, width, len(block_ids), len(geometry.segments),
                              max(geometry.page_sizes) // width, to_rows=to_rows, ok=ok)
        return
    assert ok is None, "rows are checked on the device only where the page kernel is"
    ids = torch.tensor(block_ids, dtype=torch.int64).to(device, non_blocking=True)
    picked = rows[:, : geometry.stored_bytes]
    if list(rows_of) != list(range(len(rows))):
        picked = picked[torch.tensor(rows_of, dtype=torch.int64).to(device, non_blocking=True)]
    if to_rows:
        gather_blocks(geometry.segments, ids, picked)
    else:
        scatter_blocks(geometry.segments, ids, picked)


def _device_of(geometry: StoreGroupGeometry) -> torch.device | None:
    device = geometry.segments[0].blocks.device if geometry.segments else None
    return device if device is not None and device.type == "cuda" else None


class CudaCopyEngine:
    """Copies of GPU blocks, on ``streams`` streams of each device; CPU blocks go to
    ``fallback``. ``limiter`` bounds the threads that wait on events and checksum;
    ``helpers`` share a large batch's checksums with them."""

    def __init__(self, fallback: CopyEngine, limiter: anyio.CapacityLimiter, *,
                 streams: int, helpers: HelperThreads | None = None) -> None:
        self._fallback = fallback
        self._limiter = limiter
        self._helpers = helpers
        self._stream_count = streams
        self._streams: dict[int, Iterator[torch.cuda.Stream]] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """The next of the device's streams, created on first use (an engine's tensors
        say which device)."""
        index = device.index or 0
        streams = self._streams.get(index)
        if streams is None:
            streams = self._streams[index] = itertools.cycle(
                [torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                 for _ in range(self._stream_count)]
            )
        return next(streams)

    def waits(self, nbytes: int) -> bool:
        return True  # on a device's streams (CPU blocks, on the fallback's threads or not)

    async def gather(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                     runs: Sequence[Run]) -> None:
        device = _device_of(geometry)
        if device is None:
            await self._fallback.gather(geometry, block_ids, runs)
            return
        stride = _row_stride(runs, geometry.stored_bytes)
        on_device = checksums_on_device(geometry.value_bytes, geometry.checksum_seed, stride)
        stream = self._stream(device)
        done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            if geometry.step_event is not None:
                stream.wait_event(geometry.step_event)
            rows = torch.empty((len(block_ids), stride), dtype=torch.uint8, device=device)
            _move_pages(geometry, block_ids, range(len(block_ids)), rows, device,
                        to_rows=True)
            if on_device is not None:
                kernels, seed = on_device
                kernels.seal_on_device(rows, geometry.value_bytes, seed)
            for run in runs:
                to, source = _paired(run.rows, rows[run.first : run.first + run.count])
                to.copy_(source, non_blocking=True)
            done.record(stream)
        # ``rows`` may be freed now: the allocator reuses it only behind this stream.

        def finish() -> None:
            done.synchronize()
            if on_device is None and geometry.checksum_seed is not None:
                seal_runs(runs, geometry.value_bytes, geometry.checksum_seed, self._helpers)

        await anyio.to_thread.run_sync(finish, limiter=self._limiter)

    async def unchanged(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                        runs: Sequence[Run]) -> list[bool]:
        """GPU blocks are copied after the engine's step event, ordered on the device
        with its forward: not hashed again (all True)."""
        if _device_of(geometry) is None:
            return await self._fallback.unchanged(geometry, block_ids, runs)
        return [True] * len(block_ids)

    async def scatter(self, geometry: StoreGroupGeometry, block_ids: Sequence[int],
                      runs: Sequence[Run]) -> list[bool]:
        device = _device_of(geometry)
        if device is None:
            return await self._fallback.scatter(geometry, block_ids, runs)
        stride = _row_stride(runs, geometry.stored_bytes)
        on_device = checksums_on_device(geometry.value_bytes, geometry.checksum_seed, stride)
        if on_device is None:
            intact = await anyio.to_thread.run_sync(self._verify, geometry, len(block_ids),
                                                    runs, limiter=self._limiter)
            keep = [index for index, ok in enumerate(intact) if ok]
            if not keep:
                return intact
        stream = self._stream(device)
        done = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            spans = torch.empty((len(block_ids), stride), dtype=torch.uint8, device=device)
            for run in runs:
                source, to = _paired(run.rows, spans[run.first : run.first + run.count])
                to.copy_(source, non_blocking=True)
            if on_device is None:
                _move_pages(geometry, [block_ids[index] for index in keep], keep, spans,
                            device, to_rows=False)
            else:
                # Checked where they landed: a value that fails is never scattered.
                kernels, seed = on_device
                ok = kernels.check_on_device(spans, geometry.value_bytes, seed)
                _move_pages(geometry, block_ids, range(len(block_ids)), spans, device,
                            to_rows=False, ok=ok)
                flags = torch.empty(len(block_ids), dtype=torch.int8, pin_memory=True)
                flags.copy_(ok, non_blocking=True)
            done.record(stream)
        # The host values stay held (and unchanged) until this returns, after the copy.
        await anyio.to_thread.run_sync(done.synchronize, limiter=self._limiter)
        return intact if on_device is None else [bool(flag) for flag in flags.tolist()]

    def _verify(self, geometry: StoreGroupGeometry, count: int,
                runs: Sequence[Run]) -> list[bool]:
        """Whether each value matches its checksum, checked on the host (all are, where
        none is kept)."""
        if geometry.checksum_seed is None:
            return [True] * count
        return intact_runs(runs, geometry.value_bytes, geometry.checksum_seed, self._helpers)
