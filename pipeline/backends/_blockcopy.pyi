"""Block copies with their checksums, without the GIL (``native/blockcopy.c``).

``pages``: int64 ``[values, segments]``, the address of each value's page in each
segment; ``offsets`` and ``sizes``: int64 ``[segments]``, where each page lies in a
value. Value ``v``'s row starts at ``rows + v * row_stride``; its checksum (xxh3-64 of
its ``payload_bytes`` with ``seed``) follows the payload.

A run may be shared between callers (threads) given the same ``progress``, an int64
``[2]`` (zeros at first: the values claimed, the values done): each value is copied by
whichever claims it first, and a value counts as done once every thread sees its bytes.
A caller given a ``limit`` copies at most that many (0: no limit). Each call returns
how many values it copied (or digested).
"""

from collections.abc import Sequence
from typing import Any

Buffer = Any
"""Any C-contiguous buffer (numpy arrays, bytearray): numpy declares none in its stubs."""

def gather(pages: Buffer, rows: int, row_stride: int, offsets: Buffer, sizes: Buffer,
           seal: bool, seed: int, payload_bytes: int, stream: bool,
           progress: Buffer | None = None, limit: int = 0) -> int:
    """Copy each value's pages into its row, then (``seal``) its checksum after them;
    ``stream``: write the rows around the caches (streaming stores); ``progress`` and
    ``limit``: the run is shared with the other callers given the same progress, and
    this one copies at most ``limit`` values. The values copied by this call."""

def scatter(pages: Buffer, rows: int, row_stride: int, offsets: Buffer, sizes: Buffer,
            check: bool, seed: int, payload_bytes: int, intact: Buffer,
            stream: bool, progress: Buffer | None = None, limit: int = 0) -> int:
    """Copy each intact value's row into its pages; ``intact[v]``: whether value ``v``
    was (always, unless ``check``). A value that fails is not copied at all. ``stream``:
    write the pages around the caches (streaming stores); ``progress`` and ``limit``:
    as ``gather``. The values copied by this call (failed ones included)."""

def page_table(block_ids: Sequence[int], segment_table: Buffer, num_blocks: int) -> bytes:
    """Each block's page in each segment, ``first + id * stride`` from the first two rows
    of ``segment_table`` (int64 ``[4, segments]``): int64 ``[blocks, segments]`` as
    bytes, the ``pages`` of the calls here. IndexError unless every id is in
    ``range(num_blocks)``."""

def wait_done(progress: Buffer, values: int, spin_s: float) -> bool:
    """Spin, without the GIL, until the ``values`` of the runs shared through
    ``progress`` (int64 ``[runs, 2]``) are all done, for at most ``spin_s``: whether
    they are."""

def digests(pages: Buffer, sizes: Buffer, seed: int, out: Buffer,
            progress: Buffer | None = None) -> int:
    """Each value's checksum over its pages where they lie (engine memory), as ``gather``
    would seal it: 8 native-order bytes per value into ``out``; ``progress``: as
    ``gather``. The values digested by this call."""

def stream_width(width: int = ...) -> int:
    """The bytes each streaming store writes (0: the CPU has none); with ``width``, use
    that width from now on (16, or 32 on a CPU with AVX): both kinds can be tested."""

def fused_seal(on: bool = ...) -> bool:
    """Whether ``gather`` seals each value in the copy's own pass (its pages whole
    64-byte stripes that make up its payload, over 240 bytes), on a CPU with AVX2; with
    ``on``, do so from now on or not (on: only where the CPU has AVX2): both ways can be
    tested."""
