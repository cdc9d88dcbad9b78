"""The native block copies: the bytes and checksums of the Python reference at any page
size, and nothing written for a value that fails its checksum."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.backends import _blockcopy
from pipeline.backends.in_place_copy import HelperThreads
from pipeline.core.integrity import CHECKSUM_BYTES, seal_rows, verify_rows


def engine_pages(segments: int, blocks: int, page: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (blocks, page), dtype=torch.uint8, generator=generator)
            for _ in range(segments)]


def addresses(pages: list[torch.Tensor], ids: list[int]) -> numpy.ndarray:
    return numpy.array([[p[i].data_ptr() for p in pages] for i in ids], dtype=numpy.int64)


def layout(pages: list[torch.Tensor]) -> tuple[numpy.ndarray, numpy.ndarray]:
    sizes = numpy.array([p.shape[1] for p in pages], dtype=numpy.int64)
    return numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]]).astype(numpy.int64), sizes


STREAM_WIDTHS = sorted({_blockcopy.stream_width(), 16} - {0})
"""The streaming stores this CPU can use: SSE2's, and AVX's where it has them."""


@pytest.fixture
def stream_width() -> Iterator[Callable[[int], None]]:
    """Sets the width of streaming stores for the test; the CPU's own afterwards."""
    own = _blockcopy.stream_width()

    def use(width: int) -> None:
        if width:
            _blockcopy.stream_width(width)

    yield use
    if own:
        _blockcopy.stream_width(own)


SEAL_PASSES = sorted({_blockcopy.fused_seal(), False})
"""How this CPU can seal a save: after each chunk's hash, and in the copy's own pass
where it has AVX2."""


@pytest.fixture
def fused_seal() -> Iterator[Callable[[bool], None]]:
    """Sets whether saves seal in the copy's pass for the test; as the CPU allows after."""
    own = _blockcopy.fused_seal()
    yield _blockcopy.fused_seal
    _blockcopy.fused_seal(own)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(segments=st.integers(1, 4),
       page=st.sampled_from([1, 7, 64, 79, 256, 1024, 16383, 16384, 40001, 49152]),
       count=st.integers(1, 4), padding=st.sampled_from([0, 56]), seed=st.integers(0, 2**64 - 1),
       width=st.sampled_from([0, *STREAM_WIDTHS]), fused=st.sampled_from(SEAL_PASSES))
def test_gather_seals_what_the_reference_seals_and_scatter_restores_the_pages(
    segments: int, page: int, count: int, padding: int, seed: int, width: int, fused: bool,
    stream_width: Callable[[int], None], fused_seal: Callable[[bool], None],
) -> None:
    """Pages of any size (chunk, stripe and xxh3 block edges included) land in each row
    in segment order with exactly the checksum ``seal_rows`` writes, padding between rows
    untouched; scattered back, every page is restored. Streaming stores of every width
    the CPU has (``width``; 0: none) write the same bytes, whatever the alignment of
    either side, and so does a seal in the copy's pass (``fused``) where pages allow."""
    stream = width != 0
    stream_width(width)
    fused_seal(fused)
    pages = engine_pages(segments, 6, page, seed=page + count)
    payload = segments * page
    span = payload + CHECKSUM_BYTES + padding
    memory = torch.full((count * span,), 0xAB, dtype=torch.uint8)
    rows = torch.as_strided(memory, (count, payload + CHECKSUM_BYTES), (span, 1))
    ids = [5, 0, 3, 1][:count]
    offsets, sizes = layout(pages)
    _blockcopy.gather(addresses(pages, ids), rows.data_ptr(), span, offsets, sizes, True,
                      seed, payload, stream)

    expected = torch.cat([torch.stack([p[i] for p in pages]).view(-1) for i in ids]).view(
        count, payload)
    assert torch.equal(rows[:, :payload], expected)
    reference = torch.zeros(count, payload + CHECKSUM_BYTES, dtype=torch.uint8)
    reference[:, :payload] = expected
    seal_rows(reference, payload, seed)
    assert torch.equal(rows[:, payload:], reference[:, payload:])
    if padding:
        assert bool((memory.view(count, span)[:, payload + CHECKSUM_BYTES :] == 0xAB).all())

    targets = [torch.zeros_like(p) for p in pages]
    intact = bytearray(count)
    _blockcopy.scatter(addresses(targets, ids), rows.data_ptr(), span, offsets, sizes, True,
                       seed, payload, intact, stream)
    assert list(intact) == [1] * count
    for source, target in zip(pages, targets, strict=True):
        assert torch.equal(target[ids], source[ids])


