"""KV tensors shared between processes: the engine allocates (or describes), the sidecar
maps. CPU memory here; GPU memory by CUDA IPC handle (``transport.cuda_ipc``).

Nothing has a name. ``shared_kv_tensor`` allocates an anonymous memory file
(``memfd_create``), sealed at its size, and keeps its descriptor open as long as the
tensor's storage (and so every view of it) lives; memory the engine allocated itself
(vLLM's KV cache) is moved into an unlinked shared-memory file by torch, in place. The
engine hands the sidecar its descriptors (``transport.handover``): a handle names its
file by index in what was handed over (``Segments``), never by pid, descriptor or path.
There is nothing in ``/dev/shm`` to leave behind: when the engine dies, even by SIGKILL,
its memory lives only as long as the sidecar's mappings of it, and the sidecar watches
the engine's process (a pidfd opened as it handed its memory over) to drop those as soon
as it is gone (``MappedTensors.owner_exited``).

A file sealed against shrinking (``F_SEAL_SHRINK``) cannot fault under the sidecar. One
that is not (torch's in-place sharing gives such files) could be truncated by its
owner, so every mapping is made under a SIGBUS guard (``transport._memguard``): a fault
reads zeros and marks the mapping lost, and nothing read from it since is stored.

``multiprocessing.shared_memory`` is not used: on Python 3.11 every process that
attaches a ``SharedMemory`` registers it with its resource tracker, which then unlinks
(or warns about "leaked") segments that process never owned. Linux only.

Zero copy. A tensor is ``torch.frombuffer`` over a ``memoryview`` of the mapping. The
memoryview is an export of the mmap, so ``mmap.close()`` refuses (``BufferError``)
while any tensor built on it is alive: closing can never leave a tensor pointing at
unmapped memory, it only defers the unmapping to when the last tensor is freed.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import select
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from pipeline.core.errors import LimitExceeded, TransportError
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import MAX_SEGMENTS, TensorHandle
from transport import _memguard

if TYPE_CHECKING:
    from transport.cuda_ipc import IpcAllocations
    from transport.handover import Handed

__all__ = [
    "MappedTensors",
    "Segments",
    "block_pieces",
    "shared_kv_caches",
    "shared_kv_tensor",
    "tensor_handle",
]

_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MEMFD_NAME = "kvsidecar"
"""What ``/proc/PID/maps`` shows for an engine's shared KV memory: ``/memfd:kvsidecar``."""

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8",
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


# -- engine side: allocate and describe --------------------------------------------------


@dataclass(frozen=True, eq=False)
class _OwnedSegment:
    fd: int
    nbytes: int


# Storage base address -> the segment mapped there, for every live segment this process
# allocated. Entries leave when the segment's mapping is freed.
_owned: dict[int, _OwnedSegment] = {}
_owned_lock = threading.Lock()


def _release_owned(base: int, segment: _OwnedSegment) -> None:
    with _owned_lock:
        # The address may already belong to a newer segment mapped meanwhile.
        if _owned.get(base) is segment:
            del _owned[base]
    os.close(segment.fd)


def shared_kv_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor in a new anonymous shared-memory file.

    The file has no name; its descriptor stays open while the tensor or any view of it
    lives, and closes with the last of them or with the process. Describe it with
    ``tensor_handle``.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype} is not supported for shared KV tensors")
    if any(dim <= 0 for dim in shape):
        raise ValueError(f"a shared KV tensor needs a positive shape, got {tuple(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise TransportError(f"cannot create a shared memory file: {exc}") from exc
    try:
        # Reserve the pages now: a full tmpfs would otherwise surface as SIGBUS on a
        # later write instead of an error here.
        os.posix_fallocate(fd, 0, nbytes)
        # Sealed at its size: no process holding it (this one included) can shrink it
        # under a sidecar that maps it, nor grow it past what was reserved.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS)
        mapping = mmap.mmap(fd, nbytes)
    except OSError as exc:
        os.close(fd)
        raise TransportError(f"cannot allocate {nbytes} bytes of shared memory: {exc}") from exc
    flat = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)
    segment = _OwnedSegment(fd, nbytes)
    base = flat.data_ptr()
    with _owned_lock:
        _owned[base] = segment
    # Only the tensor's storage keeps the mapping alive; when it goes, so does the file.
    weakref.finalize(mapping, _release_owned, base, segment)
    return flat.view(dtype).view(tuple(shape))


