"""The sidecar's side of shared KV tensors: the geometry of each handle checked, the
engine's memory files mapped under a SIGBUS guard, and tensors over the mappings
(``transport.tensors`` describes the engine's side and the guarantees both keep).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from pipeline.core.errors import LimitExceeded, TransportError
from pipeline.core.messages import MAX_SEGMENTS, TensorHandle
from transport import _memguard

if TYPE_CHECKING:
    from transport.cuda_ipc import IpcAllocations
    from transport.handover import Handed


__all__ = ["DTYPES", "DTYPE_NAMES", "MappedTensors", "block_pieces", "check_fits",
           "check_geometry"]

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8",
    )
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}




@dataclass(frozen=True)
class _Geometry:
    dtype: torch.dtype
    extent: int
    """Bytes from the handle's offset to the end of its last element."""


def _fail(handle: TensorHandle, problem: str) -> TransportError:
    return TransportError(f"layer {handle.layer!r}: {problem}")


def check_geometry(handle: TensorHandle) -> _Geometry:
    """Validate everything about a handle that does not need its segment."""
    if handle.device == "cpu":
        if handle.cuda_ipc is not None or handle.segment < 0:
            raise _fail(handle, "a CPU tensor is named by the index of a memory file "
                                "handed over, and no CUDA IPC handle")
    elif handle.device.startswith("cuda:") and handle.device[5:].isdigit():
        if handle.cuda_ipc is None or handle.segment >= 0:
            raise _fail(handle, f"a tensor on {handle.device} is named by its CUDA IPC "
                                "handle alone")
    else:
        raise _fail(handle, f"device {handle.device!r} is not supported: 'cpu' or 'cuda:N'")
    dtype = DTYPES.get(handle.dtype)
    if dtype is None:
        raise _fail(handle, f"unknown dtype {handle.dtype!r}")
    shape, strides = handle.shape, handle.strides
    if len(shape) != len(strides):
        raise _fail(handle, f"shape {shape} and strides {strides} differ in length")
    if handle.block_dim not in (0, 1) or handle.block_dim >= len(shape):
        raise _fail(handle, f"block_dim {handle.block_dim} is out of range for shape {shape}")
    if handle.block_dim == 1 and shape[0] != 2:
        raise _fail(handle, f"a K/V-first tensor has shape [2, num_blocks, ...], got {shape}")
    if any(dim <= 0 for dim in shape):
        raise _fail(handle, f"shape {shape} has an empty or negative dimension")
    if any(stride <= 0 for stride in strides):
        raise _fail(handle, f"strides {strides} must all be positive")
    if handle.offset < 0 or handle.offset % dtype.itemsize:
        raise _fail(handle, f"offset {handle.offset} is not a multiple of {dtype.itemsize} bytes")
    # Elements must not alias: writing one block must never change another.
    span = 1
    for stride, dim in sorted(zip(strides, shape, strict=True)):
        if dim == 1:
            continue
        if stride < span:
            raise _fail(handle, f"strides {strides} make elements of shape {shape} overlap")
        span = stride * (dim - 1) + span
    return _Geometry(dtype, span * dtype.itemsize)


def _segment(handle: TensorHandle) -> str:
    """The segment a handle names: a memory file handed over, or its CUDA allocation."""
    if handle.cuda_ipc is not None:
        return f"{handle.device}/ipc/{handle.cuda_ipc.handle.hex()}"
    return f"memory file {handle.segment}"


def check_fits(handle: TensorHandle, geometry: _Geometry, segment_bytes: int) -> None:
    end = handle.offset + geometry.extent
    if end > segment_bytes:
        raise _fail(
            handle,
            f"tensor spans bytes [{handle.offset}, {end}) but its {_segment(handle)} "
            f"has {segment_bytes} bytes",
        )


