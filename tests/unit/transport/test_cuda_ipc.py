"""GPU sharing without a GPU: handle encoding and checks, the bookkeeping of opened
allocations (through a fake driver), and refusals. The real driver is exercised by the
``gpu`` tests."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any

import msgspec
import pytest

from pipeline.core.errors import TransportError
from pipeline.core.messages import CudaIpc, CudaIpcEvent, TensorHandle
from transport.cuda_ipc import IpcAllocations, cuda_device_index, cuda_ipc_of
from transport.tensors import MappedTensors

HANDLE = bytes(range(64))


class FakeDriver:
    """The driver's IPC calls as bookkeeping: which handles are open, at which address;
    each opened allocation is ``mapped_bytes`` long."""

    def __init__(self, mapped_bytes: int = 1 << 20) -> None:
        self.opened: list[tuple[int, bytes]] = []
        self.closed: list[tuple[int, int]] = []
        self.ranges: dict[int, tuple[int, int]] = {}
        self.mapped_bytes = mapped_bytes

    def device_uuids(self) -> list[str]:
        return ["GPU-a", "GPU-b", "GPU-c"]

    def address_range(self, device: int, pointer: int) -> tuple[int, int]:
        return self.ranges[pointer]

    def ipc_handle(self, device: int, base: int) -> bytes:
        return base.to_bytes(8, "little") * 8

    def open(self, device: int, handle: bytes) -> int:
        self.opened.append((device, handle))
        pointer = 0x7000_0000 + len(self.opened) * 0x1000
        self.ranges[pointer] = (pointer, self.mapped_bytes)
        return pointer

    def close(self, device: int, pointer: int) -> None:
        self.closed.append((device, pointer))


def cuda_handle(**change: Any) -> TensorHandle:
    handle = TensorHandle(
        layer="model.layers.0", offset=4096, shape=(8, 256), strides=(256, 1),
        dtype="bfloat16", device="cuda:0",
        cuda_ipc=CudaIpc(handle=HANDLE, allocation_bytes=1 << 20, pid=os.getpid()),
    )
    return msgspec.structs.replace(handle, **change)


def test_a_cuda_handle_survives_the_wire_and_a_short_ipc_handle_does_not() -> None:
    """Device, IPC handle, offset, shape, strides and dtype travel exactly; an IPC handle
    that is not 64 bytes is refused by the decoder."""
    handle = cuda_handle()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(handle), type=TensorHandle)
    assert decoded == handle
    event = CudaIpcEvent(device=1, handle=HANDLE)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=CudaIpcEvent) == event
    short = msgspec.msgpack.encode({**msgspec.structs.asdict(handle.cuda_ipc),
                                    "handle": HANDLE[:63]})
    with pytest.raises(msgspec.ValidationError, match="length"):
        msgspec.msgpack.decode(short, type=CudaIpc)


def test_device_names_are_cuda_n() -> None:
    """Only ``cuda:N`` names a CUDA device."""
    assert cuda_device_index("cuda:3") == 3
    for bad in ("cuda", "cuda:", "cpu", "cuda:x", "gpu:0"):
        with pytest.raises(ValueError, match="is not a CUDA device"):
            cuda_device_index(bad)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"cuda_ipc": None}, "named by its CUDA IPC handle alone"),
        ({"segment": 0}, "named by its CUDA IPC handle alone"),
        ({"device": "cpu"}, "and no CUDA IPC handle"),
        ({"device": "cuda:x"}, "device 'cuda:x' is not supported"),
        ({"device": "rocm:0"}, "device 'rocm:0' is not supported"),
        ({"offset": (1 << 20) - 2048}, "but its cuda:0/ipc/"),
    ],
)
def test_a_bad_cuda_handle_is_refused_before_anything_is_opened(
    change: dict[str, Any], problem: str
) -> None:
    """A CUDA handle that does not add up is refused naming the layer, and the driver
    is never asked to open anything."""
    driver = FakeDriver()
    with MappedTensors(IpcAllocations(driver)) as mapped:
        with pytest.raises(TransportError) as caught:
            mapped.map_tensor(cuda_handle(**change))
    assert str(caught.value).startswith("layer 'model.layers.0': ")
    assert problem in str(caught.value)
    assert driver.opened == []


def test_a_handle_of_an_engine_that_is_gone_is_refused_unopened() -> None:
    """The owner's pid is watched before its allocation is opened: a dead owner's
    handle is refused and nothing is mapped."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    driver = FakeDriver()
    ipc = CudaIpc(handle=HANDLE, allocation_bytes=1 << 20, pid=dead.pid)
    with MappedTensors(IpcAllocations(driver)) as mapped, \
            pytest.raises(TransportError, match="is not running"):
        mapped.map_tensor(cuda_handle(cuda_ipc=ipc))
    assert driver.opened == []


