# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Checksums of value rows where they lie on a GPU: xxh3-64 seeded with the layout
fingerprint, the same digest as ``pipeline.core.integrity`` (and the C copies') computes
on the host, so a value sealed on a GPU verifies anywhere and the other way round.

A save seals its rows on the device before they are copied to the host, and a load
checks them on the device after they are copied from it, so no thread reads the host's
copy in a second pass.

xxh3 on a long input (over 240 bytes, which every value is) adds each 1 KiB block's
stripes into 8 accumulators, then scrambles them, block after block. Within a block the
accumulators only add, so one kernel sums every block of every row in parallel
(``_block_sums``) and a second walks each row's sums in order: it scrambles after each
block, adds the last partial block and the last stripe, and folds the accumulators into
the digest (``_finish``), which it either writes after the payload (a seal) or compares
with what is there (a check). ``tests/unit/backends/test_cuda_kernels.py`` compares the
digests with ``xxhash`` in Triton's interpreter; the GPU tests run them on a device.

Rows must start and end their payload on 8-byte words (``digestible``); other rows are
digested on the host.
"""

from __future__ import annotations

import functools

import numpy
import torch
import triton
import triton.language as tl

__all__ = ["check_on_device", "digestible", "seal_on_device"]

_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
"""xxh3's default secret (``XXH3_kSecret``), from which a seed derives its own."""
_PRIME32 = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)
_PRIME64 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
            0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)
_INIT = (_PRIME32[2], _PRIME64[0], _PRIME64[1], _PRIME64[2],
         _PRIME64[3], _PRIME32[1], _PRIME64[4], _PRIME32[0])
"""The accumulators' starting values (``XXH3_INIT_ACC``)."""
_MIX = 0x165667919E3779F9
"""The avalanche's multiplier (``PRIME_MX1``)."""
LONG = 240
"""Inputs up to this many bytes take xxh3's other paths, which these kernels lack."""
STRIPES = 16
"""Stripes of 64 bytes in a block: (secret 192 - stripe 64) / 8 bytes consumed each."""
BLOCK_WORDS = STRIPES * 8
CHUNK = 32
"""Blocks ``_finish`` steps through with their sums loaded ahead (one wait on memory for
each 32 blocks)."""
BLOCKS = 8
"""Blocks each program of ``_block_sums`` sums."""
WARPS = 1
"""Warps a program of either kernel (on an H200, one did both kernels' work quickest:
``_finish`` has no work to share, and ``_block_sums`` a block's 16 x 8 words)."""

# The key table (uint64 words): [0, 128) stripe s's key for lane l at s * 8 + l; then the
# scramble's 8 keys, the last stripe's 8, the merge's 8, the 8 starting accumulators,
# and the 64-bit primes the kernels multiply by (no literal may be above 2**63).
_SCRAMBLE = tl.constexpr(128)
_LAST = tl.constexpr(136)
_MERGE = tl.constexpr(144)
_START = tl.constexpr(152)
_MX1 = tl.constexpr(160)
_P64_1 = tl.constexpr(161)
_SCRAMBLE_PRIME = tl.constexpr(_PRIME32[0])


@functools.lru_cache(maxsize=64)
def _keys(seed: int, device: torch.device) -> torch.Tensor:
    """The key table of a seed (``XXH3_initCustomSecret``), on the device."""
    words = numpy.frombuffer(_SECRET, dtype="<u8").copy()
    offset = numpy.uint64(seed % 2**64)
    with numpy.errstate(over="ignore"):
        words[0::2] += offset
        words[1::2] -= offset
    secret = words.tobytes()

    def at(start: int) -> numpy.ndarray:
        return numpy.frombuffer(secret, dtype="<u8", count=8, offset=start)

    stripes = numpy.stack([words[stripe : stripe + 8] for stripe in range(STRIPES)])
    table = numpy.concatenate([
        stripes.ravel(), words[16:24], at(len(secret) - 64 - 7), at(11),
        numpy.array((*_INIT, _MIX, _PRIME64[0]), dtype=numpy.uint64),
    ])
    return torch.from_numpy(table.view(numpy.int64)).to(device)