def shared_kv_caches(
    layout: KVCacheLayout, num_blocks: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """A zero-filled blocks-first ``shared_kv_tensor`` per layer of ``layout``:
    ``[num_blocks, page_bytes / dtype size]``, the layer's page per block."""
    return {
        layer: shared_kv_tensor((num_blocks, max(1, group.page_bytes // dtype.itemsize)), dtype)
        for group in layout.groups
        for layer in group.layers
    }


class Segments:
    """The memory files one registration hands over, in order: a CPU handle names its
    file by index here. The descriptors stay this process's (owned by the tensors)."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self._index: dict[int, int] = {}

    def index(self, fd: int) -> int:
        """The index of ``fd``, added if new."""
        index = self._index.get(fd)
        if index is None:
            if len(self.fds) >= MAX_SEGMENTS:
                raise TransportError(f"an engine hands over at most {MAX_SEGMENTS} memory files")
            index = self._index[fd] = len(self.fds)
            self.fds.append(fd)
        return index


def tensor_handle(
    layer: str, tensor: torch.Tensor, segments: Segments | None = None, *,
    block_dim: int = 0, share_in_place: bool = False
) -> TensorHandle:
    """Describe ``tensor`` (or a view of one) for another process: a CPU tensor by the
    index of its memory file in ``segments`` (required for CPU tensors), whose
    descriptors are then handed over (``transport.handover``).

    A tensor from ``shared_kv_tensor`` is described as it is. Any other CPU tensor is
    refused unless ``share_in_place``: its storage is then moved into shared memory in
    place (torch's file-descriptor sharing; every view of the storage follows, the bytes
    are kept). Neither has a name in ``/dev/shm``, so nothing outlives the engine, even
    a SIGKILLed one.
    """
    dtype_name = _DTYPE_NAMES.get(tensor.dtype)
    if dtype_name is None:
        raise TransportError(f"layer {layer!r}: dtype {tensor.dtype} is not supported")
    if tensor.device.type == "cuda":
        return _cuda_tensor_handle(layer, tensor, dtype_name, block_dim)
    if tensor.device.type != "cpu":
        raise TransportError(f"layer {layer!r}: tensor is on {tensor.device}, not on the "
                             "CPU or a CUDA device")
    storage = tensor.untyped_storage()
    with _owned_lock:
        segment = _owned.get(storage.data_ptr())
    if segment is not None:
        fd, segment_bytes = segment.fd, segment.nbytes
    elif share_in_place:
        fd, segment_bytes = _share_fd(layer, storage)
    else:
        raise TransportError(
            f"layer {layer!r}: tensor is not in shared memory (allocate it with "
            "shared_kv_tensor, or share it in place)"
        )
    if segments is None:
        raise TransportError(f"layer {layer!r}: a CPU tensor is described with the "
                             "Segments its memory file is handed over with")
    handle = TensorHandle(
        layer=layer,
        offset=int(tensor.storage_offset()) * tensor.element_size(),
        shape=tuple(tensor.shape),
        strides=tuple(tensor.stride()),
        dtype=dtype_name,
        block_dim=block_dim,
        segment=segments.index(fd),
    )
    _check_fits(handle, _check_geometry(handle), segment_bytes)
    return handle


def _cuda_tensor_handle(
    layer: str, tensor: torch.Tensor, dtype_name: str, block_dim: int
) -> TensorHandle:
    from transport.cuda_ipc import cuda_ipc_of

    try:
        ipc, offset = cuda_ipc_of(tensor)
    except TransportError as exc:
        raise TransportError(f"layer {layer!r}: {exc}") from exc
    handle = TensorHandle(
        layer=layer, offset=offset, shape=tuple(tensor.shape),
        strides=tuple(tensor.stride()), dtype=dtype_name, block_dim=block_dim,
        device=f"cuda:{tensor.device.index or 0}", cuda_ipc=ipc,
    )
    _check_fits(handle, _check_geometry(handle), ipc.allocation_bytes)
    return handle


def _share_fd(layer: str, storage: torch.UntypedStorage) -> tuple[int, int]:
    # torch's own file-descriptor sharing (what torch.multiprocessing sends tensors with):
    # the storage's bytes move into an unlinked shared-memory file, in place.
    try:
        fd, nbytes = storage._share_fd_cpu_()
    except RuntimeError as exc:
        raise TransportError(f"layer {layer!r}: cannot share its memory in place: {exc}") from exc
    return int(fd), int(nbytes)


# -- sidecar side: map ---------------------------------------------------------------


@dataclass(frozen=True)
class _Geometry:
    dtype: torch.dtype
    extent: int
    """Bytes from the handle's offset to the end of its last element."""


def _fail(handle: TensorHandle, problem: str) -> TransportError:
    return TransportError(f"layer {handle.layer!r}: {problem}")


def _check_geometry(handle: TensorHandle) -> _Geometry:
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
    dtype = _DTYPES.get(handle.dtype)
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


def _check_fits(handle: TensorHandle, geometry: _Geometry, segment_bytes: int) -> None:
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
        geometry = _check_geometry(handle)
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
        _check_fits(handle, geometry, nbytes)
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
        _check_fits(handle, geometry, ipc.allocation_bytes)
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
