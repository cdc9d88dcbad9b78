"""The Triton kernels of GPU copies (``cuda_pages``, ``cuda_digests``), and their
compilation ahead of an engine's first copy: what waits for a compile names each store
group's device, word, row stride, value size and seed, never the engine's tensors."""

from __future__ import annotations

import dataclasses
import functools
import time
import types
from collections.abc import Iterable, Sequence

import numpy
import structlog
import torch

from pipeline.core.geometry import StoreGroupGeometry
from pipeline.core.runs import value_span

__all__ = ["KernelForms", "checksums_on_device", "compile_kernels", "kernel_forms",
           "triton_kernels", "word_bytes"]

log = structlog.get_logger("kvsidecar.cuda")


@functools.cache
def triton_kernels() -> tuple[types.ModuleType, types.ModuleType] | None:
    """The Triton kernels, ``cuda_pages`` (a batch's pages in one launch) and
    ``cuda_digests``; None where Triton is missing."""
    try:
        from pipeline.backends import cuda_digests, cuda_pages
    except ImportError:
        return None
    return cuda_pages, cuda_digests


def checksums_on_device(value_bytes: int, seed: int | None,
                         row_stride: int) -> tuple[types.ModuleType, int] | None:
    """``cuda_digests`` and the seed where the checksums of values of ``value_bytes``
    are computed on the device (one is kept, Triton is, and the kernels take such rows),
    else None."""
    found = triton_kernels()
    if found is None or seed is None or not found[1].digestible(value_bytes, row_stride):
        return None
    return found[1], seed


def word_bytes(geometry: StoreGroupGeometry, row_stride: int) -> int:
    """The widest word, 8 bytes at most, that divides every page's address, stride,
    offset and size and the rows' stride: the unit the page kernel copies in."""
    bits = int(numpy.bitwise_or.reduce(geometry.segment_table, axis=None)) | row_stride
    return min(8, bits & -bits)


@dataclasses.dataclass(frozen=True)
class KernelForms:
    """What decides the forms of the kernels a geometry's copies launch, and nothing of
    its blocks: held while its compile waits, a reference to them would keep an engine's
    memory mapped after the engine is gone."""

    device: torch.device
    word: int
    row_stride: int
    value_bytes: int
    checksum_seed: int | None


def kernel_forms(geometries: Sequence[StoreGroupGeometry]) -> set[KernelForms]:
    """The forms the copies of these geometries take, rows lying as a store lending them
    lays them (``value_span``): rows that lie otherwise may leave a word width for the
    first copy to compile."""
    forms = set()
    for geometry in geometries:
        if geometry.segments:
            stride = value_span(geometry.stored_bytes)
            forms.add(KernelForms(geometry.segments[0].blocks.device,
                                  word_bytes(geometry, stride), stride,
                                  geometry.value_bytes, geometry.checksum_seed))
    return forms


def compile_kernels(forms: Iterable[KernelForms]) -> None:
    """Compile the Triton kernels of these forms (those on a GPU), by launching each once
    on scratch memory of the device: meant for a worker thread at an engine's
    registration, so that its first save and load find them compiled instead of
    compiling them on the event loop while every engine waits. A failure is logged, and
    the first copy compiles (or fails) as it would have."""
    kernels = triton_kernels()
    on_gpu = [form for form in forms if form.device.type == "cuda"]
    if kernels is None or not on_gpu:
        return
    started = time.monotonic()
    try:
        for form in on_gpu:
            _launch_once(kernels[0], form)
    except Exception as exc:  # Triton's and CUDA's errors alike
        log.warning("cuda.kernels.failed", error=repr(exc))
        return
    log.info("cuda.kernels.compiled", seconds=round(time.monotonic() - started, 3))


def _launch_once(pages: types.ModuleType, form: KernelForms) -> None:
    """Each kernel of the form, once, on one row and one page of scratch memory, as
    ``gather`` and ``scatter`` launch them."""
    device, word, stride = form.device, form.word, form.row_stride
    on_device = checksums_on_device(form.value_bytes, form.checksum_seed, stride)
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        rows = torch.zeros((1, stride), dtype=torch.uint8, device=device)
        page = torch.zeros(word, dtype=torch.uint8, device=device)
        # One value, one segment: its page at row offset 0, one word long, at ``page``.
        table = torch.tensor([0, 1, page.data_ptr(), 0], dtype=torch.int64, device=device)
        pages.copy_pages(table, rows, word, 1, 1, 1, to_rows=True)
        ok = None
        if on_device is not None:
            digests, seed = on_device
            digests.seal_on_device(rows, form.value_bytes, seed)
            ok = digests.check_on_device(rows, form.value_bytes, seed)
        pages.copy_pages(table, rows, word, 1, 1, 1, to_rows=False, ok=ok)
    stream.synchronize()