class MappedTensors:
    """Segments mapped into this process, each once, with the tensors built on them.

    One registry per engine session: ``close()`` unmaps every segment. A tensor still
    alive at ``close()`` stays valid; its segment is unmapped when the tensor is freed.
    The engine's process is watched through a pidfd, so the owner of the session can
    tell at once when that engine is gone (``owner_exited``).
    """

    def __init__(self, allocations: IpcAllocations | None = None, *,
                 handed: Handed | None = None, owner_pid: int | None = None,
                 max_bytes: int | None = None, limit: str = "") -> None:
        """``allocations``: where CUDA allocations are opened (one per process).
        ``handed``: the memory files the engine handed over (closed with this registry;
        each descriptor as soon as its file is mapped, the rest by ``done_mapping``).
        ``owner_pid``: the engine's pid as the transport proved it, where it did: a CUDA
        handle of another process is refused. ``max_bytes``: the most host memory the
        segments may span together (None: no bound); a segment past it is refused
        before it is mapped (``LimitExceeded`` naming ``limit``)."""
        self._mappings: dict[str, mmap.mmap] = {}
        self._handed = handed
        self._owner_pid = owner_pid
        self._max_bytes = max_bytes
        self._limit = limit
        self._bytes = 0
        self._lost = False
        """Whether a mapping was lost before its guard ended."""
        self._guards: dict[str, int] = {}
        """Segment -> the ``_memguard`` token of its mapping."""
        self.unsealed = 0
        """Memory files mapped that their owner could still shrink (guarded)."""
        self._allocations: dict[str, torch.Tensor] = {}
        self._cuda = allocations
        self._pidfds: dict[int, int] = {}
        self._closed = False

    def __enter__(self) -> MappedTensors:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def segment_names(self) -> frozenset[str]:
        return frozenset(self._mappings) | frozenset(self._allocations)

    @property
    def mapped_bytes(self) -> int:
        """Bytes of host memory mapped (GPU allocations are not host memory)."""
        return self._bytes

    def lost(self) -> bool:
        """Whether a mapped file shrank under this process: its mapping now reads zeros
        (``_memguard``), so nothing read from it since is the engine's."""
        return self._lost or any(map(_memguard.lost, self._guards.values()))

    def map_tensor(self, handle: TensorHandle) -> torch.Tensor:
        """The tensor a handle describes, sharing memory with its owner (no copy)."""
        if self._closed:
            raise _fail(handle, "the tensor registry is closed")
        geometry = check_geometry(handle)
        segment = _segment(handle)
        if handle.cuda_ipc is not None:
            flat = self._allocations.get(segment)
            if flat is None:
                flat = self._allocations[segment] = self._open_allocation(handle, geometry)
        else:
            mapping = self._mappings.get(segment)
            if mapping is None:
                mapping = self._mappings[segment] = self._map(handle, segment)
                self._bytes += len(mapping)
            flat = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)
        nbytes = flat.numel()
        check_fits(handle, geometry, nbytes)
        itemsize = geometry.dtype.itemsize
        typed = flat[: nbytes - nbytes % itemsize].view(geometry.dtype)
        return typed.as_strided(handle.shape, handle.strides, handle.offset // itemsize)

    def done_mapping(self) -> None:
        """Close the descriptors of memory files handed over but not mapped."""
        if self._handed is not None:
            for index in range(len(self._handed.fds)):
                fd = self._handed.take(index)
                if fd >= 0:
                    os.close(fd)

    def owner_exited(self) -> bool:
        """Whether a process whose memory is mapped here has exited (its pidfd is
        readable): nobody will write that memory again or ask for it back."""
        pidfds = list(self._pidfds.values())
        if self._handed is not None and self._handed.pidfd >= 0 and self._mappings:
            pidfds.append(self._handed.pidfd)
        return not all(map(self._running, pidfds))

    def close(self) -> None:
        """Unmap every segment and let go of every allocation; idempotent."""
        self._closed = True
        mappings, self._mappings = self._mappings, {}
        guards, self._guards = self._guards, {}
        for name, mapping in mappings.items():
            # A guard ends before its mapping does: a later mapping at the same address
            # must not be taken for it.
            self._lost = self._lost or _memguard.lost(guards[name])
            _memguard.unwatch(guards[name])
            try:
                mapping.close()
            except BufferError:
                # Live tensors hold an export (a copy still in flight): the mapping then
                # goes with the last of them, guarded, and heard from, until then.
                self._guards[name] = _guard(mapping)
        # Likewise an allocation is closed once no tensor built on it is alive.
        self._allocations = {}
        pidfds, self._pidfds = self._pidfds, {}
        for pidfd in pidfds.values():
            os.close(pidfd)
        if self._handed is not None:
            self._handed.close()

    def _map(self, handle: TensorHandle, name: str) -> mmap.mmap:
        """Map a handed-over memory file whole, within the budget, guarded against a
        shrink; its descriptor is closed once mapped."""
        fd = -1 if self._handed is None else self._handed.take(handle.segment)
        if fd < 0:
            raise _fail(handle, f"{name} was not handed over with this registration "
                                "(or another handle of it was refused)")
        try:
            status = os.fstat(fd)
            size = status.st_size
            if size == 0:
                raise _fail(handle, f"{name} is empty")
            if len(self._mappings) >= MAX_SEGMENTS:
                raise LimitExceeded(
                    "segments_per_engine", f"layer {handle.layer!r}: an engine maps at most "
                    f"{MAX_SEGMENTS} memory files")
            if self._max_bytes is not None and self._bytes + size > self._max_bytes:
                raise LimitExceeded(
                    self._limit, f"layer {handle.layer!r}: mapping its {name} of {size} "
                    f"bytes would take the engine's mapped memory past {self._max_bytes} bytes")
            if status.st_blocks * 512 < size:
                # Mapping it would allocate the rest at the sidecar's expense.
                raise _fail(handle, f"{name} is sparse: allocate its memory before sharing "
                                    "it (posix_fallocate)")
            if not _sealed(fd):
                self.unsealed += 1
            # Populate the page tables now: a first touch per page at copy time would run
            # the first transfers of every block several times slower.
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        except OSError as exc:
            raise _fail(handle, f"cannot map its {name}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        # Watched even when sealed against shrinking: a hole punched in a hugetlb file
        # faults too.
        self._guards[name] = _guard(mapping)
        return mapping

    def _open_allocation(self, handle: TensorHandle, geometry: _Geometry) -> torch.Tensor:
        from transport.cuda_ipc import ALLOCATIONS, cuda_device_index

        ipc = handle.cuda_ipc
        assert ipc is not None
        if self._owner_pid is not None and ipc.pid != self._owner_pid:
            raise _fail(handle, "a CUDA allocation is shared by the process that owns it, "
                                "on its own connection")
        # Before opening anything: what the handle claims must hold the tensor (the
        # driver's own size is checked once it is open).
        check_fits(handle, geometry, ipc.allocation_bytes)
        pidfd = self._watch(handle, ipc.pid)
        try:
            allocations = self._cuda or ALLOCATIONS
            allocation = allocations.open(cuda_device_index(handle.device), ipc)
        except TransportError as exc:
            raise _fail(handle, str(exc)) from exc
        if not self._running(pidfd):
            raise _fail(handle, "the engine process exited while being mapped")
        return allocation.tensor()

    def _watch(self, handle: TensorHandle, pid: int) -> int:
        """A pidfd of ``pid``, opened before anything of it is: if its process is still
        running after, what was opened through its pid was that process's, not one of a
        later process given the same pid."""
        pidfd = self._pidfds.get(pid)
        if pidfd is None:
            try:
                pidfd = self._pidfds[pid] = os.pidfd_open(pid)
            except OSError as exc:
                raise _fail(handle, "the engine process is not running") from exc
        return pidfd

    @staticmethod
    def _running(pidfd: int) -> bool:
        # poll, not select: a process holding many descriptors has them past select's
        # FD_SETSIZE.
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return not poller.poll(0)


_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere faults on use


def _sealed(fd: int) -> bool:
    """Whether a file is sealed against shrinking. Any tmpfs file answers F_GET_SEALS
    (an unsealable one with F_SEAL_SEAL alone): the seals are checked, not the answer."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return bool(seals & fcntl.F_SEAL_SHRINK)


def _guard(mapping: mmap.mmap) -> int:
    """Watch a mapping of a file its owner could shrink (``_memguard``): a fault in it
    then reads zeros and marks it lost instead of killing the process. The watch ends
    when the mapping is unmapped: at ``close()``, or once the last tensor on it goes."""
    token = _memguard.watch(mapping)
    weakref.finalize(mapping, _memguard.unwatch, token)
    return token


# -- blocks ----------------------------------------------------------------------------


def block_pieces(
    tensor: torch.Tensor, block: int, *, block_dim: int = 0
) -> tuple[torch.Tensor, ...]:
    """Block ``block`` of a layer's KV tensor as 1-D byte views, one per contiguous piece.

    A blocks-first tensor ``[num_blocks, ...]`` gives one piece; a K/V-first tensor
    ``[2, num_blocks, ...]`` gives two, K then V. The views alias the tensor: copying
    into them writes the block.
    """
    if block_dim not in (0, 1):
        raise ValueError(f"block_dim must be 0 or 1, got {block_dim}")
    page = tensor.select(block_dim, block)
    pieces = (page,) if block_dim == 0 else page.unbind(0)
    views = []
    for piece in pieces:
        if not piece.is_contiguous():
            raise TransportError(
                f"block {block} of a tensor with strides {tuple(tensor.stride())} "
                "is not contiguous"
            )
        views.append(piece.reshape(-1).view(torch.uint8))
    return tuple(views)