def test_an_allocation_is_opened_once_and_closed_with_its_last_holder() -> None:
    """Two opens of one handle on one device share a mapping (the driver maps a handle
    once per context); the mapping closes when nothing holds it, and a later open maps
    it again. The same handle on another device is another allocation."""
    driver = FakeDriver()
    allocations = IpcAllocations(driver)
    ipc = CudaIpc(handle=HANDLE, allocation_bytes=1 << 20, pid=os.getpid())
    first = allocations.open(0, ipc)
    assert allocations.open(0, ipc) is first
    other = allocations.open(1, ipc)
    assert driver.opened == [(0, HANDLE), (1, HANDLE)]
    assert allocations.open_count == 2
    pointer = first.pointer
    del first
    gc.collect()
    assert driver.closed == [(0, pointer)]
    assert allocations.open_count == 1
    again = allocations.open(0, ipc)
    assert len(driver.opened) == 3 and again.pointer != pointer
    with pytest.raises(TransportError, match="is not the 4096 bytes its handle claims"):
        allocations.open(1, msgspec.structs.replace(ipc, allocation_bytes=4096))
    del again, other
    gc.collect()
    assert len(driver.closed) == 3


class FakeTensor:
    """Just enough of a CUDA tensor for ``cuda_ipc_of``."""

    class device:
        type = "cuda"
        index = 2

    def __init__(self, pointer: int) -> None:
        self._pointer = pointer

    def data_ptr(self) -> int:
        return self._pointer


def test_an_engine_tensor_is_described_by_its_allocation_and_offset() -> None:
    """A tensor inside an allocation is described by the allocation's base handle and
    size, its own offset from the base, and this process's pid."""
    driver = FakeDriver()
    driver.ranges[0x5000_1000] = (0x5000_0000, 1 << 24)
    ipc, offset = cuda_ipc_of(FakeTensor(0x5000_1000), driver)  # type: ignore[arg-type]
    assert offset == 0x1000
    assert ipc == CudaIpc(handle=driver.ipc_handle(2, 0x5000_0000), allocation_bytes=1 << 24,
                          pid=os.getpid(), device_uuid="GPU-c")


def test_an_allocation_opens_on_this_processs_index_of_its_gpu() -> None:
    """Processes number GPUs differently (CUDA_VISIBLE_DEVICES): an allocation the
    engine has on its cuda:0 opens on the sidecar's index of the same GPU, found by its
    UUID; a GPU the sidecar cannot see is refused by name."""
    driver = FakeDriver(mapped_bytes=4096)
    allocations = IpcAllocations(driver)
    ipc = CudaIpc(handle=HANDLE, allocation_bytes=4096, pid=os.getpid(), device_uuid="GPU-c")
    assert allocations.open(0, ipc).device == 2
    assert driver.opened == [(2, HANDLE)]
    hidden = msgspec.structs.replace(ipc, device_uuid="GPU-z")
    with pytest.raises(TransportError, match="GPU GPU-z is not visible to the sidecar"):
        allocations.open(0, hidden)