def test_a_value_that_fails_its_checksum_writes_no_byte_and_the_others_land() -> None:
    """One flipped byte fails that value alone: its pages stay as they were, the other
    values are copied, and ``verify_rows`` agrees on which failed."""
    pages = engine_pages(3, 4, 1000, seed=1)
    payload = 3 * 1000
    rows = torch.zeros(3, payload + CHECKSUM_BYTES, dtype=torch.uint8)
    offsets, sizes = layout(pages)
    _blockcopy.gather(addresses(pages, [0, 1, 2]), rows.data_ptr(), rows.stride(0), offsets,
                      sizes, True, 9, payload, True)
    rows[1, 1500] ^= 1
    targets = [torch.zeros_like(p) for p in pages]
    intact = bytearray(3)
    _blockcopy.scatter(addresses(targets, [0, 1, 2]), rows.data_ptr(), rows.stride(0),
                       offsets, sizes, True, 9, payload, intact, True)
    assert list(intact) == [1, 0, 1] == [int(ok) for ok in verify_rows(rows, payload, 9)]
    assert all(int(t[1].count_nonzero()) == 0 for t in targets)
    assert all(torch.equal(t[[0, 2]], p[[0, 2]]) for t, p in zip(targets, pages, strict=True))


def test_digests_of_pages_where_they_lie_are_the_checksums_gather_seals() -> None:
    """A value kept in engine memory (pages in place, any order of blocks) digests to
    the checksum a copy of it is sealed with."""
    pages = engine_pages(3, 5, 20000, seed=2)
    payload = 3 * 20000
    ids = [4, 0, 2]
    rows = torch.zeros(3, payload + CHECKSUM_BYTES, dtype=torch.uint8)
    offsets, sizes = layout(pages)
    _blockcopy.gather(addresses(pages, ids), rows.data_ptr(), rows.stride(0), offsets, sizes,
                      True, 123, payload, False)
    digests = numpy.zeros(3, dtype=numpy.uint64)
    _blockcopy.digests(addresses(pages, ids), sizes, 123, digests)
    assert torch.equal(torch.from_numpy(digests.view(numpy.uint8).reshape(3, 8)),
                       rows[:, payload:])
    with pytest.raises(ValueError, match="8 bytes per value"):
        _blockcopy.digests(addresses(pages, ids), sizes, 123, numpy.zeros(2, numpy.uint64))


def test_checksum_helpers_share_a_large_batch_and_never_wait_for_one_that_has_not_started(
) -> None:
    """A batch of ``share_bytes`` or more is digested by the calling thread and the
    helpers together, to the same checksums as one call; with the helper's thread held
    by other work, the caller digests every value itself and returns without it."""
    pages = engine_pages(2, 40, 4096, seed=6)
    ids = list(range(1, 33))
    _, sizes = layout(pages)
    expected = numpy.zeros(len(ids), dtype=numpy.uint64)
    _blockcopy.digests(addresses(pages, ids), sizes, 7, expected)
    helpers = HelperThreads(1, share_bytes=len(ids) * 2 * 4096)
    try:
        shared = numpy.zeros(len(ids), dtype=numpy.uint64)
        helpers.digests(addresses(pages, ids), sizes, 7, shared)
        assert numpy.array_equal(shared, expected)
        held, release = threading.Event(), threading.Event()
        helpers._pool.submit(lambda: (held.set(), release.wait(10)))
        assert held.wait(10)
        alone = numpy.zeros(len(ids), dtype=numpy.uint64)
        helpers.digests(addresses(pages, ids), sizes, 7, alone)
        assert not release.is_set() and numpy.array_equal(alone, expected)
        release.set()
    finally:
        helpers.close()


def test_only_a_width_the_cpu_streams_can_be_chosen(
        stream_width: Callable[[int], None]) -> None:
    """The width of streaming stores is one this CPU has (16 on any x86-64, 32 with AVX);
    another is refused and changes nothing."""
    widest = _blockcopy.stream_width()
    if widest == 0:
        pytest.skip("no streaming stores on this CPU")
    with pytest.raises(ValueError, match="bytes at a time, not 64"):
        _blockcopy.stream_width(64)
    assert _blockcopy.stream_width() == widest
    assert _blockcopy.stream_width(16) == 16


def test_a_seal_in_the_copys_pass_is_refused_where_the_cpu_has_no_avx2(
        fused_seal: Callable[[bool], None]) -> None:
    """Turning it off is always allowed; on, only where the CPU runs AVX2."""
    able = _blockcopy.fused_seal()
    assert _blockcopy.fused_seal(False) is False
    if able:
        assert _blockcopy.fused_seal(True) is True
    else:
        with pytest.raises(ValueError, match="AVX2"):
            _blockcopy.fused_seal(True)
        assert _blockcopy.fused_seal() is False


