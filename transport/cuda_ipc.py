"""GPU KV tensors shared between processes by CUDA IPC handle: the engine describes, the
sidecar opens.

An engine's KV tensors live in allocations of torch's caching allocator. A handle names
the allocation a tensor lies in (``cuIpcGetMemHandle`` of its base, found with
``cuMemGetAddressRange``), the allocation's size, the tensor's byte offset in it and the
engine's pid. The sidecar opens each allocation once per process (the driver maps a
handle once per context) and closes it when the last tensor built on it is freed.
Sessions hold those tensors, and a session is dropped as soon as its engine's process
exits (watched through a pidfd): the sidecar then closes the engine's allocations, and
the driver frees them. A handle names no file, so a SIGKILL leaves nothing behind; the
sidecar's own mappings go with its process.

The engine is a peer the sidecar does not trust: the size it sends is a claim, checked
before anything is built on the mapping. Once opened, the mapping's own base and size are
read from the driver (``cuMemGetAddressRange``); an allocation whose size is not exactly
the claim (an honest engine sends what that call told it) is closed and refused, so no
kernel is ever given more bytes than the driver mapped.

The driver API (``libcuda.so.1``, installed with the driver) is used through ctypes.
torch's own sharing (``torch.multiprocessing``) keeps a reference-count file per
allocation in /dev/shm, which a SIGKILLed engine would leave behind.

Memory from ``expandable_segments`` (CUDA virtual memory) has no such handle; the engine
is told to turn it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipeline.core.errors import TransportError
from pipeline.core.messages import CUDA_IPC_HANDLE_BYTES, CudaIpc, CudaIpcEvent

__all__ = [
    "ALLOCATIONS",
    "CudaDriver",
    "IpcAllocation",
    "IpcAllocations",
    "IpcDriver",
    "cuda_device_index",
    "cuda_ipc_of",
    "local_device",
    "open_step_event",
    "step_event",
]

_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * CUDA_IPC_HANDLE_BYTES)]


def cuda_device_index(device: str) -> int:
    """The index of a ``cuda:N`` device name."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"{device!r} is not a CUDA device (cuda:N)")
    return int(index)


class IpcDriver(Protocol):
    """The driver calls IPC sharing needs, each on one device."""

    def device_uuids(self) -> Sequence[str]:
        """The UUIDs of this process's devices, by index: the same GPU has the same UUID
        in every process, whatever its index there (``CUDA_VISIBLE_DEVICES``)."""

    def address_range(self, device: int, pointer: int) -> tuple[int, int]:
        """The base address and size of the allocation ``pointer`` lies in."""

    def ipc_handle(self, device: int, base: int) -> bytes:
        """The IPC handle of the allocation at ``base``."""

    def open(self, device: int, handle: bytes) -> int:
        """Map another process's allocation here; its base address in this process."""

    def close(self, device: int, pointer: int) -> None:
        """Unmap an allocation ``open`` mapped."""