def digestible(payload_bytes: int, row_stride: int) -> bool:
    """Whether these kernels can digest payloads of rows so far apart (in a contiguous
    matrix from torch's allocator): long, and in whole words."""
    return payload_bytes > LONG and payload_bytes % 8 == 0 and row_stride % 8 == 0


@triton.jit
def _product(value):
    """The low half of a word times its high half, as xxh3 multiplies."""
    return (value & 0xFFFFFFFF) * (value >> 32)


@triton.jit
def _stripes(words, keys, count):
    """The sums that ``count`` (up to 16) stripes from ``words`` add to the even and the
    odd accumulators: lane l adds its product and the data of lane l ^ 1."""
    stripe = tl.arange(0, 16)[:, None]
    at = stripe * 8 + 2 * tl.arange(0, 4)[None, :]
    mask = stripe < count
    even = tl.load(words + at, mask=mask, other=0)
    odd = tl.load(words + at + 1, mask=mask, other=0)
    to_even = tl.where(mask, odd + _product(even ^ tl.load(keys + at)), 0)
    to_odd = tl.where(mask, even + _product(odd ^ tl.load(keys + at + 1)), 0)
    return tl.sum(to_even, axis=0), tl.sum(to_odd, axis=0)


@triton.jit
def _fold(left, right):
    """The 128-bit product of two words, its halves xored (``XXH3_mul128_fold64``)."""
    low = (left & 0xFFFFFFFF) * (right & 0xFFFFFFFF)
    high_low = (left >> 32) * (right & 0xFFFFFFFF)
    low_high = (left & 0xFFFFFFFF) * (right >> 32)
    cross = (low >> 32) + (high_low & 0xFFFFFFFF) + low_high
    top = (left >> 32) * (right >> 32) + (high_low >> 32) + (cross >> 32)
    return ((cross << 32) | (low & 0xFFFFFFFF)) ^ top


@triton.jit(do_not_specialize=["row_words", "blocks"])
def _block_sums(rows, sums, keys, row_words, blocks, BLOCKS: tl.constexpr):
    """Program (row, chunk): the accumulator sums of ``BLOCKS`` whole blocks of the row."""
    row = tl.program_id(0)
    words = rows.to(tl.pointer_type(tl.uint64)) + row * row_words
    out = sums.to(tl.pointer_type(tl.uint64)) + row * blocks * 8
    table = keys.to(tl.pointer_type(tl.uint64))
    lane = 2 * tl.arange(0, 4)
    for step in tl.static_range(BLOCKS):
        block = tl.program_id(1) * BLOCKS + step
        if block < blocks:
            even, odd = _stripes(words + block * 128, table, 16)
            tl.store(out + block * 8 + lane, even)
            tl.store(out + block * 8 + lane + 1, odd)


@triton.jit
def _scramble(accumulators, block_sums, keys):
    """The accumulators after a block: its sums added, then scrambled
    (``XXH3_scrambleAcc``; the prime fits 32 bits, so the multiply is a short one)."""
    accumulators += block_sums
    return (accumulators ^ (accumulators >> 47) ^ keys) * _SCRAMBLE_PRIME


