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

This module is the engine's side; the sidecar's (``MappedTensors``, ``block_pieces``)
is ``transport.mapped``, re-exported here.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pipeline.core.errors import TransportError
from pipeline.core.layout import KVCacheLayout
from pipeline.core.messages import MAX_SEGMENTS, TensorHandle
from transport.mapped import (
    DTYPE_NAMES,
    MappedTensors,
    block_pieces,
    check_fits,
    check_geometry,
)

if TYPE_CHECKING:
    pass

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
    if dtype not in DTYPE_NAMES:
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
    dtype_name = DTYPE_NAMES.get(tensor.dtype)
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
    check_fits(handle, check_geometry(handle), segment_bytes)
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
    check_fits(handle, check_geometry(handle), ipc.allocation_bytes)
    return handle


def _share_fd(layer: str, storage: torch.UntypedStorage) -> tuple[int, int]:
    # torch's own file-descriptor sharing (what torch.multiprocessing sends tensors with):
    # the storage's bytes move into an unlinked shared-memory file, in place.
    try:
        fd, nbytes = storage._share_fd_cpu_()
    except RuntimeError as exc:
        raise TransportError(f"layer {layer!r}: cannot share its memory in place: {exc}") from exc
    return int(fd), int(nbytes)