class CudaDriver:
    """``IpcDriver`` over the CUDA driver API. Each call runs in the device's primary
    context (the one torch uses), pushed for the call alone: any thread may make it,
    including one that never touched CUDA (a finalizer's)."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            lib = ctypes.CDLL(library)
        except OSError as exc:
            raise TransportError(f"cannot load the CUDA driver ({library}): {exc}") from exc
        u64, p_u64 = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
        p_void = ctypes.POINTER(ctypes.c_void_p)
        self._address_range = _function(
            lib, "cuMemGetAddressRange_v2", p_u64, ctypes.POINTER(ctypes.c_size_t), u64)
        self._get_handle = _function(lib, "cuIpcGetMemHandle", ctypes.POINTER(_IpcMemHandle), u64)
        self._open = _function(lib, "cuIpcOpenMemHandle_v2", p_u64, _IpcMemHandle, ctypes.c_uint)
        self._close = _function(lib, "cuIpcCloseMemHandle", u64)
        self._error_name = _function(lib, "cuGetErrorName", ctypes.c_int,
                                     ctypes.POINTER(ctypes.c_char_p))
        self._init = _function(lib, "cuInit", ctypes.c_uint)
        self._device_get = _function(lib, "cuDeviceGet", ctypes.POINTER(ctypes.c_int),
                                     ctypes.c_int)
        self._retain = _function(lib, "cuDevicePrimaryCtxRetain", p_void, ctypes.c_int)
        self._push = _function(lib, "cuCtxPushCurrent_v2", ctypes.c_void_p)
        self._pop = _function(lib, "cuCtxPopCurrent_v2", p_void)
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    @functools.cached_property
    def _uuids(self) -> tuple[str, ...]:
        return tuple(str(torch.cuda.get_device_properties(index).uuid)
                     for index in range(torch.cuda.device_count()))

    def device_uuids(self) -> Sequence[str]:
        return self._uuids

    def address_range(self, device: int, pointer: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call(device, "cuMemGetAddressRange", self._address_range,
                   ctypes.byref(base), ctypes.byref(size), pointer)
        return base.value, size.value

    def ipc_handle(self, device: int, base: int) -> bytes:
        handle = _IpcMemHandle()
        self._call(device, "cuIpcGetMemHandle", self._get_handle, ctypes.byref(handle), base)
        return bytes(handle.reserved)

    def open(self, device: int, handle: bytes) -> int:
        pointer = ctypes.c_uint64()
        raw = _IpcMemHandle()
        ctypes.memmove(raw.reserved, handle, CUDA_IPC_HANDLE_BYTES)
        self._call(device, "cuIpcOpenMemHandle", self._open, ctypes.byref(pointer), raw,
                   _LAZY_ENABLE_PEER_ACCESS)
        return pointer.value

    def close(self, device: int, pointer: int) -> None:
        self._call(device, "cuIpcCloseMemHandle", self._close, pointer)

    def _context(self, device: int) -> ctypes.c_void_p:
        """The device's primary context, retained once for this process's life."""
        with self._lock:
            context = self._contexts.get(device)
            if context is None:
                ordinal = ctypes.c_int()
                context = ctypes.c_void_p()
                self._check(self._init(0), "cuInit", device)
                self._check(self._device_get(ctypes.byref(ordinal), device), "cuDeviceGet",
                            device)
                self._check(self._retain(ctypes.byref(context), ordinal),
                            "cuDevicePrimaryCtxRetain", device)
                self._contexts[device] = context
        return context

    def _call(self, device: int, name: str, function: Any, *args: Any) -> None:
        self._check(self._push(self._context(device)), "cuCtxPushCurrent", device)
        try:
            result = function(*args)
        finally:
            popped = ctypes.c_void_p()
            self._pop(ctypes.byref(popped))
        self._check(result, name, device)

    def _check(self, result: int, name: str, device: int) -> None:
        if result != 0:
            error = ctypes.c_char_p()
            self._error_name(result, ctypes.byref(error))
            reason = (error.value or b"").decode() or f"error {result}"
            raise TransportError(f"{name} on cuda:{device} failed: {reason}")


def _function(lib: ctypes.CDLL, name: str, *argtypes: Any) -> Any:
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


@functools.cache
def _driver() -> CudaDriver:
    return CudaDriver()


# -- engine side: describe -------------------------------------------------------------


def cuda_ipc_of(tensor: torch.Tensor, driver: IpcDriver | None = None) -> tuple[CudaIpc, int]:
    """The allocation a CUDA tensor lies in, shareable by IPC handle, and the byte offset
    of the tensor's first element from the allocation's base."""
    driver = driver or _driver()
    device = tensor.device.index if tensor.device.index is not None else 0
    pointer = tensor.data_ptr()
    try:
        base, size = driver.address_range(device, pointer)
        handle = driver.ipc_handle(device, base)
    except TransportError as exc:
        raise TransportError(
            f"{exc} (memory from PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cannot "
            "be shared by IPC handle: turn it off)"
        ) from exc
    ipc = CudaIpc(handle=handle, allocation_bytes=size, pid=os.getpid(),
                  device_uuid=driver.device_uuids()[device])
    return ipc, pointer - base


def step_event(device: int) -> tuple[torch.cuda.Event, CudaIpcEvent]:
    """An interprocess event for the engine to record after each forward, and its
    description for ``Register.step_event``."""
    event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
    with torch.cuda.device(device):
        event.record()  # an event is shared once recorded (an IPC handle needs it created)
    handle = bytes(event.ipc_handle())  # type: ignore[no-untyped-call]
    uuid = _driver().device_uuids()[device]
    return event, CudaIpcEvent(device=device, handle=handle, device_uuid=uuid)


# -- sidecar side: open -------------------------------------------------------------------


def local_device(uuid: str, index: int, driver: IpcDriver | None = None) -> int:
    """This process's index of the GPU with ``uuid`` (the engine's ``index`` where no
    UUID was given)."""
    if not uuid:
        return index
    uuids = list((driver or _driver()).device_uuids())
    if uuid not in uuids:
        raise TransportError(f"GPU {uuid} is not visible to the sidecar (CUDA_VISIBLE_DEVICES)")
    return uuids.index(uuid)


@dataclass(eq=False)
class IpcAllocation:
    """An engine's allocation mapped into this process; unmapped when garbage."""

    device: int
    pointer: int
    nbytes: int

    def tensor(self) -> torch.Tensor:
        """The allocation as a flat uint8 CUDA tensor (no copy). It keeps this allocation
        mapped for as long as it, or any view of it, lives."""
        return torch.as_tensor(_ArrayInterface(self), device=f"cuda:{self.device}")


