# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""One kernel moves a batch's pages between engine blocks and value rows on a GPU: every
page of every value in one launch, where an ``index_select`` (a save) or ``index_copy_``
(a load) per segment took a launch each from Python, 24 a request at 24 layers (measured
on an H200 host: about 35 µs a call, most of the sidecar's own time a request).

Written in Triton, which comes with CUDA builds of torch; imported only where it is
(``pipeline.backends.cuda_copy`` falls back to the calls per segment). Its forms (each
direction and word) are compiled as an engine registers, in a worker thread
(``cuda_kernels.compile_kernels``), not at the first copy on the event loop; Triton keeps
what it compiled on disk for the sidecar's next start.

The kernel reads one int64 ``table`` (copied to the device with the batch):

- ``[0, segments)``: where each segment's page lies in a row, in words;
- ``[segments, 2 * segments)``: each segment's page, in words;
- ``[pages_at, pages_at + count * segments)``: the address of each value's page in each
  segment (``_blockcopy.page_table``), in bytes;
- ``[rows_at, rows_at + count)``: the row of each value.

A word is the widest integer (8, 4, 2 or 1 bytes) that divides every address, stride,
offset and size involved (``word_bytes``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["copy_pages"]

_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
"""The word of each width, as a torch dtype."""
BLOCK = 2048
"""Words each program copies: a 64 KiB page of int64 words takes four."""


# The integers are not specialized on (their divisibility, a value of 1): one compile for
# each direction and word, whatever the batch.
@triton.jit(do_not_specialize=["pages_at", "rows_at", "segments", "row_stride"])
def _copy_pages(table, rows, ok, pages_at, rows_at, segments, row_stride,
                TO_ROWS: tl.constexpr, CHECKED: tl.constexpr, BLOCK: tl.constexpr):
    """Program (value, segment, chunk): the chunk's words of that value's page (from a row
    whose ``ok`` flag is set, where ``CHECKED``)."""
    value = tl.program_id(0)
    segment = tl.program_id(1)
    words = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    size = tl.load(table + segments + segment)
    index = tl.load(table + rows_at + value)
    if CHECKED:
        size = tl.where(tl.load(ok + index) != 0, size, 0)
    mask = words < size
    page = tl.load(table + pages_at + value * segments + segment).to(rows.dtype)
    row = rows + index * row_stride + tl.load(table + segment)
    if TO_ROWS:
        tl.store(row + words, tl.load(page + words, mask=mask), mask=mask)
    else:
        tl.store(page + words, tl.load(row + words, mask=mask), mask=mask)


def copy_pages(table: torch.Tensor, rows: torch.Tensor, word: int, count: int,
               segments: int, longest: int, *, to_rows: bool,
               ok: torch.Tensor | None = None) -> None:
    """Pages to rows (``to_rows``) or back, on the current stream: ``table`` as above (on
    the device), ``rows`` a contiguous uint8 matrix copied in words of ``word`` bytes,
    ``longest`` the longest page in words; ``ok`` (a flag a row, on the device) leaves a
    row whose flag is 0 uncopied."""
    words = rows.view(_WORDS[word])
    grid = (count, segments, triton.cdiv(longest, BLOCK))
    _copy_pages[grid](table, words, words if ok is None else ok, 2 * segments,
                      2 * segments + count * segments, segments, words.stride(0),
                      TO_ROWS=to_rows, CHECKED=ok is not None, BLOCK=BLOCK)