def test_tables_of_mismatched_shapes_are_refused() -> None:
    """Offsets and sizes of different segment counts, or a page table that is not a whole
    number of values, raise ValueError before any byte moves."""
    rows = torch.zeros(2, 16, dtype=torch.uint8)
    one = numpy.zeros(1, dtype=numpy.int64)
    with pytest.raises(ValueError, match="segment count"):
        _blockcopy.gather(numpy.zeros(2, dtype=numpy.int64), rows.data_ptr(), 16, one,
                          numpy.zeros(2, dtype=numpy.int64), False, 0, 8, False)
    with pytest.raises(ValueError, match="one byte per value"):
        _blockcopy.scatter(numpy.zeros(2, dtype=numpy.int64), rows.data_ptr(), 16, one, one,
                           False, 0, 8, bytearray(3), False)


@pytest.mark.parametrize("callers", [1, 2, 4])
def test_a_shared_run_is_copied_whole_however_many_threads_share_it(callers: int) -> None:
    """Callers given one progress table copy a run between them, each value once: the
    rows and checksums are those of one caller's copy, every value is counted done, and
    the scatter that follows, shared too, restores every page and fails exactly the
    value flipped meanwhile."""
    pages = engine_pages(2, 40, 4096, seed=3)
    payload = 2 * 4096
    ids = list(range(1, 33))
    offsets, sizes = layout(pages)
    expected = torch.zeros(len(ids), payload + CHECKSUM_BYTES, dtype=torch.uint8)
    _blockcopy.gather(addresses(pages, ids), expected.data_ptr(), expected.stride(0), offsets,
                      sizes, True, 5, payload, True)
    rows = torch.zeros_like(expected)
    progress = numpy.zeros(2, dtype=numpy.int64)

    def share(copy: Callable[[], None]) -> None:
        threads = [threading.Thread(target=copy) for _ in range(callers - 1)]
        for thread in threads:
            thread.start()
        copy()
        for thread in threads:
            thread.join()

    share(lambda: _blockcopy.gather(addresses(pages, ids), rows.data_ptr(), rows.stride(0),
                                    offsets, sizes, True, 5, payload, True, progress))
    assert torch.equal(rows, expected)
    assert progress[1] == len(ids) and progress[0] >= len(ids)
    assert _blockcopy.wait_done(progress, len(ids), 0.0)

    digests = numpy.zeros(len(ids), dtype=numpy.uint64)
    progress[:] = 0
    share(lambda: _blockcopy.digests(addresses(pages, ids), sizes, 5, digests, progress))
    assert torch.equal(torch.from_numpy(digests.view(numpy.uint8).reshape(-1, 8)),
                       expected[:, payload:])
    assert progress[1] == len(ids)

    rows[7, 100] ^= 1
    targets = [torch.zeros_like(p) for p in pages]
    intact = bytearray(len(ids))
    progress[:] = 0
    share(lambda: _blockcopy.scatter(addresses(targets, ids), rows.data_ptr(), rows.stride(0),
                                     offsets, sizes, True, 5, payload, intact, True, progress))
    assert [i for i, ok in enumerate(intact) if not ok] == [7]
    assert progress[1] == len(ids)
    restored = [i for i in ids if i != ids[7]]
    assert all(torch.equal(t[restored], p[restored]) for t, p in zip(targets, pages, strict=True))
    assert all(int(t[ids[7]].count_nonzero()) == 0 for t in targets)


def test_waiting_for_shared_values_gives_up_after_its_spin() -> None:
    """Values of several runs count done together; while some are not, the wait spins
    for its time, then says so. A progress table of the wrong shape is refused."""
    progress = numpy.array([[3, 3], [2, 1]], dtype=numpy.int64)  # a value still in hand
    started = time.perf_counter()
    assert not _blockcopy.wait_done(progress, 5, 0.002)
    assert time.perf_counter() - started >= 0.002
    progress[1, 1] = 2
    assert _blockcopy.wait_done(progress, 5, 10.0)
    with pytest.raises(ValueError, match="int64"):
        _blockcopy.wait_done(numpy.zeros(3, dtype=numpy.int64), 1, 0.0)
    rows = torch.zeros(1, 16, dtype=torch.uint8)
    one = numpy.zeros(1, dtype=numpy.int64)
    with pytest.raises(ValueError, match="int64"):
        _blockcopy.gather(numpy.zeros(1, dtype=numpy.int64), rows.data_ptr(), 16, one,
                          numpy.full(1, 8, dtype=numpy.int64), False, 0, 8, False,
                          numpy.zeros(3, dtype=numpy.int64))