class _ArrayInterface:
    """Device memory as ``__cuda_array_interface__``: torch builds a tensor on it and
    holds this object (and through it the allocation) until the tensor is freed."""

    def __init__(self, allocation: IpcAllocation) -> None:
        self.allocation = allocation
        self.__cuda_array_interface__ = {
            "shape": (allocation.nbytes,), "typestr": "|u1",
            "data": (allocation.pointer, False), "version": 2,
        }


class IpcAllocations:
    """Every engine allocation open in this process, each opened once: the driver maps a
    handle once per context, and two sessions of one engine (a re-registration while the
    old session finishes its jobs) name the same allocations."""

    def __init__(self, driver: IpcDriver | None = None) -> None:
        self._driver = driver
        self._open: weakref.WeakValueDictionary[tuple[int, bytes], IpcAllocation] = (
            weakref.WeakValueDictionary()
        )
        self._lock = threading.Lock()

    def open(self, index: int, ipc: CudaIpc) -> IpcAllocation:
        """The allocation ``ipc`` names, on the engine's device ``index`` (this process's
        index of that GPU, found by its UUID), mapped here while anyone holds it.

        The allocation's ``nbytes`` is the size the driver reports for the mapping once
        opened, never ``ipc.allocation_bytes``. A claim that is not exactly that size, or
        a mapping that does not start at the allocation's base, is refused with
        ``TransportError`` and what was opened for it is closed; an allocation already
        open is refused the same way for a claim other than its size."""
        driver = self._driver or _driver()
        device = local_device(ipc.device_uuid, index, driver)
        key = (device, ipc.handle)
        with self._lock:
            allocation = self._open.get(key)
            if allocation is None:
                pointer = driver.open(device, ipc.handle)
                try:
                    nbytes = _mapped_size(driver, device, pointer, ipc.allocation_bytes)
                except BaseException:
                    driver.close(device, pointer)
                    raise
                allocation = IpcAllocation(device, pointer, nbytes)
                weakref.finalize(allocation, driver.close, device, pointer)
                self._open[key] = allocation
            elif allocation.nbytes != ipc.allocation_bytes:
                raise TransportError(_size_refusal(ipc.allocation_bytes))
        return allocation

    @property
    def open_count(self) -> int:
        return len(self._open)


def _mapped_size(driver: IpcDriver, device: int, pointer: int, claimed: int) -> int:
    """The size of the allocation mapped at ``pointer``, as the driver reports it, when
    the mapping starts at its base and the size is exactly ``claimed``."""
    base, size = driver.address_range(device, pointer)
    if base != pointer:
        raise TransportError("the CUDA IPC handle did not map the start of an allocation")
    if size != claimed:
        raise TransportError(_size_refusal(claimed))
    return size


def _size_refusal(claimed: int) -> str:
    # Only the peer's own claim is named: the real size is of memory it may not own.
    return f"the CUDA allocation is not the {claimed} bytes its handle claims"


ALLOCATIONS = IpcAllocations()
"""This process's open engine allocations."""


def open_step_event(event: CudaIpcEvent) -> torch.cuda.Event:
    """The engine's step event, opened in this process."""
    try:
        opened: torch.cuda.Event = torch.cuda.Event.from_ipc_handle(  # type: ignore[no-untyped-call]
            local_device(event.device_uuid, event.device), event.handle)
        return opened
    except (RuntimeError, AssertionError) as exc:
        raise TransportError(f"cannot open the engine's step event: {exc}") from exc