@triton.jit(do_not_specialize=["row_words", "payload_words", "blocks", "tail"])
def _finish(rows, sums, keys, ok, row_words, payload_words, blocks, tail,
            CHECK: tl.constexpr, CHUNK: tl.constexpr):
    """Program (row): the row's digest, from its block sums on, written after the payload
    or (``CHECK``) compared with what is there, into ``ok[row]``.

    The blocks chain one after another, so this walk is a row's latency: each step is a
    few integer operations on values in registers (one warp, no reduction), and the sums
    of ``CHUNK`` blocks are loaded before their steps, one wait on memory for them all."""
    row = tl.program_id(0)
    words = rows.to(tl.pointer_type(tl.uint64)) + row * row_words
    table = keys.to(tl.pointer_type(tl.uint64))
    lane = 2 * tl.arange(0, 4)
    even = tl.load(table + _START + lane)
    odd = tl.load(table + _START + lane + 1)
    scramble_even = tl.load(table + _SCRAMBLE + lane)
    scramble_odd = tl.load(table + _SCRAMBLE + lane + 1)
    block_sums = sums.to(tl.pointer_type(tl.uint64)) + row * blocks * 8 + lane
    whole = blocks - blocks % CHUNK
    for start in range(0, whole, CHUNK):
        for step in tl.static_range(CHUNK):
            at = block_sums + (start + step) * 8
            even = _scramble(even, tl.load(at), scramble_even)
            odd = _scramble(odd, tl.load(at + 1), scramble_odd)
    for block in range(whole, blocks):
        even = _scramble(even, tl.load(block_sums + block * 8), scramble_even)
        odd = _scramble(odd, tl.load(block_sums + block * 8 + 1), scramble_odd)
    to_even, to_odd = _stripes(words + blocks * 128, table, tail)
    even += to_even
    odd += to_odd
    last = words + payload_words - 8
    last_even = tl.load(last + lane)
    last_odd = tl.load(last + lane + 1)
    even += last_odd + _product(last_even ^ tl.load(table + _LAST + lane))
    odd += last_even + _product(last_odd ^ tl.load(table + _LAST + lane + 1))
    merged = _fold(even ^ tl.load(table + _MERGE + lane), odd ^ tl.load(table + _MERGE + lane + 1))
    digest = payload_words.to(tl.uint64) * 8 * tl.load(table + _P64_1) + tl.sum(merged, axis=0)
    digest ^= digest >> 37
    digest *= tl.load(table + _MX1)
    digest ^= digest >> 32
    if CHECK:
        tl.store(ok + row, (tl.load(words + payload_words) == digest).to(tl.int8))
    else:
        tl.store(words + payload_words, digest)


def _digest(rows: torch.Tensor, payload_bytes: int, seed: int, ok: torch.Tensor | None) -> None:
    """Run both kernels over ``rows`` on the current stream."""
    count, row_words = rows.shape[0], rows.stride(0) // 8
    blocks = (payload_bytes - 1) // (BLOCK_WORDS * 8)
    tail = ((payload_bytes - 1) - blocks * BLOCK_WORDS * 8) // 64
    keys = _keys(seed, rows.device)
    sums = torch.empty((count, max(blocks, 1), 8), dtype=torch.int64, device=rows.device)
    if blocks:
        _block_sums[(count, triton.cdiv(blocks, BLOCKS))](rows, sums, keys, row_words, blocks,
                                                         BLOCKS=BLOCKS, num_warps=WARPS)
    _finish[(count,)](rows, sums, keys, rows if ok is None else ok, row_words,
                      payload_bytes // 8, blocks, tail, CHECK=ok is not None, CHUNK=CHUNK,
                      num_warps=WARPS)


def seal_on_device(rows: torch.Tensor, payload_bytes: int, seed: int) -> None:
    """Write each row's checksum after its ``payload_bytes`` (``digestible`` rows), as
    ``integrity.seal_rows`` does on the host."""
    _digest(rows, payload_bytes, seed, None)


def check_on_device(rows: torch.Tensor, payload_bytes: int, seed: int) -> torch.Tensor:
    """Whether each row's payload matches its sealed checksum, as ``integrity.verify_rows``:
    an int8 flag a row, on the rows' device, set once the kernels have run."""
    ok = torch.empty(rows.shape[0], dtype=torch.int8, device=rows.device)
    _digest(rows, payload_bytes, seed, ok)
    return ok