def test_a_limited_caller_copies_so_many_and_leaves_the_rest_to_the_others() -> None:
    """Each call says how many values it copied: one limited to 5 copies 5, the next
    copies the rest, and a late one finds nothing left and touches nothing."""
    pages = engine_pages(1, 12, 256, seed=4)
    ids = list(range(12))
    offsets, sizes = layout(pages)
    rows = torch.zeros(12, 256 + CHECKSUM_BYTES, dtype=torch.uint8)
    progress = numpy.zeros(2, dtype=numpy.int64)

    def gather(limit: int) -> int:
        return _blockcopy.gather(addresses(pages, ids), rows.data_ptr(), rows.stride(0),
                                 offsets, sizes, True, 0, 256, False, progress, limit)

    assert gather(5) == 5 and progress[1] == 5
    assert torch.equal(rows[:5, :256], pages[0][:5]) and not rows[5:].any()
    assert gather(0) == 7 and progress[1] == 12
    rows.zero_()
    assert gather(0) == 0 and not rows.any()
    assert _blockcopy.gather(addresses(pages, ids), rows.data_ptr(), rows.stride(0), offsets,
                             sizes, True, 0, 256, False) == 12


@pytest.mark.parametrize("shared", [False, True], ids=["one_thread", "helpers"])
def test_runs_in_host_memory_are_sealed_and_verified_as_the_python_reference(
    shared: bool,
) -> None:
    """A GPU copy's values land in host memory (runs of padded rows) and are sealed and
    checked there in C: the checksums ``seal_rows`` writes, each run's padding and
    payload untouched, and only a changed value found failed, by ``verify_rows`` too."""
    from pipeline.backends.cuda_copy import intact_runs, seal_runs
    from pipeline.core.runs import Run

    payload, stride = 3000, 3072
    memory = torch.randint(0, 256, (7, stride), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(4))
    reference = memory.clone()
    seal_rows(reference[:, : payload + CHECKSUM_BYTES], payload, 5)
    runs = [Run(0, memory[:4, : payload + CHECKSUM_BYTES]),
            Run(4, memory[4:, : payload + CHECKSUM_BYTES])]
    helpers = HelperThreads(2, share_bytes=0) if shared else None
    try:
        seal_runs(runs, payload, 5, helpers)
        assert torch.equal(memory, reference)
        assert intact_runs(runs, payload, 5, helpers) == [True] * 7
        memory[5, 17] ^= 1
        assert intact_runs(runs, payload, 5, helpers) == [True] * 5 + [False, True]
        assert intact_runs(runs, payload, 5, helpers) == verify_rows(
            memory[:, : payload + CHECKSUM_BYTES], payload, 5)
        assert intact_runs(runs, payload, 6, helpers) == [False] * 7  # another seed
    finally:
        if helpers is not None:
            helpers.close()


GOLDEN = {
    100: (0x5DA67EAC6D4093D5, 0xFE4AA7A0C42FFCC9),
    240: (0xB6CFAF343FAB81E6, 0xF281FDA5479FBB70),
    241: (0x956CAE592C67279E, 0x821253074E8F17C7),
    1024: (0x70BD377D9574F4BB, 0xC8AFFE16724B1447),
    12288: (0xC3B960DAB93BAB81, 0x8E1E3BE282F1F53C),
    65536: (0x04404B28125B4786, 0xB4C1C25111AB3F1C),
}
"""xxh3-64 of ``golden_bytes(n)`` with seeds 0 and 2**64 - 59: the checksums stored
values carry, fixed here so that no build of xxHash (packaged or vector width) can
change what a stored checksum means."""


def golden_bytes(n: int) -> torch.Tensor:
    return torch.tensor([(i * 131 + 7) % 256 for i in range(n)], dtype=torch.uint8)


@pytest.mark.parametrize("fused", SEAL_PASSES)
@pytest.mark.parametrize("n", sorted(GOLDEN))
def test_checksums_are_the_fixed_xxh3_digests_on_every_path(
    n: int, fused: bool, fused_seal: Callable[[bool], None],
) -> None:
    """Sealed in the copy's pass or chunk by chunk, checked before a load's copy, and
    digested where the pages lie: every path gives the fixed digests."""
    fused_seal(fused)
    pages = [golden_bytes(n).view(1, n)]
    offsets, sizes = layout(pages)
    for seed, expected in zip((0, 2**64 - 59), GOLDEN[n], strict=True):
        row = torch.zeros(1, n + CHECKSUM_BYTES, dtype=torch.uint8)
        _blockcopy.gather(addresses(pages, [0]), row.data_ptr(), row.stride(0), offsets,
                          sizes, True, seed, n, False)
        assert int(row[0, n:].numpy().view(numpy.uint64)[0]) == expected
        digest = numpy.zeros(1, dtype=numpy.uint64)
        _blockcopy.digests(addresses(pages, [0]), sizes, seed, digest)
        assert int(digest[0]) == expected
        intact, target = bytearray(1), torch.zeros(1, n, dtype=torch.uint8)
        _blockcopy.scatter(addresses([target], [0]), row.data_ptr(), row.stride(0), offsets,
                           sizes, True, seed, n, intact, False)
        assert intact == b"\x01" and torch.equal(target, pages[0])
