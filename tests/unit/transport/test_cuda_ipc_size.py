"""An opened CUDA allocation's size comes from the driver, never from the peer's claim:
a claim the driver does not confirm is refused, and what was opened for it is closed."""

from __future__ import annotations

import gc
import os

import msgspec
import pytest

from pipeline.core.errors import TransportError
from pipeline.core.messages import CudaIpc
from transport.cuda_ipc import IpcAllocations

HANDLE = bytes(range(64))
CLAIMED = 1 << 20
MAPPED_AT = 0x7000_0000


class SizedDriver:
    """A driver whose opened mapping lies at ``MAPPED_AT`` in an allocation of ``size``
    bytes starting at ``base``; it records every open and close."""

    def __init__(self, size: int, base: int = MAPPED_AT) -> None:
        self.size = size
        self.base = base
        self.opened: list[tuple[int, bytes]] = []
        self.closed: list[tuple[int, int]] = []

    def device_uuids(self) -> list[str]:
        return ["GPU-a"]

    def address_range(self, device: int, pointer: int) -> tuple[int, int]:
        assert pointer == MAPPED_AT, "asked about a pointer open never returned"
        return self.base, self.size

    def ipc_handle(self, device: int, base: int) -> bytes:
        return HANDLE

    def open(self, device: int, handle: bytes) -> int:
        self.opened.append((device, handle))
        return MAPPED_AT

    def close(self, device: int, pointer: int) -> None:
        self.closed.append((device, pointer))


class UnsizedDriver(SizedDriver):
    """A driver that maps a handle but then cannot say how large the allocation is."""

    def address_range(self, device: int, pointer: int) -> tuple[int, int]:
        raise TransportError("cuMemGetAddressRange on cuda:0 failed: CUDA_ERROR_UNKNOWN")


def claim(nbytes: int = CLAIMED) -> CudaIpc:
    return CudaIpc(handle=HANDLE, allocation_bytes=nbytes, pid=os.getpid())


def test_an_allocation_smaller_than_claimed_is_refused_and_closed() -> None:
    """A handle claiming more bytes than the driver mapped is refused naming only the
    claim, the mapping is closed, and nothing stays open."""
    driver = SizedDriver(size=CLAIMED // 2)
    allocations = IpcAllocations(driver)
    with pytest.raises(TransportError) as caught:
        allocations.open(0, claim())
    assert str(caught.value) == f"the CUDA allocation is not the {CLAIMED} bytes its handle claims"
    assert driver.opened == [(0, HANDLE)]
    assert driver.closed == [(0, MAPPED_AT)]
    assert allocations.open_count == 0


def test_an_allocation_larger_than_claimed_is_refused_and_closed() -> None:
    """An honest engine claims exactly the driver's size, so a smaller claim is refused
    too, without naming the real size, and the mapping is closed."""
    driver = SizedDriver(size=CLAIMED * 2)
    allocations = IpcAllocations(driver)
    with pytest.raises(TransportError, match="is not the 1048576 bytes its handle claims") \
            as caught:
        allocations.open(0, claim())
    assert str(CLAIMED * 2) not in str(caught.value)
    assert driver.closed == [(0, MAPPED_AT)]
    assert allocations.open_count == 0


def test_an_allocation_of_the_claimed_size_opens_with_the_drivers_size() -> None:
    """A claim the driver confirms opens the mapping with the driver's base and size,
    kept open until its last holder lets go."""
    driver = SizedDriver(size=CLAIMED)
    allocations = IpcAllocations(driver)
    allocation = allocations.open(0, claim())
    assert (allocation.device, allocation.pointer, allocation.nbytes) == (0, MAPPED_AT, CLAIMED)
    assert driver.closed == []
    del allocation
    gc.collect()
    assert driver.closed == [(0, MAPPED_AT)]


def test_a_mapping_that_is_not_the_allocations_base_is_refused_and_closed() -> None:
    """A mapping the driver places inside a larger allocation rather than at its start
    is refused, whatever the size, and closed."""
    driver = SizedDriver(size=CLAIMED, base=MAPPED_AT - 0x1000)
    allocations = IpcAllocations(driver)
    with pytest.raises(TransportError, match="did not map the start of an allocation"):
        allocations.open(0, claim())
    assert driver.closed == [(0, MAPPED_AT)]
    assert allocations.open_count == 0


def test_a_driver_failure_reading_the_size_closes_the_mapping() -> None:
    """When the driver cannot report the mapping's size its error goes up unchanged and
    the mapping is closed."""
    driver = UnsizedDriver(size=CLAIMED)
    allocations = IpcAllocations(driver)
    with pytest.raises(TransportError, match="CUDA_ERROR_UNKNOWN"):
        allocations.open(0, claim())
    assert driver.closed == [(0, MAPPED_AT)]


def test_a_second_claim_of_an_open_allocation_must_match_its_size() -> None:
    """A handle already open is shared only with a claim of its real size: another claim
    is refused as a first open would be, and the shared mapping stays open."""
    driver = SizedDriver(size=CLAIMED)
    allocations = IpcAllocations(driver)
    first = allocations.open(0, claim())
    assert allocations.open(0, claim()) is first
    for other in (CLAIMED // 2, CLAIMED * 2):
        with pytest.raises(TransportError, match=f"is not the {other} bytes its handle claims"):
            allocations.open(0, msgspec.structs.replace(claim(), allocation_bytes=other))
    assert driver.opened == [(0, HANDLE)]
    assert driver.closed == []
    assert allocations.open_count == 1
